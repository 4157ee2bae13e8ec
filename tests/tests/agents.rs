//! The coding agents people bring, run for one turn each through `1bit serve` on the real
//! llama-server with the pinned Gemma 3 270M at `--ctx-size 32768`: Claude Code (`claude -p`,
//! Anthropic's Messages API) and the Codex CLI (`codex exec`, the Responses API), the versions
//! `cargo xtask setup` pins and installs from npm (docs/agents.md). Every request they make
//! passes a recording proxy on its way to serve, and each must be answered whole: a 2xx, and
//! a stream that ends as its protocol says. The model is too small to do agent work; the test
//! is of the protocol, not of the answer.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use onebit_tests::*;

/// How long one agent's turn may take (a first prefill of its ~3,000-token prompt included).
const TURN: Duration = Duration::from_secs(300);
const SERVED: &str = "gemma-agent";

/// One request that passed the proxy and the reply serve gave it, as bytes.
struct Exchange {
    method: String,
    path: String,
    reply: Vec<u8>,
}

/// A proxy on a loopback port in front of serve that records each exchange: each request is
/// sent on with `Connection: close`, so one connection carries one exchange.
struct Recorder {
    port: u16,
    seen: Arc<Mutex<Vec<Exchange>>>,
}

impl Recorder {
    fn start(upstream: u16) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let sink = sink.clone();
                std::thread::spawn(move || {
                    if let Some(exchange) = pass(client, upstream) {
                        sink.lock().unwrap().push(exchange);
                    }
                });
            }
        });
        Recorder { port, seen }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The exchanges so far, taken.
    fn take(&self) -> Vec<Exchange> {
        std::mem::take(&mut self.seen.lock().unwrap())
    }
}

/// Passes one exchange from `client` to serve on `upstream` and back, recording the reply.
fn pass(mut client: TcpStream, upstream: u16) -> Option<Exchange> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if client.read(&mut byte).ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let first = lines.next()?.to_string();
    let mut parts = first.split(' ');
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut sent = format!("{first}\r\n");
    for line in lines.filter(|l| !l.is_empty()) {
        if !line.to_ascii_lowercase().starts_with("connection:") {
            sent.push_str(line);
            sent.push_str("\r\n");
        }
    }
    sent.push_str("Connection: close\r\n\r\n");
    let mut serve = TcpStream::connect(("127.0.0.1", upstream)).ok()?;
    serve.write_all(sent.as_bytes()).ok()?;
    // The body (and anything after it) goes on as it comes.
    let (mut from, mut to) = (client.try_clone().ok()?, serve.try_clone().ok()?);
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
    });
    let mut reply = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        match serve.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                reply.extend_from_slice(&buf[..n]);
                if client.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = serve.shutdown(Shutdown::Both);
    Some(Exchange {
        method,
        path,
        reply,
    })
}

/// The reply's status, its headers (lowercase names) and its body, de-chunked; Err when the
/// body did not arrive whole (a chunked body without its last chunk, a short one). A reply to
/// HEAD has no body.
fn whole(method: &str, reply: &[u8]) -> Result<(u16, String, Vec<u8>), String> {
    let split = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no whole head")?;
    let head = String::from_utf8_lossy(&reply[..split]).to_ascii_lowercase();
    let mut body = &reply[split + 4..];
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status")?;
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::to_string))
    };
    if method == "HEAD" || status == 204 || status == 304 {
        return Ok((status, head, Vec::new()));
    }
    if header("transfer-encoding").is_some_and(|te| te.contains("chunked")) {
        let mut out = Vec::new();
        loop {
            let end = body
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or("a chunk size line that never ends: the body was cut")?;
            let size = std::str::from_utf8(&body[..end]).unwrap_or("");
            let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16)
                .map_err(|_| format!("a bad chunk size {size:?}"))?;
            body = &body[end + 2..];
            if size == 0 {
                return Ok((status, head, out));
            }
            if body.len() < size + 2 {
                return Err("a chunk cut short: the body was cut".into());
            }
            out.extend_from_slice(&body[..size]);
            body = &body[size + 2..];
        }
    }
    if let Some(length) = header("content-length").and_then(|l| l.trim().parse::<usize>().ok())
        && body.len() != length
    {
        return Err(format!("{} of {length} bytes", body.len()));
    }
    Ok((status, head, body.to_vec()))
}

/// The event names of an event stream, in order.
fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("event:").map(|e| e.trim().to_string()))
        .collect()
}

/// Checks every exchange: whole, answered 2xx (or, for a request that changes nothing, as
/// llama-server alone answers it: Claude Code's `HEAD /` gets llama-server's 404), and a stream
/// ended as its protocol says (an Anthropic stream with `message_stop`, a Responses stream
/// with `response.completed`, a chat stream with `[DONE]`). Returns the requests, with their
/// status.
fn every_request_answered_whole(seen: &[Exchange], serve: &Serve) -> Vec<String> {
    assert!(
        !seen.is_empty(),
        "no request reached serve:\n{}",
        serve.output()
    );
    let mut paths = Vec::new();
    for e in seen {
        let what = format!("{} {}", e.method, e.path);
        let (status, head, body) = whole(&e.method, &e.reply)
            .unwrap_or_else(|why| panic!("{what}: not whole ({why}):\n{}", serve.output()));
        let text = String::from_utf8_lossy(&body);
        if !(200..300).contains(&status) {
            let alone = matches!(e.method.as_str(), "GET" | "HEAD")
                .then(|| llama_server_alone(serve, &e.method, &e.path))
                .flatten();
            assert_eq!(
                Some(status),
                alone,
                "{what}: serve answered {status} {text}; llama-server alone {alone:?}\n{}",
                serve.output()
            );
        }
        if head.contains("content-type: text/event-stream") {
            let names = events(&body);
            let path = e.path.split('?').next().unwrap_or("");
            match path {
                "/v1/messages" => assert_eq!(
                    names.last().map(String::as_str),
                    Some("message_stop"),
                    "{what}: {names:?}"
                ),
                "/v1/responses" => assert!(
                    names.iter().any(|n| n == "response.completed"),
                    "{what}: {names:?}"
                ),
                _ => assert!(text.contains("data: [DONE]"), "{what}: {text}"),
            }
        }
        paths.push(format!("{what} {status}"));
    }
    paths
}

/// The status serve's llama-server (found by the port it says it listens on) answers a
/// request with no body.
fn llama_server_alone(serve: &Serve, method: &str, path: &str) -> Option<u16> {
    let output = serve.output();
    let port: u16 = output
        .split("listening on http://127.0.0.1:")
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    Some(raw(port, request.as_bytes(), Duration::from_secs(10)).0)
}

/// An installed agent's program (`cargo xtask setup` installs them from npm).
fn agent_program(name: &str) -> PathBuf {
    installed("ONEBIT_TEST_AGENTS_DIR", "agents")
        .join("node_modules/.bin")
        .join(name)
}

/// Runs `command` for at most [`TURN`]: (exit status success, stdout and stderr).
fn run_bounded(mut command: Command) -> (bool, String) {
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
            return (status.success(), output_text(&out));
        }
        if started.elapsed() > TURN {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("the agent took over {TURN:?}:\n{}", output_text(&out));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// serve on Gemma 3 270M with the context an agent's prompt needs. A reply with no
/// `max_tokens` of its own (the Codex CLI sends none) ends after 48 tokens (llama-server's
/// `-n`), where the model would otherwise write on to the end of the context.
fn serve_gemma() -> Serve {
    let gemma = installed_model("gemma-3-270m-Q4_K_M.gguf");
    serve_cpu_with_env(
        &gemma,
        &["--ctx-size", "32768", "--parallel", "1", "--alias", SERVED],
        &[
            ("ONEBIT_LOG", "info,onebit::request=debug"),
            // llama-server's `-n`, through the environment serve passes on.
            ("LLAMA_ARG_N_PREDICT", "48"),
        ],
    )
}

/// A fresh home for an agent, so it reads no one's settings and writes nowhere else.
fn home(name: &str) -> PathBuf {
    let home = temp_dir(name);
    std::fs::create_dir_all(&home).unwrap();
    home
}

#[test]
fn claude_code_takes_one_turn_through_serve() {
    let _turn = one_at_a_time();
    let claude = agent_program("claude");
    let serve = serve_gemma();
    let recorder = Recorder::start(serve.port);
    let home = home("claude-home");
    let mut command = Command::new(&claude);
    command
        .args(["-p", "Say hello in one word."])
        .current_dir(&home)
        .env("HOME", &home)
        .env("ANTHROPIC_BASE_URL", recorder.url())
        .env("ANTHROPIC_API_KEY", "any")
        .env("ANTHROPIC_MODEL", SERVED)
        .env("ANTHROPIC_SMALL_FAST_MODEL", SERVED)
        .env("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "48")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    let (ok, said) = run_bounded(command);
    let seen = recorder.take();
    let paths = every_request_answered_whole(&seen, &serve);
    eprintln!("claude -p: exit ok {ok}; requests: {paths:?}\n{said}");
    assert!(
        paths.iter().any(|p| p.starts_with("POST /v1/messages")),
        "{paths:?}"
    );
    // A reply that reaches the limit is Claude Code's error, after its retries: the model
    // does not stop where an agent's model would, which is its limit, not serve's.
    assert!(
        ok || said.contains("exceeded the 48 output token maximum"),
        "claude -p failed:\n{said}\n{}",
        serve.output()
    );
}

#[test]
fn the_codex_cli_takes_one_turn_through_serve() {
    let _turn = one_at_a_time();
    let codex = agent_program("codex");
    let serve = serve_gemma();
    let recorder = Recorder::start(serve.port);
    let home = home("codex-home");
    let codex_home = home.join("codex");
    std::fs::create_dir_all(&codex_home).unwrap();
    write_codex_config(&codex_home, &recorder.url());
    let mut command = Command::new(&codex);
    command
        .args(["exec", "--skip-git-repo-check", "Say hello in one word."])
        .current_dir(&home)
        .env("HOME", &home)
        .env("CODEX_HOME", &codex_home)
        .env("OPENAI_API_KEY", "any");
    let (ok, said) = run_bounded(command);
    let seen = recorder.take();
    let paths = every_request_answered_whole(&seen, &serve);
    eprintln!("codex exec: exit ok {ok}; requests: {paths:?}\n{said}");
    assert!(
        paths.iter().any(|p| p.starts_with("POST /v1/responses")),
        "{paths:?}"
    );
    assert!(ok, "codex exec failed:\n{said}\n{}", serve.output());
}

/// The Codex CLI's configuration: serve as a custom provider on the Responses API.
fn write_codex_config(codex_home: &Path, base: &str) {
    let config = format!(
        "model = \"{SERVED}\"\nmodel_provider = \"local\"\n\n[model_providers.local]\n\
         name = \"1bit serve\"\nbase_url = \"{base}/v1\"\nwire_api = \"responses\"\n\
         env_key = \"OPENAI_API_KEY\"\n"
    );
    std::fs::write(codex_home.join("config.toml"), config).unwrap();
}

#[test]
fn a_cut_stream_is_not_whole() {
    let head =
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n";
    let mut reply = head.to_vec();
    reply.extend_from_slice(b"17\r\nevent: message_stop\r\n\r\n\r\n0\r\n\r\n");
    let (status, _, body) = whole("POST", &reply).unwrap();
    assert_eq!(
        (status, events(&body)),
        (200, vec!["message_stop".to_string()])
    );
    let cut = &reply[..reply.len() - 5];
    assert!(whole("POST", cut).is_err());
    let short = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345";
    assert!(whole("POST", short).is_err());
}
