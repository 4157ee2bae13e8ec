//! Generation routes: Chat Completions, Completions (OpenAI and llama.cpp-native) and Responses,
//! answered whole or streamed as SSE one chunk per write.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::app::{ErrorKind, State, Triggers, error, exceeds_context, hang, unix_now};
use crate::text::{self, Prompt};

#[path = "stream.rs"]
mod stream;
use stream::{Sse, Step, stream};

/// The fake's prompt speed, used for `prompt_ms` (10 000 tokens/s).
const PROMPT_MS_PER_TOKEN: f64 = 0.1;
/// With `fake_hang`, a stream stops after this many content chunks.
const CHUNKS_BEFORE_HANG: usize = 2;

/// Which API a generation request speaks; decides the request fields read and the reply shapes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`, `/chat/completions`.
    Chat,
    /// `/v1/completions` (OpenAI `text_completion`).
    Completion,
    /// `/completion`, `/completions` (llama.cpp's own shape; the stream has no `[DONE]`).
    Native,
    /// `/v1/responses`, `/responses` (typed `event:` lines; no `[DONE]`).
    Responses,
}

/// The parts of a request body the fake acts on.
struct Ask {
    prompt: Prompt,
    quoted: String,
    stream: bool,
    include_usage: bool,
    max_tokens: Option<usize>,
    cache_prompt: bool,
}

/// Reads the request; an error is the message of a 400.
fn read_ask(api: Api, body: &Value) -> Result<Ask, String> {
    let (prompt, quoted) = match api {
        Api::Chat | Api::Responses => {
            let turns = if api == Api::Chat {
                body.get("messages").and_then(text::chat_turns)
            } else {
                text::responses_turns(body)
            };
            let Some(turns) = turns.filter(|t| !t.is_empty()) else {
                let field = if api == Api::Chat {
                    "messages"
                } else {
                    "input"
                };
                return Err(format!("'{field}' is required and must not be empty"));
            };
            let quoted = text::last_user_text(&turns).to_owned();
            (Prompt::from_text(text::render(&turns)), quoted)
        }
        Api::Completion | Api::Native => {
            let Some(prompt) = body.get("prompt").and_then(text::prompt) else {
                return Err("\"prompt\" must be provided".to_owned());
            };
            let quoted = prompt.text.clone();
            (prompt, quoted)
        }
    };
    let max_tokens = [
        "max_output_tokens",
        "max_completion_tokens",
        "max_tokens",
        "n_predict",
    ]
    .iter()
    .find_map(|k| body.get(*k).and_then(Value::as_i64))
    .and_then(|n| usize::try_from(n).ok());
    Ok(Ask {
        prompt,
        quoted,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        max_tokens,
        cache_prompt: body
            .get("cache_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true),
    })
}

/// Prompt and generation counts of one task, shaped as llama.cpp's `timings`.
#[derive(Clone, Copy)]
struct Timings {
    cache_n: usize,
    prompt_n: usize,
    predicted_n: usize,
    predicted_ms: f64,
}

impl Timings {
    fn prompt_ms(&self) -> f64 {
        self.prompt_n as f64 * PROMPT_MS_PER_TOKEN
    }

    fn json(&self) -> Value {
        let per = |ms: f64, n: usize| {
            if n == 0 {
                (0.0, 0.0)
            } else {
                (ms / n as f64, 1e3 * n as f64 / ms.max(1e-3))
            }
        };
        let prompt_ms = self.prompt_ms();
        let (prompt_per_token_ms, prompt_per_second) = per(prompt_ms, self.prompt_n);
        let (predicted_per_token_ms, predicted_per_second) =
            per(self.predicted_ms, self.predicted_n);
        json!({
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token_ms,
            "prompt_per_second": prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": predicted_per_token_ms,
            "predicted_per_second": predicted_per_second,
        })
    }
}

/// What every reply of one task repeats.
struct Task {
    api: Api,
    ds4: bool,
    model: String,
    id: String,
    msg_id: String,
    created: u64,
    prompt_text: String,
    n_prompt: usize,
    timings: Timings,
    finish_length: bool,
    max_tokens: Option<usize>,
}

impl Task {
    fn finish_reason(&self) -> &'static str {
        if self.finish_length { "length" } else { "stop" }
    }

    fn usage(&self) -> Value {
        let n = self.timings.predicted_n;
        if self.api == Api::Responses {
            return json!({
                "input_tokens": self.n_prompt,
                "output_tokens": n,
                "total_tokens": self.n_prompt + n,
            });
        }
        json!({
            "completion_tokens": n,
            "prompt_tokens": self.n_prompt,
            "total_tokens": self.n_prompt + n,
            "prompt_tokens_details": {"cached_tokens": self.timings.cache_n},
        })
    }

    /// Adds the llama.cpp-only fields (not on the ds4-server route).
    fn llama_fields(&self, v: &mut Value, timings: bool) {
        if self.ds4 {
            return;
        }
        if let Value::Object(o) = v {
            if self.api != Api::Native && self.api != Api::Responses {
                o.insert("system_fingerprint".into(), json!(crate::BUILD_INFO));
            }
            if timings {
                o.insert("timings".into(), self.timings.json());
            }
        }
    }

    /// The native reply's trailing fields (the whole reply, or the stream's stop chunk).
    fn native_stop(&self, content: &str) -> Value {
        let n = self.timings.predicted_n;
        let mut v = json!({
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": true,
            "model": self.model,
            "tokens_predicted": n,
            "tokens_evaluated": self.n_prompt,
            "generation_settings": {"n_predict": self.max_tokens.map_or(-1, |m| m as i64)},
            "prompt": self.prompt_text,
            "has_new_line": false,
            "truncated": false,
            "stop_type": if self.finish_length { "limit" } else { "eos" },
            "stopping_word": "",
            "tokens_cached": self.n_prompt + n,
        });
        self.llama_fields(&mut v, true);
        v
    }

    fn response_item(&self, text: &str, done: bool) -> Value {
        json!({
            "type": "message",
            "id": self.msg_id,
            "status": if done { "completed" } else { "in_progress" },
            "role": "assistant",
            "content": if done {
                json!([{"type": "output_text", "text": text, "annotations": []}])
            } else {
                json!([])
            },
        })
    }

    fn response_object(&self, text: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": match text {
                None => "in_progress",
                Some(_) if self.finish_length => "incomplete",
                Some(_) => "completed",
            },
            "model": self.model,
            "output": match text {
                None => json!([]),
                Some(t) => json!([self.response_item(t, true)]),
            },
        });
        if let (Some(_), Value::Object(o)) = (text, &mut v) {
            o.insert("usage".into(), self.usage());
            if self.finish_length {
                o.insert(
                    "incomplete_details".into(),
                    json!({"reason": "max_output_tokens"}),
                );
            }
        }
        v
    }

    /// The whole, non-streamed reply.
    fn reply(&self, content: &str) -> Value {
        match self.api {
            Api::Chat => {
                let mut v = json!({
                    "choices": [{
                        "finish_reason": self.finish_reason(),
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                    }],
                    "created": self.created,
                    "model": self.model,
                    "object": "chat.completion",
                    "usage": self.usage(),
                    "id": self.id,
                });
                self.llama_fields(&mut v, true);
                v
            }
            Api::Completion => {
                let mut v = json!({
                    "choices": [{
                        "text": content,
                        "index": 0,
                        "logprobs": null,
                        "finish_reason": self.finish_reason(),
                    }],
                    "created": self.created,
                    "model": self.model,
                    "object": "text_completion",
                    "usage": self.usage(),
                    "id": self.id,
                });
                self.llama_fields(&mut v, true);
                v
            }
            Api::Native => self.native_stop(content),
            Api::Responses => {
                let mut v = self.response_object(Some(content));
                self.llama_fields(&mut v, true);
                v
            }
        }
    }
}

/// Answers one generation request. Runs on a runtime worker; never blocks (the slot lock is held
/// for a copy only). With `fake_slow_ms` it waits first; with `fake_hang` it never finishes.
pub async fn handle(st: &Arc<State>, api: Api, body: &Bytes, triggers: Triggers) -> Response {
    let Ok(json) = serde_json::from_slice::<Value>(body) else {
        return error(ErrorKind::InvalidRequest, "request body is not valid JSON");
    };
    let ask = match read_ask(api, &json) {
        Ok(a) => a,
        Err(message) => return error(ErrorKind::InvalidRequest, &message),
    };
    let n_prompt = ask.prompt.tokens.len();
    if n_prompt > st.cfg.n_ctx as usize {
        return exceeds_context(n_prompt, st.cfg.n_ctx);
    }
    // A wedged main loop takes no new task; only the request that wedged it goes on (to hang later).
    if st.hung.load(Ordering::Acquire) && !triggers.hang {
        return hang().await;
    }
    if api == Api::Chat
        && !ask.stream
        && let Some((message, finish)) = crate::tools::call_for(&json)
    {
        let id = st.next_id();
        return axum::Json(json!({
            "choices": [{"finish_reason": finish, "index": 0, "message": message}],
            "created": unix_now().as_secs(),
            "id": format!("chatcmpl-fake{id}"),
            "model": st.cfg.model_name,
            "object": "chat.completion",
        }))
        .into_response();
    }
    let busy = st.busy().await;
    let started = Instant::now();

    let reply = text::reply_to(&ask.quoted);
    let words: Vec<String> = reply.split_whitespace().map(str::to_owned).collect();
    let (n_gen, content) = if ask.stream {
        let n = st.cfg.sse_events.min(ask.max_tokens.unwrap_or(usize::MAX));
        (n, None)
    } else {
        match ask.max_tokens {
            Some(m) if m < words.len() => (m, Some(words[..m].join(" "))),
            _ => (words.len(), Some(reply.clone())),
        }
    };
    let finish_length = ask.max_tokens.is_some_and(|m| {
        if ask.stream {
            m < st.cfg.sse_events
        } else {
            m < words.len()
        }
    });

    let id_task = st.next_id();
    let cache_n = {
        let mut slot = st.slot.lock().unwrap_or_else(|p| p.into_inner());
        let cache_n = slot.start(id_task, &ask.prompt.tokens, ask.cache_prompt);
        let generated = (0..n_gen).map(|i| text::word_id(&words[i % words.len()]));
        slot.tokens.extend(generated);
        cache_n
    };
    let timings = Timings {
        cache_n,
        prompt_n: n_prompt - cache_n,
        predicted_n: n_gen,
        predicted_ms: 0.0,
    };
    let c = &st.counters;
    c.prompt_tokens
        .fetch_add(timings.prompt_n as u64, Ordering::Relaxed);
    c.prompt_us
        .fetch_add((timings.prompt_ms() * 1e3) as u64, Ordering::Relaxed);

    let prefix = match api {
        Api::Chat => "chatcmpl-fake",
        Api::Completion => "cmpl-fake",
        Api::Native => "fake",
        Api::Responses => "resp_fake",
    };
    let task = Task {
        api,
        ds4: st.cfg.ds4,
        model: st.cfg.model_name.clone(),
        id: format!("{prefix}{id_task}"),
        msg_id: format!("msg_fake{id_task}"),
        created: unix_now().as_secs(),
        prompt_text: ask.prompt.text,
        n_prompt,
        timings,
        finish_length,
        max_tokens: ask.max_tokens,
    };

    if let Some(delay) = triggers.slow {
        tokio::time::sleep(delay).await;
    }
    let Some(content) = content else {
        return stream(Sse {
            st: Arc::clone(st),
            _busy: busy,
            task,
            words,
            n: n_gen,
            sent: 0,
            text: String::new(),
            step: Step::Preamble(0),
            seq: 0,
            interval: st.cfg.sse_interval,
            first_chunk_at: None,
            hang_at: triggers.hang.then(|| CHUNKS_BEFORE_HANG.min(n_gen)),
            include_usage: ask.include_usage,
            started,
        });
    };
    if triggers.hang {
        return hang().await;
    }
    let mut task = task;
    task.timings.predicted_ms = started.elapsed().as_secs_f64() * 1e3;
    count_predicted(st, &task.timings);
    drop(busy);
    axum::Json(task.reply(&content)).into_response()
}

fn count_predicted(st: &State, t: &Timings) {
    let c = &st.counters;
    c.predicted_tokens
        .fetch_add(t.predicted_n as u64, Ordering::Relaxed);
    c.predicted_us
        .fetch_add((t.predicted_ms * 1e3) as u64, Ordering::Relaxed);
    c.n_decode
        .fetch_add(1 + t.predicted_n as u64, Ordering::Relaxed);
}
