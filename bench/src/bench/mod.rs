//! `cargo xtask bench`: what serve's hop costs, measured side by side in one run against
//! llama-server alone and against nginx in front of it (docs/performance.md).
//!
//! Parts: `hop` (1-client /tokenize latency, keep-alive and a new connection per request),
//! `throughput` (64 keep-alive clients), `sse` (per-event delay through the fake backend),
//! `startup` (launch to /health 200), `rss` (serve's own memory), `mem-check` (admission time),
//! `rpc` (tokens/s and time to first token, local against split over RPC workers);
//! `inproc` alone (an in-process route's memory and cancellation, `inproc.rs`); `stop` alone
//! (SIGTERM to exit on every kind of route, idle and with a stream in flight, `stop.rs`);
//! `prompt-cache` alone (a conversation's second request after a restart, `prompt_cache.rs`);
//! `agents` alone (recorded coding-agent sessions, one and two interleaved, `agents.rs`);
//! `fleet` alone (serves behind the pinned gateway: its added time, throughput at 1, 2 and 4
//! workers, `fleet.rs`, which also starts the fleet `cargo xtask fleet` runs; conversations on
//! the real llama-server, cache-aware with a shared prompt cache against round-robin,
//! `fleet/conversations.rs`).
//! No part named runs them all; `--quick` is the short run CI uses (`bench hop --quick`);
//! `hop --repeat N` measures the hop N times and judges the series (`series.rs`); `--hog`
//! measures beside a busy loop per core at the bench's priority (the starved soak's hog).
//! Arms alternate in blocks so drift on a shared machine falls on every arm alike.

mod agents;
mod arms;
pub(crate) mod chart;
mod client;
pub mod fleet;
mod inproc;
mod inproc_llama;
mod measures;
mod mem_check;
mod prompt_cache;
mod report;
mod rpc;
mod rpc_link;
mod series;
mod stop;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use arms::Server;
use client::Conn;
use measures::{Hop, sse, startup, throughput};
use report::Report;

use crate::{Failure, Prepare, Workspace, process};

const USAGE: &str = "use `cargo xtask bench [hop|throughput|sse|startup|rss|mem-check|rpc ...] [--quick] [--baseline PATH] [--hog]`, `cargo xtask bench hop --repeat N [--baseline PATH]`, `cargo xtask bench inproc [--quick]`, `cargo xtask bench stop [--quick]`, `cargo xtask bench prompt-cache [--quick]`, `cargo xtask bench agents [--quick]` or `cargo xtask bench fleet [--quick]`";
const TOKENIZE: &str = r#"{"content":"hello world"}"#;
const ARMS: [&str; 3] = ["direct", "serve", "nginx"];
/// Load clients for the throughput and RSS figures.
const CLIENTS: usize = 64;
const SSE_EVENTS: usize = 200;
const SSE_INTERVAL_MS: u64 = 2;
const READY_LIMIT: Duration = Duration::from_secs(120);

#[derive(Default, Clone, Copy, PartialEq)]
struct Parts {
    hop: bool,
    throughput: bool,
    sse: bool,
    startup: bool,
    rss: bool,
    mem_check: bool,
    rpc: bool,
}

#[derive(Clone)]
struct Options {
    parts: Parts,
    quick: bool,
    /// Another build's `1bit` (`--baseline PATH`): a fourth arm on the hop, so a change's
    /// added time is compared with its parent's in the same run.
    baseline: Option<PathBuf>,
    /// Runs of the hop (`--repeat N`, hop alone): more than one makes a series.
    repeat: usize,
    /// Measure beside a CPU hog (`--hog`): a busy loop per core at the bench's priority, as
    /// the starved soak runs serve.
    hog: bool,
}

/// The longest a `--hog` run's busy loops may live, should the bench itself die.
const HOG_LIMIT: Duration = Duration::from_secs(1800);

/// The runs `--repeat` takes: a series needs two for an interval, and past 30 a run's noise
/// is no longer what limits a comparison.
const REPEAT_RANGE: std::ops::RangeInclusive<usize> = 2..=30;

impl Options {
    fn parse(args: &[String]) -> Result<Options, Failure> {
        let mut parts = Parts::default();
        let mut any = false;
        let mut quick = false;
        let mut baseline = None;
        let mut repeat = 1;
        let mut hog = false;
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            any |= !matches!(
                arg.as_str(),
                "--quick" | "--baseline" | "--repeat" | "--hog"
            );
            match arg.as_str() {
                "--quick" => quick = true,
                "--hog" => hog = true,
                "--repeat" => {
                    let runs = args.next().and_then(|n| n.parse::<usize>().ok());
                    let Some(runs) = runs.filter(|n| REPEAT_RANGE.contains(n)) else {
                        return Err(Failure::new(
                            format!(
                                "--repeat needs a number of runs from {} to {}",
                                REPEAT_RANGE.start(),
                                REPEAT_RANGE.end()
                            ),
                            "say how many times to measure the hop, e.g. `cargo xtask bench hop --repeat 10`",
                        ));
                    };
                    repeat = runs;
                }
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
        let hop_alone = Parts {
            hop: true,
            ..Parts::default()
        };
        if repeat > 1 && !(any && parts == hop_alone) {
            return Err(Failure::new(
                "--repeat measures the hop alone",
                "use `cargo xtask bench hop --repeat N`, and the other parts without it",
            ));
        }
        Ok(Options {
            parts,
            quick,
            baseline,
            repeat,
            hog,
        })
    }
}

/// Runs the parts asked for, prints the table and the targets, writes `results/bench.json`
/// (and `results/latency.svg` when latencies were measured). Fails (exit 1) when serve's added
/// p50 on the hop exceeds twice nginx's: the regression check CI runs.
pub fn run(ws: &Workspace, prep: &dyn Prepare, args: &[String]) -> Result<ExitCode, Failure> {
    if args.iter().any(|a| a == "inproc-llama") {
        // The inproc add-on against --device cpu and llama-server direct: its own table.
        return inproc_llama::run(ws, prep, args.iter().any(|a| a == "--quick"));
    }
    if args.iter().any(|a| a == "agents") {
        // Recorded coding-agent sessions, serve against llama-server alone: its own table.
        return agents::run(ws, args.iter().any(|a| a == "--quick"));
    }
    if args.iter().any(|a| a == "prompt-cache") {
        // The persistent prompt cache after a restart: its own table.
        return prompt_cache::run(ws, args.iter().any(|a| a == "--quick"));
    }
    if args.iter().any(|a| a == "fleet") {
        // Serves behind the pinned gateway: its own table.
        return fleet::run(ws, prep, args.iter().any(|a| a == "--quick"));
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
    if options.repeat > 1 {
        return series::run(ws, prep, &options);
    }
    let report = measure(ws, prep, &options)?;
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
pub fn regression_check(ws: &Workspace, prep: &dyn Prepare) -> Result<Gate, Failure> {
    let options = Options {
        parts: Parts {
            hop: true,
            ..Parts::default()
        },
        quick: true,
        baseline: None,
        repeat: 1,
        hog: false,
    };
    let mut failed = Vec::new();
    let mut noisy = Vec::new();
    for attempt in 1..=GATE_ATTEMPTS {
        match measure(ws, prep, &options)?.gate() {
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

fn measure(ws: &Workspace, prep: &dyn Prepare, options: &Options) -> Result<Report, Failure> {
    let parts = options.parts;
    prep.setup(ws)?;
    let bins = build(ws, parts.sse)?;
    let scratch = scratch_dir("onebit-bench")?;
    let mut report = Report::new(options.quick);
    // Beside a CPU hog, bounded past the longest run, killed when the measurement ends.
    let hog = if options.hog {
        Some(crate::soak::Hog::start(HOG_LIMIT)?)
    } else {
        None
    };
    report.hog_loops = hog.as_ref().map_or(0, crate::soak::Hog::cores);
    if parts.hop || parts.throughput || parts.rss {
        proxied(ws, &bins, options, &scratch, &mut report)?;
    }
    if parts.sse {
        report.sse = Some(sse(ws, &bins, options, &scratch)?);
    }
    if parts.startup {
        let (ms, added) = startup(ws, &bins, options, &scratch)?;
        report.startup_ms = Some(ms);
        report.startup_added_ms = Some(added);
    }
    if parts.mem_check {
        let found = mem_check::measure(ws, &bins.onebit)?;
        report.mem_check(&found);
    }
    if parts.rpc {
        let rows = rpc::measure(ws, &bins.onebit, options.quick, &scratch)?;
        rpc::write(&ws.root.join("results"), &rows)?;
    }
    drop(hog);
    // `bench rpc` alone has its own table and file; the shared report would be empty.
    if parts.hop || parts.throughput || parts.sse || parts.startup || parts.rss || parts.mem_check {
        report.finish(&ws.root.join("results"))?;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(report)
}

/// A folder of this run's own (`/tmp/NAME-PID`) for the servers' logs and nginx's files.
fn scratch_dir(name: &str) -> Result<PathBuf, Failure> {
    let scratch = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| {
        Failure::new(
            format!("cannot create {}: {e}", scratch.display()),
            "check /tmp",
        )
    })?;
    Ok(scratch)
}

/// Writes a result file (its folder made if need be) and says where.
fn write_result(path: &Path, text: &str) -> Result<(), Failure> {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(path, text).map_err(|e| {
        Failure::new(
            format!("cannot write {}: {e}", path.display()),
            "check the folder",
        )
    })?;
    println!("written to {}", path.display());
    Ok(())
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

#[derive(Clone)]
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
        // Short blocks over every arm: a burst of load from elsewhere on the machine then falls
        // on every arm alike instead of on one arm's block. The arms' order changes block by
        // block so that each follows every other equally often (`block_order`): in a plain
        // rotation the serve arm always ran after the direct arm and the baseline after nginx,
        // and the same build measured in both places differed by about 3 µs at p50.
        let per_block = 10;
        let blocks = if options.quick { 100 } else { 500 };
        println!(
            "hop: POST /tokenize, 1 client, {} requests per arm and mode, in {blocks} alternating blocks",
            blocks * per_block
        );
        let mut hop = Hop::default();
        let mut keep_alive: [Option<Conn>; 4] = [None, None, None, None];
        for block in 0..blocks {
            for arm in block_order(block, addrs.len()) {
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

/// The order of the `n` arms in block `block`: the rows of a Williams design in turn (for an
/// odd `n`, each row and then its reverse), over which each arm runs right after every other
/// arm equally often.
fn block_order(block: usize, n: usize) -> Vec<usize> {
    let first = (0..n).map(|j| match j {
        0 => 0,
        j if j % 2 == 1 => j.div_ceil(2),
        j => n - j / 2,
    });
    let rows = if n.is_multiple_of(2) { n } else { 2 * n };
    let row = block % rows;
    let order: Vec<usize> = first.map(|a| (a + row % n) % n).collect();
    if row >= n {
        order.into_iter().rev().collect()
    } else {
        order
    }
}

/// The `q` quantile (0..=1) of sorted samples, by nearest rank.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `/proc/loadavg`'s first three fields: how busy the machine was.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// How an idle CPU of this machine waits under `sys` (`/sys`): the cpuidle driver, and under
/// `haltpoll` (a KVM guest) how long a vCPU polls before it halts. A thread woken on a halted
/// vCPU waits for it to leave the halt (19-30 µs on a guest that does not poll), which is most
/// of any proxy's hop there (docs/performance.md, "Where wrk's time goes").
fn idle_path(sys: &Path) -> String {
    let read = |file: &str| {
        std::fs::read_to_string(sys.join(file))
            .ok()
            .map(|text| text.trim().to_string())
            .filter(|text| !text.is_empty())
    };
    match read("devices/system/cpu/cpuidle/current_driver") {
        None => "no cpuidle driver".to_string(),
        Some(driver) if driver == "haltpoll" => {
            match read("module/haltpoll/parameters/guest_halt_poll_ns") {
                Some(ns) if ns == "0" => {
                    "cpuidle haltpoll, halting at once (guest_halt_poll_ns 0)".to_string()
                }
                Some(ns) => format!("cpuidle haltpoll, polling up to {ns} ns before halting"),
                None => "cpuidle haltpoll".to_string(),
            }
        }
        Some(driver) => format!("cpuidle {driver}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_path_names_the_driver_and_a_guests_halt_polling() {
        let sys = std::env::temp_dir().join(format!("onebit-idle-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&sys);
        assert_eq!(idle_path(&sys), "no cpuidle driver");
        let driver = sys.join("devices/system/cpu/cpuidle/current_driver");
        std::fs::create_dir_all(driver.parent().unwrap()).unwrap();
        std::fs::write(&driver, "intel_idle\n").unwrap();
        assert_eq!(idle_path(&sys), "cpuidle intel_idle");
        std::fs::write(&driver, "haltpoll\n").unwrap();
        assert_eq!(idle_path(&sys), "cpuidle haltpoll");
        let poll = sys.join("module/haltpoll/parameters/guest_halt_poll_ns");
        std::fs::create_dir_all(poll.parent().unwrap()).unwrap();
        std::fs::write(&poll, "0\n").unwrap();
        assert_eq!(
            idle_path(&sys),
            "cpuidle haltpoll, halting at once (guest_halt_poll_ns 0)"
        );
        std::fs::write(&poll, "200000\n").unwrap();
        assert_eq!(
            idle_path(&sys),
            "cpuidle haltpoll, polling up to 200000 ns before halting"
        );
        std::fs::remove_dir_all(&sys).unwrap();
    }

    #[test]
    fn each_arm_follows_every_other_equally_often() {
        for n in [2usize, 3, 4] {
            let rows = if n.is_multiple_of(2) { n } else { 2 * n };
            let mut follows = std::collections::BTreeMap::new();
            for block in 0..rows {
                let order = block_order(block, n);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "every arm once a block");
                for pair in order.windows(2) {
                    *follows.entry((pair[0], pair[1])).or_insert(0) += 1;
                }
            }
            assert_eq!(follows.len(), n * (n - 1), "{n} arms: {follows:?}");
            let counts: std::collections::BTreeSet<_> = follows.values().collect();
            assert_eq!(counts.len(), 1, "{n} arms: {follows:?}");
        }
    }

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

    #[test]
    fn a_series_repeats_the_hop_alone_a_sane_number_of_times() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cargo = std::env::var("CARGO").expect("cargo runs the tests");
        let options =
            Options::parse(&args(&["hop", "--repeat", "20", "--baseline", &cargo])).unwrap();
        assert_eq!(options.repeat, 20);
        assert!(options.parts.hop && !options.parts.throughput);
        assert_eq!(Options::parse(&args(&["hop"])).unwrap().repeat, 1);
        let hogged = Options::parse(&args(&["hop", "--quick", "--hog"])).unwrap();
        assert!(hogged.hog && hogged.parts.hop && !hogged.parts.sse);
        assert!(!Options::parse(&args(&["hop"])).unwrap().hog);
        for (bad, says) in [
            (
                &["hop", "--repeat"][..],
                "--repeat needs a number of runs from 2 to 30",
            ),
            (
                &["hop", "--repeat", "1"],
                "--repeat needs a number of runs from 2 to 30",
            ),
            (
                &["hop", "--repeat", "31"],
                "--repeat needs a number of runs from 2 to 30",
            ),
            (
                &["hop", "--repeat", "ten"],
                "--repeat needs a number of runs from 2 to 30",
            ),
            (&["--repeat", "5"], "--repeat measures the hop alone"),
            (
                &["hop", "sse", "--repeat", "5"],
                "--repeat measures the hop alone",
            ),
        ] {
            let Err(failure) = Options::parse(&args(bad)) else {
                panic!("{bad:?} was taken");
            };
            assert!(failure.0.starts_with(says), "{bad:?}: {}", failure.0);
        }
    }
}
