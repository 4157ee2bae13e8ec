//! `cargo xtask soak [--minutes N]`: serve under N minutes (default 20) of mixed traffic from a
//! bounded set of loopback clients, in two phases of half the time each: the cpu route with the
//! pinned llama-server (`--parallel 4`), then the inproc add-on (`--parallel 4`, llama.cpp in
//! serve's process); a third, short phase ends the run with a watchdog kill. Each phase samples
//! serve's memory, descriptors, threads and async tasks; then the report: requests by outcome
//! against what each should get, streams checked byte for byte against the non-streamed reply of
//! the same greedy request, the slopes, the stop, and what was left running. Exit 1 when any
//! target is missed. Debug build (serve's memory and descriptors are what is watched, not its
//! speed).
//!
//! Traffic, in turn per client: streamed and whole chats, completions, an embeddings request
//! (llama-server without `--embedding`, and the add-on, answer 501), a client that leaves
//! mid-stream, a slow reader, and hostile requests (a foreign Host: 403; a body that is not
//! JSON: 400; a declared body over the limit: 413). 200 keep-alive connections sit idle through
//! each phase. Faults: at 40 % of the cpu phase the backend is SIGSTOPped for 3 s (longer than
//! serve's 1.5 s health limit) and then SIGCONTed; requests that meet it may get 503 or 502. The
//! last phase: a cpu serve with `--watchdog 3` streams a reply, its backend is SIGSTOPped, and
//! the watchdog must kill it and serve exit 1 with its line, leaving nothing behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{Failure, Workspace, addon, process};

const USAGE: &str =
    "use `cargo xtask soak [--minutes N] [--only cpu|inproc]` (N a positive number; default 20)";
const CLIENTS: usize = 6;
const IDLE_POOL: usize = 200;
const PROMPTS: [&str; 3] = [
    "What is the capital of France? Answer in one word.",
    "Name three colours of the rainbow.",
    "Count from one to ten.",
];
const MAX_TOKENS: u32 = 32;
/// How long a client waits for the next bytes of its reply (the first ones included) before it
/// counts the request as unanswered: 4 slots serve 6 clients, so a request may wait for a slot
/// behind others, longer on a loaded machine.
const REPLY_WITHIN: Duration = Duration::from_secs(60);
/// RSS growth allowed after warm-up (first sample to last).
const GROWTH_LIMIT_KIB: i64 = 1024;
/// The warm-up: RSS is judged on what follows the first minute of a phase.
const WARM_UP_S: f64 = 60.0;
/// The shortest window after warm-up on which RSS is judged; a shorter phase reports its RSS
/// without judging it (allocator and library warm-up is not over in half a minute).
const JUDGED_WINDOW_S: f64 = 60.0;
/// Descriptors the last sample may hold beyond the first: the requests in flight at either
/// moment (a client socket and a backend socket each).
const FD_SLACK: i64 = 2 * CLIENTS as i64;
/// Async tasks the last sample may hold beyond the first: the requests in flight at either
/// moment (a connection's task and a request's, each).
const TASK_SLACK: i64 = 2 * CLIENTS as i64;
/// The last phase's `--watchdog`, and how long serve may take past it to kill and exit.
const WATCHDOG_S: u64 = 3;
const WATCHDOG_SLACK_S: u64 = 5;

/// What a request is, and so what it should get.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    StreamedChat,
    WholeChat,
    Completion,
    Embeddings,
    LeavesMidStream,
    SlowReader,
    ForeignHost,
    NotJson,
    TooLarge,
}

const KINDS: [Kind; 9] = [
    Kind::StreamedChat,
    Kind::WholeChat,
    Kind::Completion,
    Kind::Embeddings,
    Kind::LeavesMidStream,
    Kind::SlowReader,
    Kind::ForeignHost,
    Kind::NotJson,
    Kind::TooLarge,
];

impl Kind {
    fn expected(self) -> u16 {
        match self {
            Kind::Embeddings => 501,
            Kind::ForeignHost => 403,
            Kind::NotJson => 400,
            Kind::TooLarge => 413,
            _ => 200,
        }
    }
}

/// The engine a traffic phase runs serve on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// `--device cpu`: the pinned llama-server as serve's child; SIGSTOPped once at 40 %.
    Cpu,
    /// `--device inproc`: the add-on, llama.cpp in serve's process (no child to stop).
    Inproc,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Cpu => "cpu route (llama-server)",
            Engine::Inproc => "inproc add-on",
        }
    }
}

/// What serve's phases need: the binaries, the model, the add-on's folder, a scratch folder.
struct Kit {
    onebit: PathBuf,
    llama_server: PathBuf,
    model: PathBuf,
    plugins: PathBuf,
    lib_dir: PathBuf,
    scratch: PathBuf,
}

/// One sample of serve's process: seconds into the phase, RSS (KiB) and its anonymous and
/// file-backed parts, open descriptors, threads, its runtime's live tasks
/// (`onebit_runtime_tasks`) and the inproc add-on's prompt cache
/// (`onebit_inproc_prompt_cache_bytes`, KiB); the last two are none when the scrape failed or
/// has no such series.
#[derive(Clone, Copy)]
struct Sample {
    at_s: f64,
    rss_kib: u64,
    rss_anon_kib: u64,
    rss_file_kib: u64,
    fds: u64,
    threads: u64,
    tasks: Option<u64>,
    prompt_cache_kib: Option<u64>,
}

impl Sample {
    const HEADER: &str =
        "at_s\trss_kib\trss_anon_kib\trss_file_kib\tfds\tthreads\ttasks\tprompt_cache_kib";

    fn row(&self) -> String {
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |n| n.to_string());
        format!(
            "{:.1}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            self.at_s,
            self.rss_kib,
            self.rss_anon_kib,
            self.rss_file_kib,
            self.fds,
            self.threads,
            opt(self.tasks),
            opt(self.prompt_cache_kib)
        )
    }
}

/// One request's outcome.
struct Outcome {
    kind: Kind,
    status: u16,
    /// For a stream read to its end: whether its text equals the whole reply's.
    corrupted: bool,
    /// Whether it met the fault window (503/502 then allowed).
    in_fault: bool,
}

/// What a traffic phase saw.
struct PhaseRun {
    engine: Engine,
    minutes: f64,
    outcomes: Vec<Outcome>,
    samples: Vec<Sample>,
    stop_s: f64,
    left: Vec<u32>,
}

/// What the watchdog phase saw: serve's exit code, seconds from the SIGSTOP to serve's exit,
/// whether it printed the watchdog's line, and what was left running.
struct WatchdogRun {
    code: Option<i32>,
    exit_s: f64,
    said: bool,
    left: Vec<u32>,
}

pub fn run(ws: &Workspace, args: &[String]) -> Result<ExitCode, Failure> {
    let mut minutes = 20.0;
    let mut only = None;
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| Failure::new(format!("{flag} takes a value"), USAGE))?;
        match flag.as_str() {
            "--minutes" => {
                minutes = value
                    .parse::<f64>()
                    .ok()
                    .filter(|m| m.is_finite() && *m > 0.0)
                    .ok_or_else(|| {
                        Failure::new(format!("--minutes {value}: not a positive number"), USAGE)
                    })?
            }
            "--only" => {
                only = Some(match value.as_str() {
                    "cpu" => Engine::Cpu,
                    "inproc" => Engine::Inproc,
                    _ => {
                        return Err(Failure::new(
                            format!("--only {value}: not a traffic phase"),
                            USAGE,
                        ));
                    }
                })
            }
            _ => return Err(Failure::new(format!("unknown argument {flag}"), USAGE)),
        }
    }
    Ok(if soak_phases(ws, minutes, only)? {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Run the soak for `minutes` and print its report; whether every target was met. Called by
/// `cargo xtask soak` and, for one minute, by `cargo xtask test`.
pub fn soak(ws: &Workspace, minutes: f64) -> Result<bool, Failure> {
    soak_phases(ws, minutes, None)
}

/// The soak; with `only`, that traffic phase alone for the whole time (no watchdog phase).
fn soak_phases(ws: &Workspace, minutes: f64, only: Option<Engine>) -> Result<bool, Failure> {
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host", "-p", "onebit-route-cpu"]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "the build failed: fix the errors above")?;
    let library = addon::build(ws, false)?;
    let kit = Kit {
        onebit: ws.root.join("target/debug/1bit"),
        llama_server: ws.layout.llama_server(),
        model: ws.layout.model(ws.pins.default_model()),
        plugins: std::env::temp_dir().join(format!("onebit-soak-{}/plugins", std::process::id())),
        lib_dir: ws.layout.lib_dir(),
        scratch: std::env::temp_dir().join(format!("onebit-soak-{}", std::process::id())),
    };
    if !kit.llama_server.exists() || !kit.model.exists() {
        return Err(Failure::new(
            "llama-server or the default model is missing",
            "run `cargo xtask setup`",
        ));
    }
    std::fs::create_dir_all(&kit.plugins).map_err(|e| Failure::new(e, "check /tmp"))?;
    std::fs::copy(&library, kit.plugins.join("libonebit_route_inproc.so"))
        .map_err(|e| Failure::new(e, "check /tmp"))?;
    let (engines, each) = match only {
        Some(engine) => (vec![engine], minutes),
        None => (vec![Engine::Cpu, Engine::Inproc], minutes / 2.0),
    };
    let phases = engines
        .into_iter()
        .map(|engine| traffic_phase(&kit, engine, each))
        .collect::<Result<Vec<_>, _>>();
    let watchdog = match (&phases, only) {
        (Ok(_), None) => Some(watchdog_phase(&kit)),
        _ => None,
    };
    let _ = std::fs::remove_dir_all(&kit.scratch);
    let phases = phases?;
    let mut met = true;
    for phase in &phases {
        met &= report(phase);
        write_samples(ws, phase);
    }
    if let Some(watchdog) = watchdog {
        met &= report_watchdog(&watchdog?);
    }
    println!(
        "soak: {}",
        if met {
            "every target met"
        } else {
            "targets MISSED"
        }
    );
    Ok(met)
}

/// Start serve on `engine` with `extra` arguments, its stderr to `log`; wait until it is ready.
fn start_serve(
    kit: &Kit,
    engine: Engine,
    extra: &[&str],
    log: &Path,
) -> Result<(Killed, u16), Failure> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Failure::new(e, "the kernel has no free port"))?;
    let mut command = Command::new(&kit.onebit);
    command.arg("serve").arg("-m").arg(&kit.model);
    match engine {
        Engine::Cpu => command
            .args(["--device", "cpu", "--llama-server"])
            .arg(&kit.llama_server),
        Engine::Inproc => command
            .args(["--device", "inproc", "--ctx-size", "2048", "--plugin-dir"])
            .arg(&kit.plugins)
            .env("ONEBIT_INPROC_LIB_DIR", &kit.lib_dir),
    };
    let stderr = std::fs::File::create(log).map_err(|e| Failure::new(e, "check /tmp"))?;
    let serve = Killed(
        command
            .args(["--parallel", "4", "--port", &port.to_string()])
            .args(extra)
            .env("ONEBIT_STATE_DIR", &kit.scratch)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| Failure::new(format!("cannot start 1bit serve: {e}"), "build it"))?,
    );
    let began = Instant::now();
    while status_of(&exchange(port, &get_request("/health"), None)) != 200 {
        if began.elapsed() > Duration::from_secs(120) {
            return Err(Failure::new(
                format!("serve on the {} did not become ready", engine.name()),
                format!("see its log, {}", log.display()),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((serve, port))
}

/// One traffic phase of `minutes` on `engine`, ended by SIGTERM.
fn traffic_phase(kit: &Kit, engine: Engine, minutes: f64) -> Result<PhaseRun, Failure> {
    let log = kit.scratch.join(format!(
        "serve-{}.log",
        engine.name().split(' ').next().unwrap_or("x")
    ));
    let (mut serve, port) = start_serve(kit, engine, &[], &log)?;
    let pid = serve.0.id();
    let backend = children(pid)
        .first()
        .copied()
        .filter(|_| engine == Engine::Cpu);

    // The references: each prompt's whole greedy reply.
    let mut references = Vec::new();
    for prompt in PROMPTS {
        let reply = exchange(port, &chat_request(prompt, false, "127.0.0.1"), None);
        references.push(whole_content(&reply).ok_or_else(|| {
            Failure::new(
                format!("no reference reply for {prompt:?}: {reply}"),
                format!("see serve's log, {}", log.display()),
            )
        })?);
    }
    let references = Arc::new(references);

    let idle: Vec<TcpStream> = (0..IDLE_POOL)
        .filter_map(|_| {
            let mut tcp = TcpStream::connect(("127.0.0.1", port)).ok()?;
            tcp.write_all(&get_request_keep_alive("/health")).ok()?;
            let mut buf = [0u8; 512];
            let _ = tcp.read(&mut buf);
            Some(tcp)
        })
        .collect();

    let run_for = Duration::from_secs_f64(minutes * 60.0);
    let deadline = Instant::now() + run_for;
    let fault = Arc::new(AtomicBool::new(false));
    let outcomes = Arc::new(Mutex::new(Vec::<Outcome>::new()));
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let sample_every = if minutes <= 2.0 {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(10)
    };
    let start = Instant::now();
    let sampler = {
        let samples = samples.clone();
        std::thread::spawn(move || {
            while Instant::now() < deadline {
                if let Some(mut sample) = sample(pid) {
                    sample.at_s = start.elapsed().as_secs_f64();
                    let metrics = body_of(&exchange(port, &get_request("/metrics"), None));
                    sample.tasks = series(&metrics, "onebit_runtime_tasks");
                    sample.prompt_cache_kib =
                        series(&metrics, "onebit_inproc_prompt_cache_bytes").map(|b| b / 1024);
                    samples.lock().unwrap().push(sample);
                }
                std::thread::sleep(sample_every);
            }
        })
    };
    let faults = {
        let fault = fault.clone();
        std::thread::spawn(move || {
            let at = start + run_for.mul_f64(0.4);
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            if let Some(b) = backend {
                fault.store(true, Ordering::SeqCst);
                let _ = kill(Pid::from_raw(b as i32), Signal::SIGSTOP);
                std::thread::sleep(Duration::from_secs(3));
                let _ = kill(Pid::from_raw(b as i32), Signal::SIGCONT);
                // Requests that met the stop finish within a few seconds of it.
                std::thread::sleep(Duration::from_secs(5));
                fault.store(false, Ordering::SeqCst);
            }
        })
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (outcomes, references, fault) =
                (outcomes.clone(), references.clone(), fault.clone());
            std::thread::spawn(move || {
                let mut n = c;
                while Instant::now() < deadline {
                    let kind = KINDS[n % KINDS.len()];
                    let prompt = n % PROMPTS.len();
                    n += 1;
                    let in_fault = fault.load(Ordering::SeqCst);
                    let (status, corrupted) = one(port, kind, PROMPTS[prompt], &references[prompt]);
                    let in_fault = in_fault || fault.load(Ordering::SeqCst);
                    outcomes.lock().unwrap().push(Outcome {
                        kind,
                        status,
                        corrupted,
                        in_fault,
                    });
                }
            })
        })
        .collect();
    for c in clients {
        let _ = c.join();
    }
    let _ = faults.join();
    let _ = sampler.join();
    drop(idle);

    // The stop: SIGTERM, and nothing of serve's tree left after it.
    let tree = descendants(pid);
    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
    let stopped = Instant::now();
    while matches!(serve.0.try_wait(), Ok(None)) && stopped.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stop_s = stopped.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(200));
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    Ok(PhaseRun {
        engine,
        minutes,
        outcomes,
        samples,
        stop_s,
        left: still_running(tree),
    })
}

/// The last phase: a cpu serve with `--watchdog 3` streams a long reply; once its first event
/// is read the backend is SIGSTOPped (hung, as far as serve can tell). The watchdog must kill
/// it and serve exit 1 with its line.
fn watchdog_phase(kit: &Kit) -> Result<WatchdogRun, Failure> {
    let log = kit.scratch.join("serve-watchdog.log");
    let limit = WATCHDOG_S.to_string();
    let (mut serve, port) = start_serve(kit, Engine::Cpu, &["--watchdog", &limit], &log)?;
    let pid = serve.0.id();
    let backend = children(pid).first().copied().ok_or_else(|| {
        Failure::new("serve on the cpu route has no backend child", "see its log")
    })?;
    let tree = descendants(pid);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
        "temperature": 0, "max_tokens": 1500, "stream": true,
    })
    .to_string();
    let mut tcp = TcpStream::connect(("127.0.0.1", port))
        .map_err(|e| Failure::new(format!("cannot reach serve: {e}"), "see its log"))?;
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(30)));
    let _ = tcp.write_all(&post("/v1/chat/completions", &body, "127.0.0.1"));
    read_to_first_event(&mut tcp);
    let _ = kill(Pid::from_raw(backend as i32), Signal::SIGSTOP);
    let hung = Instant::now();
    let bound = Duration::from_secs(WATCHDOG_S + WATCHDOG_SLACK_S + 10);
    let code = loop {
        match serve.0.try_wait() {
            Ok(Some(status)) => break status.code(),
            Ok(None) if hung.elapsed() < bound => std::thread::sleep(Duration::from_millis(10)),
            _ => break None,
        }
    };
    let exit_s = hung.elapsed().as_secs_f64();
    drop(tcp);
    std::thread::sleep(Duration::from_millis(200));
    let left = still_running(tree);
    for p in &left {
        let _ = kill(Pid::from_raw(*p as i32), Signal::SIGKILL);
    }
    let said = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("1bit serve: watchdog: ") && l.contains("made no progress"));
    Ok(WatchdogRun {
        code,
        exit_s,
        said,
        left,
    })
}

/// Those of `pids` still alive.
fn still_running(pids: Vec<u32>) -> Vec<u32> {
    pids.into_iter()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists())
        .collect()
}

/// The value of an unlabelled series in a /metrics text.
fn series(metrics: &str, name: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|n| n.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// Write a phase's samples, one per line, to `target/soak/<engine>.tsv` (for a plot, or to
/// read which part of RSS moved); a write that fails is said and skipped.
fn write_samples(ws: &Workspace, phase: &PhaseRun) {
    let dir = ws.root.join("target/soak");
    let path = dir.join(format!(
        "{}.tsv",
        match phase.engine {
            Engine::Cpu => "cpu",
            Engine::Inproc => "inproc",
        }
    ));
    let mut text = format!("{}\n", Sample::HEADER);
    for s in &phase.samples {
        text.push_str(&s.row());
        text.push('\n');
    }
    match std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&path, text)) {
        Ok(()) => println!("  samples: {}", path.display()),
        Err(e) => println!("  samples not written to {}: {e}", path.display()),
    }
}

/// Print a traffic phase's report; true when every target is met.
fn report(phase: &PhaseRun) -> bool {
    let PhaseRun {
        engine,
        minutes,
        outcomes,
        samples,
        stop_s,
        left,
    } = phase;
    let fault = if *engine == Engine::Cpu {
        ", the backend SIGSTOPped 3 s at 40 %"
    } else {
        ""
    };
    println!(
        "soak, {}: {minutes} min, {CLIENTS} clients, {IDLE_POOL} idle keep-alive connections{fault}",
        engine.name()
    );
    println!(
        "  {:<18} {:>8} {:>8} {:>11} {:>10}",
        "request", "expected", "as such", "unexpected", "corrupted"
    );
    let allowed = |o: &Outcome, kind: Kind| {
        o.status == kind.expected() || (o.in_fault && matches!(o.status, 502 | 503))
    };
    let mut unexpected_total = 0;
    let mut corrupted_total = 0;
    for kind in KINDS {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.kind == kind).collect();
        let good = mine.iter().filter(|o| allowed(o, kind)).count();
        let corrupted = mine.iter().filter(|o| o.corrupted && !o.in_fault).count();
        let bad: Vec<u16> = mine
            .iter()
            .filter(|o| !allowed(o, kind))
            .map(|o| o.status)
            .collect();
        unexpected_total += bad.len();
        corrupted_total += corrupted;
        println!(
            "  {:<18} {:>8} {:>8} {:>11} {:>10}{}",
            format!("{kind:?}"),
            kind.expected(),
            good,
            bad.len(),
            corrupted,
            if bad.is_empty() {
                String::new()
            } else {
                format!("  (statuses {bad:?})")
            }
        );
    }
    if *engine == Engine::Cpu {
        let faulted = outcomes
            .iter()
            .filter(|o| o.in_fault && matches!(o.status, 502 | 503))
            .count();
        let in_fault = outcomes.iter().filter(|o| o.in_fault).count();
        println!(
            "  {in_fault} request(s) met the SIGSTOP window; {faulted} of them answered 502/503 (allowed there)"
        );
    }
    // Warm-up: the first minute, or the first third of a short phase.
    let warm = (minutes * 60.0 / 3.0).min(WARM_UP_S);
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at_s >= warm).collect();
    let slope = |f: &dyn Fn(&Sample) -> f64| -> f64 {
        let n = after.len() as f64;
        if n < 2.0 {
            return 0.0;
        }
        let mx = after.iter().map(|s| s.at_s).sum::<f64>() / n;
        let my = after.iter().map(|s| f(s)).sum::<f64>() / n;
        let num: f64 = after.iter().map(|s| (s.at_s - mx) * (f(s) - my)).sum();
        let den: f64 = after.iter().map(|s| (s.at_s - mx).powi(2)).sum();
        if den == 0.0 { 0.0 } else { num / den * 60.0 }
    };
    let growth = |f: &dyn Fn(&Sample) -> u64| -> i64 {
        match (after.first(), after.last()) {
            (Some(first), Some(last)) => f(last) as i64 - f(first) as i64,
            _ => 0,
        }
    };
    let rss_growth = growth(&|s| s.rss_kib);
    let fd_growth = growth(&|s| s.fds);
    let tasks_seen = after.iter().all(|s| s.tasks.is_some()) && !after.is_empty();
    let task_growth = growth(&|s| s.tasks.unwrap_or(0));
    let rss_judged = rss_is_judged(warm, minutes * 60.0);
    let cache = if after.iter().any(|s| s.prompt_cache_kib.is_some()) {
        format!(
            ", the add-on's prompt cache {:+} KiB",
            growth(&|s| s.prompt_cache_kib.unwrap_or(0))
        )
    } else {
        String::new()
    };
    println!(
        "  serve after warm-up ({} samples from {warm:.0} s): RSS {:+.0} KiB/min (grew {rss_growth} KiB: anonymous {:+}, file-backed {:+}{cache}; {}), FDs {:+.2}/min (grew {fd_growth}; slack {FD_SLACK}), tasks {:+.2}/min (grew {task_growth}; slack {TASK_SLACK}; last {}), threads {}",
        after.len(),
        slope(&|s| s.rss_kib as f64),
        growth(&|s| s.rss_anon_kib),
        growth(&|s| s.rss_file_kib),
        if rss_judged {
            format!("limit {GROWTH_LIMIT_KIB}")
        } else {
            format!(
                "not judged: the phase is under {:.0} min",
                (WARM_UP_S + JUDGED_WINDOW_S) / 60.0
            )
        },
        slope(&|s| s.fds as f64),
        slope(&|s| s.tasks.unwrap_or(0) as f64),
        after
            .last()
            .and_then(|s| s.tasks)
            .map_or("not scraped".to_string(), |n| n.to_string()),
        after.last().map(|s| s.threads).unwrap_or(0)
    );
    println!("  stop: SIGTERM to exit {stop_s:.2} s; processes left: {left:?}");
    let met = unexpected_total == 0
        && corrupted_total == 0
        && (!rss_judged || rss_growth <= GROWTH_LIMIT_KIB)
        && fd_growth <= FD_SLACK
        && tasks_seen
        && task_growth <= TASK_SLACK
        && left.is_empty();
    println!("  {}", if met { "targets met" } else { "targets MISSED" });
    met
}

/// Whether a phase of `length_s` seconds, warm after `warm_s`, is long enough for its RSS to be
/// judged: a full warm-up minute, then a window of [`JUDGED_WINDOW_S`].
fn rss_is_judged(warm_s: f64, length_s: f64) -> bool {
    warm_s >= WARM_UP_S && length_s - warm_s >= JUDGED_WINDOW_S
}

/// Print the watchdog phase's report; true when serve killed the hung backend, said so, exited
/// 1 within the limit and its slack, and left nothing running.
fn report_watchdog(run: &WatchdogRun) -> bool {
    println!(
        "soak, watchdog kill: backend SIGSTOPped mid-stream under --watchdog {WATCHDOG_S}: serve exited {} after {:.2} s (bound {} s), its line {}, processes left: {:?}",
        run.code
            .map_or("not at all".to_string(), |c| format!("with {c}")),
        run.exit_s,
        WATCHDOG_S + WATCHDOG_SLACK_S,
        if run.said { "printed" } else { "MISSING" },
        run.left
    );
    let met = run.code == Some(1)
        && run.said
        && run.exit_s <= (WATCHDOG_S + WATCHDOG_SLACK_S) as f64
        && run.left.is_empty();
    println!("  {}", if met { "targets met" } else { "targets MISSED" });
    met
}

/// Send one request of `kind`; its status (0: no reply) and whether a stream read to its end
/// differed from `reference`.
fn one(port: u16, kind: Kind, prompt: &str, reference: &str) -> (u16, bool) {
    match kind {
        Kind::StreamedChat => {
            let reply = exchange(port, &chat_request(prompt, true, "127.0.0.1"), None);
            let text = streamed_content(&reply);
            (status_of(&reply), text.as_deref() != Some(reference))
        }
        Kind::SlowReader => {
            let reply = exchange(
                port,
                &chat_request(prompt, true, "127.0.0.1"),
                Some(Duration::from_millis(20)),
            );
            let text = streamed_content(&reply);
            (status_of(&reply), text.as_deref() != Some(reference))
        }
        Kind::WholeChat => {
            let reply = exchange(port, &chat_request(prompt, false, "127.0.0.1"), None);
            let text = whole_content(&reply);
            (status_of(&reply), text.as_deref() != Some(reference))
        }
        Kind::Completion => {
            let body = format!(
                r#"{{"prompt":{},"max_tokens":16,"temperature":0}}"#,
                serde_json::Value::from(prompt)
            );
            (
                status_of(&exchange(
                    port,
                    &post("/v1/completions", &body, "127.0.0.1"),
                    None,
                )),
                false,
            )
        }
        Kind::Embeddings => {
            let body = format!(r#"{{"input":{}}}"#, serde_json::Value::from(prompt));
            (
                status_of(&exchange(
                    port,
                    &post("/v1/embeddings", &body, "127.0.0.1"),
                    None,
                )),
                false,
            )
        }
        Kind::LeavesMidStream => {
            let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
                return (0, false);
            };
            let _ = tcp.set_read_timeout(Some(REPLY_WITHIN));
            let _ = tcp.write_all(&chat_request(prompt, true, "127.0.0.1"));
            (status_of(&read_to_first_event(&mut tcp)), false)
        }
        Kind::ForeignHost => (
            status_of(&exchange(
                port,
                &chat_request(prompt, false, "evil.example"),
                None,
            )),
            false,
        ),
        Kind::NotJson => (
            status_of(&exchange(
                port,
                &post("/v1/chat/completions", "{not json", "127.0.0.1"),
                None,
            )),
            false,
        ),
        Kind::TooLarge => {
            let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 999999999999\r\nConnection: close\r\n\r\n{";
            (status_of(&exchange(port, head.as_bytes(), None)), false)
        }
    }
}

/// Read a streamed reply up to its first event (or the connection's end), and return what
/// was read: the head and that event.
fn read_to_first_event(tcp: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        match tcp.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&seen).into_owned()
}

fn post(path: &str, body: &str, host: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn chat_request(prompt: &str, stream: bool, host: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
    })
    .to_string();
    post("/v1/chat/completions", &body, host)
}

fn get_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").into_bytes()
}

fn get_request_keep_alive(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").into_bytes()
}

/// Send `request` on a fresh connection and read the reply to its close (`pace`: sleep that
/// long after each 256 bytes read, a slow reader).
fn exchange(port: u16, request: &[u8], pace: Option<Duration>) -> String {
    let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = tcp.set_read_timeout(Some(REPLY_WITHIN));
    if tcp.write_all(request).is_err() {
        return String::new();
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; if pace.is_some() { 256 } else { 16384 }];
    loop {
        match tcp.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        if let Some(p) = pace {
            std::thread::sleep(p);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(reply: &str) -> u16 {
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The body of an HTTP reply, de-chunked when it is chunked.
fn body_of(reply: &str) -> String {
    let Some((head, body)) = reply.split_once("\r\n\r\n") else {
        return String::new();
    };
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_string();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].strip_prefix("\r\n").unwrap_or("");
    }
    out
}

fn whole_content(reply: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&body_of(reply)).ok()?;
    v["choices"][0]["message"]["content"]
        .as_str()
        .map(str::to_string)
}

/// A stream's text, when it ended with `[DONE]`.
fn streamed_content(reply: &str) -> Option<String> {
    let body = body_of(reply);
    let mut text = String::new();
    let mut done = false;
    for line in BufReader::new(body.as_bytes())
        .lines()
        .map_while(Result::ok)
    {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).ok()?;
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    done.then_some(text)
}

/// A sample of serve's process (its memory, descriptors and threads), at 0 s and without the
/// scraped series.
fn sample(pid: u32) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some(Sample {
        at_s: 0.0,
        rss_kib: field("VmRSS:")?,
        rss_anon_kib: field("RssAnon:")?,
        rss_file_kib: field("RssFile:")?,
        fds,
        threads: field("Threads:")?,
        tasks: None,
        prompt_cache_kib: None,
    })
}

fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            out.extend(
                text.split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
    }
    out
}

fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children(p) {
            out.push(c);
            next.push(c);
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

#[cfg(test)]
mod tests {
    use super::{rss_is_judged, series};

    #[test]
    fn rss_is_judged_only_after_a_full_warm_up_and_a_minute_of_window() {
        // The suite's minute: two half-minute phases, warm after 10 s.
        assert!(!rss_is_judged(10.0, 30.0));
        // Warm after the first minute, but only 30 s after it.
        assert!(!rss_is_judged(60.0, 90.0));
        assert!(rss_is_judged(60.0, 120.0));
        // The default run: two 10-minute phases.
        assert!(rss_is_judged(60.0, 600.0));
    }

    #[test]
    fn a_series_is_read_by_its_whole_name() {
        let text = "# TYPE onebit_runtime_tasks gauge\nonebit_runtime_tasks_max 9\nonebit_runtime_tasks 212\nonebit_inproc_prompt_cache_bytes 1.5e6\n";
        assert_eq!(series(text, "onebit_runtime_tasks"), Some(212));
        assert_eq!(
            series(text, "onebit_inproc_prompt_cache_bytes"),
            Some(1_500_000)
        );
        assert_eq!(series(text, "onebit_missing"), None);
    }
}
