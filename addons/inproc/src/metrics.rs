//! The route's /metrics text: its requests' counts, the engine's, and llama.cpp's buffers.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::Model;
use crate::generate::{Counters, Finish, Outcome};

/// What the route counts of the requests it answers; the engine thread counts its own
/// ([`Counters`]).
#[derive(Debug, Default)]
pub struct RequestCounters {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    predicted_tokens: AtomicU64,
    predicted_us: AtomicU64,
    clients_gone: AtomicU64,
}

impl RequestCounters {
    /// A request was read and goes to the engine.
    pub fn taken(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// A generation ended with `outcome`: its tokens and time, and a client that left.
    pub fn ended(&self, outcome: &Outcome) {
        self.prompt_tokens
            .fetch_add(outcome.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(outcome.cached_tokens as u64, Ordering::Relaxed);
        self.predicted_tokens
            .fetch_add(outcome.completion_tokens as u64, Ordering::Relaxed);
        self.predicted_us
            .fetch_add((outcome.predicted_ms * 1000.0) as u64, Ordering::Relaxed);
        if outcome.finish == Finish::Gone {
            self.clients_gone.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The route's /metrics text: these counts, the engine's, and once a model is loaded its
    /// buffers and resident memory.
    pub fn render(&self, engine: &Counters, model: Option<&Model>) -> String {
        let series = [
            (
                "onebit_inproc_requests_total",
                "Requests the inproc route answered.",
                &self.requests,
            ),
            (
                "onebit_inproc_prompt_tokens_total",
                "Prompt tokens of the requests the inproc route answered.",
                &self.prompt_tokens,
            ),
            (
                "onebit_inproc_cached_prompt_tokens_total",
                "Prompt tokens reused from the last request's context (cache hits).",
                &self.cached_tokens,
            ),
            (
                "onebit_inproc_predicted_tokens_total",
                "Tokens the inproc route generated.",
                &self.predicted_tokens,
            ),
            (
                "onebit_inproc_predicted_microseconds_total",
                "Time the inproc route spent generating.",
                &self.predicted_us,
            ),
            (
                "onebit_inproc_clients_gone_total",
                "Generations stopped because the client left.",
                &self.clients_gone,
            ),
        ];
        let engine_series = [
            (
                "onebit_inproc_decodes_total",
                "llama.cpp decodes the inproc route ran (the warm-up at load, then token steps and prompt chunks).",
                &engine.decodes,
            ),
            (
                "onebit_inproc_shared_prompt_decodes_total",
                "Decodes that carried a prompt's tokens together with other slots' tokens.",
                &engine.shared_prompt_decodes,
            ),
            (
                "onebit_inproc_prompt_cache_restores_total",
                "Prompts put back into a slot from the prompt cache in RAM.",
                &engine.prompt_cache_restores,
            ),
        ];
        let mut text: String = series
            .iter()
            .chain(&engine_series)
            .map(|(name, help, value)| {
                format!(
                    "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                    value.load(Ordering::Relaxed)
                )
            })
            .collect();
        let name = "onebit_inproc_prompt_cache_bytes";
        text.push_str(&format!(
            "# HELP {name} What the prompt cache in RAM holds.\n# TYPE {name} gauge\n{name} {}\n",
            engine.prompt_cache_bytes.load(Ordering::Relaxed)
        ));
        // Generation speed over the route's life, as llama-server's `predicted_tokens_seconds`.
        let tokens = self.predicted_tokens.load(Ordering::Relaxed);
        let us = self.predicted_us.load(Ordering::Relaxed);
        let name = "onebit_inproc_predicted_tokens_per_second";
        text.push_str(&format!(
        "# HELP {name} Tokens generated per second of generating, over the route's life.\n# TYPE {name} gauge\n{name} {:.3}\n",
        if us == 0 { 0.0 } else { tokens as f64 * 1e6 / us as f64 }
    ));
        if let Some(model) = model {
            text.push_str(&buffer_gauges(&model.buffers));
            let name = "onebit_inproc_model_resident_bytes";
            text.push_str(&format!(
            "# HELP {name} The model's own resident memory: what loading it, making its context and the warm-up decode added to serve's anonymous memory, and the mapped GGUF's resident pages.\n# TYPE {name} gauge\n{name} {}\n",
            model.resident_bytes
        ));
        }
        text
    }
}

/// `onebit_inproc_model_buffer_bytes{buffer="..."}`: llama.cpp's buffers by kind (`model`, the
/// mapped weights; `kv`; `compute`; `output`), summed over devices, as llama.cpp reported them.
fn buffer_gauges(buffers: &[(String, u64)]) -> String {
    let mut by_kind = std::collections::BTreeMap::<String, u64>::new();
    for (kind, bytes) in buffers {
        *by_kind.entry(kind.to_lowercase()).or_default() += bytes;
    }
    let name = "onebit_inproc_model_buffer_bytes";
    let mut text = format!(
        "# HELP {name} What llama.cpp allocated for the model and its context, by buffer.\n# TYPE {name} gauge\n"
    );
    for (kind, bytes) in by_kind {
        text.push_str(&format!("{name}{{buffer=\"{kind}\"}} {bytes}\n"));
    }
    text
}
