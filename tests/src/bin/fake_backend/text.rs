//! Deterministic stand-ins for the model: word tokenizer, chat template, embeddings, rerank scores.
//!
//! Everything here is a pure function of its input, so a test can compute what the fake will answer.

use serde_json::Value;

/// Vocabulary size the fake tokenizer reports; token ids lie in `[FIRST_WORD_ID, N_VOCAB)`.
pub const N_VOCAB: u32 = 32000;
/// The begin-of-sequence id `/tokenize` prepends when `add_special` is true.
pub const BOS_ID: u32 = 1;
/// Ids below this are reserved for special tokens and never produced for a word.
const FIRST_WORD_ID: u32 = 3;
/// Length of every embedding vector.
pub const EMBEDDING_DIM: usize = 8;

/// 32-bit FNV-1a, chosen because anyone can recompute it in a few lines of any language.
fn fnv1a(seed: u32, bytes: &[u8]) -> u32 {
    let mut hash = 0x811c_9dc5_u32 ^ seed;
    for &b in bytes {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}

/// The id of one whitespace-separated word: `3 + fnv1a(word) % (32000 - 3)`.
pub fn word_id(word: &str) -> u32 {
    FIRST_WORD_ID + fnv1a(0, word.as_bytes()) % (N_VOCAB - FIRST_WORD_ID)
}

/// Token ids of a text: one per whitespace-separated word.
pub fn tokenize(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.split_whitespace().map(word_id)
}

/// One message of a conversation, reduced to what the fake needs.
pub struct Turn {
    pub role: String,
    pub text: String,
}

/// The text of an OpenAI message `content`: a string, or the `text` of each part of an array, joined
/// by spaces (image and audio parts carry no text and are skipped).
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            texts.join(" ")
        }
        _ => String::new(),
    }
}

/// Turns of a Chat Completions `messages` array; `None` when it is missing or not an array.
pub fn chat_turns(messages: &Value) -> Option<Vec<Turn>> {
    let messages = messages.as_array()?;
    Some(
        messages
            .iter()
            .map(|m| Turn {
                role: m
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or("user")
                    .to_owned(),
                text: m.get("content").map(content_text).unwrap_or_default(),
            })
            .collect(),
    )
}

/// Turns of a Responses API request: `instructions` as a system turn, then `input` (a string, or an
/// array of message items; a `function_call_output` item becomes a `tool` turn).
pub fn responses_turns(body: &Value) -> Option<Vec<Turn>> {
    let mut turns = Vec::new();
    if let Some(instructions) = body.get("instructions").and_then(Value::as_str) {
        turns.push(Turn {
            role: "system".to_owned(),
            text: instructions.to_owned(),
        });
    }
    match body.get("input")? {
        Value::String(s) => turns.push(Turn {
            role: "user".to_owned(),
            text: s.clone(),
        }),
        Value::Array(items) => {
            for item in items {
                let (role, text) = match item.get("type").and_then(Value::as_str) {
                    Some("function_call_output") => (
                        "tool",
                        item.get("output").map(content_text).unwrap_or_default(),
                    ),
                    _ => (
                        item.get("role").and_then(Value::as_str).unwrap_or("user"),
                        item.get("content").map(content_text).unwrap_or_default(),
                    ),
                };
                turns.push(Turn {
                    role: role.to_owned(),
                    text,
                });
            }
        }
        _ => return None,
    }
    Some(turns)
}

/// The fake chat template: `<|role|>\ntext\n` per turn, then `<|assistant|>\n`.
pub fn render(turns: &[Turn]) -> String {
    let mut out = String::new();
    for t in turns {
        out.push_str("<|");
        out.push_str(&t.role);
        out.push_str("|>\n");
        out.push_str(&t.text);
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    out
}

/// The text the reply quotes: a tool result that ends the conversation, else the last user
/// turn, else the last turn, else nothing.
pub fn last_user_text(turns: &[Turn]) -> &str {
    if let Some(last) = turns.last().filter(|t| t.role == "tool") {
        return &last.text;
    }
    turns
        .iter()
        .rev()
        .find(|t| t.role == "user")
        .or(turns.last())
        .map_or("", |t| t.text.as_str())
}

/// The deterministic reply: `fake reply to: ` and the first 40 characters of `quoted`.
pub fn reply_to(quoted: &str) -> String {
    let mut reply = String::from("fake reply to: ");
    reply.extend(quoted.chars().take(40));
    reply
}

/// A prompt given as text, token ids, or a mix of both (llama.cpp's `prompt`/`content` forms).
pub struct Prompt {
    pub text: String,
    pub tokens: Vec<u32>,
}

impl Prompt {
    pub fn from_text(text: String) -> Self {
        let tokens = tokenize(&text).collect();
        Self { text, tokens }
    }
}

/// Reads one prompt: a string, a token id, or a mixed array of strings and ids. An array of strings
/// or of arrays is a list of prompts, of which the fake answers the first.
pub fn prompt(value: &Value) -> Option<Prompt> {
    match value {
        Value::String(s) => Some(Prompt::from_text(s.clone())),
        Value::Number(_) => mixed_prompt(std::slice::from_ref(value)),
        Value::Array(items) if items.iter().any(Value::is_number) => mixed_prompt(items),
        Value::Array(items) => items.first().and_then(prompt),
        _ => None,
    }
}

fn mixed_prompt(items: &[Value]) -> Option<Prompt> {
    let mut words = Vec::new();
    let mut tokens = Vec::new();
    for item in items {
        match item {
            Value::String(s) => {
                words.push(s.clone());
                tokens.extend(tokenize(s));
            }
            Value::Number(n) => {
                let id = u32::try_from(n.as_u64()?).ok()?;
                words.push(id.to_string());
                tokens.push(id);
            }
            _ => return None,
        }
    }
    Some(Prompt {
        text: words.join(" "),
        tokens,
    })
}

/// A unit-length vector of `EMBEDDING_DIM` floats derived from the text's bytes.
pub fn embedding(text: &str) -> Vec<f32> {
    let raw: Vec<f32> = (0..EMBEDDING_DIM as u32)
        .map(|i| {
            let h = fnv1a(i.wrapping_mul(0x9e37_79b9), text.as_bytes());
            (h as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    raw.into_iter().map(|x| x / norm).collect()
}

/// Share of the query's distinct words (case-insensitive) that occur in the document, in `[0, 1]`.
pub fn relevance(query: &str, document: &str) -> f64 {
    let doc: std::collections::HashSet<String> =
        document.split_whitespace().map(str::to_lowercase).collect();
    let query: std::collections::HashSet<String> =
        query.split_whitespace().map(str::to_lowercase).collect();
    if query.is_empty() {
        return 0.0;
    }
    let hits = query.iter().filter(|w| doc.contains(*w)).count();
    hits as f64 / query.len() as f64
}
