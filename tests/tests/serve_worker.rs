//! serve as a gateway's worker (docs/fleet.md), on the fake backend: what SMG asks of a worker
//! is answered from what llama-server says (`/get_server_info` and `/model_info` from its
//! `/props`, `/v1/loads` from its `/slots` and serve's generations in flight), what would make
//! SMG take serve for another engine stays 404; and the drain's notice: at SIGTERM `/health`
//! answers 503 `draining` at once while serve goes on answering new connections for
//! `--drain-notice-s`, and only then refuses them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::*;

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// A stream of `events` chunks at the fake's pace, read to its end on its own thread.
fn stream(port: u16) -> std::thread::JoinHandle<String> {
    let body = r#"{"stream":true,"messages":[{"role":"user","content":"hello"}]}"#;
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).unwrap();
    std::thread::spawn(move || {
        let mut reply = String::new();
        let _ = tcp.read_to_string(&mut reply);
        reply
    })
}

#[test]
fn a_gateway_reads_the_workers_model_slots_context_and_load_from_llama_server() {
    let dir = temp_dir("worker-info");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(
        &model,
        &["--alias", "fleet-model", "--ctx-size", "2048"],
        &[
            ("FAKE_SLOTS", "1"),
            ("FAKE_SSE_EVENTS", "20"),
            ("FAKE_SSE_INTERVAL_MS", "100"),
        ],
    );
    serve.ready();

    let (status, info) = get(&serve.url("/get_server_info"));
    assert_eq!(status, 200, "{info}");
    let info = json(&info);
    assert_eq!(info["served_model_name"], "fleet-model", "{info}");
    assert_eq!(info["model_path"], model.to_str().unwrap(), "{info}");
    assert_eq!(info["context_length"], 2048, "{info}");
    assert_eq!(info["max_running_requests"], 1, "{info}");
    assert!(
        info["version"].as_str().unwrap().starts_with("1bit "),
        "{info}"
    );
    for path in ["/model_info", "/get_model_info"] {
        let (status, body) = get(&serve.url(path));
        assert_eq!(status, 200, "{path}: {body}");
        assert_eq!(json(&body)["model_path"], model.to_str().unwrap(), "{body}");
    }
    // A 200 on /version or /server_info would make SMG register serve as vLLM or SGLang.
    for path in ["/version", "/server_info", "/loads"] {
        assert_eq!(get(&serve.url(path)).0, 404, "{path}");
    }

    let load = |serve: &Serve| {
        let (status, body) = get(&serve.url("/v1/loads?include=core,disagg,queues,memory"));
        assert_eq!(status, 200, "{body}");
        let body = json(&body);
        assert_eq!(body["dp_rank_count"], 1, "{body}");
        let rank = body["loads"][0].clone();
        assert_eq!(rank["max_running_requests"], 1, "{body}");
        (
            rank["num_running_reqs"].as_u64().unwrap(),
            rank["num_waiting_reqs"].as_u64().unwrap(),
        )
    };
    assert_eq!(load(&serve), (0, 0));
    // Three streams on one slot: one runs, two wait their turn in llama-server.
    let streams: Vec<_> = (0..3).map(|_| stream(serve.port)).collect();
    assert!(
        wait_until(Duration::from_secs(5), || load(&serve) == (1, 2)),
        "{:?}",
        load(&serve)
    );
    for s in streams {
        assert!(s.join().unwrap().contains("[DONE]"));
    }
    assert_eq!(load(&serve), (0, 0));
}

#[test]
fn a_backend_without_slots_is_said_to_report_no_load() {
    let dir = temp_dir("worker-no-slots");
    let model = dummy_model(&dir, "m.gguf");
    // `--port` before `--`: what follows goes to the backend.
    let port = free_port();
    let mut command = std::process::Command::new(onebit());
    command
        .arg("serve")
        .arg("-m")
        .arg(&model)
        .args(["--device", "cpu", "--llama-server"])
        .arg(fake_backend())
        .args(["--port", &port.to_string(), "--", "--no-slots"])
        .env("ONEBIT_STATE_DIR", temp_dir("worker-no-slots-state"));
    let serve = Serve::spawn(command, port);
    serve.ready();
    let (status, body) = get(&serve.url("/v1/loads"));
    assert_eq!(status, 501, "{body}");
    assert_eq!(
        json(&body)["error"]["type"],
        "not_supported_error",
        "{body}"
    );
}

#[test]
fn at_sigterm_health_says_draining_while_serve_answers_for_the_notice_then_refuses() {
    let dir = temp_dir("worker-notice");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--drain-notice-s", "2", "--drain-s", "5"],
        &[("FAKE_SSE_EVENTS", "4"), ("FAKE_SSE_INTERVAL_MS", "100")],
    );
    serve.ready();
    let backend = serve.children()[0];
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    assert!(
        wait_until(Duration::from_millis(500), || get(&serve.url("/health")).0
            == 503),
        "{}",
        serve.output()
    );
    let (_, health) = get(&serve.url("/health"));
    assert_eq!(json(&health)["status"], "draining", "{health}");
    // New connections are still answered, whole and streamed, during the notice.
    let (status, reply) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"still there?"}]}"#,
    );
    assert_eq!(status, 200, "{reply}");
    assert!(stream(serve.port).join().unwrap().contains("[DONE]"));
    assert!(
        signalled.elapsed() < Duration::from_millis(1800),
        "the checks took the notice: {:?}",
        signalled.elapsed()
    );
    // Then the listener closes, and serve is gone within the window.
    assert!(
        wait_until(Duration::from_secs(4), || {
            TcpStream::connect(("127.0.0.1", serve.port)).is_err()
        }),
        "{}",
        serve.output()
    );
    let refused_after = signalled.elapsed();
    assert!(
        refused_after >= Duration::from_millis(1900),
        "refused before the notice ended: {refused_after:?}"
    );
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    let within = onebit_tests::bounds::stop_within(Duration::from_secs(5));
    assert!(
        signalled.elapsed() < within,
        "{:?} (bound {within:?})",
        signalled.elapsed()
    );
    assert!(!alive(backend));
    assert!(
        serve
            .output()
            .contains("SIGTERM: /health answers 503 (draining); still answering for 2.0 s"),
        "{}",
        serve.output()
    );
}

#[test]
fn a_notice_longer_than_the_drain_window_is_cut_to_it() {
    let dir = temp_dir("worker-notice-window");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(&model, &["--drain-notice-s", "30", "--drain-s", "1"], &[]);
    serve.ready();
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    let took = signalled.elapsed();
    let within = onebit_tests::bounds::stop_within(Duration::from_secs(1));
    assert!(
        (Duration::from_millis(900)..within).contains(&took),
        "{took:?} (bound {within:?})"
    );
    let mut bad = Serve::with_fake(&model, &["--drain-notice-s=-1"], &[]);
    let status = bad.wait_exit(Duration::from_secs(10)).expect("refused");
    assert_eq!(status.code(), Some(2), "{}", bad.output());
    assert!(
        bad.output().contains("--drain-notice-s -1"),
        "{}",
        bad.output()
    );
}
