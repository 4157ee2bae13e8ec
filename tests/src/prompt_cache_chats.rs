//! What the prompt-cache tests share (tests/tests/serve_prompt_cache*.rs): their long system
//! prompts, greedy chats, and serve's stop and lines.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};

use crate::{Serve, post};

/// The shortest prefix kept in these tests: the prompts below are 350-450 tokens, so a cold
/// prefill stays a few seconds on a loaded 2-core machine.
pub const MIN_TOKENS: &str = "256";

/// The cpu route's micro-batch (`-ub 256`).
pub const UBATCH: u64 = 256;

/// A long system prompt, different for each `topic`.
pub fn system(topic: &str) -> String {
    rules(topic, 24)
}

/// `n` rules about `topic` (about 22 tokens each).
pub fn rules(topic: &str, n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "Rule {i} about {topic}: answer briefly, and when asked about item {i} name the colour {}.",
                ["red", "green", "blue", "amber"][i % 4]
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A conversation's first turn: the long system prompt of `topic` and one question.
pub fn first_turn(topic: &str) -> Value {
    json!([
        {"role": "system", "content": system(topic)},
        {"role": "user", "content": "What colour is item 7? Answer in one sentence."},
    ])
}

/// The turn after `turn`: its messages, the `reply` it had, and `question`.
pub fn next_turn(turn: &Value, reply: &Value, question: &str) -> Value {
    let mut next = turn.clone();
    let list = next.as_array_mut().expect("a turn is a list of messages");
    list.push(json!({"role": "assistant", "content": text(reply)}));
    list.push(json!({"role": "user", "content": question}));
    next
}

pub fn text(reply: &Value) -> String {
    reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// SIGTERM, and the exit: the drain saves what the replies left before the backend stops.
pub fn stop(mut serve: Serve) -> String {
    serve.signal(Signal::SIGTERM);
    assert!(
        serve.wait_exit(Duration::from_secs(60)).is_some(),
        "serve did not stop:\n{}",
        serve.output()
    );
    serve.output()
}

pub fn count(output: &str, needle: &str) -> usize {
    output.lines().filter(|l| l.contains(needle)).count()
}

/// A whole chat of `messages`, greedy, at most 24 tokens.
pub fn chat_of(serve: &Serve, messages: &Value) -> Value {
    let body = json!({"messages": messages, "temperature": 0, "max_tokens": 24});
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body.to_string());
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    serde_json::from_str(&reply).unwrap()
}
