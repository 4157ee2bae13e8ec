//! `cargo xtask fleet [--workers N] [--fake] [--port P] [-- SERVE_ARGS...]`: a fleet on this
//! machine to try (docs/fleet.md): N serves (2 by default) on 127.0.0.1:P+1.., the pinned gateway
//! (SMG, installed by setup) in front on 127.0.0.1:P (8000), with the cache-aware policy, its
//! health checks on serve's `/health` and its retries; each serve drains as a fleet's worker does
//! (`--drain-notice-s 3 --drain-s 30`). The workers run the pinned llama-server with the default
//! model, or with `--fake` the fake backend (no model; it answers at once). Ctrl-C (or SIGTERM)
//! stops the gateway and the workers.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{SigSet, Signal};
use onebit_bench::bench::fleet::{Backend, Fleet, Spec, WORKER_DRAIN, build};

use crate::setup::{self, Needs};
use crate::{Failure, Workspace};

const USAGE: &str = "use `cargo xtask fleet [--workers N] [--fake] [--port P] [-- SERVE_ARGS...]`";
const MOST_WORKERS: usize = 16;

struct Options {
    workers: usize,
    fake: bool,
    port: u16,
    serve_args: Vec<String>,
}

fn parse(args: &[String]) -> Result<Options, Failure> {
    let mut options = Options {
        workers: 2,
        fake: false,
        port: 8000,
        serve_args: Vec::new(),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--fake" => options.fake = true,
            "--workers" => {
                options.workers = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .filter(|n| (1..=MOST_WORKERS).contains(n))
                    .ok_or_else(|| {
                        Failure::new(
                            format!("--workers needs a number from 1 to {MOST_WORKERS}"),
                            USAGE,
                        )
                    })?;
            }
            "--port" => {
                options.port = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .filter(|p| *p > 0 && *p as usize + MOST_WORKERS < 65536)
                    .ok_or_else(|| Failure::new("--port needs a port number", USAGE))?;
            }
            "--" => options.serve_args = args.by_ref().cloned().collect(),
            other => return Err(Failure::new(format!("unknown argument `{other}`"), USAGE)),
        }
    }
    Ok(options)
}

/// Sets up what the fleet needs, builds, starts it, and waits for Ctrl-C or SIGTERM; exit 1
/// when a worker or the gateway exits on its own first.
pub fn run(ws: &Workspace, args: &[String]) -> Result<ExitCode, Failure> {
    let options = parse(args)?;
    let smg = setup::gateway::ensure(&ws.layout)?;
    let backend_line;
    let backend = if options.fake {
        backend_line = "the fake backend (no model; `--fake`)".to_string();
        None
    } else {
        let installed = setup::run_for(ws, Needs::Serving)?;
        let model = ws.layout.model(ws.pins.default_model());
        backend_line = format!(
            "llama-server with {} (`--fake` for the fake backend)",
            ws.pins.default_model().name
        );
        Some(Backend::Llama {
            server: installed.llama_server,
            model,
        })
    };
    let (onebit, fake) = build(ws)?;
    let scratch = ws.root.join("target/fleet");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| {
        Failure::new(
            format!("cannot create {}: {e}", scratch.display()),
            "check the target folder",
        )
    })?;
    let gateway = SocketAddr::from(([127, 0, 0, 1], options.port));
    let mut serve_args: Vec<String> = WORKER_DRAIN.iter().map(|s| s.to_string()).collect();
    serve_args.extend(options.serve_args);
    let spec = Spec {
        onebit,
        smg,
        backend: backend.unwrap_or(Backend::Fake {
            binary: fake,
            env: Vec::new(),
        }),
        workers: options.workers,
        gateway: Some(gateway),
        serve_args,
        scratch: scratch.clone(),
    };
    println!(
        "starting {} worker(s) on 127.0.0.1:{}-{}: {backend_line}",
        options.workers,
        options.port + 1,
        options.port as usize + options.workers
    );
    let mut fleet = Fleet::start(&spec)?;
    println!(
        "fleet ready on http://{gateway} ({} {}, cache_aware; health checks of each worker's /health every second; 5 retries)",
        setup::gateway::PACKAGE,
        setup::gateway::VERSION
    );
    println!(
        "  the gateway's metrics: http://{}/metrics; logs in {}",
        fleet.metrics,
        scratch.display()
    );
    println!(
        "  try: curl http://{gateway}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\":\"fleet\",\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}]}}'"
    );
    println!("  Ctrl-C stops it");

    // Blocked once every child runs (a child inherits the mask), so this process waits for
    // them: a terminal's Ctrl-C reaches the whole process group, the workers drain and the
    // gateway stops on their own, and this process waits for them; a SIGTERM to this process
    // alone is passed on. Before this, Ctrl-C stops every process of the group at once.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals
        .thread_block()
        .map_err(|e| Failure::new(format!("cannot block SIGINT: {e}"), "a bug"))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(signals.wait());
    });
    let ended = loop {
        if let Ok(signal) = rx.recv_timeout(Duration::from_millis(500)) {
            let name = signal.map_or("a signal".to_string(), |s| s.as_str().to_string());
            println!("{name}: stopping the gateway and the workers (each drains)");
            break ExitCode::SUCCESS;
        }
        if let Some(status) = fleet.gateway.exited() {
            eprintln!(
                "the gateway exited ({status}); its log: {}",
                fleet.gateway.log().display()
            );
            break ExitCode::FAILURE;
        }
        if let Some((i, status)) = fleet
            .workers
            .iter_mut()
            .enumerate()
            .find_map(|(i, w)| w.exited().map(|s| (i, s)))
        {
            eprintln!(
                "worker {i} exited ({status}); its log: {}",
                fleet.workers[i].log().display()
            );
            break ExitCode::FAILURE;
        }
    };
    // Every one told at once (again, after a Ctrl-C), so the drains overlap; dropping waits
    // for each.
    fleet.gateway.terminate();
    fleet.workers.iter().for_each(|w| w.terminate());
    drop(fleet);
    Ok(ended)
}
