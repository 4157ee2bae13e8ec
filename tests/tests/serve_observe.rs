//! What an operator sees of each request, against the fake backend: the log's formats
//! (`--log-format json`, `ONEBIT_LOG=debug`'s line per request), the request id end to end
//! (sent to the backend, on the reply, a hostile one replaced), and the timing histograms.
//!
//! A streamed chat goes on the fast engine; the same chat with a body over 256 KiB (a
//! padding field) goes on the general engine, so each check runs on both.

use std::path::Path;
use std::time::Duration;

use onebit_tests::*;

const STREAMED: &str =
    r#"{"model":"m","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;

/// The same streamed chat with a body too large for the fast engine.
fn streamed_general() -> String {
    format!(
        r#"{{"model":"m","stream":true,"max_tokens":5,"padding":"{}","messages":[{{"role":"user","content":"hi"}}]}}"#,
        "x".repeat(300 * 1024)
    )
}

/// POST `body` with `X-Request-Id: id` (none for None), read it whole: (status, the reply's
/// X-Request-Id, body).
fn post_with_id(serve: &Serve, body: &str, id: Option<&str>) -> (u16, String, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into();
    let mut request = agent
        .post(&serve.url("/v1/chat/completions"))
        .header("content-type", "application/json");
    if let Some(id) = id {
        request = request.header("x-request-id", id);
    }
    let mut reply = request.send(body).expect("serve answers");
    let status = reply.status().as_u16();
    let echoed = reply
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    (
        status,
        echoed,
        reply.body_mut().read_to_string().unwrap_or_default(),
    )
}

/// The X-Request-Id the backend recorded for each request it got, in order.
fn recorded_ids(record: &Path) -> Vec<String> {
    json_lines(record)
        .iter()
        .filter(|r| r["path"] == "/v1/chat/completions")
        .map(|r| {
            r["headers"]["x-request-id"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

fn made_id(id: &str) -> bool {
    id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[test]
fn the_id_reaches_the_backend_and_comes_back_on_both_engines() {
    let dir = temp_dir("observe-id");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("FAKE_RECORD", record.to_str().unwrap()),
            ("FAKE_SSE_INTERVAL_MS", "0"),
        ],
    );
    serve.ready();
    let general = streamed_general();
    let too_long = "a".repeat(129);
    let mut expected = Vec::new();
    for (engine, body) in [("fast", STREAMED), ("general", general.as_str())] {
        // The client's id, kept.
        let mine = format!("client-{engine}-1_A.b~");
        let (status, echoed, text) = post_with_id(&serve, body, Some(&mine));
        assert_eq!(status, 200, "{engine}: {text}");
        assert_eq!(echoed, mine, "{engine}: the client's id comes back");
        expected.push(mine);
        // None sent: serve makes one, sends it and answers with it.
        let (_, echoed, _) = post_with_id(&serve, body, None);
        assert!(made_id(&echoed), "{engine}: a made id, not {echoed:?}");
        expected.push(echoed);
        // Hostile: too long, or with a space. Replaced, never echoed.
        for hostile in [too_long.as_str(), "two words"] {
            let (_, echoed, _) = post_with_id(&serve, body, Some(hostile));
            assert!(
                made_id(&echoed),
                "{engine}: {hostile:?} is replaced, not {echoed:?}"
            );
            expected.push(echoed);
        }
        // A control character and bytes above ASCII, written raw (clients refuse to send them).
        for hostile in [&b"a\tb"[..], "caf\u{e9}".as_bytes()] {
            let mut request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\nX-Request-Id: ".to_vec();
            request.extend_from_slice(hostile);
            request.extend_from_slice(
                format!("\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes(),
            );
            let (status, reply) = raw(serve.port, &request, Duration::from_secs(30));
            assert_eq!(status, 200, "{engine}: {}", &reply[..reply.len().min(300)]);
            let echoed = reply
                .lines()
                .find_map(|l| {
                    l.split_once(':')
                        .filter(|(name, _)| name.eq_ignore_ascii_case("x-request-id"))
                        .map(|(_, v)| v.trim().to_string())
                })
                .unwrap_or_default();
            assert!(
                made_id(&echoed),
                "{engine}: {hostile:?} is replaced, not {echoed:?}"
            );
            assert_eq!(
                reply.to_ascii_lowercase().matches("x-request-id").count(),
                1,
                "one id on the reply"
            );
            expected.push(echoed);
        }
    }
    assert_eq!(
        recorded_ids(&record),
        expected,
        "the backend got each request's id, as the client got it back"
    );
}

#[test]
fn json_lines_parse_and_carry_the_request_id() {
    let dir = temp_dir("observe-json");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--log-format", "json"],
        &[("ONEBIT_LOG", "debug"), ("FAKE_SSE_INTERVAL_MS", "0")],
    );
    serve.ready();
    let general = streamed_general();
    post_with_id(&serve, STREAMED, Some("json-fast"));
    post_with_id(&serve, &general, Some("json-general"));
    assert!(wait_until(Duration::from_secs(5), || serve
        .output()
        .contains("json-general")));
    serve.signal(nix::sys::signal::Signal::SIGTERM);
    serve.wait_exit(Duration::from_secs(20));
    let output = serve.output();
    let lines: Vec<serde_json::Value> = output
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for line in &lines {
        for key in ["time", "level", "target", "message", "fields"] {
            assert!(!line[key].is_null(), "{key} in {line}");
        }
    }
    let said = |message: &str| lines.iter().any(|l| l["message"].as_str() == Some(message));
    assert!(
        lines.iter().any(|l| l["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("1bit serve: ready on http://"))),
        "serve's own lines, as messages:\n{output}"
    );
    // The backend's own lines, wrapped, their source named.
    let backend: Vec<_> = lines
        .iter()
        .filter(|l| l["target"] == "onebit::backend")
        .collect();
    assert!(
        backend
            .iter()
            .any(|l| l["message"] == "srv  llama_server: model loaded"
                && l["fields"]["source"] == "backend"
                && l["fields"]["route"] == "cpu"
                && l["fields"]["backend"] == 0),
        "{output}"
    );
    for (id, engine) in [("json-fast", "fast"), ("json-general", "general")] {
        let request: Vec<_> = lines
            .iter()
            .filter(|l| l["target"] == "onebit::request" && l["fields"]["request_id"] == id)
            .collect();
        assert_eq!(request.len(), 1, "{id}: one request line:\n{output}");
        let fields = &request[0]["fields"];
        assert_eq!(fields["engine"], engine, "{fields}");
        assert_eq!(fields["status"], 200, "{fields}");
        assert_eq!(fields["method"], "POST", "{fields}");
        assert_eq!(fields["path"], "/v1/chat/completions", "{fields}");
        assert_eq!(request[0]["level"], "DEBUG");
        assert!(fields["bytes"].as_u64().unwrap_or(0) > 100, "{fields}");
    }
    assert!(!said(""), "no empty message");
    // `debug` is serve's request line, not the libraries' chatter (hyper-util's pool).
    let libraries: Vec<_> = lines
        .iter()
        .filter(|l| {
            let target = l["target"].as_str().unwrap_or("");
            ["hyper", "axum", "tower"]
                .iter()
                .any(|library| target.starts_with(library))
        })
        .collect();
    assert!(libraries.is_empty(), "{libraries:?}");
}

/// Lines of `output` that are the request line of the request with `id`.
fn request_lines<'a>(output: &'a str, id: &str) -> Vec<&'a str> {
    output
        .lines()
        .filter(|l| {
            l.starts_with("1bit serve: request ") && l.ends_with(&format!(" request_id={id}"))
        })
        .collect()
}

#[test]
fn debug_gives_one_line_per_request_on_both_engines_and_the_default_none() {
    let dir = temp_dir("observe-debug");
    let model = dummy_model(&dir, "m.gguf");
    let general = streamed_general();
    let serve = Serve::with_fake(
        &model,
        &[],
        &[("ONEBIT_LOG", "debug"), ("FAKE_SSE_INTERVAL_MS", "0")],
    );
    serve.ready();
    for n in 0..3 {
        post_with_id(&serve, STREAMED, Some(&format!("fast-{n}")));
        post_with_id(&serve, &general, Some(&format!("general-{n}")));
    }
    post_with_id(
        &serve,
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
        Some("whole"),
    );
    assert!(wait_until(Duration::from_secs(5), || !request_lines(
        &serve.output(),
        "whole"
    )
    .is_empty()));
    let output = serve.output();
    for n in 0..3 {
        for (id, engine) in [
            (format!("fast-{n}"), "fast"),
            (format!("general-{n}"), "general"),
        ] {
            let found = request_lines(&output, &id);
            assert_eq!(found.len(), 1, "{id}:\n{output}");
            let line = found[0];
            assert!(
                line.starts_with(
                    "1bit serve: request method=POST path=/v1/chat/completions status=200 "
                ) && line.contains(&format!(" engine={engine} backend=0 added_us="))
                    && line.contains(" bytes="),
                "{line}"
            );
        }
    }
    // A whole chat (its reply named: the general engine) has its line too.
    assert_eq!(request_lines(&output, "whole").len(), 1, "{output}");

    // The default level: the same requests, no request line, and serve's lines as they were.
    let quiet = Serve::with_fake(&model, &[], &[("FAKE_SSE_INTERVAL_MS", "0")]);
    quiet.ready();
    post_with_id(&quiet, STREAMED, Some("quiet-fast"));
    post_with_id(&quiet, &general, Some("quiet-general"));
    std::thread::sleep(Duration::from_millis(300));
    let output = quiet.output();
    assert!(!output.contains("1bit serve: request "), "{output}");
    assert!(!output.contains("quiet-"), "{output}");
    assert!(!output.contains("{\"time\""), "{output}");
}

#[test]
fn a_filter_tracing_cannot_read_is_one_line() {
    let out = std::process::Command::new(onebit())
        .args(["serve", "-m", "/nonexistent.gguf"])
        .env("ONEBIT_LOG", "info,=[")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("ONEBIT_LOG") && stderr.contains("use a level"),
        "{stderr}"
    );
}

/// One histogram's `_count` and `_sum` for the labels.
fn histogram(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> (f64, f64) {
    (
        sample(samples, &format!("{name}_count"), labels).unwrap_or(0.0),
        sample(samples, &format!("{name}_sum"), labels).unwrap_or(0.0),
    )
}

#[test]
fn the_histograms_time_a_streams_first_token_and_its_events_on_both_engines() {
    let dir = temp_dir("observe-histograms");
    let model = dummy_model(&dir, "m.gguf");
    // The fake's pacing: 5 content chunks 60 ms apart, the first at once.
    let serve = Serve::with_fake(&model, &[], &[("FAKE_SSE_INTERVAL_MS", "60")]);
    serve.ready();
    let general = streamed_general();
    for (engine, body) in [("fast", STREAMED), ("general", general.as_str())] {
        let (status, _, text) = post_with_id(&serve, body, None);
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("[DONE]"), "{text}");
        let (_, scraped) = get(&serve.url("/metrics"));
        let samples = parse_prometheus(&scraped);
        let labels = [("path_class", "chat"), ("engine", engine)];
        let (first, first_sum) = histogram(&samples, "onebit_time_to_first_token_seconds", &labels);
        assert_eq!(first, 1.0, "{engine}: one first token:\n{scraped}");
        assert!(
            first_sum < 5.0,
            "{engine}: the first chunk is sent at once: {first_sum} s"
        );
        let (events, events_sum) = histogram(&samples, "onebit_inter_token_seconds", &labels);
        // Four gaps of 60 ms between the five chunks at least; the role, final and [DONE]
        // events may share writes.
        assert!(events >= 4.0, "{engine}: {events} gaps:\n{scraped}");
        assert!(
            (0.2..10.0).contains(&events_sum),
            "{engine}: the gaps add up to about 4 x 60 ms: {events_sum} s"
        );
        let slow = sample(
            &samples,
            "onebit_inter_token_seconds_bucket",
            &[("path_class", "chat"), ("engine", engine), ("le", "0.025")],
        )
        .unwrap_or(f64::NAN);
        assert!(
            events - slow >= 4.0,
            "{engine}: at least four gaps over 25 ms ({slow} of {events} under):\n{scraped}"
        );
        let (whole, whole_sum) = histogram(&samples, "onebit_request_duration_seconds", &labels);
        assert_eq!(whole, 1.0, "{engine}:\n{scraped}");
        assert!(
            (0.2..10.0).contains(&whole_sum),
            "{engine}: the stream lasted about 5 x 60 ms: {whole_sum} s"
        );
        assert!(
            scraped.contains("# TYPE onebit_time_to_first_token_seconds histogram"),
            "{scraped}"
        );
        let top = samples.iter().any(|s| {
            s.name == "onebit_time_to_first_token_seconds_bucket"
                && s.labels
                    .get("le")
                    .is_some_and(|le| le.parse::<f64>() == Ok(120.0))
        });
        assert!(top, "buckets to 120 s:\n{scraped}");
    }
    let (_, scraped) = get(&serve.url("/metrics"));
    assert_eq!(
        sample(
            &parse_prometheus(&scraped),
            "onebit_requests_in_flight",
            &[]
        ),
        Some(0.0),
        "{scraped}"
    );
    assert!(
        sample(
            &parse_prometheus(&scraped),
            "onebit_busy_poll_pauses_total",
            &[]
        )
        .is_some(),
        "{scraped}"
    );
}

#[test]
fn polling_serve_never_changes_what_the_next_scrape_shows() {
    let dir = temp_dir("observe-status-reads");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let (status, _, text) = post_with_id(&serve, STREAMED, None);
    assert_eq!(status, 200, "{text}");
    let (_, first) = get(&serve.url("/metrics"));
    assert!(
        first.contains(r#"onebit_requests_total{path_class="chat""#),
        "the chat is counted:\n{first}"
    );
    // What a monitor and llama.cpp's own tests poll: health, models, props, slots, the scrape.
    for path in [
        "/health",
        "/v1/models",
        "/models",
        "/props",
        "/slots",
        "/metrics",
    ] {
        let (status, body) = get(&serve.url(path));
        assert!(status < 500, "{path}: {status} {body}");
    }
    let (_, second) = get(&serve.url("/metrics"));
    let own = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("onebit_requests") || l.starts_with("onebit_request_"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(own(&first), own(&second));
}

/// Phase 8 is one record for every engine: a stream whose client leaves after its first
/// event is counted and timed (`onebit_request_duration_seconds`) and has its line, on the
/// fast engine as on the general one.
#[test]
fn a_stream_whose_client_leaves_is_counted_timed_and_said_on_both_engines() {
    use std::io::{Read, Write};
    let dir = temp_dir("observe-left");
    let model = dummy_model(&dir, "m.gguf");
    // 5 chunks 400 ms apart: the client is gone well before the stream would end.
    let serve = Serve::with_fake(
        &model,
        &[],
        &[("FAKE_SSE_INTERVAL_MS", "400"), ("ONEBIT_LOG", "debug")],
    );
    serve.ready();
    let general = streamed_general();
    for (engine, body, chunked) in [
        ("fast", STREAMED, false),
        ("general", general.as_str(), true),
    ] {
        let request = raw_json_post(serve.port, "/v1/chat/completions", body, chunked);
        let mut client = std::net::TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
        client.write_all(&request).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("data: ") {
            let n = client.read(&mut buf).expect("the stream's first event");
            assert!(n > 0, "{engine}: the stream ended before its first event");
            seen.extend_from_slice(&buf[..n]);
        }
        drop(client);
        let labels = [("path_class", "chat"), ("engine", engine)];
        let timed = wait_until(Duration::from_secs(10), || {
            let (_, scraped) = get(&serve.url("/metrics"));
            histogram(
                &parse_prometheus(&scraped),
                "onebit_request_duration_seconds",
                &labels,
            )
            .0 == 1.0
        });
        let (_, scraped) = get(&serve.url("/metrics"));
        assert!(timed, "{engine}: the left stream is timed once:\n{scraped}");
        assert_eq!(
            requests_total_in(&scraped, &[("path_class", "chat"), ("engine", engine)]),
            1,
            "{engine}: counted once:\n{scraped}"
        );
        assert!(
            wait_until(Duration::from_secs(5), || serve
                .output()
                .contains(&format!("status=200 engine={engine} backend=0"))),
            "{engine}: its line:\n{}",
            serve.output()
        );
    }
}
