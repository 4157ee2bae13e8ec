//! Restoring a saved state into a slot before the request that shares its prefix is
//! forwarded: the file checked, marked at the prefix's end, handed to llama-server, and
//! discarded with its line when either refuses it.

use std::time::Instant;

use super::store::{self, Reason, Store};
use super::{PromptCache, Restored};

impl PromptCache {
    /// Check a state file and restore it into `slot`; a file that fails the check or that the
    /// backend refuses is discarded with its line, and the request goes on without it.
    pub(super) async fn restore(
        &self,
        slot: usize,
        entry: store::Entry,
        k: usize,
        reusable: usize,
    ) -> Option<Restored> {
        let began = Instant::now();
        let store = self.store.clone();
        let checked_entry = entry.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let mut store = store.lock().ok()?;
            Some(store.as_mut()?.verify(&checked_entry))
        })
        .await
        .ok()
        .flatten()?;
        if let Err(discarded) = checked {
            self.said_discard(&discarded);
            return None;
        }
        let file = Store::file_name(&entry);
        // The token list ends its match at k for this restore (the file is put back after).
        let mark = self
            .store
            .lock()
            .ok()
            .and_then(|s| s.as_ref().and_then(|s| s.mark_end(&entry, k)));
        let reply = self.slot_file_action(slot, "restore", &file).await;
        let whole = mark.is_none();
        if let Some(mark) = mark {
            Store::unmark(mark);
        }
        let n_restored = reply
            .as_ref()
            .ok()
            .and_then(|r| r["n_restored"].as_u64())
            .unwrap_or(0);
        if n_restored as usize != entry.tokens.len() {
            let why = match reply {
                Err(e) => format!("llama-server refused it ({e})"),
                Ok(_) => format!(
                    "llama-server restored {n_restored} tokens of its {}",
                    entry.tokens.len()
                ),
            };
            let discarded = self
                .store
                .lock()
                .ok()?
                .as_mut()?
                .discard(&entry, Reason::Corrupt, why);
            self.said_discard(&discarded);
            return None;
        }
        if let Ok(mut store) = self.store.lock()
            && let Some(store) = store.as_mut()
        {
            store.touch(&entry);
        }
        // A file serve could not mark (a read-only directory) is restored whole: llama-server
        // then reuses all the prompt shares with it, the path a follow-up turn takes.
        let k = if whole { reusable } else { k };
        if let Ok(mut slots) = self.slots.lock()
            && let Some(s) = slots.get_mut(slot)
        {
            s.tokens = if whole {
                entry.tokens.clone()
            } else {
                entry.tokens[..k].to_vec()
            };
        }
        let restore_ms = began.elapsed().as_secs_f64() * 1000.0;
        self.counts.restores.inc();
        self.counts.restored_bytes.inc_by(entry.bytes);
        tracing::info!(
            "1bit serve: prompt cache: restored {k} of the prompt's tokens into slot {slot} from {file} ({} MiB) in {restore_ms:.0} ms",
            entry.bytes / (1 << 20)
        );
        Some(Restored {
            n_tokens: k,
            restore_ms,
        })
    }
}
