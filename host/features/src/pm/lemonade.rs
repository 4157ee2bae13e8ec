//! A delegation: one non-streaming chat request to Lemonade for an expert's catalog id, whose
//! answer (or the reason there is none) becomes the PM's tool result.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use super::calls::content_text;
use super::experts::Experts;
use onebit_command::error::{Fatal, error_chain};
use onebit_supervision::backends::health::ProbeClient;

/// Lemonade's address as `--lemonade-url` gave it, checked at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LemonadeUrl(String);

/// Where Lemonade listens when `--lemonade-url` is not given.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8000";

impl LemonadeUrl {
    /// Check `--lemonade-url`: plain `http://host[:port]` (serve's client has no TLS). The error
    /// is the one-line refusal (exit 2).
    pub fn parse(url: &str) -> Result<LemonadeUrl, Fatal> {
        let base = url.trim_end_matches('/');
        let ok = base.strip_prefix("http://").is_some_and(|rest| {
            !rest.is_empty() && !rest.contains('/') && base.parse::<hyper::Uri>().is_ok()
        });
        if ok {
            Ok(LemonadeUrl(base.to_string()))
        } else {
            Err(Fatal::usage(format!(
                "--lemonade-url {url}: not a plain http://HOST:PORT address (serve's client has no TLS); pass one such as {DEFAULT_URL}"
            )))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What one delegation came to, for the reply's `pm.delegations` and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delegation {
    pub expert: String,
    /// The catalog id asked for; empty when the expert was unknown.
    pub id: String,
    pub ms: u64,
    pub ok: bool,
}

/// Run `delegate(expert, task, context)`: returns the tool result text (the expert's answer, cut
/// at `pm.max_result_bytes`, or a sentence saying why there is none) and the record. Logs one
/// line either way. Called by the tool loop on the request's task; it waits for Lemonade up to
/// `pm.delegate_timeout_s`.
pub async fn delegate(
    experts: &Experts,
    url: &LemonadeUrl,
    client: &ProbeClient,
    args: &serde_json::Map<String, Value>,
) -> (String, Delegation) {
    let text = |k: &str| match args.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    };
    let (name, task, context) = (text("expert"), text("task"), text("context"));
    let Some(expert) = experts.find(&name) else {
        tracing::info!(
            "1bit serve: pm: delegate {name}: unknown expert (task {} chars)",
            task.chars().count()
        );
        let result = format!(
            "delegation failed: there is no expert '{name}'. The experts are: {}. Answer the user yourself.",
            experts.names()
        );
        let record = Delegation {
            expert: name,
            id: String::new(),
            ms: 0,
            ok: false,
        };
        return (result, record);
    };
    let mut record = Delegation {
        expert: name.clone(),
        id: expert.id.clone(),
        ms: 0,
        ok: false,
    };
    if task.trim().is_empty() {
        tracing::info!(
            "1bit serve: pm: delegate {name} -> {}: no task given",
            expert.id
        );
        let result = "delegation failed: delegate() needs a task. Call it again with the full brief in `task`.";
        return (result.to_string(), record);
    }
    let brief = if context.trim().is_empty() {
        task.clone()
    } else {
        format!("{task}\n\nContext:\n{context}")
    };
    let mut body = json!({
        "model": expert.id,
        "messages": [
            {"role": "system", "content": format!(
                "You are the {} expert of a team led by a Project Manager model. It sends you one task; answer it completely and directly, code included. Your answer is relayed to the user.",
                if expert.domain.is_empty() { &expert.expert } else { &expert.domain })},
            {"role": "user", "content": brief},
        ],
        "stream": false,
    });
    if expert.max_tokens > 0 {
        body["max_tokens"] = json!(expert.max_tokens);
    }
    let started = Instant::now();
    let outcome = tokio::time::timeout(
        Duration::from_secs(experts.delegate_timeout_s),
        ask(client, url, &experts.chat_path, body),
    )
    .await
    .unwrap_or_else(|_| {
        Err(format!(
            "Lemonade at {} gave no answer within {} s (pm.delegate_timeout_s)",
            url.as_str(),
            experts.delegate_timeout_s
        ))
    });
    record.ms = started.elapsed().as_millis() as u64;
    let task_chars = task.chars().count();
    match outcome {
        Ok(answer) => {
            record.ok = true;
            let (mut answer, cut) = cut_utf8(answer, experts.max_result_bytes);
            tracing::info!(
                "1bit serve: pm: delegate {name} -> {} (task {task_chars} chars) {} ms ok, {} bytes{}",
                expert.id,
                record.ms,
                answer.len(),
                if cut { " (cut)" } else { "" }
            );
            if cut {
                answer.push_str(&format!(
                    "\n[the expert's answer was cut at {} bytes]",
                    experts.max_result_bytes
                ));
            }
            (answer, record)
        }
        Err(why) => {
            tracing::info!(
                "1bit serve: pm: delegate {name} -> {} (task {task_chars} chars) {} ms failed: {why}",
                expert.id,
                record.ms
            );
            let result = format!(
                "delegation to {} failed: {why}. Tell the user the expert was not available and answer yourself.",
                expert.id
            );
            (result, record)
        }
    }
}

/// The request itself: the expert's answer text, or why there is none.
async fn ask(
    client: &ProbeClient,
    url: &LemonadeUrl,
    path: &str,
    body: Value,
) -> Result<String, String> {
    let target = format!("{}{path}", url.as_str());
    let request = hyper::Request::post(&target)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| format!("{target} is not a usable address ({e})"))?;
    let reply = client.request(request).await.map_err(|e| {
        format!(
            "Lemonade at {} did not answer ({})",
            url.as_str(),
            error_chain(&e)
        )
    })?;
    let status = reply.status();
    let bytes = reply
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("Lemonade broke off its answer ({e})"))?
        .to_bytes();
    let parsed: Option<Value> = serde_json::from_slice(&bytes).ok();
    if !status.is_success() {
        let message = parsed
            .as_ref()
            .and_then(|v| v.get("error"))
            .map(|e| match e.get("message").and_then(Value::as_str) {
                Some(m) => m.to_string(),
                None => e
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| e.to_string()),
            })
            .filter(|m| !m.is_empty())
            .map(|m| format!(" ({m})"))
            .unwrap_or_default();
        return Err(format!(
            "Lemonade answered HTTP {}{message}",
            status.as_u16()
        ));
    }
    let Some(reply) = parsed else {
        return Err(format!(
            "Lemonade answered HTTP {} with a body that is not JSON",
            status.as_u16()
        ));
    };
    let Some(message) = reply.pointer("/choices/0/message") else {
        return Err("Lemonade's reply had no choices[0].message".to_string());
    };
    let mut answer = content_text(message.get("content").unwrap_or(&Value::Null));
    if answer.trim().is_empty() {
        answer = message
            .get("reasoning_content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
    }
    if answer.trim().is_empty() {
        return Err("the expert returned an empty answer".to_string());
    }
    Ok(answer)
}

/// `text` cut to at most `limit` bytes on a character boundary; whether it was cut.
pub fn cut_utf8(mut text: String, limit: usize) -> (String, bool) {
    if text.len() <= limit {
        return (text, false);
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    (text, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_on_a_character_boundary() {
        assert_eq!(cut_utf8("abc".into(), 3), ("abc".into(), false));
        assert_eq!(cut_utf8("abcd".into(), 3), ("abc".into(), true));
        // "é" is two bytes: a cut inside it keeps the character out whole.
        assert_eq!(cut_utf8("aé".into(), 2), ("a".into(), true));
        assert_eq!(cut_utf8("€€".into(), 5), ("€".into(), true));
    }

    #[test]
    fn lemonade_urls() {
        assert_eq!(
            LemonadeUrl::parse("http://127.0.0.1:8000/")
                .unwrap()
                .as_str(),
            "http://127.0.0.1:8000"
        );
        assert!(LemonadeUrl::parse("http://localhost:13305").is_ok());
        for bad in ["https://x:1", "127.0.0.1:8000", "http://", "http://x/api"] {
            let why = LemonadeUrl::parse(bad).unwrap_err();
            assert_eq!(why.code, onebit_command::error::exit::USAGE);
            assert!(
                why.message.starts_with(&format!("--lemonade-url {bad}:")),
                "{why}"
            );
        }
    }
}
