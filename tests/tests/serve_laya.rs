//! `1bit serve --laya` on fake backends, one per device the policy picks (cpu, and hrx with
//! `ONEBIT_HRX_PRESENT=1`): each class reaches its device, the `X-1bit-Route` header, the
//! decision reused on a later turn, the engine that carries them, any device's backend in
//! `/health`, the fallbacks, and the refusals (docs/laya.md).

use std::path::Path;
use std::process::Command;

use onebit_tests::*;
use serde_json::{Value, json};

/// The port serve started `device`'s backend on, from its start line.
fn port_of(output: &str, device: &str) -> String {
    let marker = format!(" on the {device} route (port ");
    let line = output
        .lines()
        .find(|l| l.starts_with("1bit serve: starting ") && l.contains(&marker))
        .unwrap_or_else(|| panic!("no {device} backend started:\n{output}"));
    let rest = &line[line.find(&marker).unwrap() + marker.len()..];
    rest[..rest.find(')').unwrap()].to_string()
}

/// POST a chat: (status, X-1bit-Route, the port of the backend that got it).
fn ask(serve: &Serve, record: &Path, messages: Value, stream: bool) -> (u16, String, String) {
    let body = json!({"messages": messages, "stream": stream}).to_string();
    let (status, route, _) =
        post_with_header(&serve.url("/v1/chat/completions"), &body, "x-1bit-route");
    let last = json_lines(record)
        .into_iter()
        .rev()
        .find(|r| r["path"] == "/v1/chat/completions")
        .expect("a chat reached a backend");
    let host = last["headers"]["host"].as_str().unwrap_or("").to_string();
    let port = host.rsplit(':').next().unwrap_or("").to_string();
    (status, route, port)
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn each_class_reaches_the_device_its_policy_names_and_says_so() {
    let dir = temp_dir("laya-route");
    let model = dummy_model(&dir, "Qwen3-4B-Q4_K_M.gguf");
    let policy = dir.join("policy.json");
    std::fs::write(
        &policy,
        json!({"min_confidence": 0.0, "default": "cpu", "classes": {
            "code": {"device": "hrx", "why": "test"},
            "prose": {"device": "cpu", "why": "test"},
            "short": {"device": "hrx", "why": "test"},
            "long_doc": {"device": "npu", "why": "no such device for a .gguf: falls back"}}})
        .to_string(),
    )
    .unwrap();
    let record = dir.join("backends.jsonl");
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--llama-server",
            fake_backend().to_str().unwrap(),
            "--laya",
            "--route-policy",
            policy.to_str().unwrap(),
        ],
        &[
            ("ONEBIT_HRX_PRESENT", "1"),
            ("FAKE_RECORD", record.to_str().unwrap()),
        ],
    );
    serve.ready();
    let out = serve.output();
    assert!(
        out.contains("1bit serve: laya: the rule-based classifier (keyword and length rules, not the Laya model; docs/laya.md), policy ")
            && out.contains("devices cpu, hrx (default first)"),
        "{out}"
    );
    assert!(
        out.contains("1bit serve: laya: npu is not a candidate: "),
        "{out}"
    );
    let (cpu, hrx) = (port_of(&out, "cpu"), port_of(&out, "hrx"));
    assert_ne!(cpu, hrx);

    let long = "A pasted report. ".repeat(70);
    for (text, class, device) in [
        ("Write a Rust function that sums a slice.", "code", &hrx),
        ("Write a poem about the sea at night.", "prose", &cpu),
        ("What is the capital of France?", "short", &hrx),
        (long.as_str(), "long_doc", &cpu),
    ] {
        let (status, route, port) = ask(&serve, &record, user(text), false);
        assert_eq!(status, 200, "{class}");
        let parts: Vec<&str> = route.split(' ').collect();
        assert_eq!(parts.len(), 3, "{class}: {route:?}");
        assert_eq!(parts[0], class, "{route}");
        let confidence: f64 = parts[1].parse().unwrap();
        assert!((0.0..=1.0).contains(&confidence), "{route}");
        let want = if device == &hrx { "hrx" } else { "cpu" };
        assert_eq!(parts[2], want, "{route}");
        assert_eq!(&port, device, "{class} reached port {port}");
    }
    assert!(
        serve
            .output()
            .contains("1bit serve: laya: long_doc 1.00 cpu"),
        "{}",
        serve.output()
    );

    // A later turn of the code conversation asks something short: it stays on hrx, under the
    // first decision, and no new decision is logged.
    let later = json!([
        {"role": "user", "content": "Write a Rust function that sums a slice."},
        {"role": "assistant", "content": "fn sum(v: &[i32]) -> i32 { v.iter().sum() }"},
        {"role": "user", "content": "Thanks!"}]);
    let first_route = ask(
        &serve,
        &record,
        user("Write a Rust function that sums a slice."),
        false,
    )
    .1;
    let (status, route, port) = ask(&serve, &record, later, true);
    assert_eq!(
        (status, route.as_str(), port.as_str()),
        (200, first_route.as_str(), hrx.as_str())
    );
    assert_eq!(
        serve.output().matches("1bit serve: laya: code ").count(),
        1,
        "{}",
        serve.output()
    );
    assert_eq!(
        serve.output().matches("1bit serve: laya: short ").count(),
        1
    );

    // Requests that open no conversation go where the rule says (the default device), unrouted.
    let (status, route, _) = post_with_header(
        &serve.url("/tokenize"),
        r#"{"content": "hi"}"#,
        "x-1bit-route",
    );
    assert_eq!((status, route.as_str()), (200, ""));

    // Laya reads each chat's body, so the general engine carried all six, streamed or not, and
    // counted them; the tokenize request it does not decide went fast.
    let general = [("engine", "general"), ("path_class", "chat")];
    assert_eq!(requests_total(&serve, &general), 6);
    assert_eq!(
        requests_total(&serve, &[("engine", "fast"), ("path_class", "chat")]),
        0
    );
    assert_eq!(
        requests_total(&serve, &[("engine", "fast"), ("path_class", "other")]),
        1
    );
}

#[test]
fn a_default_that_cannot_run_falls_back_to_the_auto_device() {
    // The built-in policy names hrx for everything; without HRX, the cpu route runs it all.
    let dir = temp_dir("laya-builtin");
    let model = dummy_model(&dir, "Qwen3-4B-Q4_K_M.gguf");
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--llama-server",
            fake_backend().to_str().unwrap(),
            "--laya",
        ],
        &[("ONEBIT_HRX_PRESENT", "0")],
    );
    serve.ready();
    let out = serve.output();
    assert!(
        out.contains("1bit serve: laya: hrx is not a candidate: the route does not run"),
        "{out}"
    );
    assert!(
        out.contains("the default device hrx does not run this model; falling back to cpu"),
        "{out}"
    );
    let body = json!({"messages": user("Write a poem about the sea at night.")}).to_string();
    let (status, route, _) =
        post_with_header(&serve.url("/v1/chat/completions"), &body, "x-1bit-route");
    assert_eq!(status, 200);
    assert!(
        route.starts_with("prose ") && route.ends_with(" cpu"),
        "{route}"
    );
}

/// `1bit serve ARGS` that must refuse to start: (exit status, what it printed). A serve that
/// starts anyway is killed after 10 s and reported as status -1.
fn refused(args: &[&str]) -> (i32, String) {
    let dir = temp_dir("laya-refused");
    let model = dummy_model(&dir, "m.gguf");
    let fake = fake_backend();
    let mut all = vec![
        "-m",
        model.to_str().unwrap(),
        "--llama-server",
        fake.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let mut serve = Serve::start(&all, &[]);
    let code = serve
        .wait_exit(std::time::Duration::from_secs(10))
        .and_then(|s| s.code())
        .unwrap_or(-1);
    (code, serve.output())
}

#[test]
fn refusals_are_one_line() {
    let dir = temp_dir("laya-bad-policy");
    let bad = dir.join("policy.json");
    std::fs::write(&bad, r#"{"classes": {"poetry": {"device": "cpu"}}}"#).unwrap();
    let bad = bad.to_str().unwrap().to_string();
    let no_device = dir.join("no-device.json");
    std::fs::write(&no_device, r#"{"classes": {"code": {"why": "fast"}}}"#).unwrap();
    let no_device = no_device.to_str().unwrap().to_string();
    for (args, says) in [
        (
            vec!["--laya", "--route-policy", bad.as_str()],
            format!(
                "1bit serve: route policy: unknown class \"poetry\" (the classes are code, prose, short, long_doc) in {bad}"
            ),
        ),
        (
            vec!["--laya", "--route-policy", no_device.as_str()],
            format!("1bit serve: route policy: class \"code\" needs a \"device\" in {no_device}"),
        ),
        (
            vec!["--laya-model", "/nonexistent/laya"],
            "1bit serve: --laya-model /nonexistent/laya: cannot read it".to_string(),
        ),
        (
            vec!["--laya", "--device", "cpu"],
            "1bit serve: --laya routes among devices; leave --device at auto (not cpu)".to_string(),
        ),
        (
            vec!["--route-policy", bad.as_str()],
            "1bit serve: --route-policy only applies with --laya".to_string(),
        ),
        (
            vec!["--laya", "--rpc", "127.0.0.1:1"],
            "1bit serve: --laya does not combine with --rpc".to_string(),
        ),
    ] {
        let (code, stderr) = refused(&args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(&says), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    }
}

/// The number after `key` in a memory line ("need 1.23 GiB", "KV/state 0.50").
fn gib_after(line: &str, key: &str) -> f64 {
    let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn the_memory_check_counts_every_device_together() {
    let dir = temp_dir("laya-mem");
    let model = dir.join("big.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "llama")
        .kv("llama.block_count", 32u32)
        .kv("llama.context_length", 32768u32)
        .kv("llama.embedding_length", 4096u32)
        .kv("llama.attention.head_count", 32u32)
        .write(&model)
        .unwrap();
    let policy = dir.join("policy.json");
    std::fs::write(
        &policy,
        r#"{"default": "cpu", "classes": {"code": {"device": "hrx"}}}"#,
    )
    .unwrap();
    let check = |extra: &[&str]| -> String {
        let out = Command::new(onebit())
            .args([
                "serve",
                "-m",
                model.to_str().unwrap(),
                "--ctx-size",
                "4096",
                "--mem-check",
            ])
            .args(["--llama-server", fake_backend().to_str().unwrap()])
            .args(extra)
            .env("ONEBIT_HRX_PRESENT", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout
            .lines()
            .find(|l| l.contains(" need "))
            .unwrap_or_else(|| panic!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
            .to_string()
    };
    let one = check(&["--device", "cpu"]);
    let both = check(&["--laya", "--route-policy", policy.to_str().unwrap()]);
    let (kv_one, kv_both) = (gib_after(&one, "KV/state "), gib_after(&both, "KV/state "));
    assert!(kv_one > 0.1, "{one}");
    assert!(
        (kv_both - 2.0 * kv_one).abs() < 0.02,
        "cpu and hrx together: {one} / {both}"
    );
}

#[test]
fn a_device_whose_backend_stops_answering_health_takes_serve_down() {
    // serve runs a plan per device; the health monitor asks every route about its own
    // backends, so the hrx backend (not the first plan's) going silent is /health's 503.
    let dir = temp_dir("laya-health");
    let model = dummy_model(&dir, "Qwen3-4B-Q4_K_M.gguf");
    let policy = dir.join("policy.json");
    std::fs::write(
        &policy,
        json!({"min_confidence": 0.0, "default": "cpu", "classes": {
            "code": {"device": "hrx", "why": "test"}}})
        .to_string(),
    )
    .unwrap();
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--llama-server",
            fake_backend().to_str().unwrap(),
            "--laya",
            "--route-policy",
            policy.to_str().unwrap(),
        ],
        &[("ONEBIT_HRX_PRESENT", "1")],
    );
    serve.ready();
    let out = serve.output();
    let (cpu, hrx) = (port_of(&out, "cpu"), port_of(&out, "hrx"));
    let body =
        json!({"messages": user("Write a Rust function that sums a slice. fake_health_hang")})
            .to_string();
    let (status, route, _) =
        post_with_header(&serve.url("/v1/chat/completions"), &body, "x-1bit-route");
    assert_eq!(status, 200);
    assert!(route.ends_with(" hrx"), "{route:?}");
    let mut last = (0, String::new());
    let went_down = wait_until(std::time::Duration::from_secs(8), || {
        last = get(&serve.url("/health"));
        last.0 == 503
    });
    assert!(went_down, "{last:?}");
    assert!(
        last.1
            .contains(&format!("the backend on port {hrx} did not answer")),
        "{}",
        last.1
    );
    assert!(!last.1.contains(&cpu), "{}", last.1);
}
