//! A streamed reply of the fake backend: its events built, stamped and paced (or gated) as
//! hyper polls for them.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{Api, Task, count_predicted};
use crate::app::{Busy, State, unix_now};

/// Wait until `gate` holds a file named `n` (`FAKE_SSE_GATE`), for at most 60 s.
pub(super) async fn opened(gate: &std::path::Path, n: usize) {
    let file = gate.join(n.to_string());
    for _ in 0..30_000 {
        if file.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    log!(
        "fake-backend: FAKE_SSE_GATE: {} did not appear within 60 s; sending on",
        file.display()
    );
}

/// Where a stream is.
#[derive(Clone, Copy)]
pub(super) enum Step {
    /// Responses' `response.created` (0) and `response.output_item.added` (1).
    Preamble(u8),
    Content,
    Finish,
    Usage,
    Done,
    End,
}

/// One streamed reply. Hyper polls it directly (no relay task), so each event is built, stamped
/// and written when the connection is ready for it, and dropping the response ends it.
pub(super) struct Sse {
    pub(super) st: Arc<State>,
    pub(super) _busy: Busy,
    pub(super) task: Task,
    pub(super) words: Vec<String>,
    /// Content chunks to send.
    pub(super) n: usize,
    pub(super) sent: usize,
    /// The content sent so far.
    pub(super) text: String,
    pub(super) step: Step,
    pub(super) seq: u64,
    pub(super) interval: Duration,
    pub(super) first_chunk_at: Option<tokio::time::Instant>,
    pub(super) hang_at: Option<usize>,
    pub(super) include_usage: bool,
    pub(super) started: Instant,
}

pub(super) fn stream(sse: Sse) -> Response {
    let events = futures_util::stream::unfold(sse, |mut sse| async move {
        let bytes = sse.next_event().await?;
        Some((Ok::<_, Infallible>(bytes), sse))
    });
    let mut res = Body::from_stream(events).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    res
}

impl Sse {
    async fn next_event(&mut self) -> Option<Bytes> {
        let api = self.task.api;
        loop {
            match self.step {
                Step::Preamble(i) => {
                    if api != Api::Responses || i > 1 {
                        self.step = Step::Content;
                        continue;
                    }
                    self.step = Step::Preamble(i + 1);
                    let v = if i == 0 {
                        json!({"type": "response.created", "response": self.task.response_object(None)})
                    } else {
                        json!({
                            "type": "response.output_item.added",
                            "output_index": 0,
                            "item": self.task.response_item("", false),
                        })
                    };
                    return Some(self.event(v));
                }
                Step::Content => {
                    if self.hang_at == Some(self.sent) {
                        log!(
                            "fake-backend: fake_hang: stream stopped after {} chunks",
                            self.sent
                        );
                        std::future::pending::<()>().await;
                    }
                    if self.sent == self.n {
                        self.step = Step::Finish;
                        continue;
                    }
                    // Deadlines from the first chunk, not sleeps after each, so the timer's
                    // millisecond rounding does not add up and the pace stays the one asked for.
                    let sent = u32::try_from(self.sent).unwrap_or(u32::MAX);
                    if let Some(gate) = &self.st.cfg.sse_gate
                        && self.sent > 0
                    {
                        opened(gate, self.sent).await;
                    }
                    match self.first_chunk_at {
                        None => self.first_chunk_at = Some(tokio::time::Instant::now()),
                        Some(first) if !self.interval.is_zero() => {
                            tokio::time::sleep_until(first + self.interval * sent).await;
                        }
                        Some(_) => {}
                    }
                    let word = &self.words[self.sent % self.words.len()];
                    let piece = if self.sent == 0 {
                        word.clone()
                    } else {
                        format!(" {word}")
                    };
                    self.text.push_str(&piece);
                    let v = self.content_chunk(&piece);
                    self.sent += 1;
                    return Some(self.event(v));
                }
                Step::Finish => {
                    self.task.timings.predicted_ms = self.started.elapsed().as_secs_f64() * 1e3;
                    count_predicted(&self.st, &self.task.timings);
                    self.step = Step::Usage;
                    let v = self.finish_chunk();
                    return Some(self.event(v));
                }
                Step::Usage => {
                    self.step = Step::Done;
                    let v = match api {
                        Api::Responses => json!({
                            "type": "response.completed",
                            "response": self.task.reply(&self.text),
                        }),
                        Api::Chat | Api::Completion if self.include_usage => {
                            let mut v = self.base_chunk(json!([]));
                            if let Value::Object(o) = &mut v {
                                o.insert("usage".into(), self.task.usage());
                            }
                            self.task.llama_fields(&mut v, true);
                            v
                        }
                        _ => continue,
                    };
                    return Some(self.event(v));
                }
                Step::Done => {
                    self.step = Step::End;
                    if matches!(api, Api::Chat | Api::Completion) {
                        return Some(Bytes::from_static(b"data: [DONE]\n\n"));
                    }
                }
                Step::End => return None,
            }
        }
    }

    /// `chat.completion.chunk` or streamed `text_completion` around the given choices.
    fn base_chunk(&self, choices: Value) -> Value {
        let object = if self.task.api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        json!({
            "choices": choices,
            "created": self.task.created,
            "id": self.task.id,
            "model": self.task.model,
            "object": object,
        })
    }

    fn content_chunk(&self, piece: &str) -> Value {
        let task = &self.task;
        let mut v = match task.api {
            Api::Chat => {
                let delta = if self.sent == 0 {
                    json!({"role": "assistant", "content": piece})
                } else {
                    json!({"content": piece})
                };
                self.base_chunk(json!([{"finish_reason": null, "index": 0, "delta": delta}]))
            }
            Api::Completion => self.base_chunk(json!([{
                "text": piece, "index": 0, "logprobs": null, "finish_reason": null,
            }])),
            Api::Native => json!({
                "index": 0,
                "content": piece,
                "tokens": [],
                "stop": false,
                "id_slot": -1,
                "tokens_predicted": self.sent + 1,
                "tokens_evaluated": task.n_prompt,
            }),
            Api::Responses => json!({
                "type": "response.output_text.delta",
                "item_id": task.msg_id,
                "output_index": 0,
                "content_index": 0,
                "delta": piece,
            }),
        };
        if task.api != Api::Responses && task.api != Api::Native {
            task.llama_fields(&mut v, false);
        }
        v
    }

    fn finish_chunk(&self) -> Value {
        let task = &self.task;
        match task.api {
            Api::Chat | Api::Completion => {
                let choice = if task.api == Api::Chat {
                    json!({"finish_reason": task.finish_reason(), "index": 0, "delta": {}})
                } else {
                    json!({"text": "", "index": 0, "logprobs": null, "finish_reason": task.finish_reason()})
                };
                let mut v = self.base_chunk(json!([choice]));
                // Timings ride on the last chunk: this one, or the usage chunk that follows.
                task.llama_fields(&mut v, !self.include_usage);
                v
            }
            Api::Native => task.native_stop(""),
            Api::Responses => json!({
                "type": "response.output_item.done",
                "output_index": 0,
                "item": task.response_item(&self.text, true),
            }),
        }
    }

    /// Stamps an event with `fake_seq` and `fake_sent_ns` and frames it as SSE.
    fn event(&mut self, mut v: Value) -> Bytes {
        let kind = v.get("type").and_then(Value::as_str).map(str::to_owned);
        if let Value::Object(o) = &mut v {
            o.insert("fake_seq".into(), json!(self.seq));
            o.insert("fake_sent_ns".into(), json!(unix_now().as_nanos() as u64));
        }
        self.seq += 1;
        let mut out = Vec::with_capacity(256);
        if self.task.api == Api::Responses
            && let Some(kind) = kind
        {
            out.extend_from_slice(b"event: ");
            out.extend_from_slice(kind.as_bytes());
            out.push(b'\n');
        }
        out.extend_from_slice(b"data: ");
        // Serializing a Value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, &v);
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }
}
