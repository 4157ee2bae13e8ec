//! The stop that finishes what it started: on SIGTERM serve stops accepting, lets a stream in
//! flight finish within `--drain-s`, and cuts one that outlasts it without a made-up `[DONE]`;
//! either way it is gone within Lemonade's 5 s.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::bounds;
use onebit_tests::*;

const STREAM: &str = r#"{"stream":true,"messages":[{"role":"user","content":"hello"}]}"#;

/// A streamed request read on its own thread; the bytes so far, and whether it ended.
struct Stream {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
}

fn start_stream(port: u16) -> Stream {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{STREAM}",
        STREAM.len()
    );
    tcp.write_all(req.as_bytes()).unwrap();
    let bytes = Arc::new(Mutex::new(Vec::new()));
    let sink = bytes.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = tcp.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    Stream { bytes, reader }
}

impl Stream {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes.lock().unwrap()).into_owned()
    }

    fn wait_first_event(&self) {
        assert!(
            wait_until(Duration::from_secs(10), || self.text().contains("data: {")),
            "no event: {}",
            self.text()
        );
    }

    /// The whole reply once the connection closed.
    fn finish(self) -> String {
        self.reader.join().unwrap();
        String::from_utf8_lossy(&self.bytes.lock().unwrap()).into_owned()
    }
}

fn refuses_connections(port: u16) -> bool {
    wait_until(Duration::from_secs(2), || {
        TcpStream::connect(("127.0.0.1", port)).is_err()
    })
}

#[test]
fn a_stream_in_flight_finishes_after_sigterm_while_new_connections_are_refused() {
    let dir = temp_dir("drain");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--drain-s", "4"],
        &[("FAKE_SSE_EVENTS", "8"), ("FAKE_SSE_INTERVAL_MS", "250")],
    );
    serve.ready();
    let backend = serve.children()[0];
    let stream = start_stream(serve.port);
    stream.wait_first_event();
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    assert!(refuses_connections(serve.port), "{}", serve.output());
    let reply = stream.finish();
    assert!(reply.contains("data: [DONE]"), "{reply}");
    assert!(
        reply.ends_with("0\r\n\r\n"),
        "the stream's last chunk: {reply}"
    );
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    let within = bounds::stop_within(Duration::from_secs(4));
    assert!(
        signalled.elapsed() < within,
        "{:?} (bound {within:?})",
        signalled.elapsed()
    );
    assert!(!alive(backend));
    assert!(
        serve.output().contains("request(s) in flight finish"),
        "{}",
        serve.output()
    );
}

#[test]
fn a_stream_that_outlasts_the_window_is_cut_without_a_done_and_serve_is_gone_within_5_s() {
    let dir = temp_dir("drain-cut");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--drain-s", "1"],
        &[("FAKE_SSE_EVENTS", "40"), ("FAKE_SSE_INTERVAL_MS", "250")],
    );
    serve.ready();
    let backend = serve.children()[0];
    let stream = start_stream(serve.port);
    stream.wait_first_event();
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .expect("serve exits");
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    assert!(took >= Duration::from_millis(900), "no drain: {took:?}");
    let within = bounds::stop_within(Duration::from_secs(1));
    assert!(took < within, "{took:?} (bound {within:?})");
    let reply = stream.finish();
    assert!(
        reply.matches("data: {").count() >= 4,
        "the window was not used: {reply}"
    );
    assert!(!reply.contains("[DONE]"), "{reply}");
    assert!(
        !reply.ends_with("0\r\n\r\n"),
        "a cut stream ended as finished: {reply}"
    );
    assert!(!alive(backend));
    assert!(
        serve
            .output()
            .contains("drain window ended with 1 request(s)"),
        "{}",
        serve.output()
    );
}

/// serve's `onebit_requests_in_flight`, from its /metrics.
fn in_flight(serve: &Serve) -> Option<u64> {
    let (_, text) = get(&serve.url("/metrics"));
    text.lines()
        .find_map(|l| l.strip_prefix("onebit_requests_in_flight "))
        .and_then(|n| n.trim().parse().ok())
}

#[test]
fn a_tool_call_in_flight_does_not_hold_the_stop_but_a_stream_beside_it_does() {
    // llama-server ends a tool call at once when told to stop (llama.cpp's
    // test_mcp_slow_tool_call_slot_release): the drain does not wait for one, but a stream in
    // flight beside it still gets the window.
    let dir = temp_dir("drain-tool");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--drain-s", "4"],
        &[
            ("FAKE_TOOL_MS", "20000"),
            ("FAKE_SSE_EVENTS", "6"),
            ("FAKE_SSE_INTERVAL_MS", "250"),
        ],
    );
    serve.ready();
    let call = slow_tool_call(&serve);
    assert!(
        wait_until(Duration::from_secs(5), || in_flight(&serve) == Some(1)),
        "the tool call is not in flight: {:?}",
        in_flight(&serve)
    );

    // A stream beside it: the drain waits for the stream, then cuts the tool call.
    let stream = start_stream(serve.port);
    stream.wait_first_event();
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(6))
        .expect("serve exits");
    let with_stream = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    let reply = stream.finish();
    assert!(reply.contains("[DONE]"), "the stream was cut: {reply}");
    assert!(with_stream < Duration::from_secs(4), "{with_stream:?}");
    assert!(
        serve.output().contains(
            "only 1 tool call(s) left in flight, which the backend ends at its stop; cutting them"
        ),
        "{}",
        serve.output()
    );
    let (status, _) = call.join().unwrap();
    assert_ne!(status, 200, "the tool call was answered");

    // The tool call alone: serve stops at once, not at the window's end.
    let mut serve = Serve::with_fake(&model, &["--drain-s", "4"], &[("FAKE_TOOL_MS", "20000")]);
    serve.ready();
    let url = serve.url("/tools");
    let call = std::thread::spawn(move || {
        post_with_timeout(&url, r#"{"tool":"slow_sleep"}"#, Duration::from_secs(30))
    });
    assert!(wait_until(Duration::from_secs(5), || in_flight(&serve) == Some(1)));
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(6))
        .expect("serve exits");
    let alone = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    assert!(
        alone < Duration::from_secs(2),
        "the drain waited for the tool call: {alone:?}\n{}",
        serve.output()
    );
    let _ = call.join();
}

#[test]
fn a_drain_window_that_is_not_a_number_of_seconds_is_refused() {
    let dir = temp_dir("drain-bad");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(&model, &["--drain-s=-1"], &[]);
    let status = serve.wait_exit(Duration::from_secs(10)).expect("refused");
    assert_eq!(status.code(), Some(2));
    assert_eq!(
        serve.output().trim(),
        "1bit serve: --drain-s -1: not a number of seconds from 0 to 3600; pass one such as 3"
    );
}
