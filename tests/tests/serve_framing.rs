//! Framing attacks on both relay engines: each request is sent as the first on a connection
//! (the fast engine reads it, and hands it over) and after a request that hands the
//! connection to the general engine (hyper reads it). Each gets the answer a careful proxy
//! gives, the same on both, and none reaches the backend framed otherwise than serve read it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use onebit_tests::*;

/// Send `request` on a new connection, after `GET /health` when `after_health` (the general
/// engine then owns the connection); the status of the reply to `request`.
fn answer(port: u16, request: &[u8], after_health: bool) -> (u16, String) {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut text = String::new();
    if after_health {
        tcp.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 4096];
        while !text.contains(r#"{"status":"ok"}"#) {
            let n = tcp.read(&mut buf).unwrap();
            assert!(n > 0, "closed after /health");
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        text.clear();
    }
    // The reply: its head, and its body to its Content-Length (or the connection's end).
    let _ = tcp.write_all(request);
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&bytes).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .and_then(|v| v.parse::<usize>().ok());
            if length.is_some_and(|n| bytes.len() >= end + 4 + n) {
                return (status_of(&text), text);
            }
        }
        match tcp.read(&mut buf) {
            Ok(0) | Err(_) => return (status_of(&text), text),
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
        }
    }
}

const BODY: &str = r#"{"content":"smuggled"}"#;

fn post_with(headers: &str, rest: &str) -> Vec<u8> {
    format!("POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{headers}\r\n{rest}")
        .into_bytes()
}

#[test]
fn framing_attacks_get_a_careful_proxys_answer_on_both_engines() {
    let dir = temp_dir("framing");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&model, &[], &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    let n = BODY.len();
    let chunked = format!("{n:x}\r\n{BODY}\r\n0\r\n\r\n");
    let long_line = format!(
        "GET /{} HTTP/1.1\r\nHost: localhost\r\n\r\n",
        "a".repeat(512 * 1024)
    );
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        // Read by its coding alone, then the connection closed (RFC 9112 6.1), as hyper does:
        // the backend gets the body serve read, with serve's own length.
        (
            "Content-Length with Transfer-Encoding",
            post_with(
                "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
                &chunked,
            ),
            200,
        ),
        (
            "two different Content-Lengths",
            post_with(&format!("Content-Length: {n}\r\nContent-Length: 3\r\n"), BODY),
            400,
        ),
        (
            "a non-numeric Content-Length",
            post_with("Content-Length: 2x\r\n", BODY),
            400,
        ),
        (
            "a Content-Length past u64",
            post_with("Content-Length: 184467440737095516160\r\n", BODY),
            400,
        ),
        (
            "a huge Content-Length",
            post_with("Content-Length: 1000000000000\r\n", BODY),
            413,
        ),
        (
            "obs-fold",
            post_with(&format!("X-A: 1\r\n folded\r\nContent-Length: {n}\r\n"), BODY),
            400,
        ),
        (
            "Transfer-Encoding: chunked, identity",
            post_with("Transfer-Encoding: chunked, identity\r\n", &chunked),
            400,
        ),
        ("a request line over the limit", long_line.into_bytes(), 431),
        (
            "two Host headers",
            format!(
                "POST /tokenize HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n{BODY}"
            )
            .into_bytes(),
            400,
        ),
        (
            "four loopback Hosts, then a foreign one",
            format!(
                "POST /tokenize HTTP/1.1\r\n{}Host: evil.example\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n{BODY}",
                "Host: localhost\r\n".repeat(4)
            )
            .into_bytes(),
            400,
        ),
        (
            "four Hosts, then an absolute target naming a foreign host",
            format!(
                "POST http://evil.example/tokenize HTTP/1.1\r\n{}Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n{BODY}",
                "Host: localhost\r\n".repeat(4)
            )
            .into_bytes(),
            400,
        ),
        (
            "five loopback Origins, then a foreign one",
            format!(
                "POST /tokenize HTTP/1.1\r\nHost: localhost\r\n{}Origin: https://evil.example\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n{BODY}",
                "Origin: http://localhost\r\n".repeat(5)
            )
            .into_bytes(),
            403,
        ),
    ];
    for after_health in [false, true] {
        let engine = if after_health {
            "general"
        } else {
            "fast first"
        };
        for (what, request, status) in &cases {
            let (got, reply) = answer(serve.port, request, after_health);
            if *status == 200 {
                assert!(
                    reply.to_ascii_lowercase().contains("connection: close"),
                    "{what} ({engine}): {reply}"
                );
            }
            assert_eq!(
                got,
                *status,
                "{what} ({engine}): {}",
                reply.chars().take(300).collect::<String>()
            );
        }
    }
    // Only the two-framed bodies reached the backend, each as serve read it.
    let reached: Vec<(String, String)> = json_lines(&record)
        .into_iter()
        .filter(|l| l["path"] == "/tokenize")
        .map(|l| {
            (
                l["body"].as_str().unwrap_or("").to_string(),
                l["headers"]["content-length"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(reached, vec![(BODY.to_string(), n.to_string()); 2]);
}

#[test]
fn a_bare_lf_request_reaches_the_backend_as_serve_read_it_on_both_engines() {
    let dir = temp_dir("framing-lf");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&model, &[], &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    let request = format!(
        "POST /tokenize HTTP/1.1\nHost: localhost\nContent-Type: application/json\nConnection: close\nContent-Length: {}\n\n{BODY}",
        BODY.len()
    );
    for after_health in [false, true] {
        let (status, reply) = answer(serve.port, request.as_bytes(), after_health);
        assert_eq!(status, 200, "{reply}");
    }
    let bodies: Vec<String> = json_lines(&record)
        .into_iter()
        .filter(|l| l["path"] == "/tokenize")
        .map(|l| l["body"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(bodies, vec![BODY.to_string(); 2]);
    assert_eq!(
        requests_total(&serve, &[("path_class", "other"), ("engine", "fast")]),
        1
    );
}

/// A chunked body that breaks off (the client stops sending mid-chunk and shuts its side)
/// gets a 400 that says so, not one about JSON.
#[test]
fn a_body_that_breaks_off_is_a_400_saying_so() {
    let dir = temp_dir("framing-broken");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let mut tcp = TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{\"messages\":",
    )
    .unwrap();
    tcp.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    let _ = tcp.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    assert!(
        reply.contains("the request body broke off before its end"),
        "{reply}"
    );
}
