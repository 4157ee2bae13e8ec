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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

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

/// What the scripted model does at one step of a session: call a tool, or answer.
#[derive(Clone, Debug)]
pub enum Step {
    /// A tool call: the tool's name (or, for the Codex CLI, the command its shell runs) and
    /// the input; a sentence said before it.
    Call {
        said: String,
        tool: String,
        input: Value,
    },
    Answer(String),
}

/// The headers kept with a request: those that say which agent and session sent it.
const KEPT_HEADERS: [&str; 9] = [
    "anthropic-beta",
    "anthropic-version",
    "x-app",
    "x-claude-code-session-id",
    "session_id",
    "conversation_id",
    "originator",
    "openai-beta",
    "user-agent",
];

/// A scripted model on a loopback port: it answers Anthropic's Messages and OpenAI's
/// Responses API, streamed, with the steps of its script (the step is the count of tool
/// results in the request), and records each request.
pub struct ScriptedModel {
    pub port: u16,
    seen: Arc<Seen>,
}

impl ScriptedModel {
    pub fn start(script: Vec<Step>) -> ScriptedModel {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let script = Arc::new(script);
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let sink = sink.clone();
                let script = script.clone();
                std::thread::spawn(move || answer(client, &script, &sink));
            }
        });
        ScriptedModel { port, seen }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The requests seen so far (method, path, kept headers, body).
    pub fn take(&self) -> Vec<SeenRequest> {
        std::mem::take(&mut self.seen.lock().unwrap())
    }
}

/// A request the scripted model saw: method, path, the headers kept, the body's text.
pub type SeenRequest = (String, String, Headers, String);
type Headers = Vec<(String, String)>;
type Seen = Mutex<Vec<SeenRequest>>;

fn answer(mut client: TcpStream, script: &[Step], seen: &Seen) {
    let Some((method, path, headers, body)) = read_request(&mut client) else {
        return;
    };
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = if method == "POST"
        && path.starts_with("/v1/messages")
        && !path.contains("count_tokens")
    {
        seen.lock().unwrap().push((
            method,
            path,
            kept(&headers),
            String::from_utf8_lossy(&body).into_owned(),
        ));
        messages_stream(&value, script)
    } else if method == "POST" && path.starts_with("/v1/responses") {
        seen.lock().unwrap().push((
            method,
            path,
            kept(&headers),
            String::from_utf8_lossy(&body).into_owned(),
        ));
        responses_stream(&value, script)
    } else if path.contains("count_tokens") {
        let body = json!({"input_tokens": body.len() / 4}).to_string();
        let _ = write!(
            client,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        return;
    } else {
        let _ = client.write_all(
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
        );
        return;
    };
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n";
    let _ = client.write_all(head.as_bytes());
    let _ = client.write_all(reply.as_bytes());
    let _ = client.flush();
    let _ = client.shutdown(Shutdown::Both);
}

fn kept(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(k, _)| KEPT_HEADERS.contains(&k.as_str()))
        .cloned()
        .collect()
}

/// One HTTP/1.1 request: method, path, headers (lowercase names) and body (by Content-Length
/// or chunked).
fn read_request(client: &mut TcpStream) -> Option<(String, String, Headers, Vec<u8>)> {
    let mut reader = BufReader::new(client.try_clone().ok()?);
    let mut first = String::new();
    reader.read_line(&mut first).ok()?;
    let mut parts = first.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':')?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(length) = header("content-length").and_then(|l| l.parse::<usize>().ok()) {
        body.resize(length, 0);
        reader.read_exact(&mut body).ok()?;
    } else if header("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    Some((method, path, headers, body))
}

fn sse(event: &str, data: &Value) -> String {
    format!("event: {event}\ndata: {data}\n\n")
}

/// The step a request is at: the tool results it carries.
fn step_of(request: &Value) -> usize {
    let mut n = 0;
    for m in request["messages"].as_array().into_iter().flatten() {
        for block in m["content"].as_array().into_iter().flatten() {
            if block["type"] == "tool_result" {
                n += 1;
            }
        }
    }
    for item in request["input"].as_array().into_iter().flatten() {
        if item["type"] == "function_call_output" || item["type"] == "custom_tool_call_output" {
            n += 1;
        }
    }
    n
}

/// A Messages stream: the script's step when the request offers tools, else a short answer
/// (Claude Code's side requests: a title, a topic).
fn messages_stream(request: &Value, script: &[Step]) -> String {
    let model = request["model"].as_str().unwrap_or("local");
    let has_tools = request["tools"].as_array().is_some_and(|t| !t.is_empty());
    let step = if has_tools {
        script
            .get(step_of(request))
            .cloned()
            .unwrap_or_else(|| Step::Answer("Done.".into()))
    } else {
        Step::Answer("Reading files".into())
    };
    let mut out = sse(
        "message_start",
        &json!({"type": "message_start", "message": {"id": format!("msg_{}", step_of(request)), "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 100, "output_tokens": 1}}}),
    );
    let text_block = |out: &mut String, index: usize, text: &str| {
        out.push_str(&sse("content_block_start", &json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}})));
        out.push_str(&sse("content_block_delta", &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}})));
        out.push_str(&sse(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
    };
    let stop = match &step {
        Step::Answer(text) => {
            text_block(&mut out, 0, text);
            "end_turn"
        }
        Step::Call { said, tool, input } => {
            text_block(&mut out, 0, said);
            let id = format!("toolu_{:02}", step_of(request) + 1);
            out.push_str(&sse("content_block_start", &json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": id, "name": tool, "input": {}}})));
            out.push_str(&sse("content_block_delta", &json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": input.to_string()}})));
            out.push_str(&sse(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 1}),
            ));
            "tool_use"
        }
    };
    out.push_str(&sse("message_delta", &json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 20}})));
    out.push_str(&sse("message_stop", &json!({"type": "message_stop"})));
    out
}

/// A Responses stream: the script's step; a call becomes a call of the shell tool the
/// request offers, with the arguments its schema asks for.
fn responses_stream(request: &Value, script: &[Step]) -> String {
    let n = step_of(request);
    let step = script
        .get(n)
        .cloned()
        .unwrap_or_else(|| Step::Answer("Done.".into()));
    let id = format!("resp_{n}");
    let mut output = Vec::new();
    let mut out = sse(
        "response.created",
        &json!({"type": "response.created", "response": {"id": id, "object": "response", "status": "in_progress", "output": []}}),
    );
    let message = |text: &str| {
        json!({"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]})
    };
    let say = |out: &mut String, output: &mut Vec<Value>, text: &str| {
        let index = output.len();
        let item = message(text);
        out.push_str(&sse("response.output_item.added", &json!({"type": "response.output_item.added", "output_index": index,
            "item": {"type": "message", "id": format!("msg_{n}"), "role": "assistant", "status": "in_progress", "content": []}})));
        out.push_str(&sse(
            "response.output_text.delta",
            &json!({"type": "response.output_text.delta", "item_id": format!("msg_{n}"),
            "output_index": index, "content_index": 0, "delta": text}),
        ));
        out.push_str(&sse(
            "response.output_item.done",
            &json!({"type": "response.output_item.done", "output_index": index, "item": item}),
        ));
        output.push(item);
    };
    match &step {
        Step::Answer(text) => say(&mut out, &mut output, text),
        Step::Call { said, tool, .. } => {
            say(&mut out, &mut output, said);
            let (name, arguments) = shell_call(request, tool);
            let item = json!({"type": "function_call", "id": format!("fc_{n}"), "call_id": format!("call_{n}"),
                "name": name, "arguments": arguments, "status": "completed"});
            out.push_str(&sse("response.output_item.added", &json!({"type": "response.output_item.added", "output_index": output.len(), "item": item})));
            out.push_str(&sse("response.output_item.done", &json!({"type": "response.output_item.done", "output_index": output.len(), "item": item})));
            output.push(item);
        }
    }
    out.push_str(&sse(
        "response.completed",
        &json!({"type": "response.completed", "response": {"id": id, "object": "response", "status": "completed",
            "output": output, "usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 120}}}),
    ));
    out
}

/// The shell tool the Codex CLI offers, and arguments that run `command` with it.
fn shell_call(request: &Value, command: &str) -> (String, String) {
    let tools: Vec<&Value> = request["tools"].as_array().into_iter().flatten().collect();
    let name_of = |t: &&Value| t["name"].as_str().unwrap_or("").to_string();
    if let Some(t) = tools.iter().find(|t| name_of(t) == "exec_command") {
        return (name_of(t), json!({"cmd": command}).to_string());
    }
    if let Some(t) = tools.iter().find(|t| name_of(t) == "shell_command") {
        return (name_of(t), json!({"command": command}).to_string());
    }
    let name = tools
        .iter()
        .find(|t| name_of(t) == "shell")
        .map(name_of)
        .unwrap_or_else(|| "shell".into());
    (
        name,
        json!({"command": ["bash", "-lc", command]}).to_string(),
    )
}

/// Runs `command` for at most `limit`: (success, what it wrote).
pub fn run_bounded(mut command: Command, limit: Duration) -> (bool, String) {
    let started = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the agent starts");
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (status.success(), crate::output_text(&out));
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            return (
                false,
                format!("took over {limit:?}:\n{}", crate::output_text(&out)),
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The files a session's agent works on: a small project of its own in `dir`.
pub fn project(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("notes.txt"),
        "Release checklist\n- bump the version in Cargo.toml\n- run the tests\n- tag the release\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("todo.md"),
        "# To do\n\n1. Fix the flaky relay test (due Friday).\n2. Write the changelog (due Monday).\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("main.py"),
        "def add(a, b):\n    return a + b\n\n\nif __name__ == \"__main__\":\n    print(add(2, 3))\n",
    )
    .unwrap();
}

/// Writes a session's requests to `file` under [`data_dir`].
pub fn save(file: &str, requests: &[Recorded]) {
    std::fs::create_dir_all(data_dir()).unwrap();
    let mut text = String::new();
    for (i, r) in requests.iter().enumerate() {
        text.push_str(&r.to_line(i.checked_sub(1).map(|p| &requests[p])));
        text.push('\n');
    }
    std::fs::write(data_dir().join(file), text).unwrap();
}

/// The requests a scripted model saw, as a session's.
pub fn recorded(
    agent: &str,
    version: &str,
    session: &str,
    seen: Vec<SeenRequest>,
) -> Vec<Recorded> {
    seen.into_iter()
        .enumerate()
        .map(|(turn, (method, path, headers, body))| Recorded {
            agent: agent.into(),
            version: version.into(),
            session: session.into(),
            turn,
            method,
            path,
            headers,
            body,
        })
        .collect()
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
