//! Recorded coding-agent sessions (tests/data/agents/): the pinned Claude Code and Codex CLI
//! run against a scripted model that answers as a model would (a tool call, then another, then
//! an answer), so each session has the shape of a real one, a prompt that grows turn by turn,
//! without a model that can do agent work. Recorded once per pin (`cargo test -p onebit-tests
//! --test agent_sessions -- --ignored record_agent_sessions`), replayed by the tests and by
//! `cargo xtask bench agents`.
//!
//! A session file is JSON lines: one request an agent made, in order: `agent`, `version`,
//! `session`, `turn` (0-based), `method`, `path`, `headers` (the identity headers the agent
//! sent, no key), and the JSON it posted, byte for byte (its keys in the agent's order): a
//! file's first request as `body`, each later one as `body_delta` on the line before it (a
//! list of `[start, length]` of the one before and text of its own), which keeps sessions of
//! 80 KB requests small.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod scripted_model;

pub use scripted_model::{
    ScriptedModel, SeenRequest, Step, offers_tools, project, recorded, run_bounded, save,
};

/// The folder the sessions are kept in.
pub fn data_dir() -> PathBuf {
    crate::route_fixture::root().join("tests/data/agents")
}

/// One request of a recorded session.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub agent: String,
    pub version: String,
    pub session: String,
    pub turn: usize,
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    /// The JSON text the agent posted.
    pub body: String,
}

impl Recorded {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    fn to_line(&self, previous: Option<&Recorded>) -> String {
        let headers: serde_json::Map<String, Value> = self
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.clone())))
            .collect();
        let mut line = json!({
            "agent": self.agent, "version": self.version, "session": self.session,
            "turn": self.turn, "method": self.method, "path": self.path, "headers": headers,
        });
        match previous {
            Some(p) => {
                line["body_delta"] = Value::from(delta(&p.body, &self.body));
            }
            None => line["body"] = Value::from(self.body.clone()),
        }
        line.to_string()
    }

    fn of_line(line: &str, previous: Option<&Recorded>) -> Option<Recorded> {
        let v: Value = serde_json::from_str(line).ok()?;
        let session = v["session"].as_str()?.to_string();
        let body = match v["body"].as_str() {
            Some(body) => body.to_string(),
            None => {
                let p = &previous?.body;
                undelta(p, v["body_delta"].as_array()?)?
            }
        };
        Some(Recorded {
            agent: v["agent"].as_str()?.to_string(),
            version: v["version"].as_str()?.to_string(),
            session,
            turn: v["turn"].as_u64()? as usize,
            method: v["method"].as_str()?.to_string(),
            path: v["path"].as_str()?.to_string(),
            headers: v["headers"]
                .as_object()?
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect(),
            body,
        })
    }
}

/// `next` as pieces of `previous` (`[start, length]`) and text of its own: it is cut after
/// each `},` (an element of an array ends there), and a piece that `previous` holds (after the
/// last piece taken, or anywhere for one of 32 bytes or more) is taken from it.
fn delta(previous: &str, next: &str) -> Vec<Value> {
    let mut ops: Vec<Value> = Vec::new();
    let mut cursor = usize::MAX;
    for piece in next.split_inclusive("},") {
        let follows = previous
            .get(cursor..)
            .is_some_and(|rest| rest.starts_with(piece));
        let found = if follows {
            Some(cursor)
        } else if piece.len() >= 32 {
            previous.find(piece)
        } else {
            None
        };
        match (found, ops.last_mut()) {
            (Some(at), Some(Value::Array(last))) if follows => {
                last[1] = Value::from(last[1].as_u64().unwrap_or(0) + piece.len() as u64);
                cursor = at + piece.len();
            }
            (Some(at), _) => {
                ops.push(json!([at, piece.len()]));
                cursor = at + piece.len();
            }
            (None, Some(Value::String(last))) => {
                last.push_str(piece);
                cursor = usize::MAX;
            }
            (None, _) => {
                ops.push(Value::from(piece));
                cursor = usize::MAX;
            }
        }
    }
    ops
}

/// The text [`delta`] made, from `previous`.
fn undelta(previous: &str, ops: &[Value]) -> Option<String> {
    let mut out = String::new();
    for op in ops {
        match op {
            Value::String(text) => out.push_str(text),
            Value::Array(range) => {
                let start = range.first()?.as_u64()? as usize;
                let length = range.get(1)?.as_u64()? as usize;
                out.push_str(previous.get(start..start + length)?);
            }
            _ => return None,
        }
    }
    Some(out)
}

/// A session's requests, read from `file` under [`data_dir`].
pub fn load(file: &str) -> Vec<Recorded> {
    let path = data_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; record it again (tests/data/agents/README.md)",
            path.display()
        )
    });
    let mut requests: Vec<Recorded> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let request = Recorded::of_line(line, requests.last())
            .unwrap_or_else(|| panic!("{}: a line that is not a request", path.display()));
        requests.push(request);
    }
    requests
}

/// What one replayed request got back.
#[derive(Clone, Debug, Default)]
pub struct Replayed {
    pub status: u16,
    /// The prompt's tokens, and those llama-server read from its slots or cache rather than
    /// prefilled (the reply's usage).
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// From the request written to the first generated text or tool input, and to the end.
    pub ttft: Duration,
    pub wall: Duration,
    /// The generated text and tool input, in order: what a greedy reply is compared by.
    pub generated: String,
}

impl Replayed {
    /// The prompt tokens llama-server prefilled.
    pub fn prefilled(&self) -> usize {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }
}

/// The body a replay sends: the recorded one, greedy (`temperature` 0) and bounded to
/// `max_tokens` generated tokens, every other byte as the agent sent it.
pub fn replay_body(request: &Recorded, max_tokens: usize) -> String {
    let body = request.body.trim_start();
    let rest = body.strip_prefix('{').unwrap_or(body);
    if request.path.starts_with("/v1/responses") {
        format!("{{\"temperature\":0,\"max_output_tokens\":{max_tokens},{rest}")
    } else {
        let value = request.json();
        let old = format!("\"max_tokens\":{}", value["max_tokens"]);
        let rest = rest.replacen(&old, &format!("\"max_tokens\":{max_tokens}"), 1);
        format!("{{\"temperature\":0,{rest}")
    }
}

/// Sends one recorded request (streamed, as the agent sent it; greedy, at most `max_tokens`
/// generated) to `port` and reads the stream to its end. Blocks.
pub fn replay(port: u16, request: &Recorded, max_tokens: usize, limit: Duration) -> Replayed {
    let body = replay_body(request, max_tokens);
    let mut head = format!(
        "{} {} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        request.method,
        request.path,
        body.len()
    );
    for (k, v) in &request.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let started = Instant::now();
    let mut out = Replayed::default();
    let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
        return out;
    };
    let _ = tcp.set_read_timeout(Some(limit));
    if tcp.write_all(head.as_bytes()).is_err() || tcp.write_all(body.as_bytes()).is_err() {
        return out;
    }
    let mut reader = BufReader::new(tcp);
    let mut status = String::new();
    let _ = reader.read_line(&mut status);
    out.status = status
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut chunked = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        let line = line.trim_end().to_ascii_lowercase();
        if line.is_empty() {
            break;
        }
        if line.starts_with("transfer-encoding:") && line.contains("chunked") {
            chunked = true;
        }
    }
    // The body's lines as they come (chunk-size lines are not `data:` lines, and a chunk
    // cut inside a line is joined by reading whole lines of the de-chunked stream).
    let mut pending = String::new();
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        if chunked && pending.is_empty() && is_chunk_size(&text) {
            continue;
        }
        pending.push_str(&text);
        if !pending.ends_with('\n') {
            continue;
        }
        let line = std::mem::take(&mut pending);
        let line = line.trim_end();
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let Ok(event) = serde_json::from_str::<Value>(data.trim()) else {
            continue;
        };
        read_event(&event, &mut out, started);
    }
    out.wall = started.elapsed();
    out
}

/// Whether a line of a chunked body is a chunk's size line (hex digits alone).
fn is_chunk_size(line: &str) -> bool {
    let t = line.trim_end_matches(['\r', '\n']);
    !t.is_empty() && t.len() <= 8 && t.chars().all(|c| c.is_ascii_hexdigit())
}

/// What one event of a Messages or Responses stream says: generated text, and usage.
fn read_event(event: &Value, out: &mut Replayed, started: Instant) {
    let mut text = |t: &str| {
        if out.generated.is_empty() && !t.is_empty() {
            out.ttft = started.elapsed();
        }
        out.generated.push_str(t);
    };
    match event["type"].as_str().unwrap_or("") {
        "content_block_delta" => {
            let delta = &event["delta"];
            text(
                delta["text"]
                    .as_str()
                    .or(delta["partial_json"].as_str())
                    .or(delta["thinking"].as_str())
                    .unwrap_or(""),
            );
        }
        "response.output_text.delta"
        | "response.function_call_arguments.delta"
        | "response.reasoning_text.delta" => {
            text(event["delta"].as_str().unwrap_or(""));
        }
        _ => {}
    }
    let anthropic = event["message"]["usage"]
        .as_object()
        .or(event["usage"].as_object());
    if let Some(usage) = anthropic
        && let Some(cached) = usage.get("cache_read_input_tokens").and_then(Value::as_u64)
    {
        let fresh = usage
            .get("input_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if fresh + cached > 0 {
            out.cached_tokens = cached as usize;
            out.prompt_tokens = (fresh + cached) as usize;
        }
    }
    let usage = &event["response"]["usage"];
    if let Some(total) = usage["input_tokens"].as_u64() {
        out.prompt_tokens = total as usize;
        out.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as usize;
    }
}
