//! `1bit serve --laya`: each conversation is classified once (code, prose, short answer or long
//! document) by the rules or, with `--laya-model`, by the Laya model's daemon (`scorer`), the
//! route policy picks its device, and its requests go to that device's backend (docs/laya.md).
//! serve runs one backend per device the policy can pick; this module only decides, by
//! conversation, which of them a request goes to.

mod cache;
mod classify;
#[cfg(test)]
mod eval;
mod policy;
mod scorer;
pub mod start;

use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use axum::http::HeaderValue;
use serde_json::Value;

#[cfg(test)]
use classify::Class;
use classify::{Decision, LONG_DOC_CHARS, classify};
pub use policy::Policy;

/// Conversations remembered; the least recently used goes first.
pub const CONVERSATIONS: usize = 4096;

/// What the start line says the classifier is without `--laya-model`.
pub const CLASSIFIER: &str =
    "the rule-based classifier (keyword and length rules, not the Laya model; docs/laya.md)";

/// A request's destination: the backend (in serve's order) and the header that says why.
#[derive(Debug, Clone)]
pub struct Routed {
    pub backend: usize,
    /// `X-1bit-Route: <class> <confidence> <device>`.
    pub header: HeaderValue,
}

/// The per-conversation router: the policy, the devices that run with their backends, and the
/// conversations decided. Built once at start; shared by every request.
pub struct Laya {
    policy: Policy,
    /// The devices that run, the fallback first, and each one's backend.
    running: Vec<String>,
    backends: Vec<usize>,
    decided: Mutex<cache::Recent<(Decision, usize)>>,
    /// `--laya-model`'s daemon, which decides what is shorter than the size gate.
    scorer: Option<scorer::Scorer>,
}

impl Laya {
    /// `devices` are the devices that run with their backend index, the one to fall back to
    /// first. Called once by serve's start.
    pub fn new(policy: Policy, devices: Vec<(String, usize)>) -> Laya {
        let (running, backends) = devices.into_iter().unzip();
        Laya {
            policy,
            running,
            backends,
            decided: Mutex::new(cache::Recent::new(CONVERSATIONS)),
            scorer: None,
        }
    }

    /// The router with `--laya-model`'s daemon deciding (dropped, and so stopped, with it).
    fn with_scorer(mut self, scorer: Option<scorer::Scorer>) -> Laya {
        self.scorer = scorer;
        self
    }

    /// Where a request goes: its conversation's device, decided now when the conversation is
    /// new (logged) and remembered for its later turns. None for a body that opens no
    /// conversation (no messages, no prompt): it goes where the rule says. Called by the relay
    /// on the request's task; it takes a lock for a lookup only and never blocks on I/O: a
    /// question to the Laya daemon is awaited (at most its bound; then the rules decide).
    pub async fn route(&self, body: &[u8]) -> Option<Routed> {
        let (key, text) = opening(body)?;
        let cached = self.lock().get(key);
        let (decision, index) = match cached {
            Some(found) => found,
            None => {
                let decision = self.decide(&text).await;
                let device = self.policy.pick(&decision, &self.running)?;
                let index = self.running.iter().position(|d| d == device)?;
                self.lock().insert(key, (decision, index));
                tracing::info!("1bit serve: laya: {}", header_text(&decision, device));
                (decision, index)
            }
        };
        let header = HeaderValue::from_str(&header_text(&decision, &self.running[index])).ok()?;
        Some(Routed {
            backend: self.backends[index],
            header,
        })
    }

    /// A new conversation's class: the daemon's when there is one, the text is under the size
    /// gate and it answers; else the rules'.
    async fn decide(&self, text: &str) -> Decision {
        if let Some(scorer) = &self.scorer
            && text.chars().count() < LONG_DOC_CHARS
            && let Some(decision) = scorer.ask(text).await
        {
            return decision;
        }
        classify(text)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, cache::Recent<(Decision, usize)>> {
        self.decided.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn header_text(decision: &Decision, device: &str) -> String {
    format!(
        "{} {:.2} {device}",
        decision.class.name(),
        decision.confidence
    )
}

/// A conversation's key and the text that is classified. For a chat the opening is the
/// messages up to the first user message (the same on every later turn), and the text that
/// user message's; for a completion, the prompt.
fn opening(body: &[u8]) -> Option<(u64, String)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    if let Some(messages) = value.get("messages").and_then(Value::as_array) {
        let first_user = messages
            .iter()
            .position(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .unwrap_or(messages.len().checked_sub(1)?);
        for m in &messages[..=first_user] {
            m.to_string().hash(&mut hasher);
        }
        let text = text_of(messages[first_user].get("content").unwrap_or(&Value::Null));
        return Some((hasher.finish(), text));
    }
    let prompt = value.get("prompt")?;
    let text = match prompt {
        Value::Array(items) => items.first().map(text_of).unwrap_or_default(),
        other => text_of(other),
    };
    text.hash(&mut hasher);
    Some((hasher.finish(), text))
}

/// A content string, or the text parts of an array of parts.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn laya() -> Laya {
        let policy = Policy::parse(
            r#"{"default": "cpu", "classes": {"code": {"device": "hrx"}, "short": {"device": "cpu"}}}"#,
        )
        .unwrap();
        Laya::new(policy, vec![("cpu".into(), 0), ("hrx".into(), 1)])
    }

    #[tokio::test]
    async fn a_later_turn_reuses_the_first_decision() {
        let l = laya();
        let first = json!({"messages": [{"role": "system", "content": "be nice"},
            {"role": "user", "content": "Write a Rust function that sums a slice."}]});
        let r = l.route(first.to_string().as_bytes()).await.unwrap();
        assert_eq!(r.backend, 1);
        assert!(
            r.header.to_str().unwrap().starts_with("code "),
            "{:?}",
            r.header
        );
        // The later turn asks something short; its conversation stays where it began.
        let later = json!({"messages": [{"role": "system", "content": "be nice"},
            {"role": "user", "content": "Write a Rust function that sums a slice."},
            {"role": "assistant", "content": "fn sum(...)"},
            {"role": "user", "content": "thanks"}]});
        let again = l.route(later.to_string().as_bytes()).await.unwrap();
        assert_eq!((again.backend, again.header), (1, r.header));
        assert_eq!(l.lock().len(), 1);
        let other = json!({"messages": [{"role": "user", "content": "thanks"}]});
        assert_eq!(
            l.route(other.to_string().as_bytes()).await.unwrap().backend,
            0
        );
        assert!(l.route(b"{}").await.is_none());
    }
}
