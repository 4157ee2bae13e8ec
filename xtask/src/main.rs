//! `cargo xtask`: installs what 1bit serve needs (llama.cpp's llama-server, the pinned models) and runs the server, its checks and its tests.
#![forbid(unsafe_code)]

mod addon;
mod fleet;
mod install;
mod paths;
mod route_packages;
mod serve;
mod service;
mod setup;
mod test;

use std::path::PathBuf;
use std::process::ExitCode;

// The measurements live in onebit-bench (bench/), what both use in xtask-support/.
use onebit_bench::{Prepare, bench, dashboard, laya_eval, llama_suite, soak};
use xtask_support::{Failure, Workspace, cache, pins, process};

const USAGE: &str = "\
usage: cargo xtask <subcommand>

  setup             install the pinned llama-server and models into the cache (fast when done)
  serve [ARGS...]   setup, build 1bit in release mode, serve the default model on 127.0.0.1:8000
  fleet [--workers N] [--fake] [--port P] [-- SERVE_ARGS...]  N serves (2) and the pinned
                    gateway (SMG) in front on 127.0.0.1:P (8000); the default model on
                    llama-server, or the fake backend; Ctrl-C stops all (docs/fleet.md)
  test [EXTRA...]   fmt and clippy checks, setup, build, then cargo test --workspace [EXTRA]
  bench [PART...] [--quick] [--baseline PATH]  serve against llama-server direct and nginx
                    (and, on the hop, another build's 1bit at PATH): hop, throughput,
                    sse, startup, rss, mem-check (all when none is named; results/); alone:
                    inproc (the fixture route), inproc-llama (the inproc add-on against the hop),
                    stop (SIGTERM to exit on every kind of route, idle and streaming),
                    fleet (serves behind the gateway: its added time, throughput at 1, 2, 4,
                    conversations on llama-server: cache-aware and shared cache against round-robin),
                    agents (recorded Claude Code and Codex CLI sessions, serve against llama-server);
                    hop --repeat N [--baseline PATH]: N runs, each figure's median, and
                    against PATH a verdict per figure (exit 1 when one is worse)
  soak [--minutes N]  N minutes (20) of mixed traffic and faults, half on the cpu route, half on
                    the inproc add-on, then a watchdog kill; the report of outcomes, corrupted
                    streams, RSS, FD and task slopes, the stops, what was left
  soak --starved [--minutes N]  the same beside a CPU hog on every core: N minutes (2) of
                    traffic and faults on the cpu route, a stop with a stream in flight on the
                    cpu route and the inproc add-on (bound: the drain + 1 s), an RPC worker
                    killed (serve must exit 1 naming it), what was left (docs/performance.md)
  dashboard         the Grafana dashboard's test against a real Prometheus, and the picture
                    of its panels from that run (docs/grafana/1bit-serve.svg)
  addon [--release] [--package]  build the inproc add-on (addons/inproc); its library's path
                    is the last line. --package: also build 1bit and make the add-on's route
                    package with `1bit plugins package`, carrying setup's llama.cpp shared
                    libraries, into target/packages; the archive's path is the last line
  laya-eval         the --laya classifier's accuracy and decision cost (docs/laya.md)
  llama-suite [--timeout S] [PYTEST ARGS...]  llama.cpp's server tests, direct and through the
                    drop-in (a `llama-server` link to 1bit); the per-file table and the
                    tests that pass direct only (docs/lemonade.md)
  paths             print cache_dir, llama_server and model paths, one name=value per line
  install [--prefix DIR] [--debug]  build and install 1bit, its routes, the pinned llama-server
                    and the llama-server link to 1bit under DIR (default ~/.local)
    --service [--model PATH]  also write the systemd user unit 1bit-serve.service and its
                    environment file (~/.config/systemd/user, or DIR/lib/systemd/user)
    --uninstall-service  remove those two files, nothing else (docs/service.md)";

/// What onebit-bench's measurements borrow from xtask: setup and the add-on's build.
struct Prepared;

impl Prepare for Prepared {
    fn setup(&self, ws: &Workspace) -> Result<(), Failure> {
        setup::run(ws).map(drop)
    }

    fn addon(&self, ws: &Workspace, release: bool) -> Result<PathBuf, Failure> {
        addon::build(ws, release)
    }

    fn gateway(&self, ws: &Workspace) -> Result<PathBuf, Failure> {
        setup::gateway::ensure(&ws.layout)
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let subcommand = args.next();
    let rest: Vec<String> = args.collect();
    let outcome = match subcommand.as_deref() {
        Some("setup") => no_arguments("setup", &rest)
            .and_then(|()| Workspace::load())
            .and_then(|ws| setup::run(&ws))
            .map(|_| ExitCode::SUCCESS),
        Some("serve") => Workspace::load().and_then(|ws| serve::run(&ws, &rest)),
        Some("fleet") => Workspace::load().and_then(|ws| fleet::run(&ws, &rest)),
        Some("test") => Workspace::load().and_then(|ws| test::run(&ws, &rest)),
        Some("addon") => Workspace::load().and_then(|ws| addon::run(&ws, &rest)),
        Some("bench") => Workspace::load().and_then(|ws| bench::run(&ws, &Prepared, &rest)),
        Some("soak") => Workspace::load().and_then(|ws| soak::run(&ws, &Prepared, &rest)),
        Some("dashboard") => Workspace::load().and_then(|ws| dashboard::run(&ws, &Prepared, &rest)),
        Some("laya-eval") => no_arguments("laya-eval", &rest)
            .and_then(|()| Workspace::load())
            .and_then(|ws| laya_eval::run(&ws)),
        Some("llama-suite") => Workspace::load().and_then(|ws| llama_suite::run(&ws, &rest)),
        Some("install") => Workspace::load().and_then(|ws| install::run(&ws, &rest)),
        Some("paths") => no_arguments("paths", &rest)
            .and_then(|()| Workspace::load())
            .map(|ws| paths::run(&ws)),
        None | Some("help" | "-h" | "--help") => {
            println!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        Some(other) => Err(Failure::new(
            format!("unknown subcommand `{other}`"),
            "use one of setup, serve, fleet, test, bench, soak, dashboard, addon, laya-eval, llama-suite, paths, install (`cargo xtask help`)",
        )),
    };
    outcome.unwrap_or_else(|failure| {
        eprintln!("xtask: {failure}");
        ExitCode::FAILURE
    })
}

fn no_arguments(subcommand: &str, rest: &[String]) -> Result<(), Failure> {
    match rest.first() {
        None => Ok(()),
        Some(extra) => Err(Failure::new(
            format!("`cargo xtask {subcommand}` takes no arguments, got `{extra}`"),
            format!("run `cargo xtask {subcommand}` alone"),
        )),
    }
}
