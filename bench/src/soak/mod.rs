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
//! JSON: 400; a declared body over the limit: 413; a chunked body that grows past it: 413; a
//! route nobody serves: 404). 200 keep-alive connections sit idle through each phase, each
//! asking `/health` every 20 s so serve's 30 s header timeout does not close it. Faults: at 40 % of the cpu phase the backend is SIGSTOPped for 3 s (longer than
//! serve's 1.5 s health limit) and then SIGCONTed; requests that meet it may get 503 or 502. The
//! last phase: a cpu serve with `--watchdog 3` streams a reply, its backend is SIGSTOPped, and
//! the watchdog must kill it and serve exit 1 with its line, leaving nothing behind.
//!
//! `--starved` runs other phases beside a CPU hog (`starved.rs`, `hog.rs`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{Failure, Prepare, Workspace, process};

mod client;
mod hog;
mod processes;
mod report;
mod starved;

pub(crate) use hog::Hog;

use client::*;
use processes::*;
use report::*;

const USAGE: &str = "use `cargo xtask soak [--minutes N] [--only cpu|inproc]` (N a positive number; default 20) or `cargo xtask soak --starved [--minutes N]` (default 2)";
const CLIENTS: usize = 6;
const IDLE_POOL: usize = 200;
/// How many times each idle connection asks `/health` at the start, in the warm-up.
const IDLE_WARM_UP_ASKS: usize = 50;
/// How often each idle connection asks `/health`: within serve's 30 s header timeout.
const IDLE_ASK: Duration = Duration::from_secs(20);
/// serve's body limit in the soak (`ONEBIT_MAX_BODY_BYTES`): the chunked hostile body grows past it.
const SOAK_BODY_LIMIT: usize = 1 << 20;
const PROMPTS: [&str; 3] = [
    "What is the capital of France? Answer in one word.",
    "Name three colours of the rainbow.",
    "Count from one to ten.",
];
const MAX_TOKENS: u32 = 32;
/// serve's `--parallel` in the traffic phases: the engine's slots.
const PARALLEL: usize = 4;
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
    ChunkedTooLarge,
    NoSuchRoute,
}

const KINDS: [Kind; 11] = [
    Kind::StreamedChat,
    Kind::WholeChat,
    Kind::Completion,
    Kind::Embeddings,
    Kind::LeavesMidStream,
    Kind::SlowReader,
    Kind::ForeignHost,
    Kind::NotJson,
    Kind::TooLarge,
    Kind::ChunkedTooLarge,
    Kind::NoSuchRoute,
];

impl Kind {
    fn expected(self) -> u16 {
        match self {
            Kind::Embeddings => 501,
            Kind::ForeignHost => 403,
            Kind::NotJson => 400,
            Kind::TooLarge | Kind::ChunkedTooLarge => 413,
            Kind::NoSuchRoute => 404,
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

/// What serve's phases need: the binaries, the model, the add-on's folder, a scratch folder,
/// and the engines' compute threads when not their default (the starved soak's one).
struct Kit {
    onebit: PathBuf,
    llama_server: PathBuf,
    model: PathBuf,
    plugins: PathBuf,
    lib_dir: PathBuf,
    scratch: PathBuf,
    engine_threads: Option<u32>,
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

pub fn run(ws: &Workspace, prep: &dyn Prepare, args: &[String]) -> Result<ExitCode, Failure> {
    let mut minutes = None;
    let mut only = None;
    let mut starved = false;
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        if flag == "--starved" {
            starved = true;
            continue;
        }
        let value = rest
            .next()
            .ok_or_else(|| Failure::new(format!("{flag} takes a value"), USAGE))?;
        match flag.as_str() {
            "--minutes" => {
                minutes = Some(
                    value
                        .parse::<f64>()
                        .ok()
                        .filter(|m| m.is_finite() && *m > 0.0)
                        .ok_or_else(|| {
                            Failure::new(format!("--minutes {value}: not a positive number"), USAGE)
                        })?,
                )
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
    let met = match (starved, only) {
        (true, Some(_)) => {
            return Err(Failure::new(
                "--starved runs its own phases; --only does not apply",
                "use `cargo xtask soak --starved [--minutes N]`",
            ));
        }
        (true, None) => starved::run(ws, prep, minutes.unwrap_or(starved::MINUTES))?,
        (false, _) => soak_phases(ws, prep, minutes.unwrap_or(20.0), only)?,
    };
    Ok(if met {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Run the soak for `minutes` and print its report; whether every target was met. Called by
/// `cargo xtask soak` and, for one minute, by `cargo xtask test`.
pub fn soak(ws: &Workspace, prep: &dyn Prepare, minutes: f64) -> Result<bool, Failure> {
    soak_phases(ws, prep, minutes, None)
}

/// The starved soak for `minutes` of traffic beside a CPU hog, its report printed; whether
/// every target was met. Called by `cargo xtask soak --starved` and, for half a minute, by
/// `cargo xtask test`.
pub fn soak_starved(ws: &Workspace, prep: &dyn Prepare, minutes: f64) -> Result<bool, Failure> {
    starved::run(ws, prep, minutes)
}

/// The soak; with `only`, that traffic phase alone for the whole time (no watchdog phase).
fn soak_phases(
    ws: &Workspace,
    prep: &dyn Prepare,
    minutes: f64,
    only: Option<Engine>,
) -> Result<bool, Failure> {
    let kit = build_kit(ws, prep)?;
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
    // serve's logs are in the scratch folder: kept when a phase could not run (its failure
    // names the log) or missed a target (said below), else removed.
    let ran = phases.is_ok() && watchdog.as_ref().is_none_or(|w| w.is_ok());
    let phases = phases?;
    let mut met = true;
    for phase in &phases {
        met &= report(phase);
        write_samples(ws, phase);
    }
    if let Some(watchdog) = watchdog {
        met &= report_watchdog(&watchdog?);
    }
    finish(&kit, ran, met);
    Ok(met)
}

/// The soak's last line; serve's logs (in the scratch folder) kept when a phase could not run
/// (its failure names the log) or missed a target, else removed.
fn finish(kit: &Kit, ran: bool, met: bool) {
    if ran && met {
        let _ = std::fs::remove_dir_all(&kit.scratch);
        println!("soak: every target met");
    } else {
        println!(
            "soak: targets MISSED; serve's logs are kept in {}",
            kit.scratch.display()
        );
    }
}

/// Build serve and the cpu route (debug) and the inproc add-on, and make the soak's scratch
/// folder with the add-on placed in it as a route: what every phase needs.
fn build_kit(ws: &Workspace, prep: &dyn Prepare) -> Result<Kit, Failure> {
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host", "-p", "onebit-route-cpu"]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "the build failed: fix the errors above")?;
    let library = prep.addon(ws, false)?;
    let kit = Kit {
        onebit: ws.root.join("target/debug/1bit"),
        llama_server: ws.layout.llama_server(),
        model: ws.layout.model(ws.pins.default_model()),
        plugins: std::env::temp_dir().join(format!("onebit-soak-{}/plugins", std::process::id())),
        lib_dir: ws.layout.lib_dir(),
        scratch: std::env::temp_dir().join(format!("onebit-soak-{}", std::process::id())),
        engine_threads: None,
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
    Ok(kit)
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
    command.args([
        "--parallel",
        &PARALLEL.to_string(),
        "--port",
        &port.to_string(),
    ]);
    command.args(extra);
    if let Some(n) = kit.engine_threads {
        match engine {
            Engine::Inproc => command.arg("--route-opt").arg(format!("threads={n}")),
            Engine::Cpu => command.args(["--", "--threads", &n.to_string()]),
        };
    }
    let serve = Killed(
        command
            .env("ONEBIT_STATE_DIR", &kit.scratch)
            // A chunked body over the limit is cheap to send at 1 MiB (the default is 64).
            .env("ONEBIT_MAX_BODY_BYTES", SOAK_BODY_LIMIT.to_string())
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

/// Keep `IDLE_POOL` keep-alive connections open and idle on serve until `deadline`. serve
/// closes a kept-alive connection that sends nothing for its header timeout (30 s), so each
/// asks `/health` every `IDLE_ASK` and is otherwise silent; one that fails is opened again. The
/// pool then stands whole through the phase, and the descriptors it holds stay level.
fn keep_idle_pool(port: u16, deadline: Instant) {
    let ask = |tcp: &mut TcpStream| -> Option<()> {
        tcp.write_all(&get_request_keep_alive("/health")).ok()?;
        let mut buf = [0u8; 512];
        (tcp.read(&mut buf).ok()? > 0).then_some(())
    };
    let open = || {
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).ok()?;
        tcp.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        ask(&mut tcp)?;
        Some(tcp)
    };
    let mut pool: Vec<TcpStream> = (0..IDLE_POOL).filter_map(|_| open()).collect();
    // Warm the pool up inside the warm-up minute: serve's memory for 200 kept-alive connections
    // settles after some 40 requests on each (8,000 in all; measured on the fake backend: RSS
    // rose 6.3 -> 8.9 MB over 40 rounds, then stayed within 0.2 MB for 360 more). One ask each
    // every 20 s would spread that settling over the whole phase and read as growth.
    for _ in 0..IDLE_WARM_UP_ASKS {
        for tcp in &mut pool {
            let _ = ask(tcp);
        }
    }
    while Instant::now() < deadline {
        std::thread::sleep(IDLE_ASK.min(deadline.saturating_duration_since(Instant::now())));
        for tcp in &mut pool {
            if ask(tcp).is_none()
                && let Some(fresh) = open()
            {
                *tcp = fresh;
            }
        }
    }
}

/// Before the clients start: one decode as large as the engine's micro-batch (`--parallel`
/// prompts of some 400 tokens at once, one token each), so the engine's compute buffer, sized
/// for that and faulted in page by page as larger batches first run, is resident before the
/// warm-up ends. Without it the soak's short chats reached a larger batch now and then, and
/// each first time read as growth (+660 KiB once at 240 s in a 7-minute inproc phase).
fn fill_the_micro_batch(port: u16) {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let body = format!(
        r#"{{"prompt":{},"max_tokens":1,"temperature":0}}"#,
        serde_json::Value::from(prompt)
    );
    let asks: Vec<_> = (0..PARALLEL)
        .map(|_| {
            let request = client::post("/v1/completions", &body, "127.0.0.1");
            std::thread::spawn(move || exchange(port, &request, None))
        })
        .collect();
    for ask in asks {
        let _ = ask.join();
    }
}

/// The next request a client sends: its kind and prompt, or None once the phase is over. The
/// clients take the kinds in turn from one count, so the first round of every kind goes out
/// within the first `KINDS.len()` requests, whichever clients are free (on a starved machine a
/// chat can hold its client for most of a short phase), and that round always goes out in full,
/// past the phase's end if need be: a kind that never ran would prove nothing.
fn next_request(taken: &AtomicUsize, deadline: Instant) -> Option<(Kind, usize)> {
    let n = taken.fetch_add(1, Ordering::SeqCst);
    if n >= KINDS.len() && Instant::now() >= deadline {
        return None;
    }
    Some((KINDS[n % KINDS.len()], n % PROMPTS.len()))
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
    fill_the_micro_batch(port);

    let run_for = Duration::from_secs_f64(minutes * 60.0);
    let deadline = Instant::now() + run_for;
    let idle = std::thread::spawn(move || keep_idle_pool(port, deadline));
    // The fault's window as a count: odd while it lasts (from SIGSTOP to 5 s after SIGCONT),
    // so a request that spans the whole window is seen to have met it too.
    let fault = Arc::new(AtomicU64::new(0));
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
                fault.fetch_add(1, Ordering::SeqCst);
                let _ = kill(Pid::from_raw(b as i32), Signal::SIGSTOP);
                std::thread::sleep(Duration::from_secs(3));
                let _ = kill(Pid::from_raw(b as i32), Signal::SIGCONT);
                // Requests that met the stop finish within a few seconds of it.
                std::thread::sleep(Duration::from_secs(5));
                fault.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let taken = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (outcomes, references, fault, taken) = (
                outcomes.clone(),
                references.clone(),
                fault.clone(),
                taken.clone(),
            );
            std::thread::spawn(move || {
                while let Some((kind, prompt)) = next_request(&taken, deadline) {
                    let before = fault.load(Ordering::SeqCst);
                    let (status, corrupted) = one(port, kind, PROMPTS[prompt], &references[prompt]);
                    let after = fault.load(Ordering::SeqCst);
                    let in_fault = before % 2 == 1 || after != before;
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
    let _ = idle.join();

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
    use super::*;

    /// Past the phase's end the first round still goes out in full, every kind once, and then
    /// no more; before the end the kinds come in turn.
    #[test]
    fn every_kind_is_sent_once_however_short_the_phase() {
        let taken = AtomicUsize::new(0);
        let over = Instant::now();
        let mut kinds = Vec::new();
        while let Some((kind, _)) = next_request(&taken, over) {
            kinds.push(kind);
            assert!(kinds.len() <= KINDS.len(), "sent past the first round");
        }
        assert_eq!(kinds, KINDS);

        let taken = AtomicUsize::new(0);
        let later = Instant::now() + Duration::from_secs(60);
        let sent: Vec<Kind> = (0..KINDS.len() + 2)
            .map(|_| next_request(&taken, later).unwrap().0)
            .collect();
        assert_eq!(sent[KINDS.len()..], KINDS[..2]);
    }
}
