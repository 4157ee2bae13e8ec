//! Room in a shared KV for a restore. llama-server restores a state into free cells only: it
//! empties the slot it restores into, but never another slot, and refuses a restore that
//! does not fit (`/slots/<id>?action=restore` answers 400). Serve's backend keeps its idle
//! slots' turns (`--no-cache-idle-slots`), so a long conversation's state may find the KV
//! full of other conversations' turns: the least recently used idle slots are emptied first,
//! as llama-server itself empties idle slots for a prompt that needs their room.

use super::{PromptCache, SlotNow};

impl PromptCache {
    /// Empty idle slots, least recently used first, until a state of `need` tokens fits
    /// beside what the other slots hold (`backend`: `/slots` as the slot was chosen). Whether
    /// it surely fits: a refusal of the restore is then the state's fault, not the room's.
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
            let others: usize = held.iter().sum();
            if others + need <= context {
                // A slot at work grows as it generates; only idle ones are counted surely.
                return backend.iter().enumerate().all(|(i, s)| i == slot || s.idle);
            }
            let victim = {
                let Ok(slots) = self.slots.lock() else {
                    return false;
                };
                (0..held.len())
                    .filter(|&i| i != slot && held[i] > 0 && backend[i].idle)
                    .filter(|&i| slots.get(i).is_some_and(|s| s.busy == 0))
                    .min_by_key(|&i| slots[i].used)
            };
            let Some(victim) = victim else {
                return false;
            };
            if !self.erase(victim, 0).await {
                return false;
            }
            tracing::debug!(
                "1bit serve: prompt cache: emptied idle slot {victim} ({} tokens) to restore {need} into slot {slot}",
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

    /// A cache of four slots in a KV of 2,048 cells, its backend (never called) at a closed port.
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

    #[test]
    fn a_state_that_fits_beside_idle_slots_surely_fits() {
        let cache = cache(&["llama-server"]);
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
