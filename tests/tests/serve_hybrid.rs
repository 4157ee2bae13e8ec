//! `1bit serve --device hybrid` against the fake backend and the test prefill provider: the
//! handoff as the backend sees it, the per-request line, every fallback, the refused flags.

use std::path::Path;
use std::time::{Duration, Instant};

use onebit_tests::*;

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hello there"}]}"#;
const SECS: fn(u64) -> Duration = Duration::from_secs;

/// serve on the hybrid route with the fake backend; `provider` adds `--prefill-provider`.
fn hybrid(model: &Path, provider: bool, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let fake = fake_backend();
    let provider_path = fake_prefill_provider();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "hybrid",
        "--llama-server",
        fake.to_str().unwrap(),
    ];
    if provider {
        args.extend(["--prefill-provider", provider_path.to_str().unwrap()]);
    }
    args.extend_from_slice(extra);
    Serve::start(&args, env)
}

/// The value after `flag` on serve's `starting llama-server` line.
fn backend_arg(serve: &Serve, flag: &str) -> String {
    let out = serve.output();
    let line = out
        .lines()
        .find(|l| l.contains("starting llama-server"))
        .unwrap_or_else(|| panic!("no start line: {out}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == flag)
        .unwrap_or_else(|| panic!("{flag} missing: {line}"));
    words[at + 1].to_string()
}

/// The numbers of each `hybrid: N prompt tokens: ...` line, in order.
fn handoff_lines(out: &str) -> Vec<(u64, f64, f64, f64)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("hybrid: ")?;
            let (n, rest) = rest.split_once(" prompt tokens: prefill ")?;
            let (prefill, rest) = rest.split_once(" ms, restore ")?;
            let (restore, rest) = rest.split_once(" ms, first byte ")?;
            let first = rest.strip_suffix(" ms")?;
            Some((
                n.parse().ok()?,
                prefill.parse().ok()?,
                restore.parse().ok()?,
                first.parse().ok()?,
            ))
        })
        .collect()
}

fn body_of(line: &serde_json::Value) -> serde_json::Value {
    serde_json::from_str(line["body"].as_str().unwrap_or("null")).unwrap_or_default()
}

#[test]
fn a_chat_is_prefilled_by_the_provider_restored_and_decoded_from_slot_0() {
    let dir = temp_dir("hybrid");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let log = dir.join("provider.jsonl");
    let serve = hybrid(
        &model,
        true,
        &[],
        &[
            ("FAKE_RECORD", record.to_str().unwrap()),
            ("FAKE_PREFILL_LOG", log.to_str().unwrap()),
            ("ONEBIT_HYBRID_ELFS", "/opt/npu/elfs"),
        ],
    );
    serve.ready();
    assert_eq!(backend_arg(&serve, "-np"), "1");
    let slot_dir = backend_arg(&serve, "--slot-save-path");
    let port = backend_arg(&serve, "--port");

    let (status, reply) = post(&serve.url("/v1/chat/completions"), CHAT);
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains("fake reply to: hello there"), "{reply}");
    assert!(
        serve.wait_output(" ms, first byte ", SECS(5)),
        "{}",
        serve.output()
    );
    // BOS, <|user|>, hello, there, <|assistant|>: the fake's template and tokenizer.
    let lines = handoff_lines(&serve.output());
    assert_eq!(lines.len(), 1, "{}", serve.output());
    let (n, prefill, restore, first) = lines[0];
    assert_eq!(n, 5);
    assert!(prefill >= 0.0 && restore >= 0.0 && first > 0.0, "{lines:?}");

    let seen = json_lines(&record);
    let asked: Vec<String> = seen
        .iter()
        .map(|l| {
            format!(
                "{}?{}",
                l["path"].as_str().unwrap(),
                l["query"].as_str().unwrap()
            )
        })
        .filter(|p| !p.starts_with("/health") && !p.starts_with("/slots?"))
        .collect();
    assert_eq!(
        asked,
        [
            "/apply-template?",
            "/tokenize?",
            "/completion?",
            "/slots/0?action=save",
            "/slots/0?action=erase",
            "/slots/0?action=restore",
            "/v1/chat/completions?",
        ],
        "the backend saw the handoff in order"
    );
    let find = |path: &str, query: &str| {
        json_lines(&record)
            .iter()
            .rfind(|l| l["path"] == path && l["query"] == query)
            .map(body_of)
            .unwrap()
    };
    let tokenize = find("/tokenize", "");
    assert_eq!(tokenize["add_special"], true);
    assert_eq!(tokenize["parse_special"], true);
    let forwarded = find("/v1/chat/completions", "");
    assert_eq!(forwarded["id_slot"], 0);
    assert_eq!(forwarded["cache_prompt"], true);
    assert_eq!(forwarded["messages"][0]["content"], "hello there");
    let restore = find("/slots/0", "action=restore");

    // The provider got the contract's argv and environment.
    let runs = json_lines(&log);
    let args: Vec<&str> = runs[0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "--tokens");
    assert!(args[1].starts_with(&slot_dir), "{args:?} in {slot_dir}");
    assert_eq!(args[2], "--out");
    assert_eq!(args[3], restore["filename"].as_str().unwrap());
    assert!(!args[3].contains('/'), "a bare name: {args:?}");
    assert_eq!(
        &args[4..],
        [
            "--model",
            model.to_str().unwrap(),
            "--elfs",
            "/opt/npu/elfs"
        ]
    );
    assert_eq!(runs[0]["backend_url"], format!("http://127.0.0.1:{port}"));
    assert_eq!(runs[0]["slot_dir"], slot_dir.as_str());
    // A provider that starts a llama-server of its own starts the decoder's.
    assert_eq!(
        runs[0]["llama_server"],
        fake_backend().to_str().unwrap(),
        "{runs:?}"
    );
    let left: Vec<_> = std::fs::read_dir(&slot_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "the handoff's files are gone: {left:?}");

    // Streamed, and a completion's prompt string: handed over too.
    let mut streamed: serde_json::Value = serde_json::from_str(CHAT).unwrap();
    streamed["stream"] = true.into();
    let events = sse(&serve.url("/v1/chat/completions"), &streamed.to_string());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let (status, reply) = post(
        &serve.url("/v1/completions"),
        r#"{"prompt":"one two three"}"#,
    );
    assert_eq!(status, 200, "{reply}");
    assert!(wait_until(SECS(5), || handoff_lines(&serve.output()).len() == 3));
    assert_eq!(
        handoff_lines(&serve.output())[2].0,
        4,
        "BOS and three words"
    );
    let completion = find("/v1/completions", "");
    assert_eq!(completion["id_slot"], 0);
    assert!(!serve.output().contains("fallback"), "{}", serve.output());

    // Slot actions stay serve's own.
    let (status, body) = post(&serve.url("/slots/0?action=save"), r#"{"filename":"x"}"#);
    assert_eq!(status, 501, "{body}");
}

#[test]
fn every_failure_is_said_and_the_request_goes_to_the_backend_as_it_came() {
    let dir = temp_dir("hybrid-fallback");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let mode = dir.join("mode");
    let provider = fake_prefill_provider();
    // Named by the environment this time, with a 1 s limit.
    let serve = hybrid(
        &model,
        false,
        &[],
        &[
            ("ONEBIT_HYBRID_PREFILL", provider.to_str().unwrap()),
            ("ONEBIT_HYBRID_PREFILL_TIMEOUT_S", "1"),
            ("FAKE_PREFILL_FILE", mode.to_str().unwrap()),
            ("FAKE_RECORD", record.to_str().unwrap()),
        ],
    );
    serve.ready();
    let cases = [
        ("fail", CHAT, "the provider failed (exit status: 3)"),
        ("hang", CHAT, "the provider did not finish within 1 s"),
        (
            "lie",
            CHAT,
            "the provider reported 6 tokens for a prompt of 5",
        ),
        ("nofile", CHAT, "the provider wrote no state file"),
        (
            "garbage",
            CHAT,
            "the restore into slot 0 failed: status 400: Unable to restore slot",
        ),
        (
            "short",
            CHAT,
            "slot 0 holds 4 tokens after the restore, not the prompt's 5",
        ),
        ("ok", r#"{"prompt":[5,6,7]}"#, "no text prompt"),
    ];
    for (behaviour, body, reason) in cases {
        std::fs::write(&mode, behaviour).unwrap();
        let path = if body.contains("messages") {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let started = Instant::now();
        let (status, reply) = post(&serve.url(path), body);
        assert_eq!(status, 200, "{behaviour}: {reply}");
        assert!(reply.contains("fake reply to:"), "{behaviour}: {reply}");
        let said = format!("hybrid: fallback: {reason}");
        assert!(
            serve.wait_output(&said, SECS(5)),
            "{behaviour}: {}",
            serve.output()
        );
        if behaviour == "hang" {
            assert!(started.elapsed() < SECS(4), "{:?}", started.elapsed());
        }
        let forwarded = json_lines(&record)
            .iter()
            .rfind(|l| l["path"] == path)
            .map(body_of)
            .unwrap();
        assert_eq!(
            forwarded,
            serde_json::from_str::<serde_json::Value>(body).unwrap()
        );
    }
    assert!(
        handoff_lines(&serve.output()).is_empty(),
        "{}",
        serve.output()
    );
    // The same serve hands over again once the provider behaves.
    std::fs::write(&mode, "ok").unwrap();
    assert_eq!(post(&serve.url("/v1/chat/completions"), CHAT).0, 200);
    assert!(wait_until(SECS(5), || handoff_lines(&serve.output()).len() == 1));
}

#[test]
fn without_a_provider_serve_says_so_once_and_relays_on_one_slot() {
    let dir = temp_dir("hybrid-none");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = hybrid(
        &model,
        false,
        &[],
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    serve.ready();
    assert_eq!(backend_arg(&serve, "-np"), "1");
    backend_arg(&serve, "--slot-save-path");
    for _ in 0..2 {
        let (status, reply) = post(&serve.url("/v1/chat/completions"), CHAT);
        assert_eq!(status, 200, "{reply}");
    }
    let out = serve.output();
    assert_eq!(out.matches("no prefill provider named").count(), 1, "{out}");
    let seen = json_lines(&record);
    assert!(
        seen.iter().all(|l| l["path"] != "/apply-template"),
        "no handoff"
    );
    let forwarded = seen
        .iter()
        .rfind(|l| l["path"] == "/v1/chat/completions")
        .map(body_of)
        .unwrap();
    assert_eq!(
        forwarded,
        serde_json::from_str::<serde_json::Value>(CHAT).unwrap()
    );
}

#[test]
fn refused_flags_exit_2_and_print_backend_exits_5() {
    let dir = temp_dir("hybrid-refused");
    let model = dummy_model(&dir, "m.gguf");
    let cases: [(&[&str], &str); 9] = [
        (
            &["--parallel", "2"],
            "--parallel 2: --device hybrid runs one slot",
        ),
        (
            &["--mtp", "head.gguf"],
            "--mtp cannot be used with --device hybrid",
        ),
        (
            &["--dflash", "d.gguf"],
            "--dflash cannot be used with --device hybrid",
        ),
        (
            &["--mmproj", "p.gguf"],
            "--mmproj cannot be used with --device hybrid",
        ),
        (
            &["--moe-slots", "4"],
            "--moe-slots cannot be used with --device hybrid",
        ),
        (
            &["--embedding"],
            "--embedding cannot be used with --device hybrid",
        ),
        (
            &["--reranking"],
            "--reranking cannot be used with --device hybrid",
        ),
        (&["--pm"], "--pm cannot be used with --device hybrid"),
        (
            &["--embed", "side.gguf"],
            "--embed cannot be used with --device hybrid",
        ),
    ];
    for (extra, expected) in cases {
        let mut serve = hybrid(&model, true, extra, &[]);
        let exit = serve.wait_exit(SECS(10)).expect("serve exits at once");
        assert_eq!(exit.code(), Some(2), "{extra:?}: {}", serve.output());
        assert!(
            serve.output().contains(expected),
            "{extra:?}: {}",
            serve.output()
        );
        assert!(serve.output().contains(&format!("remove {}", extra[0])));
    }
    let mut serve = hybrid(&model, true, &["--print-backend"], &[]);
    let exit = serve.wait_exit(SECS(10)).expect("serve exits at once");
    assert_eq!(exit.code(), Some(5), "{}", serve.output());
    assert!(
        serve
            .output()
            .contains("--device hybrid needs 1bit serve in the request path"),
        "{}",
        serve.output()
    );
}

#[test]
fn concurrent_handoffs_take_turns_until_each_reply_starts() {
    let dir = temp_dir("hybrid-turns");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = hybrid(
        &model,
        true,
        &[],
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    serve.ready();
    let url = serve.url("/v1/chat/completions");
    std::thread::scope(|s| {
        let asks: Vec<_> = (0..3)
            .map(|i| {
                let url = &url;
                s.spawn(move || {
                    let body = format!(
                        r#"{{"messages":[{{"role":"user","content":"request {i} fake_slow_ms=200"}}]}}"#
                    );
                    post(url, &body)
                })
            })
            .collect();
        for ask in asks {
            let (status, reply) = ask.join().unwrap();
            assert_eq!(status, 200, "{reply}");
        }
    });
    // Each handoff runs whole, its restore followed by its own chat, before the next begins.
    let paths: Vec<String> = json_lines(&record)
        .iter()
        .filter(|l| l["path"] != "/health" && l["path"] != "/slots")
        .map(|l| l["path"].as_str().unwrap().to_string())
        .collect();
    let one = [
        "/apply-template",
        "/tokenize",
        "/completion",
        "/slots/0",
        "/slots/0",
        "/slots/0",
        "/v1/chat/completions",
    ];
    assert_eq!(paths, one.repeat(3), "handoffs never interleave");
    assert!(wait_until(SECS(5), || handoff_lines(&serve.output()).len() == 3));
}

#[test]
fn the_decoder_is_the_hrx_llama_server_where_the_machine_has_hrx() {
    let dir = temp_dir("hybrid-hrx");
    let model = dummy_model(&dir, "m.gguf");
    for (present, expected, strict) in
        [("1", "--device HRX0 -ngl 99", true), ("0", "-ngl 0", false)]
    {
        let serve = hybrid(&model, false, &[], &[("ONEBIT_HRX_PRESENT", present)]);
        serve.ready();
        let pid = serve.children()[0];
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
            .unwrap()
            .replace('\0', " ");
        assert!(cmdline.contains(expected), "{cmdline}");
        assert!(cmdline.contains("-np 1 --slot-save-path"), "{cmdline}");
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let environ = String::from_utf8_lossy(&environ);
        assert_eq!(
            environ.split('\0').any(|v| v == "GGML_HRX_STRICT=1"),
            strict,
            "strict placement on every hrx backend"
        );
    }
}

/// `--max-generation-s`: a route's forward is bounded as the reply it leads to: a provider
/// that hangs in the route's forward past the deadline gives the client a 504 at the deadline,
/// not the fallback's answer after the provider's own limit.
#[test]
fn the_generation_deadline_bounds_a_routes_forward() {
    let dir = temp_dir("hybrid-deadline");
    let model = dummy_model(&dir, "m.gguf");
    let mode = dir.join("mode");
    std::fs::write(&mode, "hang").unwrap();
    let provider = fake_prefill_provider();
    let serve = hybrid(
        &model,
        false,
        &["--max-generation-s", "1"],
        &[
            ("ONEBIT_HYBRID_PREFILL", provider.to_str().unwrap()),
            ("ONEBIT_HYBRID_PREFILL_TIMEOUT_S", "10"),
            ("FAKE_PREFILL_FILE", mode.to_str().unwrap()),
        ],
    );
    serve.ready();
    let began = Instant::now();
    let (status, body) = post(&serve.url("/v1/chat/completions"), CHAT);
    assert_eq!(status, 504, "{body}\n{}", serve.output());
    assert!(began.elapsed() < SECS(5), "{:?}", began.elapsed());
    assert!(body.contains("--max-generation-s"), "{body}");
    assert_eq!(generation_deadlines(&serve), Some(1.0));
}
