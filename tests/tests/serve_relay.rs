//! The relay's two engines on one connection: plain proxied requests on the fast engine
//! (host/relay/src/fast/mod.rs), everything else handed to the general one (relay/general.rs),
//! with keep-alive, pipelining, a backend that closes its connections, streams and a backend
//! that dies. Each test checks, in `onebit_requests_total`, which engine carried what.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use onebit_tests::*;

const SECS: fn(u64) -> Duration = Duration::from_secs;
const TOKENIZE: &str = r#"{"content":"hello world"}"#;

fn tokenize_request(extra_headers: &str) -> String {
    format!(
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra_headers}Content-Length: {}\r\n\r\n{TOKENIZE}",
        TOKENIZE.len()
    )
}

/// One reply from a kept-alive connection: (status, lowercase head, body). Reads exactly the
/// reply's bytes (Content-Length or chunked), so the next reply stays in `pending`.
fn read_reply(tcp: &mut TcpStream, pending: &mut Vec<u8>) -> (u16, String, Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let mut fill = |pending: &mut Vec<u8>| {
        let n = tcp.read(&mut chunk).expect("a reply");
        assert!(n > 0, "the connection closed mid-reply");
        pending.extend_from_slice(&chunk[..n]);
    };
    let head_end = loop {
        if let Some(p) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        fill(pending);
    };
    let head = String::from_utf8_lossy(&pending[..head_end]).to_ascii_lowercase();
    let status = status_of(&head);
    pending.drain(..head_end);
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap());
    let body = if let Some(n) = length {
        while pending.len() < n {
            fill(pending);
        }
        pending.drain(..n).collect()
    } else {
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(p) = pending.windows(2).position(|w| w == b"\r\n") {
                    break p;
                }
                fill(pending);
            };
            let size_text = String::from_utf8_lossy(&pending[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
                .expect("a chunk size");
            while pending.len() < line_end + 2 + size + 2 {
                fill(pending);
            }
            body.extend_from_slice(&pending[line_end + 2..line_end + 2 + size]);
            pending.drain(..line_end + 2 + size + 2);
            if size == 0 {
                break body;
            }
        }
    };
    (status, head, body)
}

/// Read a streamed reply to its end (the connection's close, or with `chunked_end` the last
/// chunk), noting for each event stamped `fake_sent_ns` (sent by the backend, received here),
/// in ns since the epoch. Returns them and everything read.
fn events_as_they_arrive(
    tcp: &mut TcpStream,
    chunked_end: Option<()>,
) -> (Vec<(u64, u64)>, Vec<u8>) {
    let mut events: Vec<(u64, u64)> = Vec::new();
    let mut text = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if chunked_end.is_some() && text.ends_with(b"\r\n0\r\n\r\n") {
            break;
        }
        let n = tcp.read(&mut chunk).unwrap();
        if n == 0 {
            break;
        }
        let received = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        text.extend_from_slice(&chunk[..n]);
        let seen = String::from_utf8_lossy(&text);
        let mut sent_so_far = Vec::new();
        for rest in seen.split("\"fake_sent_ns\":").skip(1) {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if digits.len() == rest.len() {
                break; // the read ended inside the number
            }
            sent_so_far.push(digits.parse::<u64>().unwrap());
        }
        for &sent in &sent_so_far[events.len()..] {
            events.push((sent, received));
        }
    }
    (events, text)
}

/// Each event reached the client before the backend sent the next one.
fn none_held_back(events: &[(u64, u64)]) {
    for (i, pair) in events.windows(2).enumerate() {
        assert!(
            pair[0].1 < pair[1].0,
            "event {i} arrived {} ms after event {} was sent: held back",
            (pair[0].1 as f64 - pair[1].0 as f64) / 1e6,
            i + 1
        );
    }
}

/// serve on the cpu route with `script` (a Python backend taking llama-server's command line)
/// as its llama-server, ready.
fn serve_on_script(
    dir: &std::path::Path,
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Serve {
    let backend = dir.join("backend.py");
    executable(&backend, script);
    let serve = serve_cpu_engine(dir, &backend, args, env);
    serve.ready();
    serve
}

fn connect(port: u16) -> TcpStream {
    let tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(SECS(10))).unwrap();
    tcp
}

#[test]
fn kept_alive_requests_go_on_when_the_backend_closes_its_connections() {
    let dir = temp_dir("relay-close");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    // Every third reply closes the backend's connection, as llama-server does after 100.
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("FAKE_CLOSE_EVERY", "3"),
            ("FAKE_RECORD", record.to_str().unwrap()),
        ],
    );
    serve.ready();
    let mut tcp = connect(serve.port);
    let mut pending = Vec::new();
    for i in 0..12 {
        tcp.write_all(tokenize_request("").as_bytes()).unwrap();
        let (status, head, body) = read_reply(&mut tcp, &mut pending);
        assert_eq!(status, 200, "request {i}: {head}");
        assert!(!head.contains("connection: close"), "request {i}: {head}");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["tokens"].as_array().map(Vec::len), Some(2), "request {i}");
    }
    // Each request reached the backend once: none was lost, none was sent twice.
    let tokenized = json_lines(&record)
        .into_iter()
        .filter(|l| l["path"] == "/tokenize")
        .count();
    assert_eq!(tokenized, 12);
    assert_eq!(
        requests_total(&serve, &[("path_class", "other"), ("engine", "fast")]),
        12
    );
}

#[test]
fn pipelined_requests_are_answered_in_order_across_both_paths() {
    let dir = temp_dir("relay-pipeline");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let mut tcp = connect(serve.port);
    // A relayed request, one serve answers itself (so the connection changes paths), and a
    // relayed one again, in one write.
    let mut burst = tokenize_request("");
    burst.push_str("GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n");
    burst.push_str(&tokenize_request("Connection: close\r\n"));
    tcp.write_all(burst.as_bytes()).unwrap();
    let mut pending = Vec::new();
    let (s1, _, b1) = read_reply(&mut tcp, &mut pending);
    let (s2, _, b2) = read_reply(&mut tcp, &mut pending);
    let (s3, h3, b3) = read_reply(&mut tcp, &mut pending);
    assert_eq!((s1, s2, s3), (200, 200, 200));
    assert!(String::from_utf8_lossy(&b1).contains("tokens"));
    assert_eq!(String::from_utf8_lossy(&b2), r#"{"status":"ok"}"#);
    assert!(String::from_utf8_lossy(&b3).contains("tokens"));
    assert!(h3.contains("connection: close"), "{h3}");
    let mut rest = Vec::new();
    let _ = tcp.read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "nothing after the last reply, then the end"
    );
    // The first on the fast engine; /health hands the connection to the general engine,
    // which keeps it, so the third is the general engine's.
    assert_eq!(
        requests_total(&serve, &[("path_class", "other"), ("engine", "fast")]),
        1
    );
    assert_eq!(
        requests_total(&serve, &[("path_class", "other"), ("engine", "general")]),
        1
    );
}

#[test]
fn a_client_that_asks_to_close_gets_its_reply_then_the_end() {
    let dir = temp_dir("relay-close-client");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    // `raw` reads to the end of the connection: it returns only because serve closes it.
    let (status, reply) = raw(
        serve.port,
        tokenize_request("Connection: close\r\n").as_bytes(),
        SECS(10),
    );
    assert_eq!(status, 200, "{reply}");
    assert!(
        reply.to_ascii_lowercase().contains("connection: close"),
        "{reply}"
    );
    assert!(reply.ends_with("]}"), "{reply}");
}

#[test]
fn hop_by_hop_headers_stay_on_the_client_hop() {
    let dir = temp_dir("relay-hop");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&model, &[], &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    let (status, reply) = raw(
        serve.port,
        tokenize_request(
            "Connection: close, X-Secret\r\nKeep-Alive: timeout=5\r\nProxy-Authorization: Basic eA==\r\nTE: trailers\r\nX-Secret: for this hop\r\nX-Trace: 7\r\n",
        )
        .as_bytes(),
        SECS(10),
    );
    assert_eq!(status, 200, "{reply}");
    let seen = json_lines(&record)
        .into_iter()
        .find(|l| l["path"] == "/tokenize")
        .expect("the request reached the backend");
    let headers = &seen["headers"];
    // The hop-by-hop headers, and X-Secret, which the client's Connection header names.
    for gone in [
        "connection",
        "keep-alive",
        "proxy-authorization",
        "te",
        "x-secret",
    ] {
        assert!(
            headers.get(gone).is_none(),
            "{gone} was forwarded: {headers}"
        );
    }
    assert_eq!(headers["x-trace"], "7", "{headers}");
    assert_eq!(headers["content-length"], TOKENIZE.len().to_string());
    assert!(
        headers["host"]
            .as_str()
            .unwrap_or("")
            .starts_with("127.0.0.1:"),
        "{headers}"
    );
}

/// Read a stream from a fake backend that sends content event N only once `gate` holds a file
/// named N (`FAKE_SSE_GATE`): each event seen here opens the gate for the next, so `events`
/// events arrive only if serve passes each on before the backend has written the next one.
/// Returns everything read.
fn read_through_gate(tcp: &mut TcpStream, gate: &std::path::Path, events: usize) -> Vec<u8> {
    let mut text = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut seen = 0;
    while seen < events {
        let n = match tcp.read(&mut chunk) {
            Ok(0) => panic!(
                "the stream ended after {seen} events: {}",
                String::from_utf8_lossy(&text)
            ),
            Ok(n) => n,
            Err(e) => panic!(
                "event {seen} did not reach the client within 10 s, though the backend sent it and waits for the client to get it before the next ({e}): held back; got {}",
                String::from_utf8_lossy(&text)
            ),
        };
        text.extend_from_slice(&chunk[..n]);
        let now = String::from_utf8_lossy(&text)
            .matches("\"fake_sent_ns\":")
            .count();
        for next in seen + 1..=now {
            std::fs::write(gate.join(next.to_string()), "").unwrap();
        }
        seen = now;
    }
    text
}

#[test]
fn streamed_events_arrive_one_by_one_as_the_backend_sends_them() {
    let dir = temp_dir("relay-events");
    let model = dummy_model(&dir, "m.gguf");
    let gate = dir.join("gate");
    std::fs::create_dir_all(&gate).unwrap();
    // The backend sends each event only once the client got the one before: no clock decides.
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("FAKE_SSE_EVENTS", "6"),
            ("FAKE_SSE_INTERVAL_MS", "0"),
            ("FAKE_SSE_GATE", gate.to_str().unwrap()),
        ],
    );
    serve.ready();
    let body = r#"{"stream":true,"messages":[{"role":"user","content":"count"}]}"#;
    let mut tcp = connect(serve.port);
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let text = read_through_gate(&mut tcp, &gate, 6);
    assert!(
        String::from_utf8_lossy(&text).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&text)
    );
    assert_eq!(
        requests_total(&serve, &[("path_class", "chat"), ("engine", "fast")]),
        1
    );
}

#[test]
fn a_body_written_apart_from_its_head_is_relayed() {
    let dir = temp_dir("relay-split");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&model, &[], &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    let mut tcp = connect(serve.port);
    let mut pending = Vec::new();
    let engine = |e| requests_total(&serve, &[("path_class", "other"), ("engine", e)]);
    // Written at once after the head and 20 ms later (as many clients write it), and after a
    // pause far longer than the fast engine's 100 ms wait for a body (the general engine then
    // takes it). Which engine carries each is judged by the gap this side measured: the body
    // reached serve's socket at most that long after the head, and serve's wait starts no
    // earlier than its read of the head, so a gap under 100 ms is the fast engine's however
    // busy the machine.
    for pause in [0, 20, 2000] {
        let request = tokenize_request("");
        let (head, body) = request.split_at(request.len() - TOKENIZE.len());
        let (fast_before, general_before) = (engine("fast"), engine("general"));
        tcp.write_all(head.as_bytes()).unwrap();
        let written = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(pause));
        tcp.write_all(body.as_bytes()).unwrap();
        let gap = written.elapsed();
        let (status, head, body) = read_reply(&mut tcp, &mut pending);
        assert_eq!(status, 200, "after {pause} ms: {head}");
        assert!(
            String::from_utf8_lossy(&body).contains("tokens"),
            "after {pause} ms"
        );
        let carried = (
            engine("fast") - fast_before,
            engine("general") - general_before,
        );
        if pause < 100 && gap < Duration::from_millis(100) {
            assert_eq!(
                carried,
                (1, 0),
                "a body {gap:?} after its head: the fast engine's"
            );
        } else if pause > 0 {
            assert_eq!(
                carried,
                (0, 1),
                "a body {gap:?} after its head: the general engine's"
            );
        }
    }
    let bodies: Vec<String> = json_lines(&record)
        .into_iter()
        .filter(|l| l["path"] == "/tokenize")
        .map(|l| l["body"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(bodies, vec![TOKENIZE.to_string(); 3]);
}

#[test]
fn a_trickled_body_is_timed_as_a_whole() {
    let dir = temp_dir("relay-trickle");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[("ONEBIT_BODY_READ_TIMEOUT_S", "1")]);
    serve.ready();
    // 64 bytes, one every 50 ms: each comes soon after the last, the whole takes 3.2 s.
    let body = format!(r#"{{"content":"{}"}}"#, "x".repeat(50));
    let mut tcp = connect(serve.port);
    write!(
        tcp,
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let started = std::time::Instant::now();
    for byte in body.bytes() {
        if tcp.write_all(&[byte]).is_err() {
            break; // refused and closed
        }
        std::thread::sleep(Duration::from_millis(50));
        if started.elapsed() > SECS(2) {
            break;
        }
    }
    let mut reply = String::new();
    let _ = tcp.read_to_string(&mut reply);
    assert_eq!(status_of(&reply), 408, "{reply}");
    // The body timeout counts from the head (plus the fast path's 100 ms), not per byte.
    assert!(
        started.elapsed() < Duration::from_millis(1900),
        "refused after {:?}",
        started.elapsed()
    );
}

#[test]
fn a_client_that_expects_100_continue_gets_it_then_the_reply() {
    let dir = temp_dir("relay-expect");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let mut tcp = connect(serve.port);
    // As curl sends a larger body: the head, then the body only after 100 Continue.
    write!(
        tcp,
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        TOKENIZE.len()
    )
    .unwrap();
    let mut pending = Vec::new();
    let mut chunk = [0u8; 256];
    while !String::from_utf8_lossy(&pending).contains("\r\n\r\n") {
        let n = tcp.read(&mut chunk).expect("100 Continue");
        assert!(n > 0, "closed before 100 Continue");
        pending.extend_from_slice(&chunk[..n]);
    }
    let interim = String::from_utf8_lossy(&pending).to_string();
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    let end = interim.find("\r\n\r\n").unwrap() + 4;
    pending.drain(..end);
    tcp.write_all(TOKENIZE.as_bytes()).unwrap();
    let (status, head, body) = read_reply(&mut tcp, &mut pending);
    assert_eq!(status, 200, "{head}");
    assert!(String::from_utf8_lossy(&body).contains("tokens"));
}

#[test]
fn a_backend_that_dies_before_a_plain_reply_gets_502() {
    let dir = temp_dir("relay-502");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let (status, body) = post(&serve.url("/tokenize"), r#"{"content":"fake_exit"}"#);
    assert_eq!(status, 502, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "server_error", "{body}");
    assert!(body.contains("did not answer"), "{body}");
    let exit = serve.wait_exit(SECS(10)).expect("serve exits");
    assert_eq!(exit.code(), Some(1), "{}", serve.output());
}

#[test]
fn each_request_is_counted_under_the_engine_that_carried_it() {
    let dir = temp_dir("relay-engines");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let chat = |stream: bool| {
        format!(r#"{{"stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#)
    };
    // A plain request and a streamed chat: nothing to rewrite, the fast engine's.
    assert_eq!(post(&serve.url("/tokenize"), TOKENIZE).0, 200);
    assert!(!sse(&serve.url("/v1/chat/completions"), &chat(true)).is_empty());
    // A whole chat reply gets the served name, written by the fast engine (the README's chat).
    let (status, body) = post(&serve.url("/v1/chat/completions"), &chat(false));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""model":"m""#), "{body}");
    // The same chat with its body in chunks: the general engine's.
    let chunked = raw_json_post(serve.port, "/v1/chat/completions", &chat(false), true);
    let (status, reply) = raw(serve.port, &chunked, SECS(10));
    assert_eq!(status, 200, "{reply}");
    // A refusal (an unknown path) is the general engine's too.
    assert_eq!(post(&serve.url("/v1/nothing"), "{}").0, 404);
    let fast = |class| requests_total(&serve, &[("path_class", class), ("engine", "fast")]);
    let general = |class| requests_total(&serve, &[("path_class", class), ("engine", "general")]);
    assert_eq!((fast("other"), general("other")), (1, 1));
    assert_eq!((fast("chat"), general("chat")), (2, 1));
    assert_eq!(
        requests_total(
            &serve,
            &[
                ("path_class", "other"),
                ("status_class", "4xx"),
                ("engine", "general")
            ]
        ),
        1
    );
    // serve's added time is measured for what each engine relayed (not the refusal).
    let (_, text) = get(&serve.url("/metrics"));
    for (engine, relayed) in [("fast", 3.0), ("general", 1.0)] {
        let count = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "onebit_request_added_seconds_count{{engine=\"{engine}\"}} "
                ))
            })
            .and_then(|v| v.trim().parse::<f64>().ok());
        assert_eq!(count, Some(relayed), "{engine}: {text}");
    }
}

/// `ONEBIT_FAST_ENGINE=0`: the requests the fast engine carries (a plain one, a streamed chat)
/// go on the general engine, answered alike; anything else than `0` leaves the fast engine on.
#[test]
fn fast_engine_0_carries_every_request_on_the_general_engine() {
    let dir = temp_dir("relay-general-only");
    let model = dummy_model(&dir, "m.gguf");
    for (value, engine) in [("0", "general"), ("1", "fast")] {
        let serve = Serve::with_fake(&model, &[], &[("ONEBIT_FAST_ENGINE", value)]);
        serve.ready();
        assert_eq!(post(&serve.url("/tokenize"), TOKENIZE).0, 200);
        let events = sse(
            &serve.url("/v1/chat/completions"),
            r#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        );
        assert!(events.iter().any(|e| e.contains("[DONE]")), "{events:?}");
        for class in ["other", "chat"] {
            assert_eq!(
                requests_total(&serve, &[("path_class", class), ("engine", engine)]),
                1,
                "ONEBIT_FAST_ENGINE={value}: {class} on the {engine} engine"
            );
        }
    }
}

/// A backend in the manner of Python's http.server: HTTP/1.0 replies with no Content-Length,
/// each ending at the connection's close; a stream's events 150 ms apart. It takes
/// llama-server's command line and answers /health; /slots is 404 (no progress route), so the
/// watchdog sees progress only in the relayed bytes.
const HTTP10_BACKEND: &str = r#"#!/usr/bin/env python3
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path != "/health":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        self.send_response(200)
        if body.get("stream"):
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(12):
                event = {"model": "py", "choices": [{"delta": {"content": "t%d" % i}}],
                         "fake_sent_ns": time.time_ns()}
                self.wfile.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.15)
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"model": "py", "path": self.path}).encode())

args = sys.argv[1:]
host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
ThreadingHTTPServer((host, int(args[args.index("--port") + 1])), Handler).serve_forever()
"#;

#[test]
fn a_stream_from_an_http10_backend_that_ends_at_its_close_is_relayed_event_by_event() {
    let dir = temp_dir("relay-http10");
    // A one-second watchdog: the 1.8 s stream lives only if each read stamps its ticket.
    let serve = serve_on_script(&dir, HTTP10_BACKEND, &["--watchdog", "1"], &[]);
    let body = r#"{"stream":true,"messages":[{"role":"user","content":"count"}]}"#;
    let mut tcp = connect(serve.port);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).unwrap();
    let (events, text) = events_as_they_arrive(&mut tcp, Some(()));
    let text = String::from_utf8_lossy(&text).to_string();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // Framed for the HTTP/1.1 client: chunked, ended by the last chunk, kept alive.
    let head = text[..text.find("\r\n\r\n").unwrap()].to_ascii_lowercase();
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(events.len(), 12, "{text}");
    none_held_back(&events);
    // The same connection carries the next request (a whole reply to its close, named by the
    // fast engine).
    let chat = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{chat}",
        chat.len()
    )
    .unwrap();
    let mut pending = Vec::new();
    let (status, head, reply) = read_reply(&mut tcp, &mut pending);
    assert_eq!(status, 200, "{head}");
    let v: serde_json::Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(v["model"], "m", "the served name: {v}");
    // The stream and the whole reply went on the fast engine.
    let chats = |engine| {
        requests_total(
            &serve,
            &[
                ("path_class", "chat"),
                ("status_class", "2xx"),
                ("engine", engine),
            ],
        )
    };
    assert_eq!((chats("fast"), chats("general")), (2, 0));
    assert!(!serve.output().contains("watchdog"), "{}", serve.output());
}

/// A keep-alive backend on a raw socket, to put the fast engine's pool in the two cases of a
/// connection the backend closes under a request. `PY_MODE=reset`: the first POST on each
/// connection is answered after 300 ms, a later one is refused unread (the connection closed
/// with it in the buffer, which the kernel answers with a reset). `PY_MODE=hangup`: a POST
/// whose body says `hangup` is read whole, then the connection closed with no reply. Each POST
/// it reads is a line in `PY_RECORD`.
const POOL_BACKEND: &str = r#"#!/usr/bin/env python3
import os, socket, sys, threading, time

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = os.environ["PY_MODE"]
record = os.environ["PY_RECORD"]
lock = threading.Lock()

def reply(conn, status, body):
    conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (status, len(body), body))

def serve(conn):
    posts, buf = 0, b""
    while True:
        if mode == "reset" and posts >= 1 and not buf:
            if not conn.recv(1, socket.MSG_PEEK):
                break
            conn.close()
            return
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                conn.close()
                return
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path = lines[0].split(" ")[:2]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        while len(rest) < length:
            rest += conn.recv(65536)
        body, buf = rest[:length], rest[length:]
        if path == "/health":
            reply(conn, 200, b'{"status":"ok"}')
            continue
        if method != "POST":
            reply(conn, 404, b"{}")
            continue
        with lock:
            with open(record, "ab") as f:
                f.write(path.encode() + b" " + body + b"\n")
        if b"hangup" in body:
            conn.shutdown(socket.SHUT_WR)
            time.sleep(0.2)
            conn.close()
            return
        posts += 1
        if mode == "reset" and posts == 1:
            time.sleep(0.3)
        reply(conn, 200, b'{"tokens":[1,2]}')
    conn.close()

listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(64)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"#;

fn serve_on_pool_backend(mode: &str, dir: &std::path::Path) -> (Serve, std::path::PathBuf) {
    let record = dir.join("record.txt");
    let env = [("PY_MODE", mode), ("PY_RECORD", record.to_str().unwrap())];
    (serve_on_script(dir, POOL_BACKEND, &[], &env), record)
}

fn tokenize_lines(record: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(record)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("/tokenize "))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_request_refused_unread_on_a_reused_connection_is_retried_once_on_a_new_one() {
    let dir = temp_dir("relay-pool-reset");
    let (serve, record) = serve_on_pool_backend("reset", &dir);
    // Two requests at once leave two idle connections in the pool, each of which the backend
    // will refuse its next request on.
    let url = serve.url("/tokenize");
    let both: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || post(&url, TOKENIZE).0)
        })
        .collect();
    for request in both {
        assert_eq!(request.join().unwrap(), 200);
    }
    // The third takes an idle connection, is refused unread, and goes again on a new
    // connection (not on the other idle one, which would refuse it too).
    let (status, body) = post(&url, TOKENIZE);
    assert_eq!(status, 200, "{body}\n{}", serve.output());
    assert_eq!(tokenize_lines(&record).len(), 3);
    assert_eq!(
        requests_total(&serve, &[("path_class", "other"), ("engine", "fast")]),
        3
    );
}

#[test]
fn a_request_the_backend_read_before_closing_is_never_sent_twice() {
    let dir = temp_dir("relay-pool-hangup");
    let (serve, record) = serve_on_pool_backend("hangup", &dir);
    let url = serve.url("/tokenize");
    // A reused connection (the first request leaves it in the pool) ...
    assert_eq!(post(&url, TOKENIZE).0, 200);
    // ... on which the backend reads the request, then closes without a reply.
    let (status, body) = post(&url, r#"{"content":"hangup"}"#);
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("did not answer"), "{body}");
    let hangups = tokenize_lines(&record)
        .iter()
        .filter(|l| l.contains("hangup"))
        .count();
    assert_eq!(hangups, 1, "the backend got the request {hangups} times");
}
