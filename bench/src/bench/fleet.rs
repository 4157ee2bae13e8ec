//! A fleet of serves behind the pinned gateway (SMG; docs/fleet.md): [`Fleet`] starts one, as
//! `cargo xtask fleet` runs it and as the figures here measure it, and `cargo xtask bench
//! fleet` measures what it costs and gives. Figures: the gateway's added time per request
//! against a worker reached directly (one client, whole chats the fake backend answers at
//! once); and the throughput of streamed chats through the gateway at 1, 2 and 4 workers whose
//! backends run one generation at a time at a fixed time per token (the fake backend's
//! `FAKE_SLOTS=1` and `FAKE_SSE_INTERVAL_MS`), so the scaling measured is the fleet's and not
//! this machine's cores; and, on two serves of the real llama-server, multi-turn conversations
//! with long system prompts under cache-aware routing with one shared prompt cache against
//! round-robin without it: the prompt tokens prefilled again and the time to the first token
//! (`fleet/conversations.rs`). Release builds.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::arms::{Server, free_addr};
use super::client::{self, Conn};
mod conversations;
use crate::{Failure, Prepare, Workspace};
use conversations::Conversations;

/// The engine behind each worker.
pub enum Backend {
    /// The fake backend (`tests/src/bin/fake-backend.rs`) with this environment.
    Fake {
        binary: PathBuf,
        env: Vec<(String, String)>,
    },
    /// The pinned llama-server with a model.
    Llama { server: PathBuf, model: PathBuf },
}

/// What a fleet is made of.
pub struct Spec {
    pub onebit: PathBuf,
    pub smg: PathBuf,
    pub backend: Backend,
    pub workers: usize,
    /// The gateway's address; each worker listens on the next ports (None: free ports).
    pub gateway: Option<SocketAddr>,
    /// More of serve's flags for every worker (the drain's, say), last on its command line.
    pub serve_args: Vec<String>,
    /// Where the logs go.
    pub scratch: PathBuf,
}

/// serve's drain for a worker of a fleet: `/health` says draining at once, and serve answers
/// for 3 s more (the gateway's health check, every second, takes it out first), within 30 s.
pub const WORKER_DRAIN: [&str; 4] = ["--drain-notice-s", "3", "--drain-s", "30"];

/// How long a fleet may take to be ready (a real model loads in each worker).
const READY_LIMIT: Duration = Duration::from_secs(180);

/// The gateway's command line for `workers` (docs/fleet.md explains each choice): the
/// cache-aware policy, a health check of serve's `/health` every second that takes a worker
/// out at its first failure and back at its first success, five retries, the workers' load
/// polled every 2 s, Prometheus metrics on `metrics`.
pub fn gateway_args(gateway: SocketAddr, metrics: SocketAddr, workers: &[String]) -> Vec<String> {
    gateway_args_with(gateway, metrics, workers, "cache_aware")
}

/// [`gateway_args`] with another routing policy (SMG's `--policy`: `round_robin`, ...).
fn gateway_args_with(
    gateway: SocketAddr,
    metrics: SocketAddr,
    workers: &[String],
    policy: &str,
) -> Vec<String> {
    let mut args: Vec<String> = [
        "launch",
        "--host",
        &gateway.ip().to_string(),
        "--port",
        &gateway.port().to_string(),
        "--worker-urls",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(workers.iter().cloned());
    args.extend(
        [
            "--policy",
            policy,
            "--health-check-endpoint",
            "/health",
            "--health-check-interval-secs",
            "1",
            "--health-check-timeout-secs",
            "2",
            "--health-failure-threshold",
            "1",
            "--health-success-threshold",
            "1",
            "--retry-max-retries",
            "5",
            "--load-monitor-interval",
            "2",
            "--prometheus-host",
            &metrics.ip().to_string(),
            "--prometheus-port",
            &metrics.port().to_string(),
            "--shutdown-grace-period-secs",
            "5",
            "--log-level",
            "warn",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    args
}

/// A running fleet: its workers and the gateway in front, each stopped when dropped (SIGTERM,
/// then SIGKILL 10 s later), the gateway first (the fields' order).
pub struct Fleet {
    pub gateway: Server,
    /// Where the gateway's Prometheus text is (`/metrics`).
    pub metrics: SocketAddr,
    pub workers: Vec<Server>,
}

impl Fleet {
    /// Starts the workers, waits for each to be ready, then the gateway, and waits until it
    /// routes to all of them. The children stay in the caller's process group, so a terminal's
    /// Ctrl-C stops every one of them (each serve drains) as it stops the caller.
    pub fn start(spec: &Spec) -> Result<Fleet, Failure> {
        Fleet::start_with(spec, "cache_aware")
    }

    /// [`Fleet::start`] with the gateway routing by another policy (SMG's `--policy`).
    pub fn start_with(spec: &Spec, policy: &str) -> Result<Fleet, Failure> {
        let gateway_addr = match spec.gateway {
            Some(addr) => addr,
            None => free_addr()?,
        };
        let mut workers = Vec::new();
        for i in 0..spec.workers {
            let addr = match spec.gateway {
                Some(g) => SocketAddr::new(g.ip(), g.port() + 1 + i as u16),
                None => free_addr()?,
            };
            let mut command = Command::new(&spec.onebit);
            command
                .arg("serve")
                .args(["--device", "cpu", "--alias", "fleet"])
                .args(["--host", &addr.ip().to_string()])
                .args(["--port", &addr.port().to_string()])
                .env("ONEBIT_STATE_DIR", spec.scratch.join(format!("state-{i}")));
            match &spec.backend {
                Backend::Fake { binary, env } => {
                    let model = spec.scratch.join("fake.gguf");
                    std::fs::write(&model, b"the fake backend serves anything")
                        .map_err(|e| Failure::new(e, "check the scratch folder"))?;
                    command
                        .arg("-m")
                        .arg(&model)
                        .arg("--llama-server")
                        .arg(binary);
                    command.envs(env.iter().map(|(k, v)| (k, v)));
                }
                Backend::Llama { server, model } => {
                    command
                        .arg("-m")
                        .arg(model)
                        .arg("--llama-server")
                        .arg(server);
                }
            }
            // Last, so they may end with `-- LLAMA_SERVER_ARGS`.
            command.args(&spec.serve_args);
            workers.push(Server::spawn("worker", addr, &mut command, &spec.scratch)?);
        }
        let since = Instant::now();
        for worker in &mut workers {
            worker.wait_healthy(since, READY_LIMIT)?;
        }
        let metrics = free_addr()?;
        let urls: Vec<String> = workers
            .iter()
            .map(|w| format!("http://{}", w.addr))
            .collect();
        let mut command = Command::new(&spec.smg);
        command.args(gateway_args_with(gateway_addr, metrics, &urls, policy));
        let gateway = Server::spawn("gateway", gateway_addr, &mut command, &spec.scratch)?;
        let fleet = Fleet {
            gateway,
            metrics,
            workers,
        };
        let began = Instant::now();
        while fleet.routed_workers() < spec.workers {
            if began.elapsed() > Duration::from_secs(60) {
                return Err(fleet.gateway.failure(format!(
                    "the gateway did not take all {} workers within 60 s",
                    spec.workers
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(fleet)
    }

    /// The workers the gateway routes to now (its `/readiness`).
    pub fn routed_workers(&self) -> usize {
        let Ok(mut conn) = Conn::open(self.gateway.addr) else {
            return 0;
        };
        let mut body = Vec::new();
        let request = client::get(self.gateway.addr, "/readiness");
        let answered = conn.stream(&request, |bytes, _| body.extend_from_slice(bytes));
        match answered {
            Ok(reply) if reply.status == 200 => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["healthy_workers"].as_u64())
                .unwrap_or(0) as usize,
            _ => 0,
        }
    }

    /// How many requests the gateway sent each worker (`smg_worker_requests_total`).
    pub fn sent(&self) -> Vec<u64> {
        let mut text = Vec::new();
        if let Ok(mut conn) = Conn::open(self.metrics) {
            let request = client::get(self.metrics, "/metrics");
            let _ = conn.stream(&request, |bytes, _| text.extend_from_slice(bytes));
        }
        let text = String::from_utf8_lossy(&text);
        self.workers
            .iter()
            .map(|w| {
                let url = format!("\"http://{}\"", w.addr);
                text.lines()
                    .find(|l| l.starts_with("smg_worker_requests_total{") && l.contains(&url))
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|n| n.parse::<f64>().ok())
                    .map_or(0, |n| n as u64)
            })
            .collect()
    }
}

/// Tokens per streamed reply, and the fixed time each takes, in the throughput figure.
const TOKENS: u64 = 16;
const TOKEN_MS: u64 = 20;
/// Concurrent clients in the throughput figure: four a worker at the most workers.
const CLIENTS: usize = 16;
const WORKER_COUNTS: [usize; 3] = [1, 2, 4];

/// `cargo xtask bench fleet [--quick]`.
pub fn run(ws: &Workspace, prep: &dyn Prepare, quick: bool) -> Result<ExitCode, Failure> {
    let smg = prep.gateway(ws)?;
    let (onebit, fake) = build(ws)?;
    let scratch = std::env::temp_dir().join(format!("onebit-bench-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| Failure::new(e, "check /tmp"))?;
    let spec = |workers: usize, env: &[(&str, String)]| Spec {
        onebit: onebit.clone(),
        smg: smg.clone(),
        backend: Backend::Fake {
            binary: fake.clone(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        },
        workers,
        gateway: None,
        serve_args: Vec::new(),
        scratch: scratch.clone(),
    };

    let blocks = if quick { 5 } else { 20 };
    println!("==> the gateway's added time: 1 worker, {blocks} blocks of 100 whole chats each way");
    let fleet = Fleet::start(&spec(1, &[]))?;
    let (direct, through) = added_time(fleet.workers[0].addr, fleet.gateway.addr, blocks)?;
    drop(fleet);

    let window = Duration::from_secs(if quick { 4 } else { 10 });
    let mut rows = Vec::new();
    for workers in WORKER_COUNTS {
        println!(
            "==> throughput: {workers} worker(s), one generation at a time each, {TOKENS} tokens at {TOKEN_MS} ms, {CLIENTS} clients, {} s",
            window.as_secs()
        );
        let env = [
            ("FAKE_SLOTS", "1".to_string()),
            ("FAKE_SSE_EVENTS", TOKENS.to_string()),
            ("FAKE_SSE_INTERVAL_MS", TOKEN_MS.to_string()),
        ];
        let fleet = Fleet::start(&spec(workers, &env))?;
        let (done, failed) = throughput(fleet.gateway.addr, window)?;
        rows.push((
            workers,
            done as f64 / window.as_secs_f64(),
            failed,
            fleet.sent(),
        ));
    }

    let (llama_server, model) = (
        ws.layout.llama_server(),
        ws.layout.model(ws.pins.default_model()),
    );
    if !llama_server.exists() || !model.exists() {
        prep.setup(ws)?;
    }
    let kit = conversations::Kit {
        onebit: onebit.clone(),
        smg: smg.clone(),
        llama_server,
        model,
        model_name: ws.pins.default_model().name.clone(),
        scratch: scratch.clone(),
    };
    let conversations = conversations::run(&kit, quick)?;
    let _ = std::fs::remove_dir_all(&scratch);
    report(ws, &direct, &through, &rows, &conversations);
    Ok(ExitCode::SUCCESS)
}

/// Per-request times (µs) of whole chats on one keep-alive connection each way, in
/// alternating blocks so drift falls on both alike: (direct, through the gateway).
fn added_time(
    worker: SocketAddr,
    gateway: SocketAddr,
    blocks: usize,
) -> Result<(Vec<f64>, Vec<f64>), Failure> {
    let body = r#"{"model":"fleet","messages":[{"role":"user","content":"hello"}]}"#;
    let open = |addr| {
        Conn::open(addr)
            .map_err(|e| Failure::new(format!("cannot connect to {addr}: {e}"), "see the logs"))
    };
    let (mut to_worker, mut to_gateway) = (open(worker)?, open(gateway)?);
    let mut times = (Vec::new(), Vec::new());
    for block in 0..=blocks {
        for (conn, addr, out) in [
            (&mut to_worker, worker, &mut times.0),
            (&mut to_gateway, gateway, &mut times.1),
        ] {
            let request = client::post_json(addr, "/v1/chat/completions", body, false);
            for _ in 0..100 {
                let began = Instant::now();
                let reply = conn
                    .exchange(&request)
                    .map_err(|e| Failure::new(format!("{addr}: {e}"), "see the logs"))?;
                if reply.status != 200 {
                    return Err(Failure::new(
                        format!("{addr} answered {}", reply.status),
                        "see the logs",
                    ));
                }
                // The first block warms both paths up.
                if block > 0 {
                    out.push(began.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
    }
    Ok(times)
}

/// Streamed chats through the gateway from [`CLIENTS`] clients for `window` after a second's
/// warm-up: those that ended whole within the window, and those that failed.
fn throughput(gateway: SocketAddr, window: Duration) -> Result<(u64, u64), Failure> {
    let stop = Arc::new(AtomicBool::new(false));
    let from = Instant::now() + Duration::from_secs(1);
    let until = from + window;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut done, mut failed, mut n) = (0u64, 0u64, 0u64);
                let mut conn = None;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    // A prompt of its own, so the cache-aware policy balances rather than pins.
                    let body = format!(
                        r#"{{"model":"fleet","stream":true,"messages":[{{"role":"user","content":"client {client} request {n}: tell a story"}}]}}"#
                    );
                    let request = client::post_json(gateway, "/v1/chat/completions", &body, false);
                    if conn.is_none() {
                        conn = Conn::open(gateway).ok();
                    }
                    let Some(c) = conn.as_mut() else {
                        failed += 1;
                        continue;
                    };
                    let mut text = Vec::new();
                    let whole = match c.stream(&request, |b, _| text.extend_from_slice(b)) {
                        Ok(reply) => {
                            if reply.close {
                                conn = None;
                            }
                            reply.status == 200
                                && client::find(&text, b"data: [DONE]").is_some()
                                && client::find(&text, b"\"error\"").is_none()
                        }
                        Err(_) => {
                            conn = None;
                            false
                        }
                    };
                    let now = Instant::now();
                    if (from..until).contains(&now) {
                        if whole {
                            done += 1;
                        } else {
                            failed += 1;
                        }
                    }
                }
                (done, failed)
            })
        })
        .collect();
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
    stop.store(true, Ordering::Relaxed);
    let mut totals = (0, 0);
    for client in clients {
        let (done, failed) = client
            .join()
            .map_err(|_| Failure::new("a load client panicked", "a bug in the benchmark"))?;
        totals.0 += done;
        totals.1 += failed;
    }
    Ok(totals)
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The tables, and `results/fleet.json`.
fn report(
    ws: &Workspace,
    direct: &[f64],
    through: &[f64],
    rows: &[(usize, f64, u64, Vec<u64>)],
    conversations: &Conversations,
) {
    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v
    };
    let (direct, through) = (sorted(direct), sorted(through));
    let ps = [0.5, 0.9, 0.99];
    println!("the gateway's added time per whole chat (fake backend, µs):");
    println!("  {:<22} {:>8} {:>8} {:>8}", "", "p50", "p90", "p99");
    for (name, v) in [
        ("worker directly", &direct),
        ("through the gateway", &through),
    ] {
        let [a, b, c] = ps.map(|p| percentile(v, p));
        println!("  {name:<22} {a:>8.0} {b:>8.0} {c:>8.0}");
    }
    let added = ps.map(|p| percentile(&through, p) - percentile(&direct, p));
    println!(
        "  {:<22} {:>8.0} {:>8.0} {:>8.0}",
        "added", added[0], added[1], added[2]
    );
    // The fake sends a reply's first chunk at once and each next one TOKEN_MS later.
    let one = 1000.0 / ((TOKENS - 1) * TOKEN_MS) as f64;
    println!(
        "throughput through the gateway (streamed chats of {TOKENS} tokens at {TOKEN_MS} ms, one at a time per worker, {CLIENTS} clients):"
    );
    println!(
        "  {:<8} {:>10} {:>10} {:>10} {:>8} {:>7}  sent to each",
        "workers", "req/s", "tokens/s", "ideal", "of ideal", "failed"
    );
    for (workers, rate, failed, sent) in rows {
        let ideal = one * *workers as f64;
        println!(
            "  {workers:<8} {rate:>10.2} {:>10.1} {ideal:>10.2} {:>7.0}% {failed:>7}  {sent:?}",
            rate * TOKENS as f64,
            100.0 * rate / ideal
        );
    }
    conversations.print();
    let json = serde_json::json!({
        "added_us": {"p50": added[0], "p90": added[1], "p99": added[2]},
        "direct_us": {"p50": percentile(&direct, 0.5), "p99": percentile(&direct, 0.99)},
        "gateway_us": {"p50": percentile(&through, 0.5), "p99": percentile(&through, 0.99)},
        "throughput": rows.iter().map(|(w, rate, failed, sent)| serde_json::json!({
            "workers": w, "requests_per_s": rate, "tokens_per_s": rate * TOKENS as f64,
            "ideal_requests_per_s": one * *w as f64, "failed": failed, "sent": sent,
        })).collect::<Vec<_>>(),
        "conversations": conversations.json(),
    });
    let results = ws.root.join("results");
    if std::fs::create_dir_all(&results).is_ok() {
        let _ = std::fs::write(results.join("fleet.json"), json.to_string());
        println!("  written to results/fleet.json");
    }
}

/// The release builds a fleet runs: `1bit` (with its cpu route) and the fake backend.
pub fn build(ws: &Workspace) -> Result<(PathBuf, PathBuf), Failure> {
    let binaries = super::build(ws, true)?;
    Ok((binaries.onebit, binaries.fake))
}
