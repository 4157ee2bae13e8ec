//! Faults: a client that leaves mid-stream, a backend that dies mid-stream, serve SIGKILLed
//! under load; each with what the other clients, the backend and the process table see.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::*;

const SECS: fn(u64) -> Duration = Duration::from_secs;
const LONG: &str = r#"{"stream":true,"messages":[{"role":"user","content":"a long story"}]}"#;

/// Start a streamed chat on a raw connection and read until `events` data lines have come;
/// the reader is returned so the caller can go on reading or drop it.
fn open_stream(port: u16, events: usize) -> BufReader<TcpStream> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(SECS(20))).unwrap();
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{LONG}",
        LONG.len()
    )
    .unwrap();
    let mut reader = BufReader::new(tcp);
    let mut seen = 0;
    let mut line = String::new();
    while seen < events {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
        if line.starts_with("data: ") {
            seen += 1;
        }
    }
    reader
}

fn processing(serve: &Serve) -> bool {
    let (status, body) = get(&serve.url("/slots"));
    assert_eq!(status, 200, "{body}");
    body.contains("\"is_processing\":true")
}

#[test]
fn a_client_that_leaves_mid_stream_stops_its_generation_and_others_are_served() {
    let dir = temp_dir("leave");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[("FAKE_SSE_EVENTS", "100000"), ("FAKE_SSE_INTERVAL_MS", "5")],
    );
    serve.ready();
    let leaving = open_stream(serve.port, 5);
    assert!(processing(&serve));
    // Another client, served whole meanwhile.
    let events = sse(
        &serve.url("/v1/chat/completions"),
        r#"{"stream":true,"max_tokens":10,"messages":[{"role":"user","content":"short"}]}"#,
    );
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        events.len(),
        12,
        "10 chunks, the final one, [DONE]: {events:?}"
    );
    drop(leaving);
    assert!(
        wait_until(SECS(5), || !processing(&serve)),
        "the backend still generates for a client that left"
    );
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"max_tokens":3,"messages":[{"role":"user","content":"after"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_backend_that_dies_mid_stream_cuts_the_stream_without_done_and_serve_exits_1() {
    let dir = temp_dir("die");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &[],
        &[("FAKE_SSE_EVENTS", "100000"), ("FAKE_SSE_INTERVAL_MS", "5")],
    );
    serve.ready();
    let backends = serve.children();
    assert_eq!(backends.len(), 1, "{backends:?}");
    let mut reader = open_stream(serve.port, 5);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(backends[0] as i32),
        Signal::SIGKILL,
    );
    let mut rest = Vec::new();
    let read = reader.read_to_end(&mut rest);
    let rest = String::from_utf8_lossy(&rest);
    assert!(read.is_ok(), "serve closed the connection: {read:?}");
    assert!(!rest.contains("[DONE]"), "no fake [DONE]: {rest}");
    assert!(
        !rest.ends_with("0\r\n\r\n"),
        "the chunked body is not ended as if whole: {rest:?}"
    );
    let status = serve.wait_exit(SECS(10)).expect("serve exits");
    assert_eq!(status.code(), Some(1), "{}", serve.output());
    assert!(
        serve.output().contains("was killed by SIGKILL"),
        "{}",
        serve.output()
    );
    assert!(!alive(backends[0]));
}

#[test]
fn sigkill_to_serve_under_load_leaves_no_process_behind() {
    let dir = temp_dir("sigkill");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &[],
        &[("FAKE_SSE_EVENTS", "100000"), ("FAKE_SSE_INTERVAL_MS", "5")],
    );
    serve.ready();
    let backends = serve.children();
    assert!(!backends.is_empty());
    let clients: Vec<_> = (0..8).map(|_| open_stream(serve.port, 3)).collect();
    serve.signal(Signal::SIGKILL);
    let status = serve.wait_exit(SECS(5)).expect("serve dies");
    assert_eq!(status.code(), None, "killed by a signal");
    assert!(
        wait_until(SECS(5), || backends.iter().all(|&pid| !alive(pid))),
        "backends left behind: {backends:?}"
    );
    let started = Instant::now();
    for mut client in clients {
        let mut rest = Vec::new();
        let _ = client.read_to_end(&mut rest);
        assert!(!String::from_utf8_lossy(&rest).contains("[DONE]"));
    }
    assert!(
        started.elapsed() < SECS(5),
        "the clients saw their streams end"
    );
}
