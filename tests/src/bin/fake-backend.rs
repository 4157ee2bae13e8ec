//! A stand-in for llama-server (and DwarfStar's ds4-server) for tests and benchmarks: started with
//! llama-server's command line, it answers llama-server's routes with deterministic replies, and the
//! `FAKE_*` environment and trigger words in request bodies make it load slowly, hang, exit, print
//! chosen stderr lines and record what reached it. See docs/fake-backend.md.

// Unsafe is allowed in `deadlock_on_sigterm` alone (installing a raw signal handler).
#![deny(unsafe_code)]

/// Writes one line to stderr and ignores failure: a parent that closed our stderr must not turn a
/// log line into a panic (which would, say, keep SIGTERM from ending the process).
macro_rules! log {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

#[path = "fake_backend/app.rs"]
mod app;
#[path = "fake_backend/close_after_stream.rs"]
mod close_after_stream;
#[path = "fake_backend/config.rs"]
mod config;
#[path = "fake_backend/generate.rs"]
mod generate;
#[path = "fake_backend/slots.rs"]
mod slots;
#[path = "fake_backend/text.rs"]
mod text;
#[path = "fake_backend/tools.rs"]
mod tools;

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::serve::ListenerExt as _;
use nix::sys::signal::{Signal, raise};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};

use crate::config::{Command, Config, ExitPlan};

/// What `/props` and `system_fingerprint` report: the pinned llama.cpp tree has no git data.
pub const BUILD_INFO: &str = "b0-unknown";

const USAGE: &str = "\
usage: fake-backend -m MODEL [--host H] [--port P] [--alias NAME] [--slot-save-path DIR]
                    [--no-slots] [--metrics] [-c N] [any other llama-server flag]
A stand-in for llama-server; its behaviour is set by FAKE_* variables (docs/fake-backend.md).";

fn main() -> ExitCode {
    if let Some(path) = std::env::var_os("FAKE_RECORD_START").filter(|p| !p.is_empty()) {
        record_start(std::path::Path::new(&path));
    }
    let command = config::parse(std::env::args().skip(1), |k| std::env::var(k).ok());
    let cfg = match command {
        Ok(Command::Serve(cfg)) => cfg,
        Ok(Command::Version) => {
            log!("version: 0.6.0-dev (build 0, commit unknown)");
            log!(
                "built with fake-backend {} (onebit-tests) for Linux",
                env!("CARGO_PKG_VERSION")
            );
            return ExitCode::SUCCESS;
        }
        Ok(Command::Help) => {
            log!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            log!("{message}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &cfg.fork_child
        && let Err(e) = fork_child(path)
    {
        log!("fake-backend: FAKE_FORK_CHILD={}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            log!("fake-backend: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(*cfg))
}

async fn run(cfg: Config) -> ExitCode {
    let listener = match TcpListener::bind((cfg.host.as_str(), cfg.port)).await {
        Ok(l) => l,
        Err(e) => {
            log!(
                "srv         start: couldn't bind HTTP server socket, hostname: {}, port: {} ({e})",
                cfg.host,
                cfg.port
            );
            log!("srv  llama_server: exiting due to HTTP server error");
            return ExitCode::FAILURE;
        }
    };
    let port = match listener.local_addr() {
        Ok(addr) => addr.port(),
        Err(e) => {
            log!("fake-backend: cannot read the bound address: {e}");
            return ExitCode::FAILURE;
        }
    };
    if cfg.port == 0 {
        // The one line on stdout: the port the kernel chose, for a harness that passed --port 0.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{port}").and_then(|()| out.flush());
    }
    log!(
        "main: fake-backend {} standing in for {}",
        env!("CARGO_PKG_VERSION"),
        if cfg.ds4 {
            "ds4-server"
        } else {
            "llama-server"
        }
    );
    log!(
        "srv  llama_server: HTTP server is listening, hostname: {}, port: {port}",
        cfg.host
    );

    let state = match app::State::new(cfg, port) {
        Ok(s) => Arc::new(s),
        Err(message) => {
            log!("{message}");
            return ExitCode::FAILURE;
        }
    };
    let cfg = &state.cfg;

    watch_signals(cfg);
    if let Some(after) = cfg.exit_after {
        let plan = cfg.exit;
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            log!(
                "fake-backend: FAKE_EXIT_AFTER_MS={} reached; exiting",
                after.as_millis()
            );
            exit_now(plan);
        });
    }
    if !cfg.stderr_lines.is_empty() {
        if cfg.stderr_after.is_zero() {
            print_lines(&cfg.stderr_lines);
        } else {
            let (lines, after) = (cfg.stderr_lines.clone(), cfg.stderr_after);
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                print_lines(&lines);
            });
        }
    }
    log!("srv    load_model: loading model '{}'", cfg.model_path);
    if cfg.load.is_zero() {
        finish_loading(&state);
    } else {
        let (state, load) = (Arc::clone(&state), cfg.load);
        tokio::spawn(async move {
            tokio::time::sleep(load).await;
            finish_loading(&state);
        });
    }

    if let Some(after) = cfg.close_after_stream {
        close_after_stream::serve(listener, app::app(Arc::clone(&state)), after).await;
        return ExitCode::SUCCESS;
    }
    // Small SSE writes must leave at once, not wait for Nagle.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    match axum::serve(listener, app::app(state)).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log!("srv  llama_server: HTTP server error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Opens every route and prints llama-server's "model loaded" lines, in that order, so a test that
/// waits for `listening on` finds /health at 200.
fn finish_loading(state: &app::State) {
    let cfg = &state.cfg;
    state.ready.store(true, Ordering::Release);
    log!(
        "srv    load_model: initializing, n_slots = 1, n_ctx_slot = {}, kv_unified = 'true'",
        cfg.n_ctx
    );
    log!("srv  llama_server: model loaded");
    log!(
        "srv  llama_server: listening on http://{}:{}",
        cfg.host,
        state.port
    );
}

fn print_lines(lines: &[String]) {
    let mut err = std::io::stderr().lock();
    for line in lines {
        let _ = writeln!(err, "{line}");
    }
}

/// SIGTERM and SIGINT end the process with status 0 (SIGTERM is only logged with
/// `FAKE_IGNORE_SIGTERM`, and hangs its handler with `FAKE_SIGTERM_DEADLOCK`). A signal that
/// `FAKE_EXIT_SIGNAL` names keeps its default action, so the fake can die by it.
fn watch_signals(cfg: &Config) {
    if cfg.sigterm_deadlock {
        deadlock_on_sigterm();
    }
    let watched = [
        (SignalKind::terminate(), Signal::SIGTERM, cfg.ignore_sigterm),
        (SignalKind::interrupt(), Signal::SIGINT, false),
    ];
    for (kind, sig, ignore) in watched {
        if (cfg.exit.signal == Some(sig) && !ignore)
            || (sig == Signal::SIGTERM && cfg.sigterm_deadlock)
        {
            continue;
        }
        let mut stream = match signal(kind) {
            Ok(s) => s,
            Err(e) => {
                log!("fake-backend: cannot watch {sig}: {e}");
                continue;
            }
        };
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if ignore {
                    log!("fake-backend: {sig} received and ignored (FAKE_IGNORE_SIGTERM)");
                    continue;
                }
                log!("srv    operator(): operator(): cleaning up before exit...");
                std::process::exit(0);
            }
        });
    }
}

/// `FAKE_SIGTERM_DEADLOCK`: what llama-server's SIGTERM handler can do (it takes its task
/// queue's mutex, which the thread it interrupted may hold): the handler waits on a lock that a
/// thread of this process holds forever, so SIGTERM never ends the process.
fn deadlock_on_sigterm() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, sigaction};
    use std::sync::Mutex;
    static HELD: Mutex<()> = Mutex::new(());
    extern "C" fn on_sigterm(_: nix::libc::c_int) {
        let _never = HELD.lock();
    }
    let (taken, take) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _held = HELD.lock();
        let _ = taken.send(());
        loop {
            std::thread::park();
        }
    });
    let _ = take.recv();
    let action = SigAction::new(
        SigHandler::Handler(on_sigterm),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler is meant to be unsound in exactly one way, the one this fake stands
    // for: it waits on a lock in a signal handler. It touches nothing else.
    #[allow(unsafe_code)]
    if let Err(e) = unsafe { sigaction(Signal::SIGTERM, &action) } {
        log!("fake-backend: cannot install the SIGTERM handler: {e}");
    }
}

/// Ends the process now: with `FAKE_EXIT_SIGNAL`'s signal if set, else with `FAKE_EXIT_CODE`.
/// Called from runtime tasks; does not return.
pub fn exit_now(plan: ExitPlan) -> ! {
    if let Some(sig) = plan.signal {
        // Rust's runtime catches the first SIGSEGV/SIGBUS (its stack-overflow guard), restores the
        // default action and returns, so a second raise is the one that kills.
        for _ in 0..2 {
            let _ = raise(sig);
        }
        std::thread::sleep(Duration::from_millis(50));
        log!(
            "fake-backend: {sig} did not end the process (it is caught or ignored here); exiting with status {}",
            128 + sig as i32
        );
        std::process::exit(128 + sig as i32);
    }
    std::process::exit(plan.code)
}

/// `FAKE_FORK_CHILD`: start a child the way a closed engine starts its own helpers (a plain
/// fork and exec, no parent-death signal, in the fake's process group) that ignores SIGTERM, and
/// write its pid to `path` (written whole, then renamed into place, so a reader never sees half).
/// The child is never waited for: it outlives the fake unless its group is killed.
fn fork_child(path: &std::path::Path) -> std::io::Result<()> {
    let child = std::process::Command::new("/bin/sh")
        .args(["-c", "trap '' TERM; exec sleep 3600"])
        .stdin(std::process::Stdio::null())
        .spawn()?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, format!("{}\n", child.id()))?;
    std::fs::rename(&partial, path)?;
    log!(
        "fake-backend: forked a child of its own (pid {}) that ignores SIGTERM",
        child.id()
    );
    Ok(())
}

/// `FAKE_RECORD_START`: write how this process was started (its argv and whole environment) as
/// one JSON object, before anything else, so a route's author sees what the route's plan
/// made of the command line and the environment.
fn record_start(path: &std::path::Path) {
    let env: serde_json::Map<String, serde_json::Value> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                serde_json::Value::from(v.to_string_lossy().into_owned()),
            )
        })
        .collect();
    let argv: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let start = serde_json::json!({"argv": argv, "env": env, "pid": std::process::id()});
    if let Err(e) = std::fs::write(path, format!("{start}\n")) {
        log!("fake-backend: FAKE_RECORD_START={}: {e}", path.display());
    }
}
