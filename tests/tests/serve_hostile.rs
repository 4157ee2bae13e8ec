//! Hostile and broken input against a running serve: each case gets its refusal (or is dropped),
//! a normal request is answered right after it, and nothing of it reaches the backend.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use onebit_tests::*;

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hello there"}]}"#;
const SECS: fn(u64) -> Duration = Duration::from_secs;

/// A POST to the chat route with the given extra header lines and body, `Connection: close`.
fn post_raw(headers: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn error_type(reply: &str) -> String {
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    v["error"]["type"].as_str().unwrap_or("").to_string()
}

#[test]
fn hostile_input_is_refused_and_serve_goes_on() {
    let dir = temp_dir("hostile");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("FAKE_RECORD", record.to_str().unwrap()),
            ("ONEBIT_MAX_BODY_BYTES", "4096"),
            ("ONEBIT_HEADER_READ_TIMEOUT_S", "1"),
            ("ONEBIT_BODY_READ_TIMEOUT_S", "1"),
        ],
    );
    serve.ready();
    let port = serve.port;
    let mut normal = 0;
    let mut still_answers = |what: &str| {
        let (status, body) = post(&serve.url("/v1/chat/completions"), CHAT);
        assert_eq!(status, 200, "after {what}: {body}");
        normal += 1;
    };

    // Bodies that are not a JSON object, or not UTF-8, or sent as another type: 400.
    let bad: [(&str, &str, &[u8]); 7] = [
        (
            "not JSON",
            "Content-Type: application/json\r\n",
            b"{not json",
        ),
        ("an array", "Content-Type: application/json\r\n", b"[1,2,3]"),
        (
            "invalid UTF-8",
            "Content-Type: application/json\r\n",
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}",
        ),
        (
            "text/plain",
            "Content-Type: text/plain\r\n",
            CHAT.as_bytes(),
        ),
        (
            "multipart",
            "Content-Type: multipart/form-data; boundary=x\r\n",
            CHAT.as_bytes(),
        ),
        (
            "application/xml",
            "Content-Type: application/xml\r\n",
            CHAT.as_bytes(),
        ),
        ("empty", "Content-Type: application/json\r\n", b""),
    ];
    for (what, headers, body) in bad {
        let (status, reply) = raw(port, &post_raw(headers, body), SECS(10));
        assert_eq!(status, 400, "{what}: {reply}");
        assert_eq!(error_type(&reply), "invalid_request_error", "{what}");
        still_answers(what);
    }

    // A declared length over the limit: 413 before a byte of the body is read.
    let started = Instant::now();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{\"messages\":";
    let (status, reply) = raw(port, head.as_bytes(), SECS(10));
    assert_eq!(status, 413, "{reply}");
    assert!(reply.contains("ONEBIT_MAX_BODY_BYTES"), "{reply}");
    assert!(
        started.elapsed() < SECS(2),
        "answered without waiting for the body"
    );
    still_answers("a declared 1 GB body");

    // A chunked body that grows past the limit: 413, the read stops there.
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(SECS(10))).unwrap();
    tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
    for _ in 0..3 {
        let chunk = "x".repeat(2000);
        let _ = tcp.write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes());
    }
    let mut reply = String::new();
    let _ = tcp.read_to_string(&mut reply);
    assert_eq!(status_of(&reply), 413, "{reply}");
    drop(tcp);
    still_answers("a chunked body over the limit");

    // A body sent too slowly: 408 after the body timeout.
    let started = Instant::now();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"";
    let (status, reply) = raw(port, head.as_bytes(), SECS(10));
    assert_eq!(status, 408, "{reply}");
    assert!(started.elapsed() < SECS(5), "{:?}", started.elapsed());
    still_answers("a slow body");

    // Headers sent too slowly: the connection is closed after the header timeout.
    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..16 {
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
        tcp.set_read_timeout(Some(SECS(10))).unwrap();
        tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: local")
            .unwrap();
        slow.push(tcp);
    }
    still_answers("16 connections trickling their headers");
    for mut tcp in slow {
        let mut buf = Vec::new();
        let _ = tcp.read_to_end(&mut buf);
        let text = String::from_utf8_lossy(&buf);
        assert!(
            buf.is_empty() || status_of(&text) == 408,
            "dropped, at most with a 408: {text}"
        );
    }
    assert!(started.elapsed() < SECS(6), "{:?}", started.elapsed());
    still_answers("slow headers");

    // An unknown path: 404.
    let (status, reply) = raw(
        port,
        &b"POST /v2/nothing HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"[..],
        SECS(10),
    );
    assert_eq!(status, 404, "{reply}");
    still_answers("an unknown path");

    // Accepted content types: missing (a bare client) and curl -d's form type.
    for headers in ["", "Content-Type: application/x-www-form-urlencoded\r\n"] {
        let (status, reply) = raw(port, &post_raw(headers, CHAT.as_bytes()), SECS(10));
        assert_eq!(status, 200, "{headers:?}: {reply}");
        normal += 1;
    }

    let chats: Vec<serde_json::Value> = json_lines(&record)
        .into_iter()
        // serve's own calls: its health probe, and the prompt cache's `GET /props` at start.
        .filter(|l| l["path"] != "/health" && l["path"] != "/props")
        .collect();
    assert_eq!(
        chats.len(),
        normal,
        "only the normal requests reached the backend: {chats:?}"
    );
    assert!(chats.iter().all(|l| l["body"] == CHAT), "{chats:?}");
    assert_eq!(get(&serve.url("/health")).0, 200);
}
