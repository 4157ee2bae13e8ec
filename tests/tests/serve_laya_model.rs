//! `1bit serve --laya-model` with a stand-in Laya daemon (`fake-laya`, written from the
//! protocol in docs/laya.md) and fake backends for cpu and hrx (`ONEBIT_HRX_PRESENT=1`): the
//! daemon started with the GGUF, the family, the device and the HSA runtime; each new
//! conversation's text asked of it with the three classes in order, its answer routed through
//! the policy; long documents not asked; its faults at start (exit 1) and while serving (the
//! rules decide, said once, counted); its end with serve and with a `kill -9` of serve.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::*;
use serde_json::{Value, json};

fn fake_laya() -> PathBuf {
    let path = bin_dir().join("fake-laya");
    assert!(path.exists(), "{} is not built", path.display());
    path
}

/// A test's files: the model, a Laya folder with its GGUF in gguf/, the policy, where the
/// backends and the daemon record what they got, and an HSA runtime path to pass.
struct Files {
    dir: PathBuf,
    model: PathBuf,
    folder: PathBuf,
    gguf: PathBuf,
    policy: PathBuf,
    backends: PathBuf,
    asked: PathBuf,
    libhsa: PathBuf,
}

fn files(name: &str) -> Files {
    let dir = temp_dir(name);
    let model = dummy_model(&dir, "Qwen3-4B-Q4_K_M.gguf");
    let folder = dir.join("laya");
    std::fs::create_dir_all(folder.join("gguf")).unwrap();
    let gguf = folder.join("gguf/laya-typed-decisions-Q8_0.gguf");
    std::fs::write(
        &gguf,
        b"GGUF\x03\0\0\0 a stand-in: fake-laya reads nothing of it",
    )
    .unwrap();
    std::fs::write(folder.join("gguf/laya-english-f16.gguf"), b"GGUF\x03\0\0\0").unwrap();
    let policy = dir.join("policy.json");
    std::fs::write(
        &policy,
        json!({"min_confidence": 0.0, "default": "cpu", "classes": {
            "code": {"device": "hrx", "why": "test"},
            "prose": {"device": "cpu", "why": "test"},
            "short": {"device": "hrx", "why": "test"},
            "long_doc": {"device": "hrx", "why": "test"}}})
        .to_string(),
    )
    .unwrap();
    Files {
        backends: dir.join("backends.jsonl"),
        asked: dir.join("asked.jsonl"),
        libhsa: dir.join("rocm/lib/libhsa-runtime64.so.1"),
        dir,
        model,
        folder,
        gguf,
        policy,
    }
}

/// serve with `--laya-model` on the Laya folder, the fake daemon as the runtime, `extra`
/// environment on top.
fn serve_with(f: &Files, env: &[(&str, &str)]) -> Serve {
    let fake = fake_backend();
    let laya = fake_laya();
    let mut all = vec![
        ("ONEBIT_HRX_PRESENT", "1"),
        ("FAKE_RECORD", f.backends.to_str().unwrap()),
        ("FAKE_LAYA_RECORD", f.asked.to_str().unwrap()),
        ("ONEBIT_LAYA_GGML", laya.to_str().unwrap()),
    ];
    all.extend_from_slice(env);
    Serve::start(
        &[
            "-m",
            f.model.to_str().unwrap(),
            "--llama-server",
            fake.to_str().unwrap(),
            "--laya-model",
            f.folder.to_str().unwrap(),
            "--route-policy",
            f.policy.to_str().unwrap(),
            "--hrx-libhsa",
            f.libhsa.to_str().unwrap(),
        ],
        &all,
    )
}

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

/// POST a new conversation: (status, X-1bit-Route, the port of the backend that got it).
fn ask(serve: &Serve, f: &Files, messages: Value) -> (u16, String, String) {
    let body = json!({"messages": messages}).to_string();
    let (status, route, _) =
        post_with_header(&serve.url("/v1/chat/completions"), &body, "x-1bit-route");
    let last = json_lines(&f.backends)
        .into_iter()
        .rev()
        .find(|r| r["path"] == "/v1/chat/completions")
        .expect("a chat reached a backend");
    let host = last["headers"]["host"].as_str().unwrap_or("").to_string();
    (
        status,
        route,
        host.rsplit(':').next().unwrap_or("").to_string(),
    )
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// What the daemon recorded: its start (argv, pid, HSA runtime), then each line it was sent.
fn daemon_record(f: &Files) -> (Value, Vec<String>) {
    let text = std::fs::read_to_string(&f.asked).unwrap_or_default();
    let mut lines = text.lines();
    let start = lines
        .next()
        .map(|l| serde_json::from_str(l).unwrap())
        .unwrap_or(Value::Null);
    (start, lines.map(str::to_string).collect())
}

fn daemon_pid(f: &Files) -> u32 {
    let (start, _) = daemon_record(f);
    start["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("the daemon did not start: {start}")) as u32
}

fn metrics(serve: &Serve) -> String {
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    text
}

#[test]
fn the_daemon_decides_each_new_conversation_and_stops_with_serve() {
    let f = files("laya-model");
    let mut serve = serve_with(&f, &[]);
    serve.ready();
    let out = serve.output();
    let gguf = f.gguf.to_str().unwrap();
    assert!(
        out.contains(&format!(
            "1bit serve: laya: starting the Laya daemon: IREE_HAL_AMDGPU_LIBHSA_PATH={} {} daemon {gguf} --family typed-decisions --device hrx",
            f.libhsa.display(),
            fake_laya().display()
        )),
        "{out}"
    );
    let said: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("devices cpu, hrx (default first)"))
        .collect();
    assert_eq!(said.len(), 1, "{out}");
    assert!(
        said[0].starts_with(&format!(
            "1bit serve: laya: the Laya model ({gguf} on hrx, by the laya daemon, pid "
        )),
        "{out}"
    );
    let (start, asked) = daemon_record(&f);
    assert_eq!(
        start["argv"],
        json!([
            "daemon",
            gguf,
            "--family",
            "typed-decisions",
            "--device",
            "hrx"
        ])
    );
    assert_eq!(start["libhsa"], f.libhsa.to_str().unwrap());
    assert!(asked.is_empty(), "asked before any request: {asked:?}");
    let (cpu, hrx) = (port_of(&out, "cpu"), port_of(&out, "hrx"));

    let texts = [
        (
            "Write a function that reverses a list.",
            "code 0.87 hrx",
            &hrx,
        ),
        ("Explain how the tides work.", "prose 0.73 cpu", &cpu),
        ("What is 2+2?", "short 0.64 hrx", &hrx),
    ];
    for (text, route, port) in texts {
        let got = ask(&serve, &f, user(text));
        assert_eq!(got, (200, route.to_string(), port.clone()), "{text}");
    }
    let (_, asked) = daemon_record(&f);
    assert_eq!(asked.len(), 3, "{asked:?}");
    for ((text, _, _), line) in texts.iter().zip(&asked) {
        let value: Value = serde_json::from_str(line).unwrap();
        assert_eq!(value["state"], *text, "{line}");
        let question = &value["questions"]["cls"];
        assert_eq!(question["type"], "choice", "{line}");
        let criteria = question["criteria"].as_object().unwrap();
        assert_eq!(criteria.len(), 3, "{line}");
        let at = |k: &str| line.find(&format!("\"{k}\":")).unwrap();
        assert!(
            at("criteria") < at("code") && at("code") < at("prose") && at("prose") < at("short"),
            "the classes in order: {line}"
        );
    }
    assert!(out.len() < serve.output().len());
    assert!(
        serve
            .output()
            .contains("1bit serve: laya: prose 0.73 cpu\n"),
        "{}",
        serve.output()
    );

    // A long document is long_doc by size: the daemon is not asked.
    let long = "A pasted report. ".repeat(70);
    let got = ask(&serve, &f, user(&long));
    assert_eq!(got, (200, "long_doc 1.00 hrx".to_string(), hrx.clone()));
    // A later turn keeps its conversation's decision: not asked again.
    let later = json!([
        {"role": "user", "content": "Explain how the tides work."},
        {"role": "assistant", "content": "The moon."},
        {"role": "user", "content": "Write a function for it."}]);
    assert_eq!(
        ask(&serve, &f, later),
        (200, "prose 0.73 cpu".to_string(), cpu)
    );
    assert_eq!(daemon_record(&f).1.len(), 3);

    let text = metrics(&serve);
    assert!(text.contains("onebit_laya_scorer_up 1\n"), "{text}");
    assert!(
        text.contains("onebit_laya_fallbacks_total{reason=\"timeout\"} 0\n"),
        "{text}"
    );

    // serve's stop stops the daemon too (its stdin closed: its own cue to exit), and does not
    // report its end as a death.
    let pid = daemon_pid(&f);
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(15))
        .expect("serve stops");
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    assert!(!alive(pid), "the daemon outlived serve");
    let (_, lines) = daemon_record(&f);
    assert_eq!(
        lines.last().map(String::as_str),
        Some(r#"{"ended":"stdin closed"}"#),
        "serve closed the daemon's stdin before it exited"
    );
    assert!(
        !serve.output().contains("from now on"),
        "{}",
        serve.output()
    );
}

#[test]
fn kill_9_of_serve_leaves_no_daemon() {
    // The daemon is busy with a question (10 s), so it would not see its stdin end: only
    // its parent-death signal ends it with serve.
    let f = files("laya-model-kill9");
    let serve = serve_with(
        &f,
        &[
            ("FAKE_LAYA_DELAY_MS", "10000"),
            ("ONEBIT_LAYA_ANSWER_MS", "200"),
        ],
    );
    serve.ready();
    let pid = daemon_pid(&f);
    assert!(
        descendants(serve.pid()).contains(&pid),
        "the daemon is serve's"
    );
    let (status, _, _) = ask(&serve, &f, user("Write a function that sums a slice."));
    assert_eq!(status, 200);
    kill9_leaves_nothing(serve);
    assert!(!alive(pid));
}

/// serve that must not start: (exit status, everything it printed).
fn refused(f: &Files, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let fake = fake_backend();
    let mut all = vec![
        "-m",
        f.model.to_str().unwrap(),
        "--llama-server",
        fake.to_str().unwrap(),
        "--route-policy",
        f.policy.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let mut env = env.to_vec();
    env.push(("ONEBIT_HRX_PRESENT", "1"));
    env.push(("FAKE_LAYA_RECORD", f.asked.to_str().unwrap()));
    let mut serve = Serve::start(&all, &env);
    let code = serve
        .wait_exit(Duration::from_secs(20))
        .and_then(|s| s.code())
        .unwrap_or(-1);
    (code, serve.output())
}

#[test]
fn a_daemon_that_cannot_start_or_answer_at_start_is_one_line_and_exit_1() {
    let f = files("laya-model-start");
    let folder = f.folder.to_str().unwrap().to_string();
    let laya = fake_laya().to_str().unwrap().to_string();
    let not_executable = f.dir.join("laya-not-executable");
    std::fs::write(&not_executable, b"#!/bin/sh\n").unwrap();
    let missing = f.dir.join("no-laya");
    let empty_path = temp_dir("laya-empty-path");
    let cases: [(&[(&str, &str)], String); 5] = [
        (
            &[("ONEBIT_LAYA_GGML", missing.to_str().unwrap())],
            format!(
                "1bit serve: laya: ONEBIT_LAYA_GGML {}: no such file",
                missing.display()
            ),
        ),
        (
            &[("ONEBIT_LAYA_GGML", not_executable.to_str().unwrap())],
            format!(
                "1bit serve: laya: ONEBIT_LAYA_GGML {}: not an executable file",
                not_executable.display()
            ),
        ),
        (
            &[
                ("ONEBIT_LAYA_GGML", ""),
                ("PATH", empty_path.to_str().unwrap()),
            ],
            "1bit serve: laya: --laya-model needs ggmlc's laya runtime, and there is no executable laya on PATH".to_string(),
        ),
        (
            &[
                ("ONEBIT_LAYA_GGML", &laya),
                ("FAKE_LAYA_MODE", "never_ready"),
                ("ONEBIT_LAYA_READY_S", "1"),
            ],
            "did not say it was ready within 1 s (ONEBIT_LAYA_READY_S)".to_string(),
        ),
        (
            &[("ONEBIT_LAYA_GGML", &laya), ("FAKE_LAYA_MODE", "exit_at_start")],
            "exited with status 3 before it said it was ready (its last line: fake-laya: cannot open the model)".to_string(),
        ),
    ];
    for (env, says) in cases {
        let _ = std::fs::remove_file(&f.asked);
        let (code, out) = refused(&f, &["--laya-model", &folder], env);
        assert_eq!(code, 1, "{env:?}: {out}");
        let last = out.trim().lines().last().unwrap_or("");
        assert!(last.contains(&says), "{env:?}: {out}");
        assert_eq!(out.matches(&says).count(), 1, "one line: {out}");
        assert!(
            !out.contains("1bit serve: starting "),
            "no backend starts: {out}"
        );
        if let Some(pid) = daemon_record(&f).0["pid"].as_u64() {
            assert!(!alive(pid as u32), "{env:?}: the daemon was left running");
        }
    }
}

#[test]
fn a_model_path_that_is_no_gguf_is_refused_in_one_line() {
    let f = files("laya-model-path");
    let text = f.dir.join("notes.gguf");
    std::fs::write(&text, b"not a gguf").unwrap();
    let bare = temp_dir("laya-bare");
    let empty = temp_dir("laya-empty");
    std::fs::create_dir_all(empty.join("gguf")).unwrap();
    let nothing = f.dir.join("nothing");
    for (path, says) in [
        (&nothing, "cannot read it"),
        (&text, "not a GGUF file (it does not start with GGUF)"),
        (&bare, "a folder without a gguf/ subfolder"),
        (&empty, "its gguf/ subfolder holds no GGUF file"),
    ] {
        let (code, out) = refused(
            &f,
            &["--laya-model", path.to_str().unwrap()],
            &[("ONEBIT_LAYA_GGML", fake_laya().to_str().unwrap())],
        );
        assert_eq!(code, 2, "{path:?}: {out}");
        assert_eq!(out.trim().lines().count(), 1, "{path:?}: {out}");
        assert!(
            out.starts_with(&format!(
                "1bit serve: --laya-model {}: {says}",
                path.display()
            )) && out.contains(
                "; pass the Laya GGUF (typed-decisions) or the Laya folder that holds it in gguf/"
            ),
            "{out}"
        );
        assert!(!f.asked.exists(), "the daemon started");
    }
    // --laya-model implies --laya: what --laya refuses, it refuses, before the daemon starts.
    let cache = f.dir.join("prompt-cache");
    let (code, out) = refused(
        &f,
        &[
            "--laya-model",
            f.folder.to_str().unwrap(),
            "--prompt-cache-dir",
            cache.to_str().unwrap(),
        ],
        &[("ONEBIT_LAYA_GGML", fake_laya().to_str().unwrap())],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("1bit serve: --prompt-cache-dir: --laya moves conversations between devices"),
        "{out}"
    );
    assert!(!f.asked.exists(), "the daemon started");
}

/// The rules' header for `text`: a class and a confidence that are not the daemon's.
fn by_the_rules(route: &str, class: &str, daemons: &str) {
    assert!(route.starts_with(&format!("{class} ")), "{route}");
    assert!(!route.contains(daemons), "{route}: the daemon's answer");
}

#[test]
fn an_answer_outside_the_protocol_goes_to_the_rules_said_once() {
    let f = files("laya-model-garbage");
    let serve = serve_with(
        &f,
        &[("FAKE_LAYA_MODE", "garbage"), ("ONEBIT_LAYA_DEVICE", "cpu")],
    );
    serve.ready();
    let (start, _) = daemon_record(&f);
    assert_eq!(start["argv"][5], "cpu");
    assert_eq!(start["libhsa"], Value::Null, "no HSA runtime off hrx");
    let (status, route, _) = ask(&serve, &f, user("Write a Rust function that sums a slice."));
    assert_eq!(status, 200);
    by_the_rules(&route, "code", "0.87");
    let (status, route, _) = ask(&serve, &f, user("Write a poem about the sea at night."));
    assert_eq!(status, 200);
    by_the_rules(&route, "prose", "0.73");
    let out = serve.output();
    let said = "failed a question: not a JSON line: the answer is code, probably; the rule-based classifier decides that conversation";
    assert_eq!(out.matches(said).count(), 1, "{out}");
    let text = metrics(&serve);
    assert!(
        text.contains("onebit_laya_fallbacks_total{reason=\"bad_answer\"} 2\n"),
        "{text}"
    );
    assert!(text.contains("onebit_laya_scorer_up 1\n"), "{text}");
}

#[test]
fn a_late_answer_goes_to_the_rules_and_the_next_answers_stay_in_step() {
    let f = files("laya-model-slow");
    let serve = serve_with(
        &f,
        &[
            ("FAKE_LAYA_SLOW_FIRST_MS", "1500"),
            ("ONEBIT_LAYA_ANSWER_MS", "300"),
        ],
    );
    serve.ready();
    let asked = Instant::now();
    let (status, route, _) = ask(&serve, &f, user("Write a function that sums a slice."));
    let took = asked.elapsed();
    assert_eq!(status, 200);
    assert!(took < Duration::from_millis(1200), "held up {took:?}");
    by_the_rules(&route, "code", "0.87");
    let out = serve.output();
    assert_eq!(
        out.matches("failed a question: it did not answer within 300 ms (ONEBIT_LAYA_ANSWER_MS)")
            .count(),
        1,
        "{out}"
    );
    // Once the late answer is in, the next questions get their own answers, not the one
    // owed to the first.
    std::thread::sleep(Duration::from_millis(1600).saturating_sub(asked.elapsed()));
    let (_, route, _) = ask(&serve, &f, user("Explain how the tides work."));
    assert_eq!(route, "prose 0.73 cpu");
    let (_, route, _) = ask(&serve, &f, user("What is 2+2?"));
    assert_eq!(route, "short 0.64 hrx");
    let text = metrics(&serve);
    assert!(
        text.contains("onebit_laya_fallbacks_total{reason=\"timeout\"} 1\n"),
        "{text}"
    );
}

#[test]
fn the_daemons_death_is_said_shown_in_metrics_and_the_rules_take_over() {
    let f = files("laya-model-death");
    let serve = serve_with(
        &f,
        &[
            ("FAKE_LAYA_MODE", "die_after"),
            ("FAKE_LAYA_DIE_AFTER", "1"),
        ],
    );
    serve.ready();
    let pid = daemon_pid(&f);
    let (_, route, _) = ask(&serve, &f, user("Write a function that sums a slice."));
    assert_eq!(route, "code 0.87 hrx");
    let line = format!(
        "1bit serve: laya: the Laya daemon (pid {pid}) exited with status 3 (its last line: fake-laya: dying after 1 answers); the rule-based classifier decides every new conversation from now on (onebit_laya_scorer_up 0)"
    );
    assert!(
        serve.wait_output(&line, Duration::from_secs(5)),
        "{}",
        serve.output()
    );
    assert!(metrics(&serve).contains("onebit_laya_scorer_up 0\n"));
    for text in [
        "Write a poem about the sea at night.",
        "Write a story about a lighthouse keeper.",
    ] {
        let (status, route, _) = ask(&serve, &f, user(text));
        assert_eq!(status, 200);
        by_the_rules(&route, "prose", "0.73");
    }
    assert_eq!(serve.output().matches("from now on").count(), 1);
    assert_eq!(get(&serve.url("/health")).0, 200, "serve goes on");
    let text = metrics(&serve);
    assert!(
        text.contains("onebit_laya_fallbacks_total{reason=\"exited\"} 2\n"),
        "{text}"
    );
}

/// p50 and p99 of `times`, in ms.
fn percentiles(mut times: Vec<Duration>) -> (f64, f64) {
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
    (at(0.5), at(0.99))
}

/// The time of each of `n` new conversations' first request through `serve` (a short
/// question each, under the size gate, so the daemon is asked).
fn first_turns(serve: &Serve, n: usize, tag: &str) -> Vec<Duration> {
    let url = serve.url("/v1/chat/completions");
    for i in 0..20 {
        post(
            &url,
            &json!({"messages": user(&format!("warm {tag} {i}?"))}).to_string(),
        );
    }
    (0..n)
        .map(|i| {
            let body = json!({"messages": user(&format!("What is {i} plus {tag}?"))}).to_string();
            let start = Instant::now();
            let (status, _) = post(&url, &body);
            assert_eq!(status, 200);
            start.elapsed()
        })
        .collect()
}

/// Item 4 of issue 46: the decision's added time per new conversation through serve, with a
/// daemon that answers at once (serve's own overhead) and one that takes 25 ms, beside the
/// rules. `cargo test -p onebit-tests --test serve_laya_model -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: prints figures"]
fn measure_the_decision_time_per_new_conversation() {
    let n = 300;
    let f = files("laya-model-bench");
    let rules = Serve::start(
        &[
            "-m",
            f.model.to_str().unwrap(),
            "--llama-server",
            fake_backend().to_str().unwrap(),
            "--laya",
            "--route-policy",
            f.policy.to_str().unwrap(),
        ],
        &[("ONEBIT_HRX_PRESENT", "1"), ("ONEBIT_LOG", "warn")],
    );
    rules.ready();
    let base = percentiles(first_turns(&rules, n, "rules"));
    drop(rules);
    println!(
        "rules alone: p50 {:.2} ms, p99 {:.2} ms per first turn",
        base.0, base.1
    );
    for delay in ["0", "25"] {
        let serve = serve_with(&f, &[("FAKE_LAYA_DELAY_MS", delay), ("ONEBIT_LOG", "warn")]);
        serve.ready();
        let (p50, p99) = percentiles(first_turns(&serve, n, delay));
        println!(
            "daemon answering in {delay} ms: p50 {p50:.2} ms, p99 {p99:.2} ms per first turn; added over the rules: p50 {:+.2} ms, p99 {:+.2} ms",
            p50 - base.0,
            p99 - base.1
        );
    }
}
