//! The OpenAI side of the route: request bodies read, replies written as llama-server's.
//!
//! It reads `/v1/completions` and `/v1/chat/completions` bodies and writes the replies as
//! llama-server writes them (whole JSON, or SSE chunks ending in `data: [DONE]`), with `usage`
//! and `timings`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use onebit_plugin_api::{ReplySink, RouteError};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::InprocError;
use crate::generate::{Finish, Outcome, Settings};

/// The fields of a completion or chat request the route acts on; others are ignored, as
/// llama-server ignores what it does not know.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Ask {
    pub prompt: Option<Value>,
    pub messages: Option<Vec<Value>>,
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub n_predict: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// llama-server's `cache_prompt`: false decodes the whole prompt, reusing nothing.
    pub cache_prompt: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: bool,
}

impl Ask {
    /// The request's sampling and stopping settings, or a one-line reason they are wrong.
    pub fn settings(&self) -> Result<Settings, InprocError> {
        let max = self
            .max_completion_tokens
            .or(self.max_tokens)
            .or(self.n_predict);
        let max_tokens = match max {
            None => None,
            Some(n) if n < 0 => None,
            Some(n) => Some(
                u32::try_from(n)
                    .map_err(|_| InprocError::Request(format!("max_tokens {n} is too large")))?,
            ),
        };
        let stop = match &self.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| InprocError::Request(STOP_SHAPE.to_string()))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(InprocError::Request(STOP_SHAPE.to_string())),
        };
        Ok(Settings {
            max_tokens,
            temperature: self.temperature.unwrap_or(0.8) as f32,
            top_p: self.top_p.unwrap_or(0.95) as f32,
            seed: self
                .seed
                .and_then(|s| u32::try_from(s).ok())
                .unwrap_or(u32::MAX),
            stop,
            reuse_prefix: self.cache_prompt.unwrap_or(true),
        })
    }

    /// The prompt of a completion request: one string.
    pub fn prompt(&self) -> Result<String, InprocError> {
        match &self.prompt {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
                Ok(items[0].as_str().unwrap_or_default().to_string())
            }
            Some(_) => Err(InprocError::Request(
                "the inproc route takes one prompt string; send several prompts as separate requests"
                    .to_string(),
            )),
            None => Err(InprocError::Request(
                "the request has no prompt; send {\"prompt\": \"...\"}".to_string(),
            )),
        }
    }
}

/// What `stop` must be.
const STOP_SHAPE: &str = "stop must be a string or an array of strings";

/// Which OpenAI reply shape to write.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// Send a whole JSON error reply: `error`'s status and body.
pub fn send_error(sink: &mut dyn ReplySink, error: &InprocError) -> Result<(), RouteError> {
    sink.send_head(error.status(), "application/json")
        .and_then(|()| sink.send(error.body().as_bytes()))
        .map_err(|e| RouteError::new(e.message))?;
    sink.end();
    Ok(())
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh reply id (`cmpl-…` / `chatcmpl-…`): unique within the process.
fn reply_id(kind: Kind) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    format!("{prefix}-inproc-{}-{n}", now_s())
}

fn usage(outcome: &Outcome) -> Value {
    json!({
        "completion_tokens": outcome.completion_tokens,
        "prompt_tokens": outcome.prompt_tokens,
        "total_tokens": outcome.completion_tokens + outcome.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    })
}

fn timings(outcome: &Outcome) -> Value {
    let per_second = |n: usize, ms: f64| {
        if ms > 0.0 {
            n as f64 * 1000.0 / ms
        } else {
            0.0
        }
    };
    json!({
        "cache_n": outcome.cached_tokens,
        "prompt_n": outcome.prompt_tokens - outcome.cached_tokens,
        "prompt_ms": outcome.prompt_ms,
        "prompt_per_second": per_second(outcome.prompt_tokens - outcome.cached_tokens, outcome.prompt_ms),
        "predicted_n": outcome.completion_tokens,
        "predicted_ms": outcome.predicted_ms,
        "predicted_per_second": per_second(outcome.completion_tokens, outcome.predicted_ms),
    })
}

/// Writes one reply, whole or streamed, around a generation: `open` before it, `piece` for
/// each piece of text, `close` after.
pub struct Reply<'s> {
    sink: &'s mut dyn ReplySink,
    kind: Kind,
    stream: bool,
    include_usage: bool,
    model: String,
    id: String,
    created: u64,
    text: String,
    /// The head is sent.
    opened: bool,
    /// The sink refused a send: the client is gone.
    pub gone: bool,
}

impl<'s> Reply<'s> {
    pub fn new(sink: &'s mut dyn ReplySink, kind: Kind, ask: &Ask, model: &str) -> Self {
        Reply {
            sink,
            kind,
            stream: ask.stream,
            include_usage: ask.stream_options.as_ref().is_some_and(|o| o.include_usage),
            model: model.to_string(),
            id: reply_id(kind),
            created: now_s(),
            text: String::new(),
            opened: false,
            gone: false,
        }
    }

    fn object(&self) -> &'static str {
        match (self.kind, self.stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn event(&mut self, value: &Value) -> bool {
        let line = format!("data: {value}\n\n");
        if self.sink.send(line.as_bytes()).is_err() {
            self.gone = true;
        }
        !self.gone
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({
            "choices": [choice],
            "created": self.created,
            "id": self.id,
            "model": self.model,
            "system_fingerprint": "inproc",
            "object": self.object(),
        })
    }

    /// Send the head (and, for a streamed chat, the role chunk llama-server sends first), once,
    /// before the first text: so a request that fails before any text still gets a whole
    /// error reply.
    fn open(&mut self) -> bool {
        if self.opened {
            return !self.gone;
        }
        self.opened = true;
        let content_type = if self.stream {
            "text/event-stream"
        } else {
            "application/json"
        };
        if self.sink.send_head(200, content_type).is_err() {
            self.gone = true;
            return false;
        }
        if self.stream && self.kind == Kind::Chat {
            let first = self.chunk(json!({
                "finish_reason": null, "index": 0,
                "delta": {"role": "assistant", "content": null},
            }));
            return self.event(&first);
        }
        true
    }

    /// One piece of final text: an event when streaming, else kept for the whole reply.
    /// Returns false once the client is gone.
    /// Whether the client left (the sink's probe; no send).
    pub fn client_gone(&self) -> bool {
        self.sink.client_gone()
    }

    pub fn piece(&mut self, text: &str) -> bool {
        if !self.open() {
            return false;
        }
        if !self.stream {
            self.text.push_str(text);
            return true;
        }
        let choice = match self.kind {
            Kind::Completion => {
                json!({"text": text, "index": 0, "logprobs": null, "finish_reason": null})
            }
            Kind::Chat => json!({"finish_reason": null, "index": 0, "delta": {"content": text}}),
        };
        let chunk = self.chunk(choice);
        self.event(&chunk)
    }

    /// Finish the reply after the generation.
    pub fn close(mut self, outcome: &Outcome) {
        if !self.open() || outcome.finish == Finish::Gone {
            return;
        }
        let reason = outcome.finish.reason();
        if self.stream {
            let choice = match self.kind {
                Kind::Completion => {
                    json!({"text": "", "index": 0, "logprobs": null, "finish_reason": reason})
                }
                Kind::Chat => json!({"finish_reason": reason, "index": 0, "delta": {}}),
            };
            let mut last = self.chunk(choice);
            last["timings"] = timings(outcome);
            if !self.event(&last) {
                return;
            }
            if self.include_usage {
                let mut tail = self.chunk(Value::Null);
                tail["choices"] = json!([]);
                tail["usage"] = usage(outcome);
                if !self.event(&tail) {
                    return;
                }
            }
            let _ = self.sink.send(b"data: [DONE]\n\n");
        } else {
            let choice = match self.kind {
                Kind::Completion => {
                    json!({"text": self.text, "index": 0, "logprobs": null, "finish_reason": reason})
                }
                Kind::Chat => {
                    json!({"finish_reason": reason, "index": 0, "message": {"role": "assistant", "content": self.text}})
                }
            };
            let mut whole = self.chunk(choice);
            whole["usage"] = usage(outcome);
            whole["timings"] = timings(outcome);
            let _ = self.sink.send(whole.to_string().as_bytes());
        }
        self.sink.end();
    }

    /// The generation failed: a whole error reply (400 for the request's fault, 500 for the
    /// engine's) when no head went out yet; else an error, which cuts the stream off.
    pub fn fail(self, failure: InprocError) -> Result<(), RouteError> {
        if self.opened {
            return Err(failure.into());
        }
        send_error(self.sink, &failure)
    }
}
