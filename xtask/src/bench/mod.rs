//! `cargo xtask bench`: what serve's hop costs, measured side by side in one run against
//! llama-server alone and against nginx in front of it (docs/performance.md).
//!
//! Parts: `hop` (1-client /tokenize latency, keep-alive and a new connection per request),
//! `throughput` (64 keep-alive clients), `sse` (per-event delay through the fake backend),
//! `startup` (launch to /health 200), `rss` (serve's own memory), `mem-check` (admission time),
//! `rpc` (tokens/s and time to first token, local against split over RPC workers);
//! `inproc` alone (an in-process route's memory and cancellation, `inproc.rs`); `stop` alone
//! (SIGTERM to exit on every kind of route, idle and with a stream in flight, `stop.rs`);
//! `prompt-cache` alone (a conversation's second request after a restart, `prompt_cache.rs`).
//! No part named runs them all; `--quick` is the short run CI uses (`bench hop --quick`).
//! Arms alternate in blocks so drift on a shared machine falls on every arm alike.

mod arms;
pub(crate) mod chart;
mod client;
mod inproc;
mod inproc_llama;
mod mem_check;
mod prompt_cache;
mod rpc;
mod stop;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use arms::Server;
use client::Conn;

use crate::{Failure, Workspace, process, setup};

const USAGE: &str = "use `cargo xtask bench [hop|throughput|sse|startup|rss|mem-check|rpc ...] [--quick] [--baseline PATH]`, `cargo xtask bench inproc [--quick]`, `cargo xtask bench stop [--quick]` or `cargo xtask bench prompt-cache [--quick]`";
const TOKENIZE: &str = r#"{"content":"hello world"}"#;
const ARMS: [&str; 3] = ["direct", "serve", "nginx"];
/// Load clients for the throughput and RSS figures.
const CLIENTS: usize = 64;
const SSE_EVENTS: usize = 200;
const SSE_INTERVAL_MS: u64 = 2;
const READY_LIMIT: Duration = Duration::from_secs(120);

#[derive(Default, Clone, Copy)]
struct Parts {
    hop: bool,
    throughput: bool,
    sse: bool,
    startup: bool,
    rss: bool,
    mem_check: bool,
    rpc: bool,
}

struct Options {
    parts: Parts,
    quick: bool,
    /// Another build's `1bit` (`--baseline PATH`): a fourth arm on the hop, so a change's
    /// added time is compared with its parent's in the same run.
    baseline: Option<PathBuf>,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, Failure> {
        let mut parts = Parts::default();
        let mut any = false;
        let mut quick = false;
        let mut baseline = None;
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            any |= arg != "--quick" && arg != "--baseline";
            match arg.as_str() {
                "--quick" => quick = true,
                "--baseline" => {
                    let path = args.next().map(PathBuf::from).filter(|p| p.is_file());
                    let Some(path) = path else {
                        return Err(Failure::new(
                            "--baseline needs the path of another build's `1bit`",
                            "build the parent commit in a worktree and pass its target/release/1bit",
                        ));
                    };
                    baseline = Some(path);
                }
                "hop" => parts.hop = true,
                "throughput" => parts.throughput = true,
                "sse" => parts.sse = true,
                "startup" => parts.startup = true,
                "rss" => parts.rss = true,
                "mem-check" => parts.mem_check = true,
                "rpc" => parts.rpc = true,
                other => {
                    return Err(Failure::new(format!("unknown benchmark `{other}`"), USAGE));
                }
            }
        }
        if !any {
            parts = Parts {
                hop: true,
                throughput: true,
                sse: true,
                startup: true,
                rss: true,
                mem_check: true,
                rpc: true,
            };
        }
        Ok(Options {
            parts,
            quick,
            baseline,
        })
    }
}

/// Runs the parts asked for, prints the table and the targets, writes `results/bench.json`
/// (and `results/latency.svg` when latencies were measured). Fails (exit 1) when serve's added
/// p50 on the hop exceeds twice nginx's: the regression check CI runs.
pub fn run(ws: &Workspace, args: &[String]) -> Result<ExitCode, Failure> {
    if args.iter().any(|a| a == "inproc-llama") {
        // The inproc add-on against --device cpu and llama-server direct: its own table.
        return inproc_llama::run(ws, args.iter().any(|a| a == "--quick"));
    }
    if args.iter().any(|a| a == "prompt-cache") {
        // The persistent prompt cache after a restart: its own table.
        return prompt_cache::run(ws, args.iter().any(|a| a == "--quick"));
    }
    if args.iter().any(|a| a == "stop") {
        // SIGTERM to exit against Lemonade's window: its own table.
        return stop::run(ws, args.iter().any(|a| a == "--quick"));
    }
    if args.iter().any(|a| a == "inproc") {
        // Its own figures, on its own fixture route: not part of the hop report.
        return inproc::run(ws, args.iter().any(|a| a == "--quick"));
    }
    let options = Options::parse(args)?;
    let report = measure(ws, &options)?;
    Ok(match report.gate() {
        Gate::Failed(_) => ExitCode::FAILURE,
        Gate::Passed | Gate::Noisy(_) => ExitCode::SUCCESS,
    })
}

/// What the CI rule found in one run, or over the regression check's attempts.
pub enum Gate {
    Passed,
    /// The lines that say why.
    Failed(Vec<String>),
    /// The machine was too busy for the run to measure a hop: why.
    Noisy(String),
}

/// Attempts of the regression check: a busy shared machine can spoil a 5-second run, seldom
/// three in a row; a real regression fails every one.
const GATE_ATTEMPTS: usize = 3;

/// `bench hop --quick`, for `cargo xtask test`, up to [`GATE_ATTEMPTS`] times until a run
/// passes: Passed, Failed (some run measured a breach and none passed), or Noisy (no run could
/// measure).
pub fn regression_check(ws: &Workspace) -> Result<Gate, Failure> {
    let options = Options {
        parts: Parts {
            hop: true,
            ..Parts::default()
        },
        quick: true,
        baseline: None,
    };
    let mut failed = Vec::new();
    let mut noisy = Vec::new();
    for attempt in 1..=GATE_ATTEMPTS {
        match measure(ws, &options)?.gate() {
            Gate::Passed => return Ok(Gate::Passed),
            Gate::Failed(lines) => failed.extend(lines),
            Gate::Noisy(why) => noisy.push(why),
        }
        if attempt < GATE_ATTEMPTS {
            println!(
                "regression check: attempt {attempt} of {GATE_ATTEMPTS} did not pass; measuring again"
            );
        }
    }
    Ok(if failed.is_empty() {
        Gate::Noisy(noisy.join("; "))
    } else {
        Gate::Failed(failed)
    })
}

fn measure(ws: &Workspace, options: &Options) -> Result<Report, Failure> {
    let parts = options.parts;
    setup::run(ws)?;
    let bins = build(ws, parts.sse)?;
    let scratch = std::env::temp_dir().join(format!("onebit-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| {
        Failure::new(
            format!("cannot create {}: {e}", scratch.display()),
            "check /tmp",
        )
    })?;
    let mut report = Report::new(options.quick);
    if parts.hop || parts.throughput || parts.rss {
        proxied(ws, &bins, options, &scratch, &mut report)?;
    }
    if parts.sse {
        sse(ws, &bins, options, &scratch, &mut report)?;
    }
    if parts.startup {
        startup(ws, &bins, options, &scratch, &mut report)?;
    }
    if parts.mem_check {
        let found = mem_check::measure(ws, &bins.onebit)?;
        report.mem_check(&found);
    }
    if parts.rpc {
        let rows = rpc::measure(ws, &bins.onebit, options.quick, &scratch)?;
        rpc::write(&ws.root.join("results"), &rows)?;
    }
    // `bench rpc` alone has its own table and file; the shared report would be empty.
    if parts.hop || parts.throughput || parts.sse || parts.startup || parts.rss || parts.mem_check {
        report.finish(&ws.root.join("results"))?;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(report)
}

/// The CI rule on one run's added keep-alive p50s (µs).
fn gate_verdict(serve: f64, nginx: f64) -> Gate {
    if nginx < NOISE_FLOOR_US {
        Gate::Noisy(format!(
            "nginx added {nginx:.1} µs (serve {serve:.1} µs): the arms' noise was larger than the hop"
        ))
    } else if serve > 2.0 * nginx {
        Gate::Failed(vec![format!(
            "hop (keep-alive): serve adds {serve:.1} µs at p50, more than twice nginx's {nginx:.1} µs"
        )])
    } else {
        Gate::Passed
    }
}

/// Below this added p50 nginx's figure is noise (see `Report::gate`).
const NOISE_FLOOR_US: f64 = 10.0;

struct Binaries {
    onebit: PathBuf,
    llama_server: PathBuf,
    fake: PathBuf,
}

/// The release build of `1bit` and its cpu route (and of the fake backend when SSE is measured).
fn build(ws: &Workspace, fake: bool) -> Result<Binaries, Failure> {
    let mut cargo = process::cargo();
    cargo.current_dir(&ws.root).args([
        "build",
        "--release",
        "-p",
        "onebit-host",
        "-p",
        "onebit-route-cpu",
    ]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "the release build failed: fix the errors above")?;
    if fake {
        let mut cargo = process::cargo();
        cargo.current_dir(&ws.root).args([
            "build",
            "--release",
            "-p",
            "onebit-tests",
            "--bin",
            "fake-backend",
        ]);
        println!("==> {}", process::describe(&cargo));
        process::run(
            &mut cargo,
            "the fake backend does not build: fix the errors above",
        )?;
    }
    Ok(Binaries {
        onebit: ws.root.join("target/release/1bit"),
        llama_server: ws.layout.llama_server(),
        fake: ws.root.join("target/release/fake-backend"),
    })
}

/// Waits for every server, in turn, to answer `/health` with 200.
fn all_healthy(servers: &mut [&mut Server], since: Instant) -> Result<(), Failure> {
    for server in servers.iter_mut() {
        server.wait_healthy(since, READY_LIMIT)?;
    }
    Ok(())
}

/// The hop, throughput and RSS parts: llama-server direct, serve in front of its own
/// llama-server, nginx in front of the direct one (the same process, so nginx minus direct
/// is the hop alone; serve's own child is a second, identically started process).
fn proxied(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
    report: &mut Report,
) -> Result<(), Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    let nginx_bin = arms::nginx_binary()?;
    let began = Instant::now();
    let direct_addr = arms::free_addr()?;
    let mut direct = Server::spawn(
        "llama-server",
        direct_addr,
        &mut arms::llama_server(&bins.llama_server, &model, direct_addr),
        scratch,
    )?;
    let serve_addr = arms::free_addr()?;
    let mut serve = Server::spawn(
        "1bit serve",
        serve_addr,
        &mut arms::serve(&bins.onebit, &model, serve_addr, None),
        scratch,
    )?;
    let nginx_addr = arms::free_addr()?;
    let mut nginx = Server::spawn(
        "nginx",
        nginx_addr,
        &mut arms::nginx(&nginx_bin, scratch, nginx_addr, direct_addr)?,
        scratch,
    )?;
    let mut baseline = match options.baseline.as_deref().filter(|_| options.parts.hop) {
        Some(onebit) => {
            let addr = arms::free_addr()?;
            let command = &mut arms::serve(onebit, &model, addr, None);
            Some(Server::spawn(
                "1bit serve (baseline)",
                addr,
                command,
                scratch,
            )?)
        }
        None => None,
    };
    all_healthy(&mut [&mut direct, &mut serve, &mut nginx], began)?;
    if let Some(baseline) = baseline.as_mut() {
        baseline.wait_healthy(began, READY_LIMIT)?;
    }
    let mut addrs = vec![direct.addr, serve.addr, nginx.addr];
    let mut servers = vec![&direct, &serve, &nginx];
    if let Some(baseline) = &baseline {
        addrs.push(baseline.addr);
        servers.push(baseline);
    }
    for (server, addr) in servers.iter().zip(addrs.iter().copied()) {
        warm_up(addr).map_err(|e| server.failure(e))?;
    }
    let serve_pid = serve.pid();
    report.rss_idle_kib = arms::vm_rss_kib(serve_pid);

    if options.parts.hop {
        // Short blocks, rotating over the arms: a burst of load from elsewhere on the machine
        // then falls on every arm alike instead of on one arm's block.
        let per_block = 10;
        let blocks = if options.quick { 100 } else { 500 };
        println!(
            "hop: POST /tokenize, 1 client, {} requests per arm and mode, in {blocks} alternating blocks",
            blocks * per_block
        );
        let mut hop = Hop::default();
        let mut keep_alive: [Option<Conn>; 4] = [None, None, None, None];
        for block in 0..blocks {
            for rotate in 0..addrs.len() {
                let arm = (block + rotate) % addrs.len();
                let fail = |e: String| servers[arm].failure(e);
                hop.keep_alive_block(arm, addrs[arm], &mut keep_alive[arm], per_block)
                    .map_err(fail)?;
                hop.new_connection_block(arm, addrs[arm], per_block)
                    .map_err(fail)?;
            }
        }
        for samples in hop
            .keep_alive
            .iter_mut()
            .chain(hop.new_connection.iter_mut())
        {
            samples.sort_by(f64::total_cmp);
        }
        report.hop = Some(hop);
    }

    if options.parts.throughput || options.parts.rss {
        let (rounds, seconds) = if options.quick { (1, 2) } else { (2, 5) };
        let arms_run: Vec<usize> = if options.parts.throughput {
            vec![0, 1, 2]
        } else {
            vec![1]
        };
        println!(
            "throughput: {CLIENTS} keep-alive clients on /tokenize, {rounds} × {seconds} s per arm"
        );
        let mut requests = [0u64; 3];
        let mut elapsed = [0f64; 3];
        let mut peak_rss = 0u64;
        for round in 0..rounds {
            for k in 0..arms_run.len() {
                let arm = arms_run[(round + k) % arms_run.len()];
                let watch = (arm == 1).then_some(serve_pid);
                let load = throughput(addrs[arm], Duration::from_secs(seconds), watch)
                    .map_err(|e| servers[arm].failure(e))?;
                requests[arm] += load.requests;
                elapsed[arm] += load.seconds;
                peak_rss = peak_rss.max(load.peak_rss_kib);
            }
        }
        if options.parts.throughput {
            report.throughput = Some([0, 1, 2].map(|arm| requests[arm] as f64 / elapsed[arm]));
        }
        report.rss_load_kib = Some(peak_rss);
    }
    Ok(())
}

/// Enough requests for every connection pool and cache on the path to be warm.
fn warm_up(addr: SocketAddr) -> Result<(), String> {
    let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
    let request = client::post_json(addr, "/tokenize", TOKENIZE, false);
    for _ in 0..300 {
        let reply = conn.exchange(&request).map_err(|e| e.to_string())?;
        if reply.close {
            conn = Conn::open(addr).map_err(|e| e.to_string())?;
        }
    }
    let request = client::post_json(addr, "/tokenize", TOKENIZE, true);
    for _ in 0..100 {
        Conn::open(addr)
            .and_then(|mut c| c.exchange(&request))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Per-request latencies (µs) of the hop, per arm: direct, serve, nginx, and the baseline
/// serve (empty without `--baseline`).
#[derive(Default)]
struct Hop {
    keep_alive: [Vec<f64>; 4],
    new_connection: [Vec<f64>; 4],
    /// Keep-alive connections the server closed, per arm (the next request reconnects).
    reconnects: [u64; 4],
}

impl Hop {
    fn keep_alive_block(
        &mut self,
        arm: usize,
        addr: SocketAddr,
        conn: &mut Option<Conn>,
        n: usize,
    ) -> Result<(), String> {
        let request = client::post_json(addr, "/tokenize", TOKENIZE, false);
        for _ in 0..n {
            let began = Instant::now();
            let c = match conn {
                Some(c) => c,
                None => conn.insert(Conn::open(addr).map_err(|e| e.to_string())?),
            };
            let reply = c.exchange(&request).map_err(|e| e.to_string())?;
            let micros = began.elapsed().as_secs_f64() * 1e6;
            check_ok(reply.status)?;
            if reply.close {
                *conn = None;
                self.reconnects[arm] += 1;
            }
            self.keep_alive[arm].push(micros);
        }
        Ok(())
    }

    /// Connect, ask with `Connection: close`, read the reply: what a client without a pool pays.
    fn new_connection_block(
        &mut self,
        arm: usize,
        addr: SocketAddr,
        n: usize,
    ) -> Result<(), String> {
        let request = client::post_json(addr, "/tokenize", TOKENIZE, true);
        for _ in 0..n {
            let began = Instant::now();
            let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
            let reply = conn.exchange(&request).map_err(|e| e.to_string())?;
            let micros = began.elapsed().as_secs_f64() * 1e6;
            check_ok(reply.status)?;
            self.new_connection[arm].push(micros);
        }
        Ok(())
    }
}

fn check_ok(status: u16) -> Result<(), String> {
    if status == 200 {
        Ok(())
    } else {
        Err(format!("/tokenize answered {status}"))
    }
}

struct Load {
    requests: u64,
    seconds: f64,
    peak_rss_kib: u64,
}

/// `CLIENTS` threads, each with its own keep-alive connection, asking /tokenize back to back
/// for `duration`; samples `watch`'s VmRSS every 50 ms meanwhile.
fn throughput(addr: SocketAddr, duration: Duration, watch: Option<u32>) -> Result<Load, String> {
    let request = client::post_json(addr, "/tokenize", TOKENIZE, false);
    let done = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let start = Barrier::new(CLIENTS + 1);
    let peak = AtomicU64::new(0);
    let error = std::sync::Mutex::new(None::<String>);
    let seconds = std::thread::scope(|scope| {
        for _ in 0..CLIENTS {
            scope.spawn(|| {
                let conn = Conn::open(addr);
                start.wait();
                let mut conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                        return;
                    }
                };
                let mut n = 0;
                while !done.load(Ordering::Relaxed) {
                    match conn.exchange(&request) {
                        Ok(reply) if reply.status == 200 => {
                            n += 1;
                            if reply.close {
                                match Conn::open(addr) {
                                    Ok(c) => conn = c,
                                    Err(_) => break,
                                }
                            }
                        }
                        Ok(reply) => {
                            *error.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("/tokenize answered {} under load", reply.status));
                            break;
                        }
                        Err(e) => {
                            *error.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("under load: {e}"));
                            break;
                        }
                    }
                }
                count.fetch_add(n, Ordering::Relaxed);
            });
        }
        start.wait();
        let began = Instant::now();
        while began.elapsed() < duration {
            if let Some(kib) = watch.and_then(arms::vm_rss_kib) {
                peak.fetch_max(kib, Ordering::Relaxed);
            }
            std::thread::sleep(
                Duration::from_millis(50).min(duration.saturating_sub(began.elapsed())),
            );
        }
        if let Some(kib) = watch.and_then(arms::vm_rss_kib) {
            peak.fetch_max(kib, Ordering::Relaxed);
        }
        done.store(true, Ordering::Relaxed);
        began.elapsed().as_secs_f64()
    });
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(Load {
        requests: count.into_inner(),
        seconds,
        peak_rss_kib: peak.into_inner(),
    })
}

/// Per-event delays (µs) at the client, and events that arrived only after the next was sent.
#[derive(Default)]
struct Sse {
    delays: [Vec<f64>; 3],
    held: [u64; 3],
    /// How late each held-back event arrived (µs after it was sent), per arm.
    held_late_us: [Vec<f64>; 3],
    /// Consecutive events the fake sent at least half an interval apart, per arm.
    paced: [u64; 3],
    streams: usize,
}

/// ", arriving 2.4, 4.0 ms late" for held-back events (µs given), or nothing.
fn late_ms(late_us: &[f64]) -> String {
    if late_us.is_empty() {
        return String::new();
    }
    let list: Vec<String> = late_us
        .iter()
        .map(|us| format!("{:.1}", us / 1e3))
        .collect();
    format!(", arriving {} ms late", list.join(", "))
}

/// The SSE part: the fake backend alone, serve in front of another, nginx in front of the first.
fn sse(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
    report: &mut Report,
) -> Result<(), Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    let nginx_bin = arms::nginx_binary()?;
    let pace = |command: &mut Command| {
        command
            .env("FAKE_SSE_EVENTS", SSE_EVENTS.to_string())
            .env("FAKE_SSE_INTERVAL_MS", SSE_INTERVAL_MS.to_string());
    };
    let began = Instant::now();
    let direct_addr = arms::free_addr()?;
    let mut command = Command::new(&bins.fake);
    command.arg("-m").arg(&model).args([
        "--host",
        "127.0.0.1",
        "--port",
        &direct_addr.port().to_string(),
    ]);
    pace(&mut command);
    let mut direct = Server::spawn("fake-backend", direct_addr, &mut command, scratch)?;
    let serve_addr = arms::free_addr()?;
    let mut command = arms::serve(&bins.onebit, &model, serve_addr, Some(&bins.fake));
    pace(&mut command);
    let mut serve = Server::spawn("1bit serve (fake)", serve_addr, &mut command, scratch)?;
    let nginx_addr = arms::free_addr()?;
    let mut nginx = Server::spawn(
        "nginx (fake)",
        nginx_addr,
        &mut arms::nginx(&nginx_bin, scratch, nginx_addr, direct_addr)?,
        scratch,
    )?;
    all_healthy(&mut [&mut direct, &mut serve, &mut nginx], began)?;
    let servers = [&direct, &serve, &nginx];
    let rounds = if options.quick { 2 } else { 6 };
    println!(
        "sse: {rounds} streams per arm of {SSE_EVENTS} events {SSE_INTERVAL_MS} ms apart (after one warm-up)"
    );
    let mut found = Sse {
        streams: rounds,
        ..Sse::default()
    };
    for round in 0..=rounds {
        for k in 0..3 {
            let arm = (round + k) % 3;
            let events = stream_events(servers[arm].addr).map_err(|e| servers[arm].failure(e))?;
            if round == 0 {
                continue;
            }
            for pair in events.windows(2) {
                // Only pairs the fake really sent apart: a fake that wakes late sends the
                // overdue chunks back to back, and those arrive together through any arm.
                if pair[1].sent_ns.saturating_sub(pair[0].sent_ns) < SSE_INTERVAL_MS * 500_000 {
                    continue;
                }
                found.paced[arm] += 1;
                // Received no earlier than the next one was sent: held back or coalesced.
                if pair[0].received_ns >= pair[1].sent_ns {
                    found.held[arm] += 1;
                    found.held_late_us[arm]
                        .push(pair[0].received_ns.saturating_sub(pair[0].sent_ns) as f64 / 1e3);
                }
            }
            found.delays[arm].extend(
                events
                    .iter()
                    .map(|e| (e.received_ns as f64 - e.sent_ns as f64) / 1e3),
            );
        }
    }
    for delays in &mut found.delays {
        delays.sort_by(f64::total_cmp);
    }
    report.sse = Some(found);
    Ok(())
}

struct Event {
    sent_ns: u64,
    received_ns: u64,
}

/// One streamed chat completion: its content events (`fake_seq` below `SSE_EVENTS`), with
/// `fake_sent_ns` and the receipt time, in order of `fake_seq`.
fn stream_events(addr: SocketAddr) -> Result<Vec<Event>, String> {
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"stream":true}"#;
    let request = client::post_json(addr, "/v1/chat/completions", body, true);
    let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
    let mut pending = Vec::new();
    let mut events = Vec::new();
    let reply = conn
        .stream(&request, |bytes, at: SystemTime| {
            pending.extend_from_slice(bytes);
            while let Some(end) = client::find(&pending, b"\n\n") {
                let event = &pending[..end];
                // The paced content chunks only: the closing events follow the last at once.
                if let (Some(seq), Some(sent_ns)) = (
                    number_after(event, b"\"fake_seq\":"),
                    number_after(event, b"\"fake_sent_ns\":"),
                ) && seq < SSE_EVENTS as u64
                {
                    events.push((
                        seq,
                        Event {
                            sent_ns,
                            received_ns: client::unix_ns(at),
                        },
                    ));
                }
                pending.drain(..end + 2);
            }
        })
        .map_err(|e| e.to_string())?;
    check_ok(reply.status)?;
    if events.len() != SSE_EVENTS {
        return Err(format!(
            "the stream carried {} timestamped content events, expected {SSE_EVENTS}",
            events.len()
        ));
    }
    events.sort_by_key(|(seq, _)| *seq);
    Ok(events.into_iter().map(|(_, e)| e).collect())
}

fn number_after(text: &[u8], key: &[u8]) -> Option<u64> {
    let at = client::find(text, key)? + key.len();
    let digits: &[u8] = &text[at..];
    let end = digits
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

/// Launch to `/health` 200: llama-server alone against serve (with its llama-server), same
/// model and flags, alternating, after one unmeasured start of each.
fn startup(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
    report: &mut Report,
) -> Result<(), Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    // Eleven: llama-server's own start varies by ±50 ms on a busy 2-core VM.
    let rounds = if options.quick { 2 } else { 11 };
    println!("startup: launch to /health 200, {rounds} runs each (after one warm-up)");
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..=rounds {
        for k in 0..2 {
            let arm = (round + k) % 2;
            let addr = arms::free_addr()?;
            let mut command = if arm == 0 {
                arms::llama_server(&bins.llama_server, &model, addr)
            } else {
                arms::serve(&bins.onebit, &model, addr, None)
            };
            let began = Instant::now();
            let mut server = Server::spawn(ARMS[arm], addr, &mut command, scratch)?;
            let ready = server.wait_healthy(began, READY_LIMIT)?;
            drop(server);
            if round > 0 {
                times[arm].push(ready.as_secs_f64() * 1e3);
            }
        }
    }
    // What serve adds: the median of each round's two starts' difference, which drift between
    // rounds (llama-server's own start varies by ±50 ms here) cancels out of.
    let mut added: Vec<f64> = times[1].iter().zip(&times[0]).map(|(s, d)| s - d).collect();
    added.sort_by(f64::total_cmp);
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    report.startup_ms = Some([percentile(&times[0], 0.5), percentile(&times[1], 0.5)]);
    report.startup_added_ms = Some(percentile(&added, 0.5));
    Ok(())
}

/// The `q` quantile (0..=1) of sorted samples, by nearest rank.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One row of the table: a figure per arm (direct, serve, nginx; absent where not measured).
struct Row {
    figure: String,
    unit: &'static str,
    values: [Option<f64>; 3],
    /// How a proxy compares with direct: as a difference (latency) or a fraction (throughput).
    compare: Compare,
}

#[derive(Clone, Copy, PartialEq)]
enum Compare {
    Difference,
    Fraction,
    None,
}

struct Target {
    text: &'static str,
    measured: String,
    met: bool,
}

struct Report {
    quick: bool,
    load_before: String,
    hop: Option<Hop>,
    throughput: Option<[f64; 3]>,
    sse: Option<Sse>,
    startup_ms: Option<[f64; 2]>,
    /// The median of the paired differences, serve minus direct.
    startup_added_ms: Option<f64>,
    rss_idle_kib: Option<u64>,
    rss_load_kib: Option<u64>,
    mem_check: Option<(f64, f64)>,
    rows: Vec<Row>,
    targets: Vec<Target>,
}

impl Report {
    fn new(quick: bool) -> Report {
        Report {
            quick,
            load_before: loadavg(),
            hop: None,
            throughput: None,
            sse: None,
            startup_ms: None,
            startup_added_ms: None,
            rss_idle_kib: None,
            rss_load_kib: None,
            mem_check: None,
            rows: Vec::new(),
            targets: Vec::new(),
        }
    }

    fn mem_check(&mut self, found: &mem_check::MemCheck) {
        let own = |i: usize| found.cases.get(i).map_or(f64::NAN, |c| c.3);
        self.mem_check = Some((own(0), own(1)));
    }

    /// serve's and nginx's added p50 on the hop, keep-alive and new connection.
    fn added_p50(&self) -> Option<[[f64; 2]; 2]> {
        let hop = self.hop.as_ref()?;
        let added = |samples: &[Vec<f64>; 4], arm: usize| {
            percentile(&samples[arm], 0.5) - percentile(&samples[0], 0.5)
        };
        Some([
            [added(&hop.keep_alive, 1), added(&hop.keep_alive, 2)],
            [added(&hop.new_connection, 1), added(&hop.new_connection, 2)],
        ])
    }

    /// The CI rule: serve's added p50 on the keep-alive hop at most twice nginx's. One line per
    /// breach. Keep-alive only: with a new connection per request, nginx's added p50 is the
    /// small difference of two large figures (its accept path is cheaper than llama-server's,
    /// which it replaces), 10-30 µs from run to run, so twice it is no stable bound.
    ///
    /// A run where nginx adds under 10 µs to a loopback hop measured noise, not the hop (a proxy
    /// cannot be free; nginx adds 55-105 µs here): it is Noisy, neither passed nor failed.
    fn gate(&self) -> Gate {
        let Some([[serve, nginx], _]) = self.added_p50() else {
            return Gate::Passed;
        };
        gate_verdict(serve, nginx)
    }

    fn build_rows(&mut self) {
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        self.hop_rows(&mut rows, &mut targets);
        self.load_rows(&mut rows, &mut targets);
        self.resource_rows(&mut rows, &mut targets);
        self.rows = rows;
        self.targets = targets;
    }

    /// The hop's latencies and targets (and the baseline's, when there is one).
    fn hop_rows(&self, rows: &mut Vec<Row>, targets: &mut Vec<Target>) {
        if let Some(hop) = &self.hop {
            for (mode, samples) in [
                ("keep-alive", &hop.keep_alive),
                ("new conn", &hop.new_connection),
            ] {
                for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
                    rows.push(Row {
                        figure: format!("hop /tokenize {mode} {name}"),
                        unit: "µs",
                        values: [0, 1, 2].map(|a| Some(percentile(&samples[a], q))),
                        compare: Compare::Difference,
                    });
                }
            }
            let [[ka_serve, ka_nginx], [nc_serve, nc_nginx]] =
                self.added_p50().unwrap_or([[f64::NAN; 2]; 2]);
            targets.push(Target {
                text: "hop added p50 ≤ nginx's and ≤ 50 µs (keep-alive)",
                measured: format!("serve {ka_serve:+.1} µs, nginx {ka_nginx:+.1} µs"),
                met: ka_serve <= ka_nginx && ka_serve <= 50.0,
            });
            targets.push(Target {
                text: "hop added p50 ≤ nginx's and ≤ 50 µs (new connection)",
                measured: format!("serve {nc_serve:+.1} µs, nginx {nc_nginx:+.1} µs"),
                met: nc_serve <= nc_nginx && nc_serve <= 50.0,
            });
            if !hop.keep_alive[3].is_empty() {
                let added = |arm: usize| {
                    percentile(&hop.keep_alive[arm], 0.5) - percentile(&hop.keep_alive[0], 0.5)
                };
                let (this, baseline) = (added(1), added(3));
                targets.push(Target {
                    text: "hop added p50 within 2 µs of the --baseline build's (keep-alive)",
                    measured: format!("this {this:+.1} µs, baseline {baseline:+.1} µs"),
                    met: this - baseline <= 2.0,
                });
            }
        }
    }

    /// Throughput and the SSE stream's delays.
    fn load_rows(&self, rows: &mut Vec<Row>, targets: &mut Vec<Target>) {
        if let Some(rps) = self.throughput {
            rows.push(Row {
                figure: format!("throughput /tokenize, {CLIENTS} clients"),
                unit: "req/s",
                values: rps.map(Some),
                compare: Compare::Fraction,
            });
            let fraction = rps[1] / rps[0];
            targets.push(Target {
                text: "throughput through serve ≥ 90% of direct",
                measured: format!(
                    "{:.1}% (nginx {:.1}%)",
                    fraction * 100.0,
                    rps[2] / rps[0] * 100.0
                ),
                met: fraction >= 0.9,
            });
        }
        if let Some(sse) = &self.sse {
            for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
                rows.push(Row {
                    figure: format!("SSE per-event delay {name}"),
                    unit: "µs",
                    values: [0, 1, 2].map(|a| Some(percentile(&sse.delays[a], q))),
                    compare: Compare::Difference,
                });
            }
            rows.push(Row {
                figure: "SSE events held back".into(),
                unit: "events",
                values: sse.held.map(|n| Some(n as f64)),
                compare: Compare::None,
            });
            let added = percentile(&sse.delays[1], 0.5) - percentile(&sse.delays[0], 0.5);
            targets.push(Target {
                text: "SSE added delay p50 ≤ 50 µs",
                measured: format!("{added:+.1} µs"),
                met: added <= 50.0,
            });
            targets.push(Target {
                text: "SSE: no event held back",
                measured: format!(
                    "{} of {} paced events{} (direct {}, nginx {})",
                    sse.held[1],
                    sse.paced[1],
                    late_ms(&sse.held_late_us[1]),
                    sse.held[0],
                    sse.held[2]
                ),
                met: sse.held[1] == 0,
            });
        }
    }

    /// Start-up, serve's RSS and the memory check.
    fn resource_rows(&self, rows: &mut Vec<Row>, targets: &mut Vec<Target>) {
        if let Some([direct, serve]) = self.startup_ms {
            rows.push(Row {
                figure: "start-up to /health 200 (median)".into(),
                unit: "ms",
                values: [Some(direct), Some(serve), None],
                compare: Compare::Difference,
            });
            let added = self.startup_added_ms.unwrap_or(serve - direct);
            targets.push(Target {
                text: "start-up ≤ llama-server's own + 50 ms",
                measured: format!("{added:+.1} ms (median of the paired differences)"),
                met: added <= 50.0,
            });
        }
        let mib = |kib: u64| kib as f64 / 1024.0;
        if let Some(idle) = self.rss_idle_kib.filter(|_| self.rss_load_kib.is_some()) {
            rows.push(Row {
                figure: "serve RSS idle (child excluded)".into(),
                unit: "MiB",
                values: [None, Some(mib(idle)), None],
                compare: Compare::None,
            });
            targets.push(Target {
                text: "serve RSS ≤ 20 MiB idle",
                measured: format!("{:.1} MiB", mib(idle)),
                met: mib(idle) <= 20.0,
            });
        }
        if let Some(load) = self.rss_load_kib {
            rows.push(Row {
                figure: format!("serve RSS, {CLIENTS} clients (peak)"),
                unit: "MiB",
                values: [None, Some(mib(load)), None],
                compare: Compare::None,
            });
            targets.push(Target {
                text: "serve RSS ≤ 40 MiB under the 64-client load",
                measured: format!("{:.1} MiB", mib(load)),
                met: mib(load) <= 40.0,
            });
        }
        if let Some((model, huge)) = self.mem_check {
            rows.push(Row {
                figure: "--mem-check SmolLM2, beyond process start".into(),
                unit: "ms",
                values: [None, Some(model), None],
                compare: Compare::None,
            });
            rows.push(Row {
                figure: "--mem-check sparse 4 TiB, beyond process start".into(),
                unit: "ms",
                values: [None, Some(huge), None],
                compare: Compare::None,
            });
            targets.push(Target {
                text: "--mem-check on the sparse 4 TiB file ≤ 5 ms beyond process start",
                measured: format!("{huge:.2} ms"),
                met: huge <= 5.0,
            });
        }
    }

    /// Prints the table, the targets and the CI rule; writes the JSON and the chart.
    fn finish(&mut self, out_dir: &Path) -> Result<(), Failure> {
        self.build_rows();
        let load_after = loadavg();
        println!();
        println!(
            "{:<54} {:>9} {:>9} {:>9}  {:<20} nginx vs direct",
            "figure", "direct", "serve", "nginx", "serve vs direct"
        );
        for row in &self.rows {
            let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
            let versus = |arm: usize| match (row.compare, row.values[0], row.values[arm]) {
                (Compare::Difference, Some(d), Some(v)) => {
                    format!("{:+.1} {} (×{:.2})", v - d, row.unit, v / d)
                }
                (Compare::Fraction, Some(d), Some(v)) => format!("{:.1}%", v / d * 100.0),
                _ => "-".to_string(),
            };
            println!(
                "{:<54} {:>9} {:>9} {:>9}  {:<20} {}",
                format!("{} ({})", row.figure, row.unit),
                cell(row.values[0]),
                cell(row.values[1]),
                cell(row.values[2]),
                versus(1),
                versus(2)
            );
        }
        println!();
        for t in &self.targets {
            println!(
                "{} {:<66} {}",
                if t.met { "met    " } else { "MISSED " },
                t.text,
                t.measured
            );
        }
        if self.hop.is_some() {
            match (self.gate(), self.added_p50()) {
                (Gate::Passed, Some([[serve, nginx], _])) => println!(
                    "CI rule (keep-alive: serve's added p50 ≤ 2 × nginx's): passed, {serve:.1} µs against {nginx:.1} µs"
                ),
                (Gate::Passed, None) => {}
                (Gate::Failed(lines), _) => {
                    for line in lines {
                        println!("CI rule FAILED: {line}");
                    }
                }
                (Gate::Noisy(why), _) => println!("CI rule not judged, the run was noise: {why}"),
            }
        }
        println!(
            "load average before: {}; after: {load_after}",
            self.load_before
        );

        let _ = std::fs::create_dir_all(out_dir);
        let json = self.json(&load_after);
        let path = out_dir.join("bench.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        )
        .map_err(|e| {
            Failure::new(
                format!("cannot write {}: {e}", path.display()),
                "check the folder",
            )
        })?;
        println!("written to {}", path.display());
        if let Some(svg) = self.chart() {
            let path = out_dir.join("latency.svg");
            std::fs::write(&path, svg).map_err(|e| {
                Failure::new(
                    format!("cannot write {}: {e}", path.display()),
                    "check the folder",
                )
            })?;
            println!("written to {}", path.display());
        }
        Ok(())
    }

    fn json(&self, load_after: &str) -> serde_json::Value {
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                let [d, s, n] = r.values;
                let vs = |v: Option<f64>| match (r.compare, d, v) {
                    (Compare::Difference, Some(d), Some(v)) => {
                        serde_json::json!({"added": v - d, "ratio": v / d})
                    }
                    (Compare::Fraction, Some(d), Some(v)) => serde_json::json!({"fraction": v / d}),
                    _ => serde_json::Value::Null,
                };
                serde_json::json!({
                    "figure": r.figure, "unit": r.unit,
                    "direct": d, "serve": s, "nginx": n,
                    "serve_vs_direct": vs(s), "nginx_vs_direct": vs(n),
                })
            })
            .collect();
        let targets: Vec<_> = self
            .targets
            .iter()
            .map(|t| serde_json::json!({"target": t.text, "measured": t.measured, "met": t.met}))
            .collect();
        let quantiles = |data: &[f64]| -> Vec<f64> {
            (0..=100)
                .map(|k| percentile(data, k as f64 / 100.0))
                .collect()
        };
        let mut distributions = serde_json::Map::new();
        if let Some(hop) = &self.hop {
            for (mode, samples) in [
                ("hop_keep_alive", &hop.keep_alive),
                ("hop_new_connection", &hop.new_connection),
            ] {
                let arms: serde_json::Map<_, _> = ARMS
                    .iter()
                    .zip(samples)
                    .map(|(arm, d)| (arm.to_string(), serde_json::json!(quantiles(d))))
                    .collect();
                distributions.insert(mode.into(), serde_json::Value::Object(arms));
            }
            if !hop.keep_alive[3].is_empty() {
                distributions.insert(
                    "hop_keep_alive_baseline".into(),
                    serde_json::json!(quantiles(&hop.keep_alive[3])),
                );
            }
            distributions.insert(
                "keep_alive_reconnects".into(),
                serde_json::json!(hop.reconnects),
            );
            distributions.insert(
                "requests_per_arm".into(),
                serde_json::json!(hop.keep_alive[0].len()),
            );
        }
        if let Some(sse) = &self.sse {
            let arms: serde_json::Map<_, _> = ARMS
                .iter()
                .zip(&sse.delays)
                .map(|(arm, d)| (arm.to_string(), serde_json::json!(quantiles(d))))
                .collect();
            distributions.insert("sse_delay".into(), serde_json::Value::Object(arms));
            distributions.insert("sse_streams_per_arm".into(), serde_json::json!(sse.streams));
            distributions.insert("sse_held_back".into(), serde_json::json!(sse.held));
            distributions.insert(
                "sse_held_back_late_us".into(),
                serde_json::json!(sse.held_late_us),
            );
            distributions.insert("sse_paced_pairs".into(), serde_json::json!(sse.paced));
        }
        serde_json::json!({
            "benchmark": "serve hop against llama-server direct and nginx",
            "quick": self.quick,
            "unix_time": SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "machine": {
                "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                "load_average_before": self.load_before,
                "load_average_after": load_after,
            },
            "settings": {
                "llama_server_threads_http": arms::THREADS_HTTP,
                "clients": CLIENTS,
                "sse_events": SSE_EVENTS,
                "sse_interval_ms": SSE_INTERVAL_MS,
            },
            "rows": rows,
            "targets": targets,
            "quantiles_us": distributions,
        })
    }

    fn chart(&self) -> Option<String> {
        let mut panels = Vec::new();
        if let Some(hop) = &self.hop {
            for (title, samples) in [
                ("POST /tokenize, keep-alive", &hop.keep_alive),
                ("POST /tokenize, new connection", &hop.new_connection),
            ] {
                panels.push(chart::Panel {
                    title: format!("{title} ({} requests per arm)", samples[0].len()),
                    arms: ARMS
                        .iter()
                        .copied()
                        .zip(samples.iter().map(Vec::as_slice))
                        .collect(),
                });
            }
        }
        if let Some(sse) = &self.sse {
            panels.push(chart::Panel {
                title: format!(
                    "SSE per-event delay ({} events per arm)",
                    sse.delays[0].len()
                ),
                arms: ARMS
                    .iter()
                    .copied()
                    .zip(sse.delays.iter().map(Vec::as_slice))
                    .collect(),
            });
        }
        (!panels.is_empty()).then(|| {
            chart::svg(
                "1bit serve vs llama-server direct vs nginx, one run, loopback (CDF; left is faster)",
                &panels,
            )
        })
    }
}

/// `/proc/loadavg`'s first three fields: how busy the machine was.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ci_rule_passes_fails_or_says_the_run_was_noise() {
        assert!(matches!(gate_verdict(40.0, 60.0), Gate::Passed));
        assert!(matches!(gate_verdict(119.0, 60.0), Gate::Passed));
        assert!(matches!(gate_verdict(121.0, 60.0), Gate::Failed(_)));
        // nginx adding nothing (or less than nothing) measured the machine, not the hop.
        assert!(matches!(gate_verdict(367.3, -9.8), Gate::Noisy(_)));
        assert!(matches!(gate_verdict(5.0, 9.9), Gate::Noisy(_)));
    }

    #[test]
    fn a_baseline_is_another_build_and_only_that() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cargo = std::env::var("CARGO").expect("cargo runs the tests");
        let options = Options::parse(&args(&["hop", "--baseline", &cargo])).unwrap();
        assert_eq!(options.baseline.as_deref(), Some(Path::new(&cargo)));
        assert!(options.parts.hop && !options.parts.sse);
        // Alone, --baseline runs every part, as no part named does.
        assert!(
            Options::parse(&args(&["--baseline", &cargo]))
                .unwrap()
                .parts
                .sse
        );
        for bad in [
            &["hop", "--baseline"][..],
            &["--baseline", "/nonexistent/1bit"],
        ] {
            let Err(failure) = Options::parse(&args(bad)) else {
                panic!("{bad:?} was taken");
            };
            assert!(
                failure.0.contains("another build's `1bit`"),
                "{}",
                failure.0
            );
        }
    }
}
