//! The drop-in's command line as the user's policy: `--api-key` is serve's key (both headers
//! llama-server reads, never forwarded), `--cors-origins` the guard's allowance with
//! llama-server's preflight, `/metrics` 501 without `--metrics` and llama-server's reply headers
//! with it, a comma `--host` list bound address by address, Google's AIP mode on serve's port.

use std::process::Command;
use std::time::Duration;

use onebit_tests::*;

const KEY: &str = "sk-dropin-test-41c9";
const TOKENIZE: &str = r#"{"content":"hello world"}"#;

/// `1bit llama-server ARGS --port <free>` over the fake backend (with `FAKE_RECORD`), ready.
fn drop_in(args: &[&str], env: &[(&str, &str)]) -> (Serve, std::path::PathBuf) {
    let dir = temp_dir("dropin-policy");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let port = free_port();
    let mut command = Command::new(onebit());
    command
        .arg("llama-server")
        .args(["-m", model.to_str().unwrap(), "--port", &port.to_string()])
        .args(args)
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .env("ONEBIT_LLAMA_SERVER", fake_backend())
        .env("ONEBIT_HRX_PRESENT", "0")
        .env("FAKE_RECORD", &record);
    for (k, v) in env {
        command.env(k, v);
    }
    let serve = Serve::spawn(command, port);
    serve.ready();
    (serve, record)
}

/// One request with extra header lines and `Connection: close`: (status, the whole reply).
fn call(port: u16, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    raw(port, request.as_bytes(), Duration::from_secs(10))
}

/// A reply header's value (names compare case-insensitively).
fn header_of(reply: &str, name: &str) -> Option<String> {
    let head = &reply[..reply.find("\r\n\r\n").unwrap_or(reply.len())];
    head.lines().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

fn body_of(reply: &str) -> serde_json::Value {
    let body = &reply[reply.find("\r\n\r\n").map_or(0, |i| i + 4)..];
    serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
}

/// The command line of serve's one backend.
fn backend_argv(serve: &Serve) -> Vec<String> {
    let children = serve.children();
    assert_eq!(children.len(), 1, "one backend: {}", serve.output());
    let raw = std::fs::read(format!("/proc/{}/cmdline", children[0])).unwrap();
    raw.split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

#[test]
fn the_api_key_is_serves_on_every_route_in_both_of_llama_servers_headers() {
    let (serve, record) = drop_in(&["--api-key", KEY, "--metrics"], &[]);
    let port = serve.port;
    let bearer = format!("Authorization: Bearer {KEY}");
    let x_api_key = format!("X-Api-Key: {KEY}");
    // The key never reaches the backend's command line.
    let argv = backend_argv(&serve);
    assert!(
        !argv.iter().any(|a| a.contains("api-key") || a == KEY),
        "{argv:?}"
    );
    // serve's own routes and relayed ones: 401 as llama-server's, without a key or with another.
    for (method, path, body) in [
        ("GET", "/v1/models", ""),
        ("GET", "/metrics", ""),
        ("POST", "/tokenize", TOKENIZE),
    ] {
        for headers in [
            &[][..],
            &["X-Api-Key: sk-wrong"][..],
            &["Authorization: Bearer no"][..],
        ] {
            let (status, reply) = call(port, method, path, headers, body);
            assert_eq!(status, 401, "{method} {path} {headers:?}: {reply}");
            assert_eq!(
                body_of(&reply)["error"]["type"],
                "authentication_error",
                "{reply}"
            );
        }
        for header in [&bearer, &x_api_key] {
            let (status, reply) = call(port, method, path, &[header.as_str()], body);
            assert_eq!(status, 200, "{method} {path} {header}: {reply}");
        }
    }
    assert_eq!(call(port, "GET", "/health", &[], "").0, 200);
    // Neither header reached the backend.
    let seen = json_lines(&record);
    let tokenizes: Vec<_> = seen.iter().filter(|r| r["path"] == "/tokenize").collect();
    assert_eq!(tokenizes.len(), 2, "{seen:?}");
    for r in tokenizes {
        assert!(r["headers"].get("authorization").is_none(), "{r}");
        assert!(r["headers"].get("x-api-key").is_none(), "{r}");
    }
}

#[test]
fn cors_origins_are_the_guards_allowance_and_preflights_are_answered_as_llama_servers() {
    const APP: &str = "Origin: https://app.example";
    const EVIL: &str = "Origin: https://evil.example";
    let (serve, _) = drop_in(&["--cors-origins", "https://app.example", "--metrics"], &[]);
    let port = serve.port;
    // The backend gets the same policy, so what it relays carries the same headers.
    let argv = backend_argv(&serve);
    let at = argv
        .iter()
        .position(|a| a == "--cors-origins")
        .expect("passed on");
    assert_eq!(argv[at + 1], "https://app.example");
    // The preflight: 200, empty, llama-server's headers, before any key.
    let (status, reply) = call(
        port,
        "OPTIONS",
        "/completions",
        &[APP, "Access-Control-Request-Method: POST"],
        "",
    );
    assert_eq!(status, 200, "{reply}");
    let allow = |name| header_of(&reply, name);
    assert_eq!(
        allow("access-control-allow-origin").as_deref(),
        Some("https://app.example")
    );
    assert_eq!(
        allow("access-control-allow-credentials").as_deref(),
        Some("true")
    );
    assert_eq!(
        allow("access-control-allow-methods").as_deref(),
        Some("GET, POST, DELETE, OPTIONS")
    );
    assert_eq!(allow("access-control-allow-headers").as_deref(), Some("*"));
    // A write from the allowed origin passes the guard, one from another does not.
    let (status, reply) = call(port, "POST", "/tokenize", &[APP], TOKENIZE);
    assert_eq!(status, 200, "{reply}");
    let (status, reply) = call(port, "POST", "/tokenize", &[EVIL], TOKENIZE);
    assert_eq!(status, 403, "{reply}");
    // serve's own route names the allowed origin too.
    let (status, reply) = call(port, "GET", "/v1/models", &[APP], "");
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        header_of(&reply, "access-control-allow-origin").as_deref(),
        Some("https://app.example")
    );
}

#[test]
fn without_cors_flags_the_specifications_guard_stands() {
    let (serve, _) = drop_in(&["--metrics"], &[]);
    let port = serve.port;
    let (status, reply) = call(
        port,
        "POST",
        "/tokenize",
        &["Origin: https://app.example"],
        TOKENIZE,
    );
    assert_eq!(status, 403, "{reply}");
    let (status, reply) = call(
        port,
        "OPTIONS",
        "/completions",
        &[
            "Origin: https://app.example",
            "Access-Control-Request-Method: POST",
        ],
        "",
    );
    assert_eq!(status, 404, "{reply}");
    assert_eq!(
        header_of(&reply, "access-control-allow-origin"),
        None,
        "{reply}"
    );
}

#[test]
fn metrics_are_llama_servers_501_without_the_flag_and_its_headers_with_it() {
    let (serve, _) = drop_in(&[], &[]);
    let (status, reply) = call(serve.port, "GET", "/metrics", &[], "");
    assert_eq!(status, 501, "{reply}");
    let v = body_of(&reply);
    assert_eq!(v["error"]["type"], "not_supported_error", "{reply}");
    assert_eq!(
        v["error"]["message"],
        "This server does not support metrics endpoint. Start it with `--metrics`"
    );
    drop(serve);

    let (serve, _) = drop_in(&["--metrics"], &[]);
    let (status, first) = call(serve.port, "GET", "/metrics", &[], "");
    assert_eq!(status, 200, "{first}");
    let start =
        header_of(&first, "process-start-time-unix").expect("llama-server's header relayed");
    assert!(
        start.parse::<u64>().is_ok_and(|t| t > 1_600_000_000),
        "{start}"
    );
    // In llama-server's case: llama.cpp's own tests look the name up case by case.
    assert!(
        first.contains("\r\nProcess-Start-Time-Unix: ") && first.contains("\r\nContent-Type: "),
        "{first}"
    );
    // A scrape is a status read, in no series: neither in its own text nor in the next one.
    let scrapes = |text: &str| requests_total_in(text, &[("path_class", "status")]);
    assert_eq!(scrapes(&first), 0, "{first}");
    let (_, second) = call(serve.port, "GET", "/metrics", &[], "");
    assert_eq!(scrapes(&second), 0, "{second}");
    assert!(!second.contains("path_class=\"metrics\""), "{second}");
}

#[test]
fn a_comma_host_list_binds_each_address() {
    let (serve, _) = drop_in(&["--host", "127.0.0.1,::1", "--metrics"], &[]);
    for addr in ["127.0.0.1", "[::1]"] {
        let reply = std::process::Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("http://{addr}:{}/health", serve.port))
            .output()
            .expect("curl");
        assert_eq!(String::from_utf8_lossy(&reply.stdout), "200", "{addr}");
    }
}

#[test]
fn aip_mode_listens_on_aip_http_port_and_relays_predict() {
    let aip_port = free_port();
    let (serve, record) = {
        let dir = temp_dir("dropin-aip");
        let model = dummy_model(&dir, "m.gguf");
        let record = dir.join("record.jsonl");
        let mut command = Command::new(onebit());
        command
            .args(["llama-server", "-m", model.to_str().unwrap(), "--metrics"])
            .env("ONEBIT_STATE_DIR", temp_dir("state"))
            .env("ONEBIT_LLAMA_SERVER", fake_backend())
            .env("ONEBIT_HRX_PRESENT", "0")
            .env("FAKE_RECORD", &record)
            .env("AIP_MODE", "PREDICTION")
            .env("AIP_HTTP_PORT", aip_port.to_string());
        let serve = Serve::spawn(command, aip_port);
        serve.ready();
        (serve, record)
    };
    // The backend listens on its own port, told so in AIP_HTTP_PORT.
    let child = serve.children()[0];
    let environ = std::fs::read(format!("/proc/{child}/environ")).unwrap();
    let aip: Vec<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .filter(|v| v.starts_with("AIP_HTTP_PORT="))
        .collect();
    assert_eq!(aip.len(), 1, "{aip:?}");
    assert_ne!(aip[0], format!("AIP_HTTP_PORT={aip_port}"));
    let body = r#"{"instances":[{"@requestFormat":"chatCompletions","messages":[]}]}"#;
    call(aip_port, "POST", "/predict", &[], body);
    let seen = json_lines(&record);
    assert!(seen.iter().any(|r| r["path"] == "/predict"), "{seen:?}");
}
