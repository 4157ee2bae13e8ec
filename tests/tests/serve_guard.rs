//! The browser guard against a running serve: Host and Origin pairs, methods, on a loopback and
//! a LAN bind, sent with raw requests so any Host header can be set; the fake backend's record
//! proves that no refused request reached it.

use std::time::Duration;

use onebit_tests::*;

/// The bind of the serve a case runs against.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bind {
    Loopback,
    Lan,
}

/// One request: the bind, the method and path, the Host header (None: an HTTP/1.0 request
/// without one), the Origin header, and the status the client must get.
struct Case {
    bind: Bind,
    method: &'static str,
    path: &'static str,
    host: Option<&'static str>,
    origin: Option<&'static str>,
    status: u16,
}

const fn case(
    bind: Bind,
    method: &'static str,
    path: &'static str,
    host: Option<&'static str>,
    origin: Option<&'static str>,
    status: u16,
) -> Case {
    Case {
        bind,
        method,
        path,
        host,
        origin,
        status,
    }
}

use Bind::{Lan, Loopback};
const CHAT: &str = "/v1/chat/completions";
const EVIL: Option<&str> = Some("https://evil.example");

/// `PORT` in a Host or Origin is replaced by serve's port.
const CASES: &[Case] = &[
    // Loopback bind: the Host must name loopback.
    case(
        Loopback,
        "GET",
        "/health",
        Some("localhost:PORT"),
        None,
        200,
    ),
    case(
        Loopback,
        "GET",
        "/health",
        Some("127.0.0.1:PORT"),
        None,
        200,
    ),
    case(Loopback, "GET", "/v1/models", Some("[::1]:PORT"), None, 200),
    case(
        Loopback,
        "GET",
        "/health",
        Some("LocalHost:PORT"),
        None,
        200,
    ),
    case(
        Loopback,
        "GET",
        "/health",
        Some("app.localhost:8000"),
        None,
        200,
    ),
    case(Loopback, "GET", "/health", Some("127.1.2.3"), None, 200),
    case(Loopback, "GET", "/health", Some("evil.example"), None, 403),
    case(
        Loopback,
        "GET",
        "/health",
        Some("127.0.0.1.example"),
        None,
        403,
    ),
    case(
        Loopback,
        "GET",
        "/v1/models",
        Some("evil.localhost.example"),
        None,
        403,
    ),
    case(Loopback, "GET", "/health", Some(":PORT"), None, 403),
    case(Loopback, "GET", "/health", Some(""), None, 403),
    case(Loopback, "GET", "/health", None, None, 403),
    case(Loopback, "GET", "/health", Some("10.0.0.5:PORT"), None, 403),
    case(Loopback, "GET", "/health", Some("127.0.0.256"), None, 403),
    case(
        Loopback,
        "GET",
        "/no/such/route",
        Some("evil.example"),
        None,
        403,
    ),
    case(
        Loopback,
        "GET",
        "/no/such/route",
        Some("localhost"),
        None,
        404,
    ),
    case(Loopback, "POST", CHAT, Some("localhost:PORT"), None, 200),
    case(
        Loopback,
        "POST",
        CHAT,
        Some("[0:0:0:0:0:0:0:1]:PORT"),
        None,
        200,
    ),
    case(
        Loopback,
        "POST",
        CHAT,
        Some("localhost:PORT"),
        Some("http://localhost:3000"),
        200,
    ),
    case(
        Loopback,
        "POST",
        CHAT,
        Some("127.0.0.1:PORT"),
        Some("http://127.0.0.1:PORT"),
        200,
    ),
    case(Loopback, "POST", CHAT, Some("localhost:PORT"), EVIL, 403),
    case(
        Loopback,
        "POST",
        CHAT,
        Some("localhost:PORT"),
        Some("null"),
        403,
    ),
    case(Loopback, "POST", CHAT, Some("evil.example"), None, 403),
    case(
        Loopback,
        "POST",
        CHAT,
        Some("localhost:PORT"),
        Some("http://evil.localhost.example"),
        403,
    ),
    case(
        Loopback,
        "POST",
        CHAT,
        Some("localhost:PORT"),
        Some("file://"),
        403,
    ),
    case(Loopback, "POST", CHAT, None, None, 403),
    // Reads are not refused for their Origin; no CORS header lets the page read the reply.
    case(
        Loopback,
        "GET",
        "/v1/models",
        Some("localhost:PORT"),
        EVIL,
        200,
    ),
    case(Loopback, "OPTIONS", CHAT, Some("localhost:PORT"), EVIL, 404),
    case(
        Loopback,
        "DELETE",
        "/v1/models",
        Some("localhost:PORT"),
        EVIL,
        403,
    ),
    // LAN bind: any Host; the Origin rule still holds.
    case(Lan, "GET", "/health", Some("box.lan:8000"), None, 200),
    case(Lan, "GET", "/v1/models", Some("evil.example"), None, 200),
    case(Lan, "GET", "/health", None, None, 200),
    case(
        Lan,
        "POST",
        CHAT,
        Some("box.lan:8000"),
        Some("http://box.lan:8000"),
        200,
    ),
    case(
        Lan,
        "POST",
        CHAT,
        Some("box.lan:8000"),
        Some("http://localhost:5173"),
        200,
    ),
    case(Lan, "POST", CHAT, Some("box.lan:8000"), None, 200),
    case(Lan, "POST", CHAT, None, None, 200),
    case(
        Lan,
        "POST",
        CHAT,
        Some("box.lan:8000"),
        Some("http://evil.example"),
        403,
    ),
    case(
        Lan,
        "POST",
        CHAT,
        Some("box.lan:8000"),
        Some("http://box.lan:8001"),
        403,
    ),
    case(Lan, "POST", CHAT, Some("box.lan:8000"), Some("null"), 403),
    case(
        Lan,
        "DELETE",
        "/v1/models",
        Some("box.lan:8000"),
        Some("http://evil.example"),
        403,
    ),
];

/// The raw request of case `i`; a POST carries `guard-case-<i>` so the record shows whether it
/// was forwarded.
fn request(i: usize, c: &Case, port: u16) -> Vec<u8> {
    let fill = |s: &str| s.replace("PORT", &port.to_string());
    let mut head = match c.host {
        Some(host) => format!(
            "{} {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            c.method,
            c.path,
            fill(host)
        ),
        None => format!("{} {} HTTP/1.0\r\n", c.method, c.path),
    };
    if let Some(origin) = c.origin {
        head.push_str(&format!("Origin: {}\r\n", fill(origin)));
    }
    let body = if c.method == "POST" {
        format!(r#"{{"messages":[{{"role":"user","content":"guard-case-{i}"}}]}}"#)
    } else {
        String::new()
    };
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    head.into_bytes()
}

#[test]
fn the_guard_table_on_loopback_and_lan_binds() {
    assert!(CASES.len() >= 30);
    let dir = temp_dir("guard");
    let model = dummy_model(&dir, "m.gguf");
    let mut failures = Vec::new();
    for bind in [Loopback, Lan] {
        let record = dir.join(format!("record-{bind:?}.jsonl"));
        let host = if bind == Lan { "0.0.0.0" } else { "127.0.0.1" };
        let serve = Serve::with_fake(
            &model,
            &["--host", host],
            &[("FAKE_RECORD", record.to_str().unwrap())],
        );
        serve.ready();
        let mut forwarded_expected = Vec::new();
        for (i, c) in CASES.iter().enumerate().filter(|(_, c)| c.bind == bind) {
            let (status, reply) = raw(serve.port, &request(i, c, serve.port), SECS(10));
            if status != c.status {
                failures.push(format!(
                    "case {i} ({bind:?} {} {} Host {:?} Origin {:?}): want {}, got {status}: {reply}",
                    c.method, c.path, c.host, c.origin, c.status
                ));
            }
            if status == 403 {
                let body = reply.split("\r\n\r\n").nth(1).unwrap_or("");
                let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
                let message = v["error"]["message"].as_str().unwrap_or("");
                // In this table every refused case with an Origin has a good Host.
                let why = if c.origin.is_some() {
                    "cross-site requests are not allowed"
                } else {
                    "the Host header does not name this server"
                };
                assert!(message.starts_with(why), "case {i}: {reply}");
                assert_eq!(v["error"]["type"], "permission_error", "case {i}");
                assert_eq!(v["error"]["code"], 403, "case {i}");
            }
            assert!(
                !reply
                    .to_ascii_lowercase()
                    .contains("access-control-allow-origin"),
                "case {i}: no CORS headers: {reply}"
            );
            if c.method == "POST" && c.status == 200 {
                forwarded_expected.push(format!("guard-case-{i}"));
            }
        }
        let bodies: Vec<String> = json_lines(&record)
            .iter()
            .filter(|l| l["path"] == CHAT)
            .map(|l| l["body"].as_str().unwrap_or("").to_string())
            .collect();
        for (i, c) in CASES.iter().enumerate().filter(|(_, c)| c.bind == bind) {
            let marker = format!("guard-case-{i}\"");
            let reached = bodies.iter().any(|b| b.contains(&marker));
            if c.method == "POST" {
                assert_eq!(
                    reached,
                    c.status == 200,
                    "case {i} ({bind:?}): reached the backend: {reached}"
                );
            }
        }
        assert_eq!(bodies.len(), forwarded_expected.len(), "{bodies:?}");
        assert_eq!(get(&serve.url("/health")).0, 200, "serve still answers");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

const SECS: fn(u64) -> Duration = Duration::from_secs;
