//! Completions on the loaded context, and what a job, its settings and its outcome are.
//!
//! Completions on the loaded context: slots (`--parallel`), each prompt decoded (reusing the
//! slot's cached prefix), tokens sampled until an end token, a stop string or the budget, the
//! text handed out as it becomes final. One decode per step carries every generating slot's
//! next token and as much of the waiting prompts as the batch holds, as llama-server's slots
//! share one decode: a new prompt never stops the other streams for a decode of its own.
//! The slots and their step are slots.rs; where a prompt's decodes end, breaks.rs; the prompt
//! cache in RAM, prompt_cache.rs; the text released as it becomes final, stop_scan.rs.

mod breaks;
mod prompt_cache;
mod slots;
mod stop_scan;

pub use prompt_cache::PromptCache;
pub use slots::SlotEngine;
pub use stop_scan::StopScan;

use std::sync::atomic::AtomicU64;

use crate::error::InprocError;

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

/// Where a completion's text and outcome go: the request's thread, through a channel.
pub trait Client: Send {
    /// A piece of final text (never a partial UTF-8 character, never text that might still
    /// start a stop string). False once the client is gone: generation stops at that token.
    fn text(&mut self, text: &str) -> bool;
    /// Whether the client left while no text was handed out (a prefill): asked before each
    /// decode that carries some of its prompt, so a long prompt stops between batches.
    fn gone(&self) -> bool;
    /// The completion ended (or could not run).
    fn done(self: Box<Self>, outcome: Result<Outcome, InprocError>);
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
