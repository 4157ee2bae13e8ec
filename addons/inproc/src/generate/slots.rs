//! The slots and the step that decodes them together: admitting a job, one shared decode, sampling.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::breaks::{prompt_breaks, prompt_chunk_end, user_starts};
use super::prompt_cache::{KEEP_AT_LEAST, PromptCache, shared_prefix};
use super::stop_scan::StopScan;
use super::{Client, Counters, Finish, Job, Outcome};
use crate::error::InprocError;
use crate::ffi::{SamplerChain, Session, Token, TokenBatch};

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
        let trim = onebit_heap::Trimmer::default();
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
            trim.worked();
            trim.trim_if_due();
        }
    }

    /// Take a job into a free slot: tokenize, and keep the cached prefix it shares; the rest of
    /// the prompt goes into the next steps' decodes. A job that cannot run is answered at once.
    fn admit(&mut self, job: Job) {
        let started = Instant::now();
        let tokens = match self.session.tokenize(&job.prompt) {
            Ok(tokens) => tokens,
            Err(e) => return job.client.done(Err(e)),
        };
        let room_total = self.session.n_ctx_seq() as usize;
        if tokens.is_empty() {
            return job.client.done(Err(InprocError::Request(
                "the prompt is empty; send some text to complete".to_string(),
            )));
        }
        if tokens.len() >= room_total {
            return job.client.done(Err(InprocError::Request(format!(
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
                .done(Err(InprocError::Engine("no free slot".to_string())));
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
                    active.client.done(Err(e.clone()));
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
