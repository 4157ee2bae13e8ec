//! Room in a shared KV for a restore, laid out as a cold prefill's. llama-server restores a
//! state into free cells only: it empties the slot it restores into, never another, and
//! refuses a restore that does not fit (`/slots/<id>?action=restore` answers 400). Where a
//! state's cells lie matters too: the kernels read the KV's cells in blocks, and a prompt whose
//! cells follow another conversation's is computed in other sums than a cold prefill's (seen
//! with SmolLM2: a second conversation's greedy reply differs when the first's cells stay).
//! By default llama-server empties every idle slot as a request starts
//! (`--cache-idle-slots`), so a cold prefill runs in an otherwise empty KV: serve empties the
//! other idle slots before a restore, as the request about to start would. Where idle slots
//! keep their turns (the user's `--no-cache-idle-slots`), only the least recently used are
//! emptied, until the state fits.

use super::{PromptCache, SlotNow};

/// Whether llama-server with this command line empties every idle slot when a request starts:
/// `--cache-idle-slots` (its default, the last of it and `--no-cache-idle-slots` wins) with a
/// RAM cache (`--cache-ram`, not 0) and one KV for the slots.
pub(super) fn idle_slots_emptied(argv: &[String]) -> bool {
    let asked = argv
        .iter()
        .rev()
        .find_map(|a| match a.as_str() {
            "--cache-idle-slots" => Some(true),
            "--no-cache-idle-slots" => Some(false),
            _ => None,
        })
        .unwrap_or(true);
    let ram = super::start::flag_value(argv, &["-cram", "--cache-ram"]) != Some(0);
    asked && ram && super::identity::kv_unified(argv)
}

impl PromptCache {
    /// Empty idle slots (never one a request of serve's has chosen) before a state of `need`
    /// tokens is restored into `slot` (`backend`: `/slots` as the slot was chosen): every
    /// other one where llama-server empties them as a request starts, else the least recently
    /// used first until the state fits. Whether it surely fits: a refusal of the restore is
    /// then the state's fault, not the room's.
    pub(super) async fn make_room(&self, slot: usize, need: usize, backend: &[SlotNow]) -> bool {
        if !self.shared_kv {
            // A slot of its own, as long as the context the state was saved in.
            return true;
        }
        let context = self.context.load(std::sync::atomic::Ordering::Relaxed);
        if context == 0 || backend.is_empty() {
            return false;
        }
        let mut held: Vec<usize> = backend.iter().map(|s| s.holds.unwrap_or(0)).collect();
        // The restore empties its own slot first.
        if let Some(own) = held.get_mut(slot) {
            *own = 0;
        }
        loop {
            let fits = held.iter().sum::<usize>() + need <= context;
            let victim = if fits && !self.idle_slots_emptied {
                None
            } else {
                let Ok(slots) = self.slots.lock() else {
                    return false;
                };
                (0..held.len())
                    .filter(|&i| i != slot && held[i] > 0 && backend[i].idle)
                    .filter(|&i| slots.get(i).is_some_and(|s| s.busy == 0))
                    .min_by_key(|&i| slots[i].used)
            };
            let Some(victim) = victim else {
                // A slot at work grows as it generates; only idle ones are counted surely.
                return fits && backend.iter().enumerate().all(|(i, s)| i == slot || s.idle);
            };
            if !self.erase(victim, 0).await {
                return false;
            }
            tracing::debug!(
                "1bit serve: prompt cache: emptied idle slot {victim} ({} tokens) before restoring {need} into slot {slot}",
                held[victim]
            );
            held[victim] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::super::{PromptCache, Setup, Slot, SlotNow};
    use super::idle_slots_emptied;

    /// A cache of four slots in a KV of 2,048 cells, its backend at a closed port (an erase
    /// fails).
    fn cache(argv: &[&str]) -> PromptCache {
        let setup = Setup {
            dir: "/nonexistent".into(),
            budget_bytes: 1 << 30,
            min_tokens: 256,
            ubatch: 256,
            model: "m.gguf".into(),
            argv: argv.iter().map(|a| a.to_string()).collect(),
        };
        let runtime = runtime();
        let _entered = runtime.enter();
        let cache = PromptCache::new(
            setup,
            9,
            onebit_supervision::backends::health::probe_client(),
        );
        cache.context.store(2048, Ordering::Relaxed);
        *cache.slots.lock().unwrap() = vec![Slot::default(); 4];
        cache
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn slot(idle: bool, holds: usize) -> SlotNow {
        SlotNow {
            idle,
            holds: Some(holds),
        }
    }

    /// llama-server's idle slots keep their turns.
    const KEEPING: &[&str] = &["llama-server", "--no-cache-idle-slots"];

    #[test]
    fn a_state_that_fits_beside_idle_slots_that_keep_their_turns_surely_fits() {
        let cache = cache(KEEPING);
        let backend = [
            slot(true, 1500),
            slot(true, 300),
            slot(true, 300),
            slot(true, 0),
        ];
        // Slot 0's own 1,500 go with the restore.
        assert!(runtime().block_on(cache.make_room(0, 1400, &backend)));
    }

    #[test]
    fn a_slot_at_work_makes_the_room_unsure_and_is_never_emptied() {
        let cache = cache(&["llama-server"]);
        let backend = [
            slot(true, 0),
            slot(false, 1800),
            slot(true, 0),
            slot(true, 0),
        ];
        assert!(!runtime().block_on(cache.make_room(0, 600, &backend)));
        // Room enough beside it, but it grows as it generates.
        assert!(!runtime().block_on(cache.make_room(0, 100, &backend)));
    }

    #[test]
    fn a_slot_serve_has_chosen_is_never_emptied_for_another() {
        let cache = cache(&["llama-server"]);
        cache.slots.lock().unwrap()[2].busy = 1;
        let backend = [
            slot(true, 0),
            slot(true, 0),
            slot(true, 1800),
            slot(true, 0),
        ];
        assert!(!runtime().block_on(cache.make_room(0, 600, &backend)));
    }

    #[test]
    fn where_llama_server_empties_idle_slots_serve_empties_them_before_a_restore() {
        // The erase goes to a closed port and fails: the room is then not sure.
        let cache = cache(&["llama-server"]);
        let backend = [slot(true, 0), slot(true, 300), slot(true, 0), slot(true, 0)];
        assert!(!runtime().block_on(cache.make_room(0, 600, &backend)));
        let backend = [slot(true, 0), slot(true, 0), slot(true, 0), slot(true, 0)];
        assert!(runtime().block_on(cache.make_room(0, 600, &backend)));
    }

    #[test]
    fn which_command_lines_empty_idle_slots() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(idle_slots_emptied(&argv(&["llama-server"])));
        assert!(idle_slots_emptied(&argv(&[
            "s",
            "--no-cache-idle-slots",
            "--cache-idle-slots"
        ])));
        assert!(!idle_slots_emptied(&argv(&[
            "s",
            "--cache-idle-slots",
            "--no-cache-idle-slots"
        ])));
        assert!(!idle_slots_emptied(&argv(&["s", "--cache-ram", "0"])));
        assert!(!idle_slots_emptied(&argv(&["s", "-cram", "0"])));
        assert!(!idle_slots_emptied(&argv(&["s", "--cache-ram=0"])));
        assert!(idle_slots_emptied(&argv(&["s", "--cache-ram", "512"])));
        assert!(!idle_slots_emptied(&argv(&["s", "-np", "4"])));
        assert!(idle_slots_emptied(&argv(&["s", "-np", "4", "-kvu"])));
    }

    #[test]
    fn slots_of_their_own_always_have_room() {
        let cache = cache(&["llama-server", "-np", "4"]);
        let backend = [
            slot(true, 0),
            slot(false, 2048),
            slot(false, 2048),
            slot(true, 2048),
        ];
        assert!(runtime().block_on(cache.make_room(0, 2000, &backend)));
    }

    #[test]
    fn an_unknown_context_or_slots_list_is_no_room_for_sure() {
        let cache = cache(&["llama-server"]);
        assert!(!runtime().block_on(cache.make_room(0, 10, &[])));
        cache.context.store(0, Ordering::Relaxed);
        assert!(!runtime().block_on(cache.make_room(0, 10, &[slot(true, 0)])));
    }
}
