//! The engine's "model": a deterministic generator (the prompt's words in reverse, one word a
//! token), and OpenAI's chat completion request and replies around it.

use serde_json::{Value, json};

/// A chat request, as much of it as the engine reads.
pub struct Chat {
    /// The last user message's text.
    pub prompt: String,
    /// `stream`.
    pub stream: bool,
    /// `max_tokens` (or `max_completion_tokens`), when given.
    pub max_tokens: Option<u32>,
}

/// Read a chat request; the error is one line for a 400 reply.
pub fn parse(body: &[u8]) -> Result<Chat, String> {
    let body: Value = serde_json::from_slice(body).map_err(|e| {
        format!(
            "the request is not JSON ({e}); send {{\"messages\":[{{\"role\":\"user\",\"content\":\"...\"}}]}}"
        )
    })?;
    let messages = body["messages"].as_array().ok_or(
        "the request has no messages; send \"messages\":[{\"role\":\"user\",\"content\":\"...\"}]",
    )?;
    let user = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .ok_or("the request has no user message; send one with \"role\":\"user\"")?;
    let prompt = match &user["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p["type"] == "text")
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    let max_tokens = body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_completion_tokens"].as_u64())
        .map(|n| n.min(u64::from(u32::MAX)) as u32);
    if max_tokens == Some(0) {
        return Err("max_tokens is 0; ask for at least 1 token, or leave it out".to_string());
    }
    Ok(Chat {
        prompt,
        stream: body["stream"].as_bool().unwrap_or(false),
        max_tokens,
    })
}

/// The reply's tokens: the prompt's words in reverse, at most `limit` of them; and whether the
/// limit cut them (`length`) or not (`stop`).
pub fn generate(prompt: &str, limit: u32) -> (Vec<String>, &'static str) {
    let words: Vec<&str> = prompt.split_whitespace().rev().collect();
    let limit = limit as usize;
    let finish = if words.len() > limit {
        "length"
    } else {
        "stop"
    };
    let tokens = words
        .iter()
        .take(limit)
        .enumerate()
        .map(|(i, w)| {
            if i == 0 {
                w.to_string()
            } else {
                format!(" {w}")
            }
        })
        .collect();
    (tokens, finish)
}

/// What every reply and event of one completion names.
pub struct Completion {
    /// `chatcmpl-zeta-<n>`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served name the engine was given (`--alias`).
    pub model: String,
}

/// A whole `chat.completion`.
pub fn whole(c: &Completion, text: &str, finish: &str, prompt_tokens: u64, tokens: u64) -> String {
    json!({
        "id": c.id, "object": "chat.completion", "created": c.created, "model": c.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens},
    })
    .to_string()
}

/// One `chat.completion.chunk` event's data.
pub fn chunk(c: &Completion, delta: Value, finish: Option<&str>) -> String {
    json!({
        "id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })
    .to_string()
}

/// An OpenAI-shaped error body.
pub fn error(status: u16, kind: &str, message: &str) -> String {
    json!({"error": {"code": status, "message": message, "type": kind}}).to_string()
}
