//! `1bit rpc-worker`: the pinned `ggml-rpc-server`, started and supervised as serve supervises
//! its backends, announced in one line once it answers the RPC probe.

use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use onebit_process::{Process, Stopped};
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::backends::supervisor::describe_exit;
use crate::rpc::probe;
use crate::rpc::traffic::{self, Traffic};
use onebit_command::cli::WorkerArgs;
use onebit_command::error::{Fatal, exit};

/// The pins of what the project installs, compiled in to find the `ggml-rpc-server` that
/// `cargo xtask setup` built beside llama-server.
const PINS: &str = include_str!("../../../../third_party/pins.json");
/// How long the worker may take to answer its first probe before `1bit rpc-worker` gives up.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How long the worker has to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

const GIB: f64 = (1u64 << 30) as f64;

/// Run `1bit rpc-worker` on the main thread (the worker is started by the one spawner, so it
/// dies with this process and leads its own process group) and return the exit
/// status: the worker's own when it exits by itself (128 + the signal when a signal killed
/// it), 0 when it stopped because this process was told to stop, 1 when it never came up.
pub fn run(args: WorkerArgs) -> i32 {
    match start(&args) {
        Ok(code) => code,
        Err(fatal) => {
            tracing::info!("1bit rpc-worker: {fatal}");
            fatal.code
        }
    }
}

fn start(args: &WorkerArgs) -> Result<i32, Fatal> {
    let cap = match args.mem {
        None => None,
        Some(gib) if gib.is_finite() && gib > 0.0 && gib < 1e9 => Some((gib * GIB) as u64),
        Some(gib) => {
            return Err(Fatal::usage(format!(
                "--mem {gib}: pass the GiB to offer as a positive number, such as 8 or 0.5"
            )));
        }
    };
    let host: Ipv4Addr = args.host.parse().map_err(|_| {
        Fatal::usage(format!(
            "--host {}: ggml-rpc-server listens on an IPv4 address only; pass one such as 127.0.0.1 or 192.168.1.20",
            args.host
        ))
    })?;
    if args.threads == Some(0) {
        return Err(Fatal::usage(
            "--threads 0: pass a positive number of threads".to_string(),
        ));
    }
    let binary = rpc_server_binary(args.rpc_server.as_deref())?;
    // With --mem or --traffic, the address given is the relay's and the worker listens on a
    // private loopback port behind it.
    let relayed = cap.is_some() || args.traffic.is_some();
    let traffic = std::sync::Arc::new(Traffic::default());
    // The file is checked (written once) before any port is taken: a usage error is a usage
    // error whatever else holds the port.
    if let Some(path) = &args.traffic {
        traffic::keep_written(traffic.clone(), path.clone()).map_err(|e| {
            Fatal::usage(format!(
                "--traffic {}: cannot write it ({e}); name a file in a folder you can write",
                path.display()
            ))
        })?;
    }
    let relay = match relayed {
        true => Some(TcpListener::bind((host, args.port)).map_err(|e| {
            Fatal::backend(format!(
                "cannot listen on {host}:{} ({e}); pass another --port",
                args.port
            ))
        })?),
        false => None,
    };
    let port = match (&relay, args.port) {
        (Some(l), _) => l.local_addr().map(|a| a.port()).unwrap_or(args.port),
        (None, 0) => free_port(host)?,
        (None, p) => p,
    };
    let (worker_host, worker_port) = match &relay {
        Some(listener) => {
            let private = free_port(Ipv4Addr::LOCALHOST)?;
            let listener = listener
                .try_clone()
                .map_err(|e| Fatal::backend(e.to_string()))?;
            let to = (Ipv4Addr::LOCALHOST, private).into();
            crate::rpc::relay::spawn(listener, to, cap.unwrap_or(u64::MAX), traffic.clone())
                .map_err(|e| Fatal::backend(format!("cannot start the relay: {e}")))?;
            (Ipv4Addr::LOCALHOST, private)
        }
        None => (host, port),
    };
    let endpoint = format!("{host}:{port}");
    if !host.is_loopback() {
        tracing::warn!("1bit rpc-worker: {}", exposure_warning(&endpoint));
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Fatal::backend(format!("cannot start the runtime: {e}")))?;
    // The signal handlers go in before the worker starts, so a SIGTERM at any point after
    // is forwarded rather than killing this process and leaving the worker to PDEATHSIG.
    let _guard = runtime.enter();
    let (Ok(term), Ok(int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return Err(Fatal::backend("cannot install signal handlers"));
    };

    let child = spawn_worker(&binary, worker_host, worker_port, args.threads)?;
    let pid = child.pid();
    let child = std::sync::Arc::new(child);
    let probe_at = if host.is_unspecified() {
        format!("127.0.0.1:{port}")
    } else {
        endpoint.clone()
    };

    let worker = Worker {
        child,
        pid,
        binary,
        endpoint,
        probe_at,
    };
    let stopped = runtime.block_on(watch(worker, term, int));
    if let Some(path) = &args.traffic {
        let _ = traffic.write(path);
    }
    stopped
}

/// The started worker, as [`watch`] follows it.
struct Worker {
    child: std::sync::Arc<Process>,
    pid: u32,
    binary: PathBuf,
    /// The address announced (the relay's with --mem).
    endpoint: String,
    /// Where the readiness probe asks.
    probe_at: String,
}

/// The worker started with this command's settings; its stdout joins stderr.
fn spawn_worker(
    binary: &Path,
    worker_host: Ipv4Addr,
    worker_port: u16,
    threads: Option<u32>,
) -> Result<Process, Fatal> {
    let mut command = Command::new(binary);
    command
        .args([
            "--host",
            &worker_host.to_string(),
            "--port",
            &worker_port.to_string(),
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(n) = threads {
        command.args(["--threads", &n.to_string()]);
    }
    // The worker prints a line on stdout per client connection; this command's stdout is its
    // one announcement, so the worker's goes to stderr with its other lines.
    if let Ok(err) = std::io::stderr().as_fd().try_clone_to_owned() {
        command.stdout(Stdio::from(err));
    }
    onebit_process::spawn(command)
        .map_err(|e| Fatal::backend(format!("could not start {} ({e})", binary.display())))
}

/// Announce the worker once it answers, then wait for its exit or a signal, and stop it on
/// the signal. The exit status this command ends with.
async fn watch(worker: Worker, mut term: Signal, mut int: Signal) -> Result<i32, Fatal> {
    let Worker {
        child,
        pid,
        binary,
        endpoint,
        probe_at,
    } = worker;
    let mut waiter = {
        let child = child.clone();
        tokio::task::spawn_blocking(move || child.wait())
    };
    // Ready when it answers the probe; a worker that exits first, or a signal, ends it.
    let ready = async {
        let started = Instant::now();
        loop {
            let at = probe_at.clone();
            let asked =
                tokio::task::spawn_blocking(move || probe::ask(&at, probe::ANSWER_WITHIN)).await;
            match asked {
                Ok(Ok(offer)) => return Ok(offer),
                Ok(Err(e)) if started.elapsed() > READY_WITHIN => {
                    return Err(format!("{e}; gave up after {} s", READY_WITHIN.as_secs()));
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    let asked = tokio::select! {
        offer = ready => match offer {
            Ok(offer) => {
                println!("{}", announcement(&endpoint, &offer));
                None
            }
            Err(e) => {
                let _ = stop(&child, Duration::ZERO).await;
                return Err(Fatal::backend(e));
            }
        },
        done = &mut waiter => {
            let status = done.ok().and_then(Result::ok);
            let how = status.map(describe_exit).unwrap_or_else(|| "ended".into());
            return Err(Fatal {
                code: status.map(exit_code).unwrap_or(exit::BACKEND),
                message: format!("{} {how} before it answered on {endpoint}", binary.display()),
            });
        }
        _ = term.recv() => Some("SIGTERM"),
        _ = int.recv() => Some("SIGINT"),
    };
    let asked = match asked {
        Some(asked) => asked,
        None => tokio::select! {
            done = &mut waiter => {
                let status = done
                    .map_err(|e| Fatal::backend(e.to_string()))?
                    .map_err(|e| Fatal::backend(e.to_string()))?;
                tracing::info!(
                    "1bit rpc-worker: the worker on {endpoint} (pid {pid}) {}",
                    describe_exit(status)
                );
                return Ok(exit_code(status));
            }
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
    };
    tracing::info!("1bit rpc-worker: {asked}: stopping the worker on {endpoint} (pid {pid})");
    if stop(&child, STOP_GRACE).await != Stopped::Exited {
        tracing::info!(
            "1bit rpc-worker: the worker (pid {pid}) {}",
            crate::backends::supervisor::why_killed(&child, STOP_GRACE)
        );
    }
    let status = waiter.await.ok().and_then(Result::ok);
    // Stopped because we were asked: a clean stop, unless it failed on its way out.
    Ok(match status {
        Some(s) if s.code().is_some_and(|c| c != 0) => exit_code(s),
        _ => exit::OK,
    })
}

/// The spawner's stop sequence for the worker, on a blocking thread.
async fn stop(child: &std::sync::Arc<Process>, grace: Duration) -> Stopped {
    let child = child.clone();
    tokio::task::spawn_blocking(move || child.stop(grace))
        .await
        .unwrap_or(Stopped::Stuck)
}

/// The worker's exit as this command's status: its code, or 128 + the signal that killed it.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(exit::BACKEND)
}

/// The one line on stdout once the worker answers: where, what it offers, how to use it.
pub fn announcement(endpoint: &str, offer: &probe::Offer) -> String {
    let devices: Vec<String> = offer
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            format!(
                "device {i}: {:.1} GiB free of {:.1}",
                d.free as f64 / GIB,
                d.total as f64 / GIB
            )
        })
        .collect();
    format!(
        "1bit rpc-worker: listening on {endpoint} (RPC protocol {}.{}.{}), offering {:.1} GiB ({}); pass --rpc {endpoint} to 1bit serve",
        offer.version.0,
        offer.version.1,
        offer.version.2,
        offer.free() as f64 / GIB,
        devices.join(", ")
    )
}

/// The one warning line for a worker that listens beyond loopback.
pub fn exposure_warning(endpoint: &str) -> String {
    format!(
        "warning: {endpoint} is not a loopback address and the RPC protocol has no authentication: anyone who can reach this port can allocate this machine's memory, read and write every tensor in it, and run compute graphs on it; bind it only on a private network you trust (docs/security.md)"
    )
}

/// A free port on `host`, from the kernel; released just before the worker binds it.
fn free_port(host: Ipv4Addr) -> Result<u16, Fatal> {
    TcpListener::bind((host, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Fatal::backend(format!("cannot find a free port on {host}: {e}")))
}

/// Which ggml-rpc-server to run: `--rpc-server PATH`, else `$ONEBIT_RPC_SERVER`, else the one
/// beside `$ONEBIT_LLAMA_SERVER`, else the one `cargo xtask setup` installed beside
/// llama-server, else `ggml-rpc-server` on `PATH`.
pub fn rpc_server_binary(explicit: Option<&Path>) -> Result<PathBuf, Fatal> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(path) = explicit {
        return check_executable(path, "--rpc-server");
    }
    if let Some(path) = env("ONEBIT_RPC_SERVER") {
        return check_executable(&path, "ONEBIT_RPC_SERVER");
    }
    let beside_llama = env("ONEBIT_LLAMA_SERVER").and_then(|p| Some(p.parent()?.join(NAME)));
    let candidates = beside_llama.into_iter().chain(installed()).chain(
        std::env::var_os("PATH").into_iter().flat_map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(NAME))
                .collect::<Vec<_>>()
        }),
    );
    for candidate in candidates {
        if is_executable(&candidate) {
            return Ok(candidate);
        }
    }
    Err(Fatal::usage(
        "no ggml-rpc-server found: run `cargo xtask setup` to build the pinned one, or pass --rpc-server PATH (or set ONEBIT_RPC_SERVER)",
    ))
}

const NAME: &str = "ggml-rpc-server";

/// `<cache>/<install dir of the pinned llama.cpp>/bin/ggml-rpc-server`, the cache found as
/// `cargo xtask setup` finds it.
fn installed() -> Option<PathBuf> {
    let pins: serde_json::Value = serde_json::from_str(PINS).ok()?;
    let dir = pins["llama_cpp"]["install_dir"].as_str()?;
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let cache = env("ONEBIT_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("onebit")))
        .or_else(|| env("HOME").map(|h| h.join(".cache").join("onebit")))?;
    Some(cache.join(dir).join("bin").join(NAME))
}

fn check_executable(path: &Path, what: &str) -> Result<PathBuf, Fatal> {
    if is_executable(path) {
        Ok(path.to_path_buf())
    } else if path.exists() {
        Err(Fatal::usage(format!(
            "{what} {}: not an executable file; pass the ggml-rpc-server binary",
            path.display()
        )))
    } else {
        Err(Fatal::usage(format!(
            "{what} {}: no such file; pass the path of a ggml-rpc-server binary",
            path.display()
        )))
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}
