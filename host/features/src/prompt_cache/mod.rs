//! The persistent prompt cache of the llama-server routes (`--prompt-cache-dir`): the KV state
//! of a long prompt saved to disk when its reply ends, and restored, after a restart of serve,
//! into the slot a later request with the same prefix is pinned to, before it is forwarded.
//! Slot preparation of the relay plan, as the hybrid handoff is; the state's identity is checked
//! by `identity`, the files kept by `store` (docs/serve.md, Prompt cache). Serves that share
//! the folder restore each other's states: it is read again, where another changed it, as
//! each request is prepared (`store`, `folder`; docs/fleet.md).
//!
//! Below the relay (which calls [`PromptCache::prepare`] and [`PromptCache::released`]); it
//! calls its backend with serve's probe client, and renders its own series for `/metrics`.

pub mod identity;
pub mod sessions;
pub mod start;
pub mod store;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;

use identity::Identity;
use onebit_supervision::backends::health::ProbeClient;
use store::{Admitted, Discarded, News, Reason, Store};

mod backend_calls;
mod copy;
mod folder;
mod note;
mod restore;
mod room;
mod series;

pub use note::{ReplyWatch, noted_in_reply};
use series::{Counts, ReasonLabel};

/// A tokenize or template call; a long prompt's takes milliseconds.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A save or restore reads or writes the whole state (tens of MB for a long prompt).
const STATE_TIMEOUT: Duration = Duration::from_secs(120);
/// A look at the folder (one `stat`, a listing when it changed) takes microseconds; one that
/// has not answered in this long is a folder on a disk that stopped answering.
const FOLDER_TIMEOUT: Duration = Duration::from_secs(2);

/// What the flags asked for, settled before the backend starts (`start::setup`).
#[derive(Clone, Debug)]
pub struct Setup {
    pub dir: PathBuf,
    pub budget_bytes: u64,
    pub min_tokens: usize,
    /// llama-server's micro-batch (`-ub`: 256 on the cpu route, else llama-server's 512): a
    /// cold prefill decodes the prompt in runs of this many tokens from its start, so a
    /// restore that stops at a multiple of it, within what the state holds exactly, leaves
    /// the rest to be decoded in the very runs a cold prefill decodes, bit for bit.
    pub ubatch: usize,
    /// The model file and the backend's command line, for the identity.
    pub model: PathBuf,
    pub argv: Vec<String>,
}

/// The request kinds whose prompt the cache reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A chat: templated by the backend (`/apply-template`), then tokenized.
    Chat,
    /// A completion with one string prompt.
    Completion,
}

impl Kind {
    fn of(path: &str) -> Option<Kind> {
        match path {
            "/v1/chat/completions" | "/chat/completions" => Some(Kind::Chat),
            "/v1/completions" | "/completions" | "/completion" => Some(Kind::Completion),
            _ => None,
        }
    }
}

/// Whether a request to `path` is one the cache can prepare (the relay plan asks).
pub fn takes(path: &str) -> bool {
    Kind::of(path).is_some()
}

/// What the cache did for one request before it was forwarded; handed back to
/// [`PromptCache::released`] when its reply ends.
#[derive(Debug)]
pub struct Prepared {
    pub slot: usize,
    tokens: Vec<i32>,
    /// Tokens restored from the disk (the prefix the prompt shares with the state), and the
    /// restore's time.
    pub restored: Option<Restored>,
    /// The prompt tokens llama-server reused rather than prefilled (its reply's
    /// `timings.cache_n`), once the relay has read it; `usize::MAX` until then.
    reused: Arc<AtomicUsize>,
}

impl Prepared {
    /// What the relay reads from and notes in this request's reply.
    pub fn watch(&self) -> ReplyWatch {
        ReplyWatch {
            restored: self.restored,
            reused: self.reused.clone(),
        }
    }
}

/// Where a request's prefill began: the prompt's length, the prefix restored from disk, and
/// the tokens llama-server reused (as its reply said).
#[derive(Clone, Copy, Debug)]
struct Prefill {
    prompt_tokens: usize,
    restored: Option<usize>,
    reused: Option<usize>,
}

#[derive(Clone, Copy, Debug)]
pub struct Restored {
    pub n_tokens: usize,
    pub restore_ms: f64,
}

/// What a slot holds, as far as serve knows: the tokens of the last prompt it was given.
#[derive(Clone, Debug, Default)]
struct Slot {
    tokens: Vec<i32>,
    used: u64,
    busy: usize,
}

/// One slot as the backend's `/slots` says it is now.
#[derive(Clone, Copy, Debug)]
struct SlotNow {
    idle: bool,
    /// The tokens in its KV (`n_prompt_tokens`: its prompt and what it generated); absent
    /// for a slot that never ran a task.
    holds: Option<usize>,
}

impl SlotNow {
    fn of(slot: &Value) -> SlotNow {
        SlotNow {
            idle: !slot["is_processing"].as_bool().unwrap_or(false),
            holds: slot["n_prompt_tokens"].as_u64().map(|n| n as usize),
        }
    }
}

/// The cache of one backend (backend 0 of a llama-server route). Made by `serve`; opened once
/// the backend is ready; shared by every request handler.
pub struct PromptCache {
    setup: Setup,
    port: u16,
    client: ProbeClient,
    store: Arc<Mutex<Option<Store>>>,
    slots: Mutex<Vec<Slot>>,
    /// The slots share one KV (llama-server's unified KV): a restore needs the room the other
    /// slots leave (`room`).
    shared_kv: bool,
    /// llama-server empties every idle slot as a request starts (`room`).
    idle_slots_emptied: bool,
    /// The KV's cells (a slot's context, `n_ctx`, from the backend's `/props`); 0 until open.
    context: AtomicUsize,
    clock: AtomicU64,
    saving: AtomicBool,
    seq: AtomicU64,
    pending: AtomicUsize,
    settled: tokio::sync::Notify,
    counts: Counts,
    /// Whether the folder could be read at the last look (said once when it could not).
    reachable: AtomicBool,
    /// A look at the folder is still under way past its time: none other is begun.
    stalled: Arc<AtomicBool>,
    /// The agent sessions relayed (`sessions`).
    sessions: Mutex<sessions::Sessions>,
}

impl PromptCache {
    pub fn new(setup: Setup, port: u16, client: ProbeClient) -> PromptCache {
        PromptCache {
            shared_kv: identity::kv_unified(&setup.argv),
            idle_slots_emptied: room::idle_slots_emptied(&setup.argv),
            context: AtomicUsize::new(0),
            setup,
            port,
            client,
            store: Arc::new(Mutex::new(None)),
            slots: Mutex::new(Vec::new()),
            clock: AtomicU64::new(0),
            saving: AtomicBool::new(true),
            seq: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            settled: tokio::sync::Notify::new(),
            counts: Counts::default(),
            reachable: AtomicBool::new(true),
            stalled: Arc::new(AtomicBool::new(false)),
            sessions: Mutex::new(sessions::Sessions::default()),
        }
    }

    /// The shortest prompt (in tokens) worth a state on disk; the relay plan sends a body
    /// shorter than this many bytes on without asking.
    pub fn min_tokens(&self) -> usize {
        self.setup.min_tokens
    }

    /// Once the backend is ready: its identity (its `/props`, the model's header, the
    /// llama-server executable), then the folder read, each file that does not fit its
    /// description discarded with its line, the states of other identities said and left.
    /// Called once by `serve` before it says ready; a failure says one line and leaves the
    /// cache off.
    pub async fn open(&self) {
        let props = match self.get_json("/props").await {
            Ok(props) => props,
            Err(e) => {
                tracing::warn!(
                    "1bit serve: prompt cache off: the backend's /props did not answer ({e}); serving continues"
                );
                return;
            }
        };
        let setup = self.setup.clone();
        let opened = tokio::task::spawn_blocking(move || {
            let (model_path, model_bytes, model_header_sha256) =
                identity::model_part(&setup.model)?;
            let program = setup.argv.first().map(PathBuf::from).unwrap_or_default();
            let identity = Identity {
                model_path,
                model_bytes,
                model_header_sha256,
                llama_build: props["build_info"].as_str().unwrap_or("").to_string(),
                llama_sha256: identity::file_sha256(&program)?,
                n_ctx_slot: props["default_generation_settings"]["n_ctx"]
                    .as_u64()
                    .unwrap_or(0),
                total_slots: props["total_slots"].as_u64().unwrap_or(1),
                kv_settings: identity::kv_settings(&setup.argv),
            };
            let slots = identity.total_slots.max(1) as usize;
            let context = identity.n_ctx_slot as usize;
            let mut store = Store::open(&setup.dir, setup.budget_bytes, identity);
            let news = store.take_news();
            Ok::<_, std::io::Error>((store, news, slots, context))
        })
        .await;
        let (store, news, slots, context) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => {
                tracing::warn!(
                    "1bit serve: prompt cache off: cannot read what made its states ({e}); serving continues"
                );
                return;
            }
            Err(_) => return,
        };
        self.say(news);
        tracing::info!(
            "1bit serve: prompt cache: {} (states: {}, {:.2} of {:.2} GiB; prompts of {} tokens or more)",
            self.setup.dir.display(),
            store.count(),
            store.folder_bytes() as f64 / GIB,
            self.setup.budget_bytes as f64 / GIB,
            self.setup.min_tokens
        );
        if let Ok(mut s) = self.slots.lock() {
            *s = vec![Slot::default(); slots];
        }
        self.context.store(context, Ordering::Relaxed);
        if let Ok(mut s) = self.store.lock() {
            *s = Some(store);
        }
    }

    /// Slot preparation of one request (a chat or completion the plan marked): its prompt
    /// tokenized by the backend; a slot chosen and, when a saved state shares a prefix of at
    /// least the minimum with the prompt and the slot holds less of it, the state restored into
    /// it; the body pinned to that slot (`id_slot`). None when the prompt is not the cache's
    /// (short, not text, the cache not open): the body goes as it came. Runs on the request's
    /// task; the file check goes to a blocking thread.
    pub async fn prepare(&self, path: &str, body: &Bytes) -> Option<(Bytes, Prepared)> {
        let kind = Kind::of(path)?;
        // Not open yet (or off); a store busy with a save or a look is open. Never waited on
        // here: a folder whose disk stopped answering holds its lock (`refreshed`).
        match self.store.try_lock() {
            Ok(store) if store.is_none() => return None,
            Err(std::sync::TryLockError::Poisoned(_)) => return None,
            _ if self.stalled.load(Ordering::Relaxed) => return None,
            _ => {}
        }
        let mut value: Value = serde_json::from_slice(body).ok()?;
        let asked_slot = value
            .get("id_slot")
            .and_then(Value::as_i64)
            .filter(|n| *n >= 0);
        let prompt = match kind {
            Kind::Chat => {
                value.get("messages")?.as_array()?;
                let templated = self
                    .post_json("/apply-template", body.clone(), CALL_TIMEOUT)
                    .await
                    .ok()?;
                templated["prompt"].as_str()?.to_string()
            }
            Kind::Completion => value.get("prompt")?.as_str()?.to_string(),
        };
        let request =
            serde_json::json!({"content": prompt, "add_special": true, "parse_special": true});
        let tokenized = self
            .post_json("/tokenize", Bytes::from(request.to_string()), CALL_TIMEOUT)
            .await
            .ok()?;
        let tokens: Vec<i32> = tokenized["tokens"]
            .as_array()?
            .iter()
            .map(|t| t.as_i64().map(|t| t as i32))
            .collect::<Option<_>>()?;
        if tokens.len() < self.setup.min_tokens || !self.refreshed().await {
            return None;
        }
        let (slot, held, backend) = self.choose_slot(asked_slot, &tokens).await;
        let best = self
            .store
            .lock()
            .ok()?
            .as_mut()
            .and_then(|store| {
                let (entry, shared) = store.best(&tokens)?;
                // llama-server evaluates at least the prompt's last token; the restore stops
                // at a micro-batch boundary within the state's exact part, so what is
                // prefilled is what a cold prefill decodes in its last runs, and the reply is
                // the cold one's.
                let k = self.exact_cut(shared.min(entry.exact).min(tokens.len() - 1));
                // A prefix the slot already holds is a use of its state too (least recently
                // used is what the budget evicts).
                if k >= self.setup.min_tokens && k <= held {
                    store.touch(&entry);
                }
                Some((entry, k, shared.min(tokens.len() - 1)))
            })
            .filter(|(_, k, _)| *k >= self.setup.min_tokens && *k > held);
        let restored = match best {
            Some((entry, k, reusable)) => {
                let room = self.make_room(slot, entry.tokens.len(), &backend).await;
                self.restore(slot, entry, k, reusable, room).await
            }
            None => None,
        };
        if restored.is_none() && held < self.setup.min_tokens {
            // What the slot holds is not worth keeping: emptied, the prompt is prefilled from
            // its first token as a cold run prefills it, and its state can be saved as exact
            // (llama-server would otherwise reuse the few tokens a template's preamble shares).
            self.erase(slot, 1).await;
        }
        let object = value.as_object_mut()?;
        object.insert("id_slot".to_string(), Value::from(slot));
        object.insert("cache_prompt".to_string(), Value::from(true));
        Some((
            Bytes::from(value.to_string()),
            Prepared {
                slot,
                tokens,
                restored,
                reused: Arc::new(AtomicUsize::new(usize::MAX)),
            },
        ))
    }

    /// The longest prefix of `n` tokens that ends on a micro-batch boundary.
    fn exact_cut(&self, n: usize) -> usize {
        let unit = self.setup.ubatch.max(1);
        n / unit * unit
    }

    /// Empty a slot that at most `busy` requests of serve's have chosen (the one asking, or
    /// none) with `POST /slots/<id>?action=erase`; a refusal leaves it as it was. Whether it
    /// was emptied.
    async fn erase(&self, slot: usize, busy: usize) -> bool {
        let idle = self
            .slots
            .lock()
            .ok()
            .and_then(|slots| slots.get(slot).map(|s| s.busy <= busy))
            .unwrap_or(false);
        if !idle {
            return false;
        }
        if self
            .post_json(
                &format!("/slots/{slot}?action=erase"),
                Bytes::new(),
                CALL_TIMEOUT,
            )
            .await
            .is_ok()
            && let Ok(mut slots) = self.slots.lock()
            && let Some(s) = slots.get_mut(slot)
        {
            s.tokens.clear();
            return true;
        }
        false
    }

    /// The slot a prepared request goes to: the one it asked for, else among the idle slots
    /// (the backend's `/slots`) the one serve knows holds most of the prompt, else the least
    /// recently used. Returns it with the prompt tokens serve knows it holds.
    ///
    /// What serve knows a slot holds is what it last gave it, as long as the backend says the
    /// slot still holds at least that many tokens: llama-server empties idle slots on its own
    /// (with `--cache-idle-slots` when another task starts, and when its KV runs short), and a
    /// request pinned to a slot serve wrongly trusts is prefilled whole.
    /// Returns too what `/slots` said (empty when it did not answer).
    async fn choose_slot(
        &self,
        asked: Option<i64>,
        tokens: &[i32],
    ) -> (usize, usize, Vec<SlotNow>) {
        let backend: Option<Vec<SlotNow>> = self.get_json("/slots").await.ok().and_then(|v| {
            v.as_array()
                .map(|slots| slots.iter().map(SlotNow::of).collect())
        });
        let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        let Ok(mut slots) = self.slots.lock() else {
            return (0, 0, Vec::new());
        };
        for (slot, said) in slots.iter_mut().zip(backend.iter().flatten()) {
            if slot.busy == 0 && said.holds.is_some_and(|n| n < slot.tokens.len()) {
                slot.tokens.clear();
            }
        }
        let idle: Option<Vec<bool>> = backend.as_ref().map(|b| b.iter().map(|s| s.idle).collect());
        let n = slots.len().max(1);
        let chosen = match asked {
            Some(asked) => asked as usize % n,
            None => (0..n)
                .filter(|i| {
                    slots.get(*i).is_none_or(|s| s.busy == 0)
                        && idle
                            .as_ref()
                            .is_none_or(|idle| idle.get(*i) != Some(&false))
                })
                .max_by_key(|i| {
                    // A slot holding a prefix worth keeping, else the least recently used.
                    let s = &slots[*i];
                    let held = store::common_prefix(&s.tokens, tokens);
                    (
                        if held >= self.setup.min_tokens {
                            held
                        } else {
                            0
                        },
                        std::cmp::Reverse(s.used),
                    )
                })
                .unwrap_or_else(|| (0..n).min_by_key(|i| slots[*i].used).unwrap_or(0)),
        };
        let backend = backend.unwrap_or_default();
        let Some(slot) = slots.get_mut(chosen) else {
            return (chosen, 0, backend);
        };
        let held = store::common_prefix(&slot.tokens, tokens);
        slot.busy += 1;
        slot.used = now;
        (chosen, held, backend)
    }

    /// The request's reply ended (or its client left): the slot is released, and its state
    /// saved unless a state already holds the whole prompt, saving stopped, or the prompt is
    /// short. The save runs on its own task; [`settle`](Self::settle) waits for it. Called from
    /// the reply body's drop, on a runtime thread.
    pub fn released(self: &Arc<Self>, prepared: Prepared) {
        if let Ok(mut slots) = self.slots.lock()
            && let Some(s) = slots.get_mut(prepared.slot)
        {
            s.busy = s.busy.saturating_sub(1);
            s.tokens.clone_from(&prepared.tokens);
        }
        if !self.saving.load(Ordering::Relaxed)
            || !self.reachable.load(Ordering::Relaxed)
            || self.stalled.load(Ordering::Relaxed)
        {
            return;
        }
        let at_best = self.exact_cut(prepared.tokens.len());
        let held = self
            .store
            .lock()
            .ok()
            .and_then(|s| s.as_ref().map(|s| s.holds(&prepared.tokens, at_best)))
            .unwrap_or(true);
        if held {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.pending.fetch_add(1, Ordering::SeqCst);
        let cache = self.clone();
        let prefill = Prefill {
            prompt_tokens: prepared.tokens.len(),
            restored: prepared.restored.map(|r| r.n_tokens),
            reused: match prepared.reused.load(Ordering::Relaxed) {
                usize::MAX => None,
                n => Some(n),
            },
        };
        runtime.spawn(async move {
            cache.save(prepared.slot, &prepared.tokens, prefill).await;
            if cache.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
                cache.settled.notify_waiters();
            }
        });
    }

    /// The stop is cutting the replies still in flight: their slots hold a prompt half
    /// prefilled or a reply cut short, not worth the stop's time, so nothing more is saved.
    /// Called by the drain just before the cut; does not block.
    pub fn cutting(&self) {
        self.saving.store(false, Ordering::Relaxed);
    }

    /// How many tokens of what the slot holds after `prefill` a cold prefill computes bit
    /// for bit. Begun at the first token (llama-server reused none) or at a prefix restored
    /// on a micro-batch boundary: the prompt's whole micro-batches. Begun anywhere else (a
    /// prefix llama-server kept in its memory), or where the reply did not say: none that
    /// serve can vouch for. What was generated is never a cold prefill's.
    fn exact_after(&self, prefill: Prefill) -> usize {
        match prefill.reused {
            Some(0) => self.exact_cut(prefill.prompt_tokens),
            Some(reused) if prefill.restored == Some(reused) => {
                self.exact_cut(prefill.prompt_tokens)
            }
            _ => 0,
        }
    }

    async fn save(&self, slot: usize, prompt: &[i32], prefill: Prefill) {
        let exact = self.exact_after(prefill);
        if exact < self.setup.min_tokens {
            tracing::debug!(
                "1bit serve: prompt cache: slot {slot} not saved: {exact} of its tokens are a cold prefill's (whole micro-batches prefilled from an empty slot or an exact restore), fewer than --prompt-cache-min-tokens {}",
                self.setup.min_tokens
            );
            return;
        }
        let temp = Store::temp_name(self.seq.fetch_add(1, Ordering::Relaxed));
        // Removed however the save ends: also when the stop drops it, once the backend that
        // was writing it is gone.
        let _temp = folder::TempFile(self.setup.dir.join(&temp));
        let saved = self.slot_file_action(slot, "save", &temp).await;
        if let Err(e) = saved {
            // A folder gone is said as such; a backend that refused (its disk full or
            // read-only) stops saving; one that did not answer (stopping, or gone) is the
            // supervisor's to report.
            if let Some(why) = self.folder_lost().await {
                self.unreachable(&why);
            } else if e.starts_with("status ") {
                self.stop_saving(&format!("llama-server could not save slot {slot} ({e})"));
            }
            return;
        }
        let store = self.store.clone();
        let min = self.setup.min_tokens;
        let prompt = prompt.to_vec();
        let admitted = tokio::task::spawn_blocking(move || {
            let mut store = store.lock().ok()?;
            let store = store.as_mut()?;
            Some((store.admit(&temp, min, &prompt, exact), store.take_news()))
        })
        .await
        .ok()
        .flatten();
        let Some((admitted, news)) = admitted else {
            return;
        };
        self.say(news);
        match admitted {
            Ok(Admitted::Kept { bytes, evicted }) => {
                self.counts.saves.inc();
                self.counts.saved_bytes.inc_by(bytes);
                self.counts.evictions.inc_by(evicted as u64);
            }
            Ok(Admitted::Dropped(_)) => {}
            Err(e) => match self.folder_lost().await {
                Some(why) => self.unreachable(&why),
                None => self.stop_saving(&format!("cannot keep a state ({e})")),
            },
        }
    }

    /// The folder looked at again where another serve changed it ([`Store::refresh`], on a
    /// blocking thread, for at most [`FOLDER_TIMEOUT`]) before a request is prepared: false
    /// when it cannot be read, said once, and the request goes on without the cache. A look
    /// past its time is given up and no other begun until it ends.
    async fn refreshed(&self) -> bool {
        if self.stalled.load(Ordering::Relaxed) {
            return false;
        }
        let store = self.store.clone();
        let mut look = tokio::task::spawn_blocking(move || {
            let mut store = store.lock().ok()?;
            let store = store.as_mut()?;
            Some(store.refresh().map(|_| store.take_news()))
        });
        let looked = match tokio::time::timeout(FOLDER_TIMEOUT, &mut look).await {
            Ok(joined) => joined.ok().flatten(),
            Err(_) => {
                self.stalled.store(true, Ordering::Relaxed);
                let stalled = self.stalled.clone();
                tokio::spawn(async move {
                    let _ = look.await;
                    stalled.store(false, Ordering::Relaxed);
                });
                self.unreachable(&format!(
                    "it did not answer within {} s",
                    FOLDER_TIMEOUT.as_secs()
                ));
                return false;
            }
        };
        match looked {
            Some(Ok(news)) => {
                self.say(news);
                if !self.reachable.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        "1bit serve: prompt cache: {} can be read again; restoring and saving again",
                        self.setup.dir.display()
                    );
                }
                true
            }
            Some(Err(e)) => {
                self.unreachable(&e.to_string());
                false
            }
            None => false,
        }
    }

    /// Why the folder cannot be read now, or None when it can.
    async fn folder_lost(&self) -> Option<String> {
        let dir = self.setup.dir.clone();
        tokio::task::spawn_blocking(move || folder::Stamp::of(&dir).err())
            .await
            .ok()
            .flatten()
            .map(|e| e.to_string())
    }

    /// The folder cannot be read: said once, until it can again; requests go on without the
    /// cache, and nothing is saved.
    fn unreachable(&self, why: &str) {
        if self.reachable.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "1bit serve: prompt cache: {} cannot be read ({why}); serving goes on without the cache until it can",
                self.setup.dir.display()
            );
        }
    }

    fn stop_saving(&self, why: &str) {
        if self.saving.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "1bit serve: prompt cache: saving stopped: {why}; serving continues, restores too (make {} writable, with free space, or pass --no-prompt-cache)",
                self.setup.dir.display()
            );
        }
    }

    /// At drain, after the requests in flight: wait until `deadline` at the latest for the
    /// saves under way, so the backend is not stopped in the middle of one. The deadline is the
    /// stop's bound (the drain window and 0.3 s): a save still running then is given up, with
    /// one line, rather than holding serve past Lemonade's SIGKILL.
    pub async fn settle(&self, deadline: tokio::time::Instant) {
        let wait = async {
            while self.pending.load(Ordering::SeqCst) > 0 {
                let notified = self.settled.notified();
                if self.pending.load(Ordering::SeqCst) == 0 {
                    break;
                }
                notified.await;
            }
        };
        if tokio::time::timeout_at(deadline, wait).await.is_err() {
            tracing::warn!(
                "1bit serve: prompt cache: {} save(s) still under way when the stop's time ran out; not kept (a longer --drain-s gives them time)",
                self.pending.load(Ordering::SeqCst)
            );
        }
    }

    /// Say what the folder's listings found: each file discarded, and each reason another
    /// identity's states are not used, once.
    fn say(&self, news: News) {
        for d in &news.discarded {
            self.said_discard(d);
        }
        for other in &news.others {
            self.counts
                .discards
                .get_or_create(&ReasonLabel {
                    reason: Reason::Foreign.label(),
                })
                .inc();
            if other.first {
                tracing::warn!(
                    "1bit serve: prompt cache: not using {}: {}; left in the folder for the serves it is theirs (the folder's budget evicts it in its turn)",
                    other.file.display(),
                    other.why
                );
            }
        }
    }

    fn said_discard(&self, d: &Discarded) {
        self.counts
            .discards
            .get_or_create(&ReasonLabel {
                reason: d.reason.label(),
            })
            .inc();
        tracing::warn!(
            "1bit serve: prompt cache: discarded {}: {}",
            d.file.display(),
            d.why
        );
    }
}

const GIB: f64 = (1u64 << 30) as f64;
