//! The scripted model the sessions are recorded against, and the recording: what the agent
//! sent, kept as a session's requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{Recorded, data_dir};

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
    steps: usize,
}

impl ScriptedModel {
    pub fn start(script: Vec<Step>) -> ScriptedModel {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let steps = script.len();
        let script = Arc::new(script);
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let sink = sink.clone();
                let script = script.clone();
                std::thread::spawn(move || answer(client, &script, &sink));
            }
        });
        ScriptedModel { port, seen, steps }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Whether the agent has asked for the script's last step (its answer): a request of the
    /// agent's loop (one that offers tools) carrying a result of every call before it.
    pub fn answered(&self) -> bool {
        let last = self.steps.saturating_sub(1);
        self.seen.lock().unwrap().iter().any(|(_, _, _, body)| {
            let value: Value = serde_json::from_str(body).unwrap_or(Value::Null);
            offers_tools(&value) && step_of(&value) >= last
        })
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

/// Whether a request offers tools: one of the agent's loop, not a side request (Claude Code's
/// session title).
pub fn offers_tools(request: &Value) -> bool {
    request["tools"].as_array().is_some_and(|t| !t.is_empty())
}

/// A Messages stream: the script's step when the request offers tools, else a short answer
/// (Claude Code's side requests: a session title, which asks for JSON by a schema, a topic).
fn messages_stream(request: &Value, script: &[Step]) -> String {
    let model = request["model"].as_str().unwrap_or("local");
    let step = if offers_tools(request) {
        script
            .get(step_of(request))
            .cloned()
            .unwrap_or_else(|| Step::Answer("Done.".into()))
    } else {
        Step::Answer(side_answer(request))
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

/// The answer to a side request: the JSON its `output_config.format` schema asks for (each
/// property a short text), else a short text.
fn side_answer(request: &Value) -> String {
    const SAID: &str = "Reading files";
    let format = &request["output_config"]["format"];
    if format["type"] != "json_schema" {
        return SAID.into();
    }
    let answer: serde_json::Map<String, Value> = format["schema"]["properties"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, _)| (name.clone(), Value::from(SAID)))
        .collect();
    Value::Object(answer).to_string()
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
