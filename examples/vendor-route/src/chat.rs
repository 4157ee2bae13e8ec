//! OpenAI's chat completions as the acme route reads and writes them: the request's prompt and
//! settings, a whole `chat.completion` reply, and the `chat.completion.chunk` events of a
//! streamed one. Pure; no I/O.

use serde::Deserialize;
use serde_json::{Value, json};

/// What the route takes from a chat request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatRequest {
    /// The last user message's text: what the kernels answer.
    pub prompt: String,
    /// `stream`: answer with server-sent events.
    pub stream: bool,
    /// `max_tokens` (or `max_completion_tokens`), when given.
    pub max_tokens: Option<u32>,
}

/// The request body, as much of it as the route reads; other fields are ignored.
#[derive(Deserialize)]
struct Body {
    /// The conversation.
    messages: Vec<Message>,
    /// Whether to stream (null reads as false).
    #[serde(default)]
    stream: Option<bool>,
    /// The reply's token limit (OpenAI's older name).
    #[serde(default)]
    max_tokens: Option<u32>,
    /// The reply's token limit (OpenAI's newer name), used when `max_tokens` is absent.
    #[serde(default)]
    max_completion_tokens: Option<u32>,
}

/// One message of the conversation.
#[derive(Deserialize)]
struct Message {
    /// `system`, `user`, `assistant`, ...
    role: String,
    /// Its content (null for an assistant's tool call).
    #[serde(default)]
    content: Option<Content>,
}

/// A message's content: a string, or an array of parts whose text parts count.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    /// Plain text.
    Text(String),
    /// Parts (`{"type":"text","text":"..."}`, images, ...).
    Parts(Vec<Part>),
}

/// One part of a message's content.
#[derive(Deserialize)]
struct Part {
    /// `text`, `image_url`, ...
    #[serde(rename = "type")]
    kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    text: Option<String>,
}

impl Content {
    /// The text parts, joined by one space.
    fn text(&self) -> String {
        match self {
            Content::Text(text) => text.clone(),
            Content::Parts(parts) => parts
                .iter()
                .filter(|p| p.kind == "text")
                .filter_map(|p| p.text.as_deref())
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// Read a chat request's body; the error is one line for a 400 reply, saying what was wrong and
/// what to send instead.
pub fn parse(body: &str) -> Result<ChatRequest, String> {
    let body: Body = serde_json::from_str(body).map_err(|e| {
        format!(
            "the request is not a chat completion the acme route reads ({e}); send {{\"messages\":[{{\"role\":\"user\",\"content\":\"...\"}}]}}"
        )
    })?;
    let prompt = body
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .ok_or_else(|| {
            "the request has no user message; send at least one message with \"role\":\"user\""
                .to_string()
        })?
        .content
        .as_ref()
        .map(Content::text)
        .unwrap_or_default();
    if prompt.contains('\0') {
        return Err("the user message contains a NUL character; remove it".to_string());
    }
    let max_tokens = body.max_tokens.or(body.max_completion_tokens);
    if max_tokens == Some(0) {
        return Err("max_tokens is 0; ask for at least 1 token, or leave it out".to_string());
    }
    Ok(ChatRequest {
        prompt,
        stream: body.stream.unwrap_or(false),
        max_tokens,
    })
}

/// The prompt's length in tokens for `usage`: the Acme kernels' tokens are words.
pub fn prompt_tokens(prompt: &str) -> u64 {
    prompt.split_ascii_whitespace().count() as u64
}

/// What every reply and event of one completion names.
#[derive(Clone, Debug)]
pub struct Completion {
    /// `id`: `chatcmpl-acme-<n>`.
    pub id: String,
    /// `created`: Unix seconds.
    pub created: u64,
    /// `model`: the served name.
    pub model: String,
}

/// Why the reply ended, as OpenAI's `finish_reason` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The kernels' reply was complete: `stop`.
    Stop,
    /// The token limit cut it: `length`.
    Length,
}

impl Finish {
    /// OpenAI's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The whole reply: a `chat.completion` object.
pub fn whole(
    completion: &Completion,
    content: &str,
    finish: Finish,
    prompt_tokens: u64,
    completion_tokens: u64,
) -> String {
    json!({
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": finish.as_str(),
        }],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    })
    .to_string()
}

/// One server-sent event of a streamed reply: a `chat.completion.chunk` with this `delta` and
/// `finish_reason`, framed as `data: ...\n\n`.
pub fn chunk(completion: &Completion, delta: Value, finish: Option<Finish>) -> String {
    let event = json!({
        "id": completion.id,
        "object": "chat.completion.chunk",
        "created": completion.created,
        "model": completion.model,
        "choices": [{
            "index": 0,
            "delta": delta,
            "finish_reason": finish.map(Finish::as_str),
        }],
    });
    format!("data: {event}\n\n")
}

/// The event that ends a stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";
