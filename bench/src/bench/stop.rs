//! `cargo xtask bench stop`: how long serve takes from SIGTERM to its exit, against Lemonade's
//! window (SIGTERM, then SIGKILL 5 s later). Arms: the cpu route (the pinned llama-server and
//! the default model) and `1bit llama-server` (the drop-in command line) idle and with a long
//! stream in flight, and an in-process route (the test fixture `tests/fixtures/inproc-route`)
//! idle and streaming. Targets (issue 25): idle within 0.5 s; with a request in flight within
//! the drain window (`--drain-s`, default 3 s) + 1 s. Debug builds: the figures are waits, which
//! optimisation does not change.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::inproc::{build_fixture, get};
use crate::{Failure, Workspace, process};

/// serve's default drain window (docs/serve.md).
const DRAIN_S: f64 = 3.0;
const IDLE_TARGET: Duration = Duration::from_millis(500);
/// A chat that decodes for far longer than the drain window.
const LONG_CHAT: &str = r#"{"stream":true,"max_tokens":4000,"ignore_eos":true,"temperature":0,"messages":[{"role":"user","content":"Write a long story about a lighthouse keeper."}]}"#;
const LONG_INPROC: &str = r#"{"stream":true,"events":1000,"event_bytes":8,"pace_ms":200}"#;

/// One arm: how serve is started, and the request in flight at SIGTERM (None: idle).
struct Arm {
    name: &'static str,
    command: Box<dyn Fn(u16) -> Command>,
    in_flight: Option<&'static str>,
}

/// Run it; `quick` stops each arm once, else three times (the median and the worst reported).
pub fn run(ws: &Workspace, quick: bool) -> Result<ExitCode, Failure> {
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host", "-p", "onebit-route-cpu"]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "the build failed: fix the errors above")?;
    let plugins = build_fixture(&ws.root)?;
    let onebit = ws.root.join("target/debug/1bit");
    let llama = ws.layout.llama_server();
    let model = ws.layout.model(ws.pins.default_model());
    for (what, path) in [("llama-server", &llama), ("the default model", &model)] {
        if !path.exists() {
            return Err(Failure::new(
                format!("{what} is not at {}", path.display()),
                "run `cargo xtask setup`",
            ));
        }
    }
    let scratch = std::env::temp_dir().join(format!("onebit-bench-stop-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| Failure::new(e, "check /tmp"))?;
    let dummy = scratch.join("inproc.bin");
    std::fs::write(&dummy, b"the fixture serves anything")
        .map_err(|e| Failure::new(e, "check /tmp"))?;

    let cpu = {
        let (onebit, llama, model, state) = (
            onebit.clone(),
            llama.clone(),
            model.clone(),
            scratch.clone(),
        );
        move |port: u16| {
            let mut c = Command::new(&onebit);
            c.arg("serve")
                .arg("-m")
                .arg(&model)
                .args(["--device", "cpu", "--port", &port.to_string()])
                .arg("--llama-server")
                .arg(&llama)
                .env("ONEBIT_STATE_DIR", &state);
            c
        }
    };
    let drop_in = {
        let (onebit, llama, model, state) = (
            onebit.clone(),
            llama.clone(),
            model.clone(),
            scratch.clone(),
        );
        move |port: u16| {
            let mut c = Command::new(&onebit);
            c.arg("llama-server")
                .arg("-m")
                .arg(&model)
                .args(["--port", &port.to_string()])
                .env("ONEBIT_LLAMA_SERVER", &llama)
                .env("ONEBIT_STATE_DIR", &state);
            c
        }
    };
    let inproc = {
        let (onebit, dummy, plugins, state) = (
            onebit.clone(),
            dummy.clone(),
            plugins.clone(),
            scratch.clone(),
        );
        move |port: u16| {
            let mut c = Command::new(&onebit);
            c.arg("serve")
                .arg("-m")
                .arg(&dummy)
                .args(["--device", "inproc", "--port", &port.to_string()])
                .arg("--plugin-dir")
                .arg(&plugins)
                .env("ONEBIT_STATE_DIR", &state);
            c
        }
    };
    let arms = [
        Arm {
            name: "cpu route, idle",
            command: Box::new(cpu.clone()),
            in_flight: None,
        },
        Arm {
            name: "cpu route, a stream in flight",
            command: Box::new(cpu),
            in_flight: Some(LONG_CHAT),
        },
        Arm {
            name: "1bit llama-server, idle",
            command: Box::new(drop_in.clone()),
            in_flight: None,
        },
        Arm {
            name: "1bit llama-server, a stream in flight",
            command: Box::new(drop_in),
            in_flight: Some(LONG_CHAT),
        },
        Arm {
            name: "in-process route, idle",
            command: Box::new(inproc.clone()),
            in_flight: None,
        },
        Arm {
            name: "in-process route, a stream in flight",
            command: Box::new(inproc),
            in_flight: Some(LONG_INPROC),
        },
    ];
    let runs = if quick { 1 } else { 3 };
    let mut rows = Vec::new();
    for arm in &arms {
        let mut took = Vec::new();
        for _ in 0..runs {
            took.push(stop_once(arm)?);
        }
        took.sort();
        let target = match arm.in_flight {
            None => IDLE_TARGET,
            Some(_) => Duration::from_secs_f64(DRAIN_S + 1.0),
        };
        rows.push((arm.name, took[took.len() / 2], took[took.len() - 1], target));
    }
    let _ = std::fs::remove_dir_all(&scratch);

    println!(
        "SIGTERM to exit (debug build, default --drain-s {DRAIN_S}, {runs} run(s) per arm; Lemonade SIGKILLs at 5 s):"
    );
    println!(
        "  {:<40} {:>10} {:>10} {:>8}",
        "arm", "median s", "worst s", "target s"
    );
    let mut met = true;
    for (name, median, worst, target) in &rows {
        met &= worst <= target;
        println!(
            "  {:<40} {:>10.2} {:>10.2} {:>8.1}{}",
            name,
            median.as_secs_f64(),
            worst.as_secs_f64(),
            target.as_secs_f64(),
            if worst <= target { "" } else { "  (missed)" }
        );
    }
    let json = serde_json::json!(
        rows.iter()
            .map(|(name, median, worst, target)| serde_json::json!({
                "arm": name, "median_s": median.as_secs_f64(),
                "worst_s": worst.as_secs_f64(), "target_s": target.as_secs_f64(),
            }))
            .collect::<Vec<_>>()
    );
    let results = ws.root.join("results");
    if std::fs::create_dir_all(&results).is_ok() {
        let _ = std::fs::write(results.join("stop.json"), json.to_string());
        println!("  written to results/stop.json");
    }
    Ok(if met {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Start serve, wait for ready, start the arm's request and see its first bytes, SIGTERM, and
/// time the exit; checks that serve left no process behind.
fn stop_once(arm: &Arm) -> Result<Duration, Failure> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Failure::new(e, "the kernel has no free port"))?;
    let mut command = (arm.command)(port);
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut serve = Killed(
        command
            .spawn()
            .map_err(|e| Failure::new(format!("cannot start 1bit: {e}"), "build it"))?,
    );
    let began = Instant::now();
    while get(port, "/health").0 != 200 {
        if began.elapsed() > Duration::from_secs(120) || !matches!(serve.0.try_wait(), Ok(None)) {
            return Err(Failure::new(
                format!("{}: serve did not become ready", arm.name),
                "run it by hand to see why",
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let tree = descendants(serve.0.id());
    let reading = match arm.in_flight {
        Some(body) => Some(first_bytes(port, body).map_err(|e| {
            Failure::new(
                format!("{}: the stream did not start: {e}", arm.name),
                "run it by hand",
            )
        })?),
        None => None,
    };
    let signalled = Instant::now();
    let _ = kill(Pid::from_raw(serve.0.id() as i32), Signal::SIGTERM);
    loop {
        if let Ok(Some(_)) = serve.0.try_wait() {
            break;
        }
        if signalled.elapsed() > Duration::from_secs(60) {
            return Err(Failure::new(
                format!("{}: serve did not exit within 60 s of SIGTERM", arm.name),
                "a bug in the stop",
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let took = signalled.elapsed();
    drop(reading);
    let left: Vec<u32> = tree
        .into_iter()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists())
        .collect();
    if !left.is_empty() {
        return Err(Failure::new(
            format!("{}: processes left after serve exited: {left:?}", arm.name),
            "a bug in the stop",
        ));
    }
    Ok(took)
}

/// A streamed request on a fresh connection, returned once its first event arrived.
fn first_bytes(port: u16, body: &str) -> std::io::Result<TcpStream> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = tcp.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::other(
                String::from_utf8_lossy(&seen).into_owned(),
            ));
        }
        seen.extend_from_slice(&buf[..n]);
    }
    Ok(tcp)
}

/// Every process below `pid`, from /proc.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in text.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(child);
                next.push(child);
            }
        }
    }
    out
}

/// serve, SIGKILLed when dropped (an error path leaves nothing running).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
