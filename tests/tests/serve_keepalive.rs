//! SSE keep-alive: a stream whose backend is silent (a long prefill, a slow token) gets
//! `: keep-alive` comments, each its own chunk and between events, on both relay engines (the
//! fast path, and the general path a chunked request body goes to); counted in /metrics.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use onebit_tests::*;

const KEEPALIVE: &str = ": keep-alive\n\n";

/// The engine that carried the one chat request `serve` was sent: a whole body stays on the
/// fast engine, a chunked one goes to the general engine. Checked, so a test of one path
/// cannot pass on the other.
fn assert_carried_by(serve: &Serve, chunked_body: bool) {
    let engine = if chunked_body { "general" } else { "fast" };
    let chats = |e| requests_total(serve, &[("path_class", "chat"), ("engine", e)]);
    assert_eq!(
        (chats("fast"), chats("general")),
        if chunked_body { (0, 1) } else { (1, 0) },
        "the chat should have gone to the {engine} engine"
    );
}

/// A streamed chat request as raw HTTP/1.1, with its body sent whole (the fast path) or in
/// chunks (the general path).
fn request(port: u16, content: &str, chunked_body: bool) -> Vec<u8> {
    let body = format!(r#"{{"stream":true,"messages":[{{"role":"user","content":"{content}"}}]}}"#);
    raw_json_post(port, "/v1/chat/completions", &body, chunked_body)
}

/// What the client got: the head, each chunk's bytes in order, and when the first byte came.
struct Reply {
    head: String,
    chunks: Vec<String>,
    first_byte: Duration,
    /// The body ended with its last (empty) chunk.
    complete: bool,
}

fn send(port: u16, raw: &[u8]) -> Reply {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let began = Instant::now();
    tcp.write_all(raw).unwrap();
    let mut bytes = Vec::new();
    let mut first_byte = None;
    let mut buf = [0u8; 4096];
    while let Ok(n) = tcp.read(&mut buf) {
        if n == 0 {
            break;
        }
        first_byte.get_or_insert_with(|| began.elapsed());
        bytes.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, mut rest) = text.split_once("\r\n\r\n").expect("a reply head");
    assert!(
        head.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    let mut chunks = Vec::new();
    let mut complete = false;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if size == 0 {
            complete = true;
            break;
        }
        chunks.push(after[..size].to_string());
        rest = &after[size + 2..];
    }
    Reply {
        head: head.to_string(),
        chunks,
        first_byte: first_byte.unwrap_or_default(),
        complete,
    }
}

/// Every comment is a chunk of its own, at an event boundary.
fn assert_between_events(reply: &Reply) -> usize {
    let mut so_far = String::new();
    let mut comments = 0;
    for chunk in &reply.chunks {
        if chunk.contains(": keep-alive") {
            assert_eq!(chunk, KEEPALIVE, "a comment shares its chunk");
            assert!(
                so_far.is_empty() || so_far.ends_with("\n\n"),
                "a comment inside an event: {so_far:?}"
            );
            comments += 1;
        }
        so_far.push_str(chunk);
    }
    comments
}

fn keepalives_counted(serve: &Serve) -> f64 {
    let (_, text) = get(&serve.url("/metrics"));
    sample(&parse_prometheus(&text), "onebit_sse_keepalives_total", &[]).unwrap_or(-1.0)
}

fn long_prefill_is_kept_alive(chunked_body: bool) {
    let dir = temp_dir("keepalive");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--sse-keepalive-s", "1"], &[]);
    serve.ready();
    let reply = send(
        serve.port,
        &request(serve.port, "fake_slow_ms=3600", chunked_body),
    );
    assert!(reply.head.starts_with("HTTP/1.1 200"), "{}", reply.head);
    assert!(reply.head.contains("text/event-stream"), "{}", reply.head);
    assert!(
        reply.first_byte < Duration::from_millis(2500),
        "nothing for {:?}",
        reply.first_byte
    );
    let comments = assert_between_events(&reply);
    assert!(
        (3..=4).contains(&comments),
        "{comments} comments: {:?}",
        reply.chunks
    );
    let body: String = reply.chunks.concat();
    assert!(body.contains("data: {"), "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(reply.complete);
    assert_eq!(keepalives_counted(&serve), comments as f64);
    assert_carried_by(&serve, chunked_body);
}

#[test]
fn a_long_prefill_is_kept_alive_on_the_fast_path() {
    long_prefill_is_kept_alive(false);
}

#[test]
fn a_long_prefill_is_kept_alive_on_the_general_path() {
    long_prefill_is_kept_alive(true);
}

fn slow_tokens_are_kept_alive_between_events(chunked_body: bool) {
    let dir = temp_dir("keepalive-mid");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(
        &model,
        &["--sse-keepalive-s", "1"],
        &[("FAKE_SSE_EVENTS", "3"), ("FAKE_SSE_INTERVAL_MS", "1500")],
    );
    serve.ready();
    let reply = send(serve.port, &request(serve.port, "hello", chunked_body));
    assert!(reply.head.starts_with("HTTP/1.1 200"), "{}", reply.head);
    let comments = assert_between_events(&reply);
    assert!(comments >= 2, "{comments} comments: {:?}", reply.chunks);
    assert!(reply.chunks.concat().ends_with("data: [DONE]\n\n"));
    assert_carried_by(&serve, chunked_body);
}

#[test]
fn slow_tokens_are_kept_alive_between_events_on_both_paths() {
    slow_tokens_are_kept_alive_between_events(false);
    slow_tokens_are_kept_alive_between_events(true);
}

fn a_refusal_after_the_stream_began_is_one_error_event(chunked_body: bool) {
    let dir = temp_dir("keepalive-err");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--sse-keepalive-s", "1"], &[]);
    serve.ready();
    let reply = send(
        serve.port,
        &request(
            serve.port,
            "fake_slow_ms=1800 fake_status=400",
            chunked_body,
        ),
    );
    assert!(reply.head.starts_with("HTTP/1.1 200"), "{}", reply.head);
    let body: String = reply.chunks.concat();
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{body}");
    assert_eq!(events[0], ": keep-alive");
    let error: serde_json::Value =
        serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(
        error["error"]["message"], "fake_status=400 requested",
        "{body}"
    );
    assert!(!body.contains("[DONE]"), "{body}");
    assert!(reply.complete);
    assert_carried_by(&serve, chunked_body);
}

#[test]
fn a_refusal_after_the_stream_began_is_one_error_event_on_both_paths() {
    a_refusal_after_the_stream_began_is_one_error_event(false);
    a_refusal_after_the_stream_began_is_one_error_event(true);
}

#[test]
fn zero_turns_keep_alive_off() {
    let dir = temp_dir("keepalive-off");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--sse-keepalive-s", "0"], &[]);
    serve.ready();
    let reply = send(serve.port, &request(serve.port, "fake_slow_ms=2200", false));
    assert!(
        reply.first_byte >= Duration::from_millis(2100),
        "{:?}",
        reply.first_byte
    );
    assert_eq!(assert_between_events(&reply), 0, "{:?}", reply.chunks);
    assert_eq!(keepalives_counted(&serve), 0.0);
}

#[test]
fn a_whole_chat_in_router_mode_gets_its_json_and_no_comments() {
    // In router mode serve does not name the model in replies, so the fast engine carries a
    // whole chat too; a silent backend must not turn its reply into an event stream.
    let fake = fake_backend();
    let serve = Serve::start(
        &[
            "--llama-router",
            "--device",
            "cpu",
            "--llama-server",
            fake.to_str().unwrap(),
            "--sse-keepalive-s",
            "1",
        ],
        &[],
    );
    serve.ready();
    let body = r#"{"messages":[{"role":"user","content":"fake_slow_ms=2500"}]}"#;
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        serve.port,
        body.len()
    );
    let mut tcp = TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    tcp.write_all(raw.as_bytes()).unwrap();
    let mut text = String::new();
    let _ = tcp.read_to_string(&mut text);
    let (head, body) = text.split_once("\r\n\r\n").expect("a reply head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("application/json"),
        "not the backend's JSON head: {head}"
    );
    assert!(!body.contains(KEEPALIVE), "{body:?}");
    assert!(body.contains(r#""choices""#), "{body}");
    assert_eq!(keepalives_counted(&serve), 0.0);
}
