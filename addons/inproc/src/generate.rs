//! Completions on the loaded context: slots (`--parallel`), each prompt decoded (reusing the
//! slot's cached prefix), tokens sampled until an end token, a stop string or the budget, the
//! text handed out as it becomes final. One decode per step carries every generating slot's
//! next token and as much of the waiting prompts as the batch holds, as llama-server's slots
//! share one decode: a new prompt never stops the other streams for a decode of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::ffi::{SamplerChain, Session, Token, TokenBatch};
use crate::state_buffer::StateBuffer;

/// How one request samples and when it stops.
#[derive(Clone, Debug)]
pub struct Settings {
    /// At most this many new tokens (None: until the context is full).
    pub max_tokens: Option<u32>,
    /// 0 (or less) is greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// The sampler's seed (llama.cpp's "random" value 0xFFFFFFFF when the request has none).
    pub seed: u32,
    /// Strings that end the completion; the text stops before the first one found.
    pub stop: Vec<String>,
    /// Reuse the slot's cached prefix (llama-server's `cache_prompt`, default true).
    pub reuse_prefix: bool,
}

/// Why generation ended, as OpenAI's `finish_reason` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    /// The client left (`emit` said so): nothing more is sent.
    Gone,
}

impl Finish {
    pub fn reason(self) -> &'static str {
        match self {
            Finish::Stop | Finish::Gone => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a completion took.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub finish: Finish,
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the last request's context instead of decoded again.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
}

/// Why a completion could not run: a request error (the prompt does not fit) or the engine's.
#[derive(Debug)]
pub enum Failure {
    /// The client's fault: answered 400.
    Request(String),
    /// The engine failed: answered 500.
    Engine(String),
}

/// Where a completion's text and outcome go: the request's thread, through a channel.
pub trait Client: Send {
    /// A piece of final text (never a partial UTF-8 character, never text that might still
    /// start a stop string). False once the client is gone: generation stops at that token.
    fn text(&mut self, text: &str) -> bool;
    /// Whether the client left while no text was handed out (a prefill): asked before each
    /// decode that carries some of its prompt, so a long prompt stops between batches.
    fn gone(&self) -> bool;
    /// The completion ended (or could not run).
    fn done(self: Box<Self>, outcome: Result<Outcome, Failure>);
}

/// One completion to run.
pub struct Job {
    pub prompt: String,
    /// A chat's prompt (the template's rendering): its batches also end where user messages
    /// start, as llama-server's do.
    pub chat: bool,
    pub settings: Settings,
    pub client: Box<dyn Client>,
}

/// What the engine counts, read by the route's /metrics.
#[derive(Debug, Default)]
pub struct Counters {
    /// Decodes run (the warm-up at load, then prompt chunks and token steps alike).
    pub decodes: AtomicU64,
    /// Decodes that carried a prompt's tokens together with other slots' tokens.
    pub shared_prompt_decodes: AtomicU64,
    /// Prompts put back into a slot from the prompt cache in RAM.
    pub prompt_cache_restores: AtomicU64,
    /// What the prompt cache in RAM holds, in bytes (a gauge).
    pub prompt_cache_bytes: AtomicU64,
}

/// A slot's contents worth keeping when the slot moves on to another prompt: at least this
/// many tokens.
const KEEP_AT_LEAST: usize = 32;

/// Prompts kept in RAM once their slot moved on to another (llama-server's `--cache-ram`): a
/// later prompt that shares more with one of them than with any free slot gets that state put
/// back into its slot instead of decoding the shared part again. Bounded in bytes; the least
/// recently kept go first.
pub struct PromptCache {
    budget: usize,
    /// Oldest first.
    kept: Vec<Kept>,
}

struct Kept {
    tokens: Vec<Token>,
    state: StateBuffer,
}

impl PromptCache {
    pub fn new(budget_bytes: usize) -> Self {
        PromptCache {
            budget: budget_bytes,
            kept: Vec::new(),
        }
    }

    pub fn bytes(&self) -> usize {
        self.kept.iter().map(|k| k.state.len()).sum()
    }

    /// Keep `tokens`' state, dropping what it makes useless (a kept prompt it starts with)
    /// and then the oldest until it fits; a state larger than the whole budget is not kept.
    fn keep(&mut self, tokens: Vec<Token>, state: StateBuffer) {
        if state.len() > self.budget {
            return;
        }
        self.kept.retain(|k| !tokens.starts_with(&k.tokens));
        while self.bytes() + state.len() > self.budget && !self.kept.is_empty() {
            self.kept.remove(0);
        }
        self.kept.push(Kept { tokens, state });
    }

    /// Take out the kept prompt sharing the longest prefix with `prompt`, when it shares more
    /// than `than` tokens.
    fn take_best(&mut self, prompt: &[Token], than: usize) -> Option<Kept> {
        let (i, n) = self
            .kept
            .iter()
            .enumerate()
            .map(|(i, k)| (i, shared_prefix(&k.tokens, prompt)))
            .max_by_key(|&(i, n)| (n, i))?;
        (n > than).then(|| self.kept.remove(i))
    }
}

/// How many tokens `a` and `b` share from their start.
fn shared_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A completion in progress on a slot.
struct Active {
    client: Box<dyn Client>,
    sampler: SamplerChain,
    scan: StopScan,
    /// The whole prompt; `fed` of its tokens are in the slot's cache (the reused prefix
    /// first), the rest wait for the next decodes.
    prompt: Vec<Token>,
    /// Where this prompt's decodes end, as llama-server's batches do ([`prompt_breaks`]).
    breaks: Vec<usize>,
    fed: usize,
    reused: usize,
    generated: usize,
    budget: usize,
    started: Instant,
    prompt_ms: f64,
    predicting: Instant,
    /// The token sampled last, to go into the next decode.
    pending: Option<Token>,
}

impl Active {
    fn prefilling(&self) -> bool {
        self.fed < self.prompt.len()
    }
}

/// What a slot put into a decode: its next token, or prompt tokens `from..to`.
#[derive(Clone, Copy)]
enum Fed {
    Token(Token),
    Prompt(usize, usize),
}

/// One sequence of the context: the tokens it holds, in order (what the next prompt may
/// reuse), and the completion running on it.
struct Slot {
    cached: Vec<Token>,
    active: Option<Active>,
}

/// The engine: the context, its slots (`--parallel`), and one batch that carries every active
/// slot's next token into each decode, so N streams cost one decode per token step, not N.
/// Owned and run by the route's engine thread.
pub struct SlotEngine<'a> {
    session: Session<'a>,
    slots: Vec<Slot>,
    batch: TokenBatch,
    counters: std::sync::Arc<Counters>,
    cache: PromptCache,
    /// [`SlotEngine::checkpoint_ends_for`] the model.
    checkpoint_ends: Vec<usize>,
    /// The tokens that start a user message in the chat template's prompts (empty: none).
    user_start: Vec<Token>,
}

impl<'a> SlotEngine<'a> {
    pub fn new(
        session: Session<'a>,
        slots: usize,
        cache: PromptCache,
        counters: std::sync::Arc<Counters>,
        user_start: Vec<Token>,
    ) -> Self {
        let batch = session.batch(session.n_batch().max(slots));
        SlotEngine {
            user_start,
            checkpoint_ends: Self::checkpoint_ends_for(&session),
            cache,
            counters,
            session,
            slots: (0..slots.max(1))
                .map(|_| Slot {
                    cached: Vec::new(),
                    active: None,
                })
                .collect(),
            batch,
        }
    }

    pub fn session(&self) -> &Session<'a> {
        &self.session
    }

    /// Run jobs from `queue` until it closes: admit each into a free slot (the one whose
    /// cached tokens share the longest prefix with its prompt), then step: one decode carries
    /// every generating slot's next token and the waiting prompts' tokens. Blocks the calling
    /// thread (the engine thread).
    pub fn run(&mut self, queue: &std::sync::mpsc::Receiver<Job>) {
        let mut trim = crate::heap_trim::HeapTrim::default();
        loop {
            let idle = self.slots.iter().all(|s| s.active.is_none());
            if idle {
                match queue.recv() {
                    Ok(job) => self.admit(job),
                    Err(_) => return,
                }
            }
            while self.slots.iter().any(|s| s.active.is_none()) {
                match queue.try_recv() {
                    Ok(job) => self.admit(job),
                    Err(_) => break,
                }
            }
            self.step();
            trim.ran();
            trim.between_steps();
        }
    }

    /// Take a job into a free slot: tokenize, and keep the cached prefix it shares; the rest of
    /// the prompt goes into the next steps' decodes. A job that cannot run is answered at once.
    fn admit(&mut self, job: Job) {
        let started = Instant::now();
        let tokens = match self.session.tokenize(&job.prompt) {
            Ok(tokens) => tokens,
            Err(e) => return job.client.done(Err(Failure::Engine(e))),
        };
        let room_total = self.session.n_ctx_seq() as usize;
        if tokens.is_empty() {
            return job.client.done(Err(Failure::Request(
                "the prompt is empty; send some text to complete".to_string(),
            )));
        }
        if tokens.len() >= room_total {
            return job.client.done(Err(Failure::Request(format!(
                "the prompt is {} tokens and a slot's context holds {room_total}; shorten it or serve with a larger --ctx-size",
                tokens.len()
            ))));
        }
        let reuse = job.settings.reuse_prefix;
        let common = |cached: &[Token]| {
            if reuse {
                shared_prefix(cached, &tokens)
            } else {
                0
            }
        };
        let Some(seq) = (0..self.slots.len())
            .filter(|&i| self.slots[i].active.is_none())
            .max_by_key(|&i| (common(&self.slots[i].cached), std::cmp::Reverse(i)))
        else {
            return job
                .client
                .done(Err(Failure::Engine("no free slot".to_string())));
        };
        if reuse {
            self.swap_with_cache(seq, &tokens, common(&self.slots[seq].cached));
        }
        // Reuse the longest prefix the slot holds, but decode at least the prompt's last
        // token: its logits choose the first new token.
        let mut reused = common(&self.slots[seq].cached).min(tokens.len() - 1);
        // A windowed layer's cache dropped the positions that fell out of its window: the
        // prefix is reusable only while it still holds the window the next position reads.
        let window = self.session.n_swa();
        if window > 0 && reused > 0 {
            let needed = (reused + 1).saturating_sub(window);
            if self
                .session
                .first_position(seq as i32)
                .is_none_or(|first| first > needed)
            {
                reused = 0;
            }
        }
        if reused == 0 || !self.session.forget_from(seq as i32, reused) {
            self.session.forget_from(seq as i32, 0);
            reused = 0;
        }
        let room = room_total - tokens.len();
        let settings = &job.settings;
        let budget = settings.max_tokens.map_or(room, |m| (m as usize).min(room));
        let sampler = self
            .session
            .sampler(settings.temperature, settings.top_p, settings.seed);
        let user_starts = if job.chat && !self.checkpoint_ends.is_empty() {
            user_starts(&tokens, &self.user_start)
        } else {
            Vec::new()
        };
        let breaks = prompt_breaks(tokens.len(), &self.checkpoint_ends, &user_starts);
        let slot = &mut self.slots[seq];
        slot.cached.truncate(reused);
        slot.active = Some(Active {
            breaks,
            sampler,
            scan: StopScan::new(settings.stop.clone()),
            client: job.client,
            prompt: tokens,
            fed: reused,
            reused,
            generated: 0,
            budget,
            started,
            prompt_ms: 0.0,
            predicting: Instant::now(),
            pending: None,
        });
        if budget == 0 {
            self.finish(seq, Finish::Length);
        }
    }

    /// Before slot `seq` takes `prompt`, of which it holds `held` tokens: keep what the slot
    /// would lose in the prompt cache, and put back a kept prompt that shares more.
    fn swap_with_cache(&mut self, seq: usize, prompt: &[Token], held: usize) {
        if self.cache.budget == 0 {
            return;
        }
        let slot = &self.slots[seq];
        if slot.cached.len() >= KEEP_AT_LEAST
            && held < slot.cached.len()
            && let Some(state) = self.session.save_sequence(seq as i32)
        {
            self.cache.keep(slot.cached.clone(), state);
        }
        if let Some(kept) = self.cache.take_best(prompt, held.max(KEEP_AT_LEAST - 1)) {
            let slot = &mut self.slots[seq];
            if self.session.restore_sequence(seq as i32, &kept.state) {
                slot.cached = kept.tokens;
                self.counters
                    .prompt_cache_restores
                    .fetch_add(1, Ordering::Relaxed);
            } else {
                slot.cached.clear();
            }
        }
        self.counters
            .prompt_cache_bytes
            .store(self.cache.bytes() as u64, Ordering::Relaxed);
    }

    /// How many tokens before a prompt's end llama-server ends a prompt decode, on a model
    /// whose memory it checkpoints (windowed attention): `4 + n_ubatch` and 4, each at most
    /// n_batch (its `checkpoint_offsets`, llama.cpp PR 20288). Empty for other models. The
    /// add-on keeps no checkpoints, but splits the prompt where llama-server does: a batch's
    /// size picks the matmul path (repacked weights take a batched kernel for several rows,
    /// another for one), whose rounding can flip a greedy near-tie (issue 23: Gemma 3).
    fn checkpoint_ends_for(session: &Session<'_>) -> Vec<usize> {
        if session.n_swa() == 0 {
            return Vec::new();
        }
        let n_batch = session.n_batch();
        vec![(4 + session.n_ubatch()).min(n_batch), 4.min(n_batch)]
    }

    /// The most tokens a prompt decode takes at once (the batch's capacity, at most n_batch).
    fn batch_room(&self) -> usize {
        self.session.n_batch().max(1)
    }

    /// One step: one decode carrying every generating slot's next token and, in the room
    /// left, the waiting prompts' next tokens (a prompt longer than the room goes on in the
    /// next steps); then each slot whose logits came back samples its next token.
    fn step(&mut self) {
        self.batch.clear();
        let room = self.batch_room();
        // (slot, what it put in, the batch index of its logits when it asked for them)
        let mut decoded: Vec<(usize, Fed, Option<i32>)> = Vec::new();
        for seq in 0..self.slots.len() {
            let pos = self.slots[seq].cached.len();
            let Some(token) = self.slots[seq]
                .active
                .as_mut()
                .filter(|active| !active.prefilling())
                .and_then(|active| active.pending.take())
            else {
                continue;
            };
            let index = self.batch.add(token, pos, seq as i32, true);
            decoded.push((seq, Fed::Token(token), Some(index)));
        }
        for seq in 0..self.slots.len() {
            let free = room.saturating_sub(self.batch.len());
            let Some(active) = self.slots[seq].active.as_ref().filter(|a| a.prefilling()) else {
                continue;
            };
            if free == 0 {
                break;
            }
            if active.client.gone() {
                // The client left mid-prefill: stop before decoding more of its prompt.
                self.finish(seq, Finish::Gone);
                continue;
            }
            let from = active.fed;
            let to = prompt_chunk_end(from, active.prompt.len().min(from + free), &active.breaks);
            let mut logits = None;
            for pos in from..to {
                let last = pos == active.prompt.len() - 1;
                let index = self.batch.add(active.prompt[pos], pos, seq as i32, last);
                logits = logits.or(last.then_some(index));
            }
            decoded.push((seq, Fed::Prompt(from, to), logits));
        }
        if decoded.is_empty() {
            return;
        }
        self.counters.decodes.fetch_add(1, Ordering::Relaxed);
        if decoded.len() > 1
            && decoded
                .iter()
                .any(|(_, fed, _)| matches!(fed, Fed::Prompt(..)))
        {
            self.counters
                .shared_prompt_decodes
                .fetch_add(1, Ordering::Relaxed);
        }
        if let Err(e) = self.session.decode_batch(&self.batch) {
            for (seq, _, _) in decoded {
                self.session.forget_from(seq as i32, 0);
                self.slots[seq].cached.clear();
                if let Some(active) = self.slots[seq].active.take() {
                    active.client.done(Err(Failure::Engine(e.clone())));
                }
            }
            return;
        }
        for (seq, fed, logits) in decoded {
            let slot = &mut self.slots[seq];
            let Some(active) = slot.active.as_mut() else {
                continue;
            };
            match fed {
                Fed::Token(token) => slot.cached.push(token),
                Fed::Prompt(from, to) => {
                    slot.cached.extend_from_slice(&active.prompt[from..to]);
                    active.fed = to;
                    if !active.prefilling() {
                        active.prompt_ms = active.started.elapsed().as_secs_f64() * 1000.0;
                        active.predicting = Instant::now();
                    }
                }
            }
            if let Some(index) = logits {
                let next = self.session.sample_at(&mut active.sampler, index);
                self.advance(seq, next);
            }
        }
    }

    /// A token sampled for slot `seq`: end on an end token, hand out its text, stop at a stop
    /// string, the budget or a client that left; else keep it for the next decode.
    fn advance(&mut self, seq: usize, token: Token) {
        if self.session.is_end(token) {
            return self.finish(seq, Finish::Stop);
        }
        let piece = self.session.piece(token, false);
        let Some(active) = self.slots[seq].active.as_mut() else {
            return;
        };
        active.generated += 1;
        let (ready, stopped) = active.scan.push(&piece);
        if !ready.is_empty() && !active.client.text(&ready) {
            return self.finish(seq, Finish::Gone);
        }
        if stopped {
            return self.finish(seq, Finish::Stop);
        }
        if active.generated >= active.budget {
            return self.finish(seq, Finish::Length);
        }
        active.pending = Some(token);
    }

    /// End the completion on slot `seq`: the rest of its text, then its outcome.
    fn finish(&mut self, seq: usize, finish: Finish) {
        let Some(mut active) = self.slots[seq].active.take() else {
            return;
        };
        if finish != Finish::Gone {
            let rest = active.scan.finish();
            if !rest.is_empty() {
                active.client.text(&rest);
            }
        }
        let outcome = Outcome {
            finish,
            prompt_tokens: active.prompt.len(),
            cached_tokens: active.reused,
            completion_tokens: active.generated,
            prompt_ms: active.prompt_ms,
            predicted_ms: active.predicting.elapsed().as_secs_f64() * 1000.0,
        };
        active.client.done(Ok(outcome));
    }
}

/// The generated text, released as it becomes final: bytes wait until they make whole UTF-8
/// characters, and text waits while its end could be the start of a stop string.
pub struct StopScan {
    stops: Vec<String>,
    /// Bytes of an unfinished UTF-8 character.
    partial: Vec<u8>,
    /// Text held back (a possible stop string's start).
    held: String,
    stopped: bool,
}

impl StopScan {
    pub fn new(stops: Vec<String>) -> Self {
        StopScan {
            stops,
            partial: Vec::new(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Add a token's bytes; returns the text now final and whether a stop string was reached
    /// (the text before it is in the returned text; the stop string itself never is).
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.partial.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.partial) {
            Ok(s) => s.len(),
            // An error with no length is an unfinished character at the end: wait for it.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // Invalid bytes: let them through as replacement characters.
            Err(_) => self.partial.len(),
        };
        let whole: Vec<u8> = self.partial.drain(..valid).collect();
        self.held.push_str(&String::from_utf8_lossy(&whole));
        let first_stop = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| longest_prefix_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The text still held at the end (no stop string came). Bytes of a character the last
    /// token left unfinished are dropped, as llama-server drops them.
    pub fn finish(&mut self) -> String {
        self.partial.clear();
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest end of `text` that is a proper start of `stop` (on a char boundary).
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.is_char_boundary(n)
                && text.ends_with(&stop[..n])
        })
        .unwrap_or(0)
}

/// Where a decode of the prompt's tokens `from..to` ends: at the first of `breaks` inside it
/// (a decode that starts at a break goes past it), else at `to`.
fn prompt_chunk_end(from: usize, to: usize, breaks: &[usize]) -> usize {
    breaks
        .iter()
        .copied()
        .filter(|point| from < *point && *point < to)
        .min()
        .unwrap_or(to)
}

/// Where llama-server ends the batches of a `len`-token prompt on a model it checkpoints
/// (windowed attention): `n` tokens before the end for each `n` of `ends` (4 + n_ubatch and
/// 4), and before the user messages starting at `user_starts` (of a chat): the last one, and
/// the first; another only when it is more than [`CHECKPOINT_MIN_STEP`] past the previous
/// break (the spacing of its checkpoints). Sorted.
fn prompt_breaks(len: usize, ends: &[usize], user_starts: &[usize]) -> Vec<usize> {
    let mut breaks: Vec<usize> = ends.iter().filter_map(|n| len.checked_sub(*n)).collect();
    let last = user_starts.iter().copied().filter(|&u| u > 0).max();
    let mut previous: Option<usize> = None;
    for &start in user_starts.iter().filter(|&&u| u > 0) {
        if Some(start) == last || previous.is_none_or(|p| start > p + CHECKPOINT_MIN_STEP) {
            breaks.push(start);
            previous = Some(start);
        }
    }
    breaks.sort_unstable();
    breaks.dedup();
    breaks
}

/// llama-server's least spacing of context checkpoints (`checkpoint_min_step`).
const CHECKPOINT_MIN_STEP: usize = 8192;

/// The positions in `tokens` where `marker` starts (none when it is empty), as llama-server
/// finds a chat prompt's messages.
fn user_starts(tokens: &[Token], marker: &[Token]) -> Vec<usize> {
    if marker.is_empty() {
        return Vec::new();
    }
    let mut starts = Vec::new();
    let mut at = 0;
    while at + marker.len() <= tokens.len() {
        if tokens[at..at + marker.len()] == *marker {
            starts.push(at);
        }
        at += 1;
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::{PromptCache, StopScan, prompt_breaks, prompt_chunk_end, user_starts};
    use crate::state_buffer::StateBuffer;

    fn state(len: usize) -> StateBuffer {
        StateBuffer::zeroed(len).expect("mapped")
    }

    #[test]
    fn a_chats_batches_also_end_where_user_messages_start() {
        let ends = [516, 4];
        // One user message at 1 (after BOS) of 20 tokens: [0, 1), [1, 16), [16, 20).
        assert_eq!(prompt_breaks(20, &ends, &[1]), [1, 16]);
        // Three: the first and the last; the middle one is within the checkpoints' spacing.
        assert_eq!(prompt_breaks(100, &ends, &[1, 30, 60]), [1, 60, 96]);
        // One more than 8192 past the first gets a break of its own.
        assert_eq!(
            prompt_breaks(20_000, &ends, &[1, 9000, 9100, 15_000]),
            [1, 9000, 15_000, 19_484, 19_996]
        );
        // A message at the prompt's start is not a break (nothing comes before it).
        assert_eq!(prompt_breaks(20, &ends, &[0]), [16]);
        assert_eq!(user_starts(&[7, 1, 2, 9, 1, 2, 1], &[1, 2]), [1, 4]);
        assert_eq!(user_starts(&[1, 2], &[]), Vec::<usize>::new());
    }

    #[test]
    fn the_prompt_cache_keeps_within_its_budget_and_gives_the_longest_match() {
        let mut cache = PromptCache::new(100);
        cache.keep(vec![1, 2, 3], state(40));
        cache.keep(vec![4, 5, 6], state(40));
        // A third does not fit beside both: the oldest goes.
        cache.keep(vec![7, 8, 9], state(40));
        assert_eq!(cache.bytes(), 80);
        assert!(
            cache.take_best(&[1, 2, 3, 4], 0).is_none(),
            "[1, 2, 3] was dropped"
        );
        // A prompt that starts with a kept one makes it useless.
        cache.keep(vec![4, 5, 6, 10], state(10));
        assert_eq!(cache.bytes(), 50);
        // Larger than the whole budget: not kept.
        cache.keep(vec![11], state(101));
        assert_eq!(cache.bytes(), 50);
        // Only a match longer than the slot's own is taken out.
        assert!(cache.take_best(&[4, 5, 6, 10, 12], 4).is_none());
        let best = cache
            .take_best(&[4, 5, 6, 10, 12], 3)
            .expect("a longer match");
        assert_eq!(best.tokens, [4, 5, 6, 10]);
        assert_eq!(cache.bytes(), 40);
    }

    #[test]
    fn text_before_a_stop_string_is_released_and_the_stop_string_never() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        let mut scan = StopScan::new(stops);
        assert_eq!(scan.push(b"Hello E"), ("Hello ".to_string(), false));
        assert_eq!(scan.push(b"N"), (String::new(), false));
        assert_eq!(scan.push(b"X, then"), ("ENX, then".to_string(), false));
        assert_eq!(scan.push(b"\n"), (String::new(), false));
        assert_eq!(scan.push(b"\nmore"), (String::new(), true));
        assert_eq!(scan.finish(), "");
    }

    #[test]
    fn a_character_split_across_tokens_waits_for_its_last_byte() {
        let mut scan = StopScan::new(Vec::new());
        let e = "é".as_bytes();
        assert_eq!(scan.push(&e[..1]), (String::new(), false));
        assert_eq!(scan.push(&e[1..]), ("é".to_string(), false));
        assert_eq!(scan.push(&e[..1]), (String::new(), false));
        assert_eq!(scan.finish(), "", "an unfinished last character is dropped");
    }

    /// llama-server's batch ends on a windowed model: 4 + n_ubatch and 4 tokens before the
    /// prompt's end, only inside a decode; a decode starting at such a point goes on.
    #[test]
    fn a_prompt_decode_ends_where_llama_servers_does() {
        let ends = [516, 4];
        let at = |from, to, len| prompt_chunk_end(from, to, &prompt_breaks(len, &ends, &[]));
        // 9 tokens: 5, then the last 4.
        assert_eq!(at(0, 9, 9), 5);
        assert_eq!(at(5, 9, 9), 9);
        // 1,000 tokens in a 2,048 batch: 484, then 512, then 4.
        assert_eq!(at(0, 1000, 1000), 484);
        assert_eq!(at(484, 1000, 1000), 996);
        assert_eq!(at(996, 1000, 1000), 1000);
        // A batch that ends before the points, a prompt of 4 or fewer, a model without them.
        assert_eq!(at(0, 300, 1000), 300);
        assert_eq!(at(0, 3, 3), 3);
        assert_eq!(prompt_chunk_end(0, 9, &prompt_breaks(9, &[], &[])), 9);
    }
}
