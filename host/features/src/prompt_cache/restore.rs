//! Restoring a saved state into a slot before the request that shares its prefix is
//! forwarded: the file checked as it is copied to this serve's own temporary name, the copy
//! marked at the prefix's end and handed to llama-server, and the state discarded with its
//! line when either refuses it. The state in the folder is only read: other serves may read
//! or evict it meanwhile.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::copy;
use super::folder::TempFile;
use super::store::{self, Reason, Source, Store, Unusable};
use super::{PromptCache, Restored};

impl PromptCache {
    /// Check a state file and restore it into `slot`; a file that fails the check, or that the
    /// backend refuses though there was `room` for it, is discarded with its line, and the
    /// request goes on without it.
    pub(super) async fn restore(
        &self,
        slot: usize,
        entry: store::Entry,
        k: usize,
        reusable: usize,
        room: bool,
    ) -> Option<Restored> {
        let began = Instant::now();
        let temp = Store::restore_temp_name(self.seq.fetch_add(1, Ordering::Relaxed));
        let dir = self.setup.dir.clone();
        // The copy is removed however the restore ends (the request's client may leave).
        let _copy = TempFile(dir.join(&temp));
        let (copied_entry, copy_name) = (entry.clone(), temp.clone());
        let copied =
            tokio::task::spawn_blocking(move || copy::private(&dir, &copied_entry, k, &copy_name))
                .await
                .ok()?;
        let (file, whole) = match &copied {
            Ok(Source::Copy { marked }) => (temp, !marked),
            Ok(Source::Whole) => (Store::file_name(&entry), true),
            Err(Unusable::Gone) => {
                self.store.lock().ok()?.as_mut()?.forget(&entry);
                return None;
            }
            Err(Unusable::Bad(reason, why)) => {
                let discarded =
                    self.store
                        .lock()
                        .ok()?
                        .as_mut()?
                        .discard(&entry, *reason, why.clone());
                self.said_discard(&discarded);
                return None;
            }
        };
        let reply = self.slot_file_action(slot, "restore", &file).await;
        let n_restored = reply
            .as_ref()
            .ok()
            .and_then(|r| r["n_restored"].as_u64())
            .unwrap_or(0);
        if n_restored as usize != entry.tokens.len() {
            // The state itself, restored whole, may have been evicted by another serve since.
            let gone = matches!(copied, Ok(Source::Whole))
                && !self
                    .setup
                    .dir
                    .join(Store::file_name(&entry))
                    .try_exists()
                    .unwrap_or(true);
            if gone {
                self.store.lock().ok()?.as_mut()?.forget(&entry);
                return None;
            }
            if !room && reply.is_err() {
                // Slots at work hold the cells it needs; the state is kept for a later turn.
                tracing::debug!(
                    "1bit serve: prompt cache: not restored into slot {slot}: no room beside the slots at work"
                );
                return None;
            }
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
        if let Ok(store) = self.store.lock()
            && let Some(store) = store.as_ref()
        {
            store.touch(&entry);
        }
        // A state serve could not copy (a read-only folder) is restored whole: llama-server
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
            "1bit serve: prompt cache: restored {k} of the prompt's tokens into slot {slot} from {} ({} MiB) in {restore_ms:.0} ms",
            Store::file_name(&entry),
            entry.bytes / (1 << 20)
        );
        Some(Restored {
            n_tokens: k,
            restore_ms,
        })
    }
}
