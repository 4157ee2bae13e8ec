//! `--max-generations N`: the pipeline's one gate (relay::exchange's admission), the same on
//! every engine. A generation carried by the fast engine (a plain stream), by the general
//! engine (a whole chat, whose reply serve names) or answered in process holds a place; one
//! more is refused at once with 503 and Retry-After, whichever engine read it; a request that
//! generates nothing passes; a place comes back when its reply ends.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use onebit_tests::*;

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
const STREAM: &str = r#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#;

/// A streamed chat held open by the fake's gate: its head and first event read, the rest
/// waiting for the gate's files. The connection is the returned reader.
fn held_stream(port: u16, gate: &Path) -> BufReader<TcpStream> {
    std::fs::write(gate.join("1"), "").unwrap();
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{STREAM}",
        STREAM.len()
    )
    .unwrap();
    let mut reader = BufReader::new(tcp);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    // Until the first event: the generation is under way.
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
        if line.starts_with("data: ") {
            return reader;
        }
    }
}

/// Open the gate for the rest of the stream and read it to its end.
fn release(mut held: BufReader<TcpStream>, gate: &Path) {
    for n in 2..=8 {
        std::fs::write(gate.join(n.to_string()), "").unwrap();
    }
    let mut line = String::new();
    while held.read_line(&mut line).unwrap_or(0) > 0 {
        if line.starts_with("data: [DONE]") {
            return;
        }
        line.clear();
    }
}

fn assert_refused(serve: &Serve, body: &str) {
    let (status, retry, text) =
        post_with_header(&serve.url("/v1/chat/completions"), body, "retry-after");
    assert_eq!(status, 503, "{text}");
    assert_eq!(retry, "1");
    let error: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["type"], "unavailable_error", "{text}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("1 generations in flight, its limit (--max-generations 1)"),
        "{text}"
    );
}

#[test]
fn a_generation_on_either_engine_holds_the_one_place_and_the_next_is_refused() {
    let dir = temp_dir("max-generations");
    let gate = dir.join("gate");
    std::fs::create_dir_all(&gate).unwrap();
    let record = dir.join("record.jsonl");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(
        &model,
        &["--max-generations", "1"],
        &[
            ("FAKE_SSE_GATE", gate.to_str().unwrap()),
            ("FAKE_RECORD", record.to_str().unwrap()),
        ],
    );
    serve.ready();

    // A stream (the fast engine carries it) holds the place: a whole chat (the general
    // engine's) is refused; a request that generates nothing passes.
    let held = held_stream(serve.port, &gate);
    assert_refused(&serve, CHAT);
    assert_eq!(get(&serve.url("/v1/models")).0, 200);
    release(held, &gate);
    let (status, body) = post(&serve.url("/v1/chat/completions"), CHAT);
    assert_eq!(status, 200, "the place came back: {body}");

    // A whole chat (the general engine) holds it: a stream, which the fast engine reads, is
    // refused too.
    let url = serve.url("/v1/chat/completions");
    let slow = std::thread::spawn(move || {
        post(
            &url,
            r#"{"messages":[{"role":"user","content":"fake_slow_ms=3000"}],"max_tokens":4}"#,
        )
    });
    let reached = wait_until(Duration::from_secs(10), || {
        json_lines(&record)
            .iter()
            .any(|r| r["body"].as_str().unwrap_or("").contains("fake_slow_ms"))
    });
    assert!(reached, "the slow chat reached the backend");
    assert_refused(&serve, STREAM);
    assert_eq!(slow.join().unwrap().0, 200);
    let counted = get(&serve.url("/metrics")).1;
    assert!(
        counted
            .lines()
            .any(|l| l.starts_with("onebit_requests_total") && l.contains("status_class=\"5xx\"")),
        "the refusals are counted: {counted}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn without_the_flag_nothing_is_refused_and_a_limit_of_zero_is_a_usage_error() {
    let dir = temp_dir("max-generations-off");
    let model = dummy_model(&dir, "m.gguf");
    let out = std::process::Command::new(onebit())
        .args([
            "serve",
            "-m",
            model.to_str().unwrap(),
            "--max-generations",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    let gate = dir.join("gate");
    std::fs::create_dir_all(&gate).unwrap();
    let serve = Serve::with_fake(&model, &[], &[("FAKE_SSE_GATE", gate.to_str().unwrap())]);
    serve.ready();
    let held = held_stream(serve.port, &gate);
    let (status, body) = post(&serve.url("/v1/chat/completions"), CHAT);
    assert_eq!(status, 200, "{body}");
    release(held, &gate);
    std::fs::remove_dir_all(&dir).unwrap();
}
