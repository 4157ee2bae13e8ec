//! `cargo xtask soak --starved [--minutes N]`: serve's promises on a starved machine (issue
//! 53). A CPU hog (one busy loop per core, at serve's priority) runs through the whole soak:
//! the cpu route's mixed traffic and its SIGSTOP fault for N minutes (default 2), judged as the
//! plain soak judges it; then a stop with a stream in flight on the cpu route and on the inproc
//! add-on, judged against the drain window + 1 s; then an RPC worker killed (`kill -9`) just as
//! a streamed request is sent, judged on serve's exit (1, within docs/rpc.md's 10 s, the
//! worker's line); after each, serve's process tree through /proc, which must be empty.

use super::hog::Hog;
use super::*;

/// The traffic phase's default length under `--starved`.
pub(super) const MINUTES: f64 = 2.0;
/// The engines (llama-server, the inproc add-on) compute on one thread beside the hog. ggml's
/// threads wait for each other at every step of a token's graph, spinning while a partner
/// waits for a core: llama-server's two threads beside two busy loops made 8-15 tokens/s here
/// against 33-37 for one, and in a CI run 0.34 (a 50-token reply took 24 s, the next outlasted
/// the client's minute). That measures the scheduler, not serve, whose own threads still meet
/// the hog at its priority.
const ENGINE_THREADS: u32 = 1;
/// serve's `--drain-s` in the stops, given explicitly so the bound is derived from it.
const DRAIN_S: f64 = 3.0;
/// How far past the drain window a signal's stop may end (docs/serve.md: the window + 1 s).
const STOP_PAST_THE_WINDOW_S: f64 = 1.0;
/// docs/rpc.md: a lost worker ends serve within 10 s.
const WORKER_LOST_WITHIN_S: f64 = 10.0;
/// How long past the traffic phase the hog may run, whatever becomes of the soak: the stops
/// and the worker's loss take under a minute starved, the rest is the builds' slack.
const HOG_PAST_THE_TRAFFIC: Duration = Duration::from_secs(240);

/// A stop with a stream in flight: serve's exit code, seconds from SIGTERM to exit, whether the
/// stream had begun, what was left of serve's tree.
struct StopRun {
    engine: Engine,
    code: Option<i32>,
    stop_s: f64,
    left: Vec<u32>,
}

/// An RPC worker killed as a request was sent: serve's exit code, seconds from the kill to its
/// exit, its line naming the worker, the request's status and whether it finished, what was
/// left of serve's tree and of the worker's.
struct WorkerLossRun {
    code: Option<i32>,
    exit_s: f64,
    line: Option<String>,
    status: u16,
    finished: bool,
    left: Vec<u32>,
}

/// The starved soak: each phase beside the hog, the report, whether every target was met.
pub(super) fn run(ws: &Workspace, prep: &dyn Prepare, minutes: f64) -> Result<bool, Failure> {
    let mut kit = build_kit(ws, prep)?;
    kit.engine_threads = Some(ENGINE_THREADS);
    let hog = Hog::start(Duration::from_secs_f64(minutes * 60.0) + HOG_PAST_THE_TRAFFIC)?;
    println!(
        "soak --starved: {} busy loop(s), one per core, at serve's priority through every phase",
        hog.cores()
    );
    let began = Instant::now();
    let phases = (|| {
        let traffic = traffic_phase(&kit, Engine::Cpu, minutes)?;
        let load = loadavg();
        let stops = [Engine::Cpu, Engine::Inproc]
            .into_iter()
            .map(|engine| stop_phase(&kit, engine))
            .collect::<Result<Vec<_>, _>>()?;
        let loss = worker_loss_phase(ws, &kit)?;
        Ok::<_, Failure>((traffic, load, stops, loss))
    })();
    let hog_left = hog.stop();
    let took = began.elapsed().as_secs_f64();
    let ran = phases.is_ok();
    let (traffic, load, stops, loss) = phases?;
    let mut met = report(&traffic);
    println!("  load average at the traffic's end: {load}");
    met &= report_stops(&stops);
    met &= report_worker_loss(&loss);
    println!("soak --starved: the hog ran {took:.0} s; its processes left after it: {hog_left:?}");
    met &= hog_left.is_empty();
    finish(&kit, ran, met);
    Ok(met)
}

/// The 1-minute load average, as /proc/loadavg says it.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string())
}

/// serve on `engine` with `--drain-s` [`DRAIN_S`] streams a long reply; once its first event is
/// read, SIGTERM, and the time to serve's exit (the client reads on meanwhile).
fn stop_phase(kit: &Kit, engine: Engine) -> Result<StopRun, Failure> {
    let log = kit.scratch.join(format!(
        "serve-starved-stop-{}.log",
        engine.name().split(' ').next().unwrap_or("x")
    ));
    let drain = DRAIN_S.to_string();
    let (mut serve, port) = start_serve(kit, engine, &["--drain-s", &drain], &log)?;
    let pid = serve.0.id();
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
        "temperature": 0, "max_tokens": 1500, "stream": true,
    })
    .to_string();
    let mut tcp = TcpStream::connect(("127.0.0.1", port))
        .map_err(|e| Failure::new(format!("cannot reach serve: {e}"), "see its log"))?;
    let _ = tcp.set_read_timeout(Some(REPLY_WITHIN));
    let _ = tcp.write_all(&post("/v1/chat/completions", &body, "127.0.0.1"));
    let first = read_to_first_event(&mut tcp);
    if !first.contains("data: {") {
        return Err(Failure::new(
            format!("the {}'s stream did not begin: {first}", engine.name()),
            format!("see serve's log, {}", log.display()),
        ));
    }
    // A client reads its stream to the end, as Lemonade's would through the drain.
    let reader = std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = tcp.read_to_end(&mut sink);
    });
    let tree = descendants(pid);
    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
    let signalled = Instant::now();
    let code = wait_exit(&mut serve, Duration::from_secs_f64(DRAIN_S + 20.0));
    let stop_s = signalled.elapsed().as_secs_f64();
    drop(serve);
    let _ = reader.join();
    std::thread::sleep(Duration::from_millis(200));
    Ok(StopRun {
        engine,
        code,
        stop_s,
        left: still_running(tree),
    })
}

/// serve's exit code within `limit` (None: still running then, or killed by a signal).
fn wait_exit(serve: &mut Killed, limit: Duration) -> Option<i32> {
    let began = Instant::now();
    loop {
        match serve.0.try_wait() {
            Ok(Some(status)) => return status.code(),
            Ok(None) if began.elapsed() < limit => std::thread::sleep(Duration::from_millis(10)),
            _ => return None,
        }
    }
}

/// A cpu serve over one `1bit rpc-worker`; the worker's ggml-rpc-server is killed (`kill -9`)
/// and a streamed request sent at once, so it meets serve before it can reach the engine (the
/// starved case of issue 53, where serve once stayed up answering 503 for good).
fn worker_loss_phase(ws: &Workspace, kit: &Kit) -> Result<WorkerLossRun, Failure> {
    let worker = Worker::start(ws, kit)?;
    let log = kit.scratch.join("serve-starved-rpc.log");
    let (mut serve, port) = start_serve(
        kit,
        Engine::Cpu,
        &["--rpc", &worker.endpoint, "--ctx-size", "1024"],
        &log,
    )?;
    let pid = serve.0.id();
    let server = descendants(worker.child.id())
        .into_iter()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "ggml-rpc-server")
        })
        .ok_or_else(|| {
            Failure::new(
                "1bit rpc-worker runs no ggml-rpc-server",
                "run `1bit rpc-worker` by hand to see why",
            )
        })?;
    let tree = descendants(pid);
    let _ = kill(Pid::from_raw(server as i32), Signal::SIGKILL);
    let lost = Instant::now();
    let asker = std::thread::spawn(move || {
        exchange(port, &chat_request(PROMPTS[2], true, "127.0.0.1"), None)
    });
    let code = wait_exit(
        &mut serve,
        Duration::from_secs_f64(WORKER_LOST_WITHIN_S + 10.0),
    );
    let exit_s = lost.elapsed().as_secs_f64();
    // A serve still up is killed here, so the request's read ends.
    drop(serve);
    let reply = asker.join().unwrap_or_default();
    let worker_tree = [vec![worker.child.id()], descendants(worker.child.id())].concat();
    let said = format!("1bit serve: RPC worker {} ", worker.endpoint);
    drop(worker);
    std::thread::sleep(Duration::from_millis(200));
    let line = std::fs::read_to_string(&log).ok().and_then(|text| {
        text.lines()
            .find(|l| l.starts_with(&said) && l.contains("cannot go on without the layers it held"))
            .map(str::to_string)
    });
    Ok(WorkerLossRun {
        code,
        exit_s,
        line,
        status: status_of(&reply),
        finished: streamed_content(&reply).is_some(),
        left: still_running([tree, worker_tree].concat()),
    })
}

/// A `1bit rpc-worker` on a free loopback port, one thread; SIGTERMed when dropped.
struct Worker {
    child: Child,
    endpoint: String,
}

impl Worker {
    fn start(ws: &Workspace, kit: &Kit) -> Result<Worker, Failure> {
        let mut child = Command::new(&kit.onebit)
            .args(["rpc-worker", "--port", "0", "--threads", "1"])
            .env("ONEBIT_LLAMA_SERVER", ws.layout.llama_server())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Failure::new(format!("cannot start 1bit rpc-worker: {e}"), "build it"))?;
        let out = child.stdout.take();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let Some(out) = out else { return };
            let mut reader = BufReader::new(out);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // Drained so the worker never blocks on a full pipe.
            let mut sink = Vec::new();
            let _ = reader.read_to_end(&mut sink);
        });
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
        let endpoint = line
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string);
        let worker = Worker {
            child,
            endpoint: endpoint.unwrap_or_default(),
        };
        if worker.endpoint.is_empty() {
            return Err(Failure::new(
                "1bit rpc-worker did not announce itself within 60 s",
                "run `1bit rpc-worker` by hand to see why",
            ));
        }
        Ok(worker)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

/// Print the stops' report; true when each exited 0 within the drain window + 1 s and left
/// nothing running.
fn report_stops(stops: &[StopRun]) -> bool {
    let bound = DRAIN_S + STOP_PAST_THE_WINDOW_S;
    let mut met = true;
    for stop in stops {
        println!(
            "soak --starved, stop on the {} with a stream in flight (--drain-s {DRAIN_S}): SIGTERM to exit {:.2} s (bound {bound:.1} s), exit {}, processes left: {:?}",
            stop.engine.name(),
            stop.stop_s,
            stop.code.map_or("none".to_string(), |c| c.to_string()),
            stop.left
        );
        met &= stop.code == Some(0) && stop.stop_s <= bound && stop.left.is_empty();
    }
    println!("  {}", if met { "targets met" } else { "targets MISSED" });
    met
}

/// Print the worker's loss's report; true when serve exited 1 within docs/rpc.md's bound with
/// the worker's line, the request did not finish as if nothing happened, and nothing was left.
fn report_worker_loss(run: &WorkerLossRun) -> bool {
    println!(
        "soak --starved, RPC worker killed (kill -9) as a streamed request was sent: serve exited {} after {:.2} s (bound {WORKER_LOST_WITHIN_S:.0} s), the worker's line {}, the request answered {}{}, processes left: {:?}",
        run.code
            .map_or("not at all".to_string(), |c| format!("with {c}")),
        run.exit_s,
        if run.line.is_some() {
            "printed"
        } else {
            "MISSING"
        },
        run.status,
        if run.finished {
            " and FINISHED"
        } else {
            " (not finished)"
        },
        run.left
    );
    if let Some(line) = &run.line {
        println!("  {line}");
    }
    let met = run.code == Some(1)
        && run.exit_s <= WORKER_LOST_WITHIN_S
        && run.line.is_some()
        && !run.finished
        && run.left.is_empty();
    println!("  {}", if met { "targets met" } else { "targets MISSED" });
    met
}
