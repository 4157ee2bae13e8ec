//! `1bit` run as stock Lemonade's llamacpp backend runs llama-server, written from Lemonade's
//! source (11.7, ../shared/reference/lemonade.md §1): the binary named by
//! `LEMONADE_LLAMACPP_CPU_BIN` (here the `llama-server` link to `1bit`) started with Lemonade's
//! argv and lemond's whole environment, `PR_SET_PDEATHSIG(SIGTERM)` set in the child
//! (`setpriv --pdeathsig`, then exec: the same PID), no process group of its own; readiness is
//! a 200 on `/health` (1 s per probe, every 100 ms, within 600 s, the process checked each
//! time); the watchdog's probe has 2 s; an unload is SIGTERM to the PID, `waitpid` every
//! 100 ms for 5 s, then SIGKILL.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::*;

/// Lemonade's public model name, which it leaves in the request body.
const LEMONADE_NAME: &str = "Qwen3-0.6B-GGUF";

/// What lemond holds of one loaded llamacpp backend.
struct LlamaCppServer {
    process: Serve,
    port: u16,
}

/// The `LEMONADE_LLAMACPP_CPU_BIN` a user sets: the `llama-server` link to `1bit`.
fn cpu_bin(dir: &Path) -> PathBuf {
    let link = dir.join("llama-server");
    symlink(onebit(), &link).unwrap();
    link
}

/// `LlamaCppServer::load`'s argv for a plain GGUF, with custom arguments appended.
fn load_argv(model: &Path, port: u16, custom: &[&str]) -> Vec<String> {
    let mut argv: Vec<String> = [
        "-m",
        model.to_str().unwrap(),
        "--ctx-size",
        "4096",
        "--port",
        &port.to_string(),
        "--jinja",
        "--metrics",
        "--reasoning-format",
        "auto",
        "--no-ui",
    ]
    .map(String::from)
    .to_vec();
    argv.extend(custom.iter().map(|a| a.to_string()));
    argv
}

impl LlamaCppServer {
    /// `spawn_process`: the child sets PDEATHSIG and execs; it inherits lemond's environment
    /// (the test's, plus `lemond_env`).
    fn spawn(bin: &Path, argv: &[String], port: u16, lemond_env: &[(&str, &str)]) -> Self {
        let mut command = Command::new("setpriv");
        command
            .args(["--pdeathsig", "TERM", "--"])
            .arg(bin)
            .args(argv);
        for (k, v) in lemond_env {
            command.env(k, v);
        }
        LlamaCppServer {
            process: Serve::spawn(command, port),
            port,
        }
    }

    fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// `wait_for_ready("/health")`: Err is what lemond logs when the process ended first; Ok
    /// says how many probes answered 503 (loading) first.
    fn wait_for_ready(&mut self) -> Result<usize, String> {
        let mut loading = 0;
        for _ in 0..6000 {
            if let Some(status) = self.process.wait_exit(Duration::ZERO) {
                return Err(format!(
                    "llama-server process has terminated with exit code: {}",
                    status.code().unwrap_or(-1)
                ));
            }
            match status(&self.url("/health"), Duration::from_secs(1)) {
                Some(200) => return Ok(loading),
                Some(503) => loading += 1,
                _ => {}
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("llama-server failed to start".into())
    }

    /// One BackendWatchdog probe: 200 within 2 s.
    fn watchdog_probe(&self) -> bool {
        status(&self.url("/health"), Duration::from_secs(2)) == Some(200)
    }

    /// The watchdog's cheap check, every poll: has the process exited?
    fn exited(&mut self) -> Option<i32> {
        self.process
            .wait_exit(Duration::ZERO)
            .map(|s| s.code().unwrap_or(-1))
    }

    /// `LinuxProcessPlatform::terminate`: SIGTERM to the PID only, `waitpid(WNOHANG)` every
    /// 100 ms, 50 times, then SIGKILL. Whether SIGKILL was needed, and how long it took.
    fn unload(&mut self) -> (bool, Duration) {
        let began = Instant::now();
        self.process.signal(Signal::SIGTERM);
        for _ in 0..50 {
            if self.process.wait_exit(Duration::ZERO).is_some() {
                return (false, began.elapsed());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.process.signal(Signal::SIGKILL);
        self.process.wait_exit(Duration::from_secs(10));
        (true, began.elapsed())
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

/// The status of GET `url` within `limit`; None when nothing answered in time.
fn status(url: &str, limit: Duration) -> Option<u16> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(limit))
        .build()
        .into();
    agent.get(url).call().ok().map(|r| r.status().as_u16())
}

/// A streamed chat read as lemond's curl reads it with 11.8's stall limit: any byte resets a
/// `stall` timer; Err when it runs out. The data lines, in order.
fn stream_with_stall_limit(
    url: &str,
    content: &str,
    stall: Duration,
) -> Result<Vec<String>, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_recv_body(None)
        .build()
        .into();
    let body = serde_json::json!({
        "model": LEMONADE_NAME,
        "stream": true,
        "messages": [{"role": "user", "content": content}],
    });
    let started = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<Option<String>>();
    let url = url.to_string();
    std::thread::spawn(move || {
        let Ok(mut reply) = agent.post(&url).send_json(&body) else {
            let _ = tx.send(None);
            return;
        };
        let _ = tx.send(Some(String::new()));
        let reader = BufReader::new(reply.body_mut().as_reader());
        for line in reader.lines().map_while(Result::ok) {
            if tx.send(Some(line)).is_err() {
                return;
            }
        }
    });
    let mut data = Vec::new();
    loop {
        match rx.recv_timeout(stall) {
            Ok(Some(line)) => {
                if let Some(d) = line.strip_prefix("data: ") {
                    data.push(d.to_string());
                }
            }
            Ok(None) => return Err("the request failed".into()),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(data),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "no byte for {stall:?} after {:?}: lemond gives up on the stream",
                    started.elapsed()
                ));
            }
        }
    }
}

fn lemond_env(state: &Path, record: &Path) -> Vec<(&'static str, String)> {
    vec![
        (
            "ONEBIT_LLAMA_SERVER",
            fake_backend().to_string_lossy().into_owned(),
        ),
        ("ONEBIT_HRX_PRESENT", "0".into()),
        ("ONEBIT_STATE_DIR", state.to_string_lossy().into_owned()),
        ("ONEBIT_SSE_KEEPALIVE_S", "1".into()),
        ("FAKE_RECORD", record.to_string_lossy().into_owned()),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[test]
fn lemonade_loads_chats_keeps_a_long_prefill_alive_reaches_slots_and_unloads_leaving_nothing() {
    let dir = temp_dir("harness");
    let model = dummy_model(&dir, "Qwen3-0.6B-Q4_0.gguf");
    let (state, record, slots) = (
        dir.join("state"),
        dir.join("record.jsonl"),
        dir.join("slots"),
    );
    std::fs::create_dir_all(&slots).unwrap();
    let port = free_port();
    let custom = ["--temp", "0.6", "--slot-save-path", slots.to_str().unwrap()];
    let mut env = lemond_env(&state, &record);
    env.push(("FAKE_LOAD_MS", "800".into()));
    let mut server = LlamaCppServer::spawn(
        &cpu_bin(&dir),
        &load_argv(&model, port, &custom),
        port,
        &borrowed(&env),
    );
    let loading = server
        .wait_for_ready()
        .unwrap_or_else(|e| panic!("{e}: {}", server.process.output()));
    assert!(loading > 0, "/health never said 503 while the model loaded");
    let backend = children_of(server.pid());
    assert_eq!(backend.len(), 1, "{}", server.process.output());
    // No process group of its own: Lemonade signals the PID, and a group it shares with lemond.
    let group = |pid: Option<u32>| {
        nix::unistd::getpgid(pid.map(|p| nix::unistd::Pid::from_raw(p as i32))).unwrap()
    };
    assert_eq!(group(Some(server.pid())), group(None));

    // Chat, not streamed and streamed, under Lemonade's name for the model.
    let chat = serde_json::json!({
        "model": LEMONADE_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
    });
    let (code, body) = post(&server.url("/v1/chat/completions"), &chat.to_string());
    assert_eq!(code, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        reply["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    let events = stream_with_stall_limit(
        &server.url("/v1/chat/completions"),
        "hello",
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );

    // A long prefill under a 2 s stall limit, with the watchdog probing meanwhile.
    let url = server.url("/v1/chat/completions");
    let long = std::thread::spawn(move || {
        stream_with_stall_limit(&url, "fake_slow_ms=4000", Duration::from_secs(2))
    });
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..3 {
        assert!(
            server.watchdog_probe(),
            "the watchdog's probe went unanswered"
        );
        std::thread::sleep(Duration::from_millis(700));
    }
    let events = long.join().unwrap().unwrap();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );

    // Slots (downsize erases them) and tokenize, as Lemonade forwards them.
    for action in ["save", "restore", "erase"] {
        let body = if action == "erase" {
            "{}"
        } else {
            r#"{"filename":"lemonade.bin"}"#
        };
        let (code, reply) = post(&server.url(&format!("/slots/0?action={action}")), body);
        assert_eq!(code, 200, "{action}: {reply}");
    }
    let (code, reply) = post(&server.url("/tokenize"), r#"{"content":"hello world"}"#);
    assert_eq!(code, 200, "{reply}");
    let reached: Vec<String> = json_lines(&record)
        .iter()
        .map(|l| {
            format!(
                "{}?{}",
                l["path"].as_str().unwrap_or(""),
                l["query"].as_str().unwrap_or("")
            )
        })
        .collect();
    for want in [
        "/slots/0?action=save",
        "/slots/0?action=restore",
        "/slots/0?action=erase",
    ] {
        assert!(
            reached.iter().any(|r| r.starts_with(want)),
            "{want} not in {reached:?}"
        );
    }
    assert!(
        reached.iter().any(|r| r.starts_with("/tokenize")),
        "{reached:?}"
    );

    // Unload: gone within the 5 s, no SIGKILL, nothing left, no half-written state file.
    let (killed, took) = server.unload();
    assert!(
        !killed,
        "SIGKILL was needed after {took:?}: {}",
        server.process.output()
    );
    assert!(
        backend.iter().all(|p| !alive(*p)),
        "a backend outlived the unload"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&state)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        leftovers
            .iter()
            .all(|n| !n.to_string_lossy().contains(".tmp")),
        "{leftovers:?}"
    );
}

#[test]
fn a_load_that_does_not_fit_ends_lemonades_readiness_wait_with_exit_3() {
    let dir = temp_dir("harness-fit");
    let model = dir.join("huge-4TiB.gguf");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(4 << 40)
        .write(&model)
        .unwrap();
    let port = free_port();
    let env = lemond_env(&dir.join("state"), &dir.join("record.jsonl"));
    let mut server = LlamaCppServer::spawn(
        &cpu_bin(&dir),
        &load_argv(&model, port, &[]),
        port,
        &borrowed(&env),
    );
    let began = Instant::now();
    let err = server.wait_for_ready().unwrap_err();
    assert_eq!(err, "llama-server process has terminated with exit code: 3");
    assert!(began.elapsed() < Duration::from_secs(3));
    assert!(
        server.process.output().contains("does not fit"),
        "{}",
        server.process.output()
    );
}

#[test]
fn a_backend_that_dies_is_seen_by_lemonade_as_the_process_exiting() {
    let dir = temp_dir("harness-dies");
    let model = dummy_model(&dir, "m.gguf");
    let port = free_port();
    let env = lemond_env(&dir.join("state"), &dir.join("record.jsonl"));
    let mut server = LlamaCppServer::spawn(
        &cpu_bin(&dir),
        &load_argv(&model, port, &[]),
        port,
        &borrowed(&env),
    );
    server.wait_for_ready().unwrap();
    let backend = children_of(server.pid());
    let chat = r#"{"model":"Qwen3-0.6B-GGUF","messages":[{"role":"user","content":"fake_exit"}]}"#;
    let (code, _) = post(&server.url("/v1/chat/completions"), chat);
    assert_ne!(code, 200);
    // The watchdog's cheap check runs every 5 s.
    assert!(
        wait_until(Duration::from_secs(5), || server.exited().is_some()),
        "{}",
        server.process.output()
    );
    assert_eq!(server.exited(), Some(1));
    assert!(backend.iter().all(|p| !alive(*p)));
}

#[test]
fn lemond_dying_takes_serve_and_its_backend_with_it() {
    let dir = temp_dir("harness-pdeathsig");
    let model = dummy_model(&dir, "m.gguf");
    let port = free_port();
    let bin = cpu_bin(&dir);
    let env = lemond_env(&dir.join("state"), &dir.join("record.jsonl"));
    // lemond's forking thread: it loads the backend, then ends (as lemond does when it dies).
    let mut server = std::thread::spawn(move || {
        let mut server =
            LlamaCppServer::spawn(&bin, &load_argv(&model, port, &[]), port, &borrowed(&env));
        server.wait_for_ready().unwrap();
        server
    })
    .join()
    .unwrap();
    let backend = children_of(server.pid());
    assert!(
        wait_until(Duration::from_secs(5), || server.exited().is_some()),
        "serve outlived lemond's thread: {}",
        server.process.output()
    );
    assert!(wait_until(Duration::from_secs(2), || backend
        .iter()
        .all(|p| !alive(*p))));
}
