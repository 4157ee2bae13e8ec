//! When a backend hangs or loses its GPU: the progress watchdog, `/health` following the
//! backend, and the lost-device line, against the fake backend.

use std::path::Path;
use std::time::{Duration, Instant};

use onebit_tests::bounds;
use onebit_tests::*;

const SECS: fn(u64) -> Duration = Duration::from_secs;
const HUNG_STREAM: &str =
    r#"{"stream":true,"messages":[{"role":"user","content":"please fake_hang now"}]}"#;

/// Send `body` to the chat route on a thread of its own (the reply may never come).
fn send_in_background(serve: &Serve, body: String) {
    let url = serve.url("/v1/chat/completions");
    std::thread::spawn(move || post_with_timeout(&url, &body, SECS(60)));
}

fn metrics_of(serve: &Serve) -> Vec<Sample> {
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    parse_prometheus(&text)
}

fn kills(serve: &Serve) -> f64 {
    sample(&metrics_of(serve), "onebit_watchdog_kills_total", &[]).expect("the kills counter")
}

fn state_env(dir: &Path) -> String {
    dir.join("state").to_str().unwrap().to_string()
}

#[test]
fn the_watchdog_kills_a_hung_backend_says_why_exits_1_and_the_kill_is_counted() {
    let dir = temp_dir("wd-hang");
    let model = dummy_model(&dir, "m.gguf");
    let state = state_env(&dir);
    let env = [
        ("ONEBIT_STATE_DIR", state.as_str()),
        ("FAKE_STDERR_LINES", "W engine: last words before the hang"),
    ];
    let mut serve = Serve::with_fake(&model, &["--watchdog", "2"], &env);
    serve.ready();
    let before = kills(&serve);
    let backend = serve.children()[0];
    let began = Instant::now();
    send_in_background(&serve, HUNG_STREAM.to_string());
    let exit = serve.wait_exit(SECS(15)).expect("serve exits");
    let took = began.elapsed();
    let out = serve.output();
    assert_eq!(exit.code(), Some(1), "{out}");
    let within = bounds::watchdog_ends_within(SECS(2));
    assert!(
        took >= SECS(2) && took < within,
        "fired after {took:?} with --watchdog 2 (bound {within:?})"
    );
    assert!(
        out.contains(
            "1bit serve: watchdog: POST /v1/chat/completions (streamed) on the cpu backend (port "
        ) && out.contains(&format!("pid {backend}) made no progress for "))
            && out.contains("(limit 2 s; ")
            && out.contains("bytes received in ")
            && out.contains("); killing it and exiting so Lemonade reloads it"),
        "{out}"
    );
    assert!(
        out.contains("1bit serve: watchdog: the backend's last lines:\n")
            && out.contains("1bit serve: watchdog: | W engine: last words before the hang\n"),
        "{out}"
    );
    assert!(
        wait_until(SECS(2), || !alive(backend)),
        "the backend is gone"
    );

    let again = Serve::with_fake(&model, &[], &[("ONEBIT_STATE_DIR", state.as_str())]);
    again.ready();
    assert_eq!(kills(&again), before + 1.0, "the kill outlives serve");
}

#[test]
fn a_long_non_streamed_request_on_a_backend_whose_slots_answer_is_not_killed() {
    let dir = temp_dir("wd-slow");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(&model, &["--watchdog", "2"], &[]);
    serve.ready();
    let url = serve.url("/v1/chat/completions");
    let slow = std::thread::spawn(move || {
        post(
            &url,
            r#"{"messages":[{"role":"user","content":"think fake_slow_ms=6000"}]}"#,
        )
    });
    // Meanwhile /health answers at once: it never waits behind inference (6 s here), nor
    // for a health question to the backend (which could take the health timeout).
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..5 {
        let asked = Instant::now();
        assert_eq!(get(&serve.url("/health")).0, 200);
        assert!(
            asked.elapsed() < bounds::HEALTH_TIMEOUT,
            "{:?}",
            asked.elapsed()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, body) = slow.join().unwrap();
    assert_eq!(status, 200, "{body}\n{}", serve.output());
    assert!(serve.wait_exit(Duration::from_millis(100)).is_none());
    assert!(!serve.output().contains("watchdog:"), "{}", serve.output());
}

#[test]
fn watchdog_0_turns_it_off_even_when_the_environment_sets_a_default() {
    let dir = temp_dir("wd-off");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--watchdog", "0"],
        &[("ONEBIT_WATCHDOG_SECS", "1")],
    );
    serve.ready();
    send_in_background(&serve, HUNG_STREAM.to_string());
    assert!(
        serve.wait_exit(SECS(5)).is_none(),
        "serve exited: {}",
        serve.output()
    );
    assert!(!serve.output().contains("watchdog:"));
}

#[test]
fn a_large_prompt_gets_its_allowance_before_the_first_byte() {
    let dir = temp_dir("wd-prompt");
    let model = dummy_model(&dir, "m.gguf");
    // ONEBIT_WATCHDOG_SECS sets the limit (2 s); 400 000 bytes ≈ 100 000 tokens, at 25 000
    // tok/s: 4 s more before the first byte.
    let mut serve = Serve::with_fake(
        &model,
        &["--watchdog-prompt-tps", "25000"],
        &[("ONEBIT_WATCHDOG_SECS", "2")],
    );
    serve.ready();
    let word = "x".repeat(400_000);
    let body = format!(r#"{{"messages":[{{"role":"user","content":"fake_hang {word}"}}]}}"#);
    let began = Instant::now();
    send_in_background(&serve, body);
    let exit = serve
        .wait_exit(SECS(20))
        .expect("the watchdog fires in the end");
    let took = began.elapsed();
    assert_eq!(exit.code(), Some(1));
    let within = bounds::watchdog_ends_within(SECS(6));
    assert!(
        took >= Duration::from_millis(5500) && took < within,
        "fired after {took:?}; 2 s + 4 s expected (bound {within:?})\n{}",
        serve.output()
    );
    assert!(
        serve.output().contains("(not streamed)") && serve.output().contains("(limit 6 s; 0 bytes"),
        "{}",
        serve.output()
    );
}

#[test]
fn health_is_503_with_a_reason_within_the_health_timeout_of_the_backend_hanging_its_health_route() {
    let dir = temp_dir("wd-health");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--watchdog", "0"], &[]);
    serve.ready();
    let (status, _) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"fake_health_hang"}]}"#,
    );
    assert_eq!(status, 200);
    // The health timeout after the monitor's next question, and a busy machine's margin (the
    // bare 2 s once failed beside a heavy neighbour: issue 53).
    let within = bounds::health_follows();
    let began = Instant::now();
    let mut last = (0, String::new());
    let went_down = wait_until(within + SECS(3), || {
        last = get(&serve.url("/health"));
        last.0 == 503
    });
    let took = began.elapsed();
    assert!(went_down, "{last:?}");
    assert!(
        took < within,
        "/health went 503 after {took:?} (bound {within:?})"
    );
    assert!(
        last.1.contains("did not answer within 1.5 s on /health"),
        "{}",
        last.1
    );
}

#[test]
fn health_stops_answering_200_within_the_health_timeout_of_the_backend_exiting_and_serve_exits_1() {
    let dir = temp_dir("wd-exit");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let backend = serve.children()[0];
    let began = Instant::now();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(backend as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    // 503 with the reason while serve stops, then nothing: serve has exited. Seen at once by
    // the reaper, at worst by the health monitor's next question.
    let within = bounds::health_follows();
    assert!(wait_until(within + SECS(2), || get(&serve.url("/health"))
        .0
        != 200));
    assert!(
        began.elapsed() < within,
        "{:?} (bound {within:?})",
        began.elapsed()
    );
    let exit = serve.wait_exit(SECS(10)).expect("serve exits");
    assert_eq!(exit.code(), Some(1));
    assert!(
        serve.output().contains("was killed by SIGKILL"),
        "{}",
        serve.output()
    );
}

#[test]
fn a_lost_gpu_line_ends_serve_with_1_even_with_the_watchdog_off() {
    let dir = temp_dir("wd-gpu");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--watchdog", "0"],
        &[
            ("FAKE_STDERR_AFTER_MS", "1500"),
            ("FAKE_STDERR_LINES", "ggml_hrx: AMDGPU hardware exception"),
        ],
    );
    serve.ready();
    let backend = serve.children()[0];
    let exit = serve.wait_exit(SECS(10)).expect("serve exits");
    let out = serve.output();
    assert_eq!(exit.code(), Some(1), "{out}");
    assert!(
        out.contains(
            "1bit serve: the backend lost its GPU (its line: ggml_hrx: AMDGPU hardware exception)"
        ) && out.contains("killing the cpu backend and exiting"),
        "{out}"
    );
    assert!(wait_until(SECS(2), || !alive(backend)));
}
