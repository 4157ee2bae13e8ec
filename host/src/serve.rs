//! `1bit serve`: plan with the chosen route, start its backends, serve until told to stop or
//! until a backend fails, and stop everything in order.

use std::collections::BTreeMap;
use std::net::TcpListener as StdListener;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use nix::sys::signal::Signal;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{
    BackendHealth, HealthProbe, Plan, PlanOutcome, PlanRequest, Purpose, ServeOptions, Started,
};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc::unbounded_channel;

use crate::busy_poll::{BusyPollStream, Side};
use crate::cli::ServeArgs;
use crate::error::{Fatal, exit};
use crate::fast_path;
use crate::guard::Guard;
use crate::proxy::{self, App, BackendClient, Status};
use crate::route_calls::{RouteCalls, install_host_services};
use crate::supervisor::{self, Backend, Event};
use crate::watchdog::{self, Watchdog};
use crate::{admission, metrics, model, routes};

/// A backend that does not answer its health route within this long is reported down.
const HEALTH_TIMEOUT: Duration = Duration::from_millis(1500);
/// A client must send a request's headers within this long; `ONEBIT_HEADER_READ_TIMEOUT_S`
/// changes it.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How often serve asks a loading backend's health route (see `wait_ready`).
const READY_POLL: Duration = Duration::from_millis(5);
/// The pause between two rounds of health questions once ready. With the timeout this puts a
/// backend that stops answering in `/health` within 1.75 s (Lemonade's probe gives up at 2 s).
const HEALTH_EVERY: Duration = Duration::from_millis(250);
/// Ports Lemonade scans for its own servers; backends never take one.
const LEMONADE_PORTS: std::ops::RangeInclusive<u16> = 8001..=9000;

/// Devices whose routes always need serve in the request path (NPU engines in process, the
/// hybrid prefill handoff, ds4-server's renamed replies), so `--print-backend` exits 5 for them
/// even in a build without their route.
const ONE_HOP_NEVER: [&str; 3] = ["npu", "hybrid", "ds4"];

/// Run `1bit serve` and return its exit status.
pub fn run(args: ServeArgs) -> i32 {
    match prepare(&args) {
        Ok(Prepared::Exit(code)) => code,
        Ok(Prepared::Serve(prepared)) => {
            // One worker per core (tokio's default; `TOKIO_WORKER_THREADS` sets another
            // count): a fast-path request is one task, so a second worker adds no hand-off,
            // and under load the workers relay in parallel (docs/performance.md).
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("serve")
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    return say_fatal(&Fatal::backend(format!("cannot start the runtime: {e}")));
                }
            };
            let code = runtime.block_on(serve_plan(*prepared));
            runtime.shutdown_timeout(Duration::from_millis(200));
            code
        }
        Err(fatal) => say_fatal(&fatal),
    }
}

fn say_fatal(fatal: &Fatal) -> i32 {
    eprintln!("1bit serve: {}", fatal.message);
    fatal.code
}

enum Prepared {
    Exit(i32),
    Serve(Box<ServePlan>),
}

struct ServePlan {
    args: ServeArgs,
    route: LoadedRoute,
    plan: Plan,
    served_name: String,
    run_dir: PathBuf,
}

/// Everything before a process starts: the flags, the model, the route, the plan.
fn prepare(args: &ServeArgs) -> Result<Prepared, Fatal> {
    if let Some(why) = args.removed() {
        return Err(Fatal::usage(why));
    }
    let printing = args.print_backend || args.print_backend_env;
    let needs_serve = |why: String| Fatal {
        code: exit::NEEDS_SERVE,
        message: format!(
            "--print-backend: {why} needs 1bit serve in the request path; run 1bit serve itself"
        ),
    };
    if let Some(tps) = args.watchdog_prompt_tps
        && !(tps.is_finite() && tps > 0.0)
    {
        return Err(Fatal::usage(format!(
            "--watchdog-prompt-tps {tps}: not a positive number of tokens per second; pass one such as 50"
        )));
    }
    if printing {
        if let Some(flag) = args.needs_serve_in_path() {
            return Err(needs_serve(flag.to_string()));
        }
        if ONE_HOP_NEVER.contains(&args.device.as_str()) {
            return Err(needs_serve(format!("--device {}", args.device)));
        }
    }
    let facts = model::facts(&args.model)?;
    if facts.hadamard_q4_0 {
        return Err(Fatal::usage(format!(
            "{}: an H32 file (a Hadamard-rotated Q4_0 stamped onebit.hadamard_q4_0) is refused on every device: the format is dropped; use the model's UD-Q4_K_XL or another standard GGUF",
            args.model.display()
        )));
    }
    if printing && facts.is_dir {
        return Err(needs_serve(format!(
            "the model directory {}",
            args.model.display()
        )));
    }
    let served_name = model::served_name(&args.model, args.alias.as_deref());

    let found = routes::discover(&routes::search_dirs(&args.plugin_dir));
    let mut loaded = Vec::new();
    for f in found {
        match f.outcome {
            Ok(route) => loaded.push(route),
            Err(e) => eprintln!("1bit serve: skipping a route: {e}"),
        }
    }

    let ports = if printing {
        vec![args.port]
    } else {
        reserve_ports(4)?
    };
    let run_dir = std::env::temp_dir().join(format!("1bit-serve-{}", std::process::id()));
    let request = PlanRequest {
        purpose: if printing {
            Purpose::PrintBackend
        } else if args.mem_check {
            Purpose::MemCheck
        } else {
            Purpose::Serve
        },
        options: ServeOptions {
            model: args.model.to_string_lossy().into_owned(),
            served_name: served_name.clone(),
            host: args.host.clone(),
            port: args.port,
            device: args.device.clone(),
            ctx_size: args.ctx_size,
            llama_server: args.llama_server.clone(),
            ds4: args.ds4.clone(),
            parallel: args.parallel,
            ssd_streaming: args.ssd_streaming,
            hrx_libhsa: args.hrx_libhsa.clone(),
            strict_device: args.strict_device,
            no_strict_device: args.no_strict_device,
            placement_report: args.placement_report,
            recipes: args.recipes.clone(),
            no_recipes: args.no_recipes,
            mtp: args.mtp.clone(),
            dflash: args.dflash.clone(),
            no_mtp: args.no_mtp,
            mtp_max: args.mtp_max,
            mtp_p_min: args.mtp_p_min,
            mmproj: args.mmproj.clone(),
            embedding: args.embedding,
            reranking: args.reranking,
            embed: args.embed.clone(),
            rerank: args.rerank.clone(),
            args: std::env::args().skip(2).collect(),
        },
        model: facts,
        env: std::env::vars_os()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.to_string_lossy().into_owned(),
                )
            })
            .collect(),
        ports,
        run_dir: run_dir.to_string_lossy().into_owned(),
    };

    let refused_flag = refused_flag(args);
    let (route, claim) = routes::choose(&args.device, &loaded, &request)?;
    if let Some(claim) = claim.filter(|_| refused_flag.is_none()) {
        eprintln!(
            "1bit serve: --device auto chose {} ({})",
            route.info.name, claim.reason
        );
    }
    let plan = match route.plan(&request) {
        Ok(PlanOutcome::Plan(plan)) => plan,
        Ok(PlanOutcome::Refused(refusal)) => {
            return Err(Fatal {
                code: refusal.exit_code,
                message: refusal.message,
            });
        }
        Err(e) => {
            return Err(Fatal::backend(format!(
                "the {} route failed to plan: {e}",
                route.info.name
            )));
        }
    };
    // A flag refused for every route is refused only once the route has planned, so that a
    // route's own refusal of it (`--mtp` on --device hybrid, say) says why instead. A plan is
    // pure, so asking it first starts nothing.
    if let Some(refused) = refused_flag {
        return Err(refused);
    }

    let workers = crate::rpc::before_start(args, &plan)?;
    if let Some(code) = crate::rpc::split::admit(args, &served_name, &plan, &workers)? {
        return Ok(Prepared::Exit(code));
    }
    if args.mem_check {
        return Ok(Prepared::Exit(mem_check(args, &served_name, &plan)?));
    }
    if workers.is_empty() && !admission::skipped(args.no_mem_check) {
        admit(args, &served_name, &plan)?;
    }
    for note in &plan.notes {
        eprintln!("1bit serve: {note}");
    }
    if printing {
        return print_backend(args, &plan).map(Prepared::Exit);
    }
    Ok(Prepared::Serve(Box::new(ServePlan {
        args: args.clone(),
        route: route.clone(),
        plan,
        served_name,
        run_dir,
    })))
}

/// A flag this build parses but refuses on every route, as the one line serve exits 2 with.
fn refused_flag(args: &ServeArgs) -> Option<Fatal> {
    if let Some(flag) = args.refused_in_this_build() {
        return Some(Fatal::usage(format!(
            "{flag} is not available in this build: the expert streamer is not ported to this engine; remove {flag}"
        )));
    }
    args.not_yet_available().first().map(|flag| {
        Fatal::usage(format!(
            "{flag} is not available in this version of 1bit serve yet; remove {flag}"
        ))
    })
}

/// `--mem-check`: the estimate on stdout, exit 0 when it fits and 3 when it does not.
fn mem_check(args: &ServeArgs, name: &str, plan: &Plan) -> Result<i32, Fatal> {
    let Some(need) = &plan.memory else {
        println!(
            "{name}: nothing to check: the {} route gave no memory estimate for {}",
            plan.device,
            args.model.display()
        );
        return Ok(exit::OK);
    };
    let free =
        admission::free_for(&need.pool, &admission::Sources::from_env()).map_err(Fatal::backend)?;
    let verdict = admission::judge(name, &args.model, need, &free);
    println!("{}", verdict.line);
    for warning in &verdict.warnings {
        println!("warning: {warning}");
    }
    Ok(if verdict.fits { exit::OK } else { exit::NO_FIT })
}

/// The check before a load: say the estimate, refuse with exit 3 when it does not fit.
fn admit(args: &ServeArgs, name: &str, plan: &Plan) -> Result<(), Fatal> {
    let Some(need) = &plan.memory else {
        return Ok(());
    };
    let free =
        admission::free_for(&need.pool, &admission::Sources::from_env()).map_err(Fatal::backend)?;
    let verdict = admission::judge(name, &args.model, need, &free);
    if !verdict.fits {
        return Err(Fatal {
            code: exit::NO_FIT,
            message: verdict.line,
        });
    }
    eprintln!("1bit serve: {}", verdict.line);
    for warning in &verdict.warnings {
        eprintln!("1bit serve: warning: {warning}");
    }
    Ok(())
}

/// `--print-backend`: the plan's backend as one JSON line; `--print-backend-env`: its
/// environment, one `NAME=VALUE` line each. Only variables the caller has not set are listed.
fn print_backend(args: &ServeArgs, plan: &Plan) -> Result<i32, Fatal> {
    let backend = match plan.backends.as_slice() {
        [one] if plan.one_hop => one,
        _ => {
            return Err(Fatal {
                code: exit::NEEDS_SERVE,
                message: format!(
                    "--print-backend: --device {} needs 1bit serve in the request path; run 1bit serve itself",
                    plan.device
                ),
            });
        }
    };
    let mut env: BTreeMap<&String, &String> = backend
        .env
        .iter()
        .filter(|(k, _)| std::env::var_os(k).is_none())
        .collect();
    env.extend(backend.env_combined.iter());
    if args.print_backend_env {
        for (k, v) in env {
            println!("{k}={v}");
        }
        return Ok(exit::OK);
    }
    let line = serde_json::json!({
        "argv": backend.argv,
        "device": plan.device,
        "env": env,
        "port": backend.port,
        "warmups": plan.warmups,
        "warmup": plan.warmups.first(),
    });
    println!("{line}");
    Ok(exit::OK)
}

/// Reserve `n` free loopback ports outside Lemonade's range. The kernel picks each; they are
/// released just before the backends bind them.
fn reserve_ports(n: usize) -> Result<Vec<u16>, Fatal> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..(n * 8) {
        if ports.len() == n {
            break;
        }
        let listener = StdListener::bind("127.0.0.1:0")
            .map_err(|e| Fatal::backend(format!("cannot reserve a loopback port: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| Fatal::backend(format!("cannot reserve a loopback port: {e}")))?
            .port();
        if !LEMONADE_PORTS.contains(&port) {
            ports.push(port);
        }
        held.push(listener);
    }
    if ports.len() < n {
        return Err(Fatal::backend(
            "cannot reserve loopback ports outside 8001-9000",
        ));
    }
    Ok(ports)
}

/// How long to wait for a backend to stop after SIGTERM.
fn stop_grace() -> Duration {
    let secs = std::env::var("ONEBIT_BACKEND_STOP_GRACE_S")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(30.0);
    Duration::from_secs_f64(secs)
}

/// A number from the environment; None when unset or not a finite number.
fn env_number(name: &str) -> Option<f64> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|n| n.is_finite())
}

/// A positive number of seconds from the environment.
fn env_secs(name: &str) -> Option<Duration> {
    env_number(name)
        .filter(|s| *s > 0.0 && *s < 1e9)
        .map(Duration::from_secs_f64)
}

/// Serve HTTP/1 on `listener` until `shutdown` turns true, then let each connection finish
/// its request in flight. hyper's own connection loop rather than `axum::serve`, because only
/// it bounds the time a client may take to send its headers: a client that trickles them is
/// dropped after `header_timeout`, holding nothing but its socket until then.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    header_timeout: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let service = TowerToHyperService::new(proxy::router(app.clone()));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors and the like: say so, and do not spin.
                    eprintln!("1bit serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            () = stopped(&mut shutdown) => break,
        };
        let _ = tcp.set_nodelay(true);
        let client = BusyPollStream::new(tcp, Side::Client);
        let (http, service) = (http.clone(), service.clone());
        // The fast path first; what it does not serve goes to hyper and axum.
        let general = move |io, mut stop| async move {
            let connection = http.serve_connection(TokioIo::new(io), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => return,
                () = stopped(&mut stop) => {}
            }
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        };
        connections.spawn(fast_path::serve_connection(
            client,
            app.clone(),
            header_timeout,
            shutdown.clone(),
            general,
        ));
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Resolves once serve is told to stop (or the sender is gone).
pub async fn stopped(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

async fn serve_plan(p: ServePlan) -> i32 {
    let ServePlan {
        args,
        route,
        plan,
        served_name,
        run_dir,
    } = p;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(e) => {
            return say_fatal(&Fatal::backend(format!(
                "cannot listen on {addr} ({e}); pass another --port or --host"
            )));
        }
    };
    if let Err(e) = std::fs::create_dir_all(&run_dir) {
        return say_fatal(&Fatal::backend(format!(
            "cannot create {} ({e})",
            run_dir.display()
        )));
    }
    // serve's own calls (readiness, health, warm-ups, the watchdog's questions, the route's
    // host services, metrics) go on a client that never busy-polls; relayed requests do.
    let client = proxy::probe_client();
    let state = if plan.backends.is_empty() {
        None
    } else {
        let name = served_name.clone();
        tokio::task::spawn_blocking(move || {
            let dir = metrics::state_dir()?;
            let state = metrics::StateFile::open(&dir, &name);
            state.bump(|c| c.serve_starts += 1);
            Some(Arc::new(state))
        })
        .await
        .ok()
        .flatten()
    };
    let app = Arc::new(App {
        served_name: served_name.clone(),
        device: plan.device.clone(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        rules: plan.rules.clone(),
        ports: plan.backends.iter().map(|b| b.port).collect(),
        status: RwLock::new(Status::Loading),
        client: proxy::backend_client(),
        probes: client.clone(),
        body_limit: env_number("ONEBIT_MAX_BODY_BYTES")
            .filter(|n| *n >= 1.0)
            .map(|n| n as usize)
            .unwrap_or(proxy::DEFAULT_BODY_LIMIT),
        body_timeout: env_secs("ONEBIT_BODY_READ_TIMEOUT_S").unwrap_or(proxy::DEFAULT_BODY_TIMEOUT),
        guard: Guard::for_bind(&args.host),
        side_models: plan.side_models.clone(),
        rename_in_streams: plan.rename_in_streams,
        precise: args.precise || std::env::var("ONEBIT_PRECISE").is_ok_and(|v| v.trim() == "1"),
        serialize_forwards: plan.serialize_forwards,
        forward_turn: Arc::new(tokio::sync::Mutex::new(())),
        route: RouteCalls {
            route: route.clone(),
        },
        watchdog: OnceLock::new(),
        metrics: metrics::Sources {
            state,
            backends: plan
                .backends
                .iter()
                .map(|b| (b.port, b.metrics_path.clone()))
                .collect(),
            sysfs_root: metrics::sysfs_root(),
        },
        pool: Default::default(),
    });
    install_host_services(
        tokio::runtime::Handle::current(),
        client.clone(),
        app.ports.clone(),
    );

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(accept_loop(
        listener,
        app.clone(),
        env_secs("ONEBIT_HEADER_READ_TIMEOUT_S").unwrap_or(HEADER_READ_TIMEOUT),
        shutdown_rx,
    ));

    let code = supervise(&args, &route, &plan, &app, &client).await;

    let _ = shutdown_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    let _ = std::fs::remove_dir_all(&run_dir);
    code
}

/// Start the backends, wait for them, serve until a signal or a failure, then stop them.
async fn supervise(
    args: &ServeArgs,
    route: &LoadedRoute,
    plan: &Plan,
    app: &Arc<App>,
    client: &BackendClient,
) -> i32 {
    let (Ok(mut sigterm), Ok(mut sigint)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return say_fatal(&Fatal::backend("cannot install signal handlers"));
    };
    let (events_tx, mut events) = unbounded_channel();
    let mut backends: Vec<Backend> = Vec::new();
    for (index, spec) in plan.backends.iter().enumerate() {
        eprintln!(
            "1bit serve: starting {} on the {} route (port {}): {}",
            spec.engine,
            plan.device,
            spec.port,
            spec.argv.join(" ")
        );
        match supervisor::spawn(index, spec, route, events_tx.clone()) {
            Ok(b) => backends.push(b),
            Err(e) => {
                let program = spec.argv.first().map(String::as_str).unwrap_or("");
                supervisor::stop_all(&backends, stop_grace()).await;
                return say_fatal(&Fatal::backend(format!(
                    "could not start {} ({program}): {e}",
                    spec.engine
                )));
            }
        }
    }
    let grace = stop_grace();
    let limit = watchdog::limit_secs(
        args.watchdog,
        std::env::var("ONEBIT_WATCHDOG_SECS").ok().as_deref(),
    );
    if limit > 0 {
        let dog = Watchdog::new(
            Duration::from_secs(limit),
            args.watchdog_prompt_tps
                .unwrap_or(watchdog::DEFAULT_PROMPT_TPS),
            &plan.device,
            backends
                .iter()
                .map(|b| watchdog::Watched {
                    port: b.spec.port,
                    pid: b.pid,
                    progress_path: b.spec.progress_path.clone(),
                })
                .collect(),
        );
        let _ = app.watchdog.set(Arc::new(dog));
    }

    // Loading: wait until every backend answers its health route, or fails, or we are told
    // to stop.
    let ready = async {
        for b in &backends {
            wait_ready(client, b).await;
        }
    };
    tokio::select! {
        _ = ready => {}
        event = events.recv() => {
            return fail(event, &backends, app, plan, grace).await;
        }
        _ = sigterm.recv() => return stop(&backends, grace, "SIGTERM").await,
        _ = sigint.recv() => return stop(&backends, grace, "SIGINT").await,
    }

    let started = Started {
        plan: plan.clone(),
        pids: backends.iter().map(|b| b.pid).collect(),
    };
    let route_start = {
        let route = route.clone();
        tokio::task::spawn_blocking(move || route.start(&started))
    };
    let start_error = match route_start.await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(e) => Some(e.to_string()),
    };
    if let Some(e) = start_error {
        supervisor::stop_all(&backends, grace).await;
        return say_fatal(&Fatal::backend(format!(
            "the {} route failed to start: {e}",
            plan.device
        )));
    }
    for warmup in &plan.warmups {
        if let Err(e) = backend_post(client, &backends[0], &warmup.path, &warmup.body).await {
            eprintln!("1bit serve: warm-up {} failed: {e}", warmup.path);
        }
    }
    app.set_status(Status::Ready);
    eprintln!(
        "1bit serve: ready on http://{}:{}",
        display_host(&args.host),
        args.port
    );

    crate::rpc::watch::spawn();
    let monitor = tokio::spawn(monitor_health(
        app.clone(),
        client.clone(),
        route.clone(),
        backends
            .iter()
            .map(|b| (b.spec.port, b.spec.health_path.clone()))
            .collect(),
    ));
    let dog = app
        .watchdog
        .get()
        .map(|dog| tokio::spawn(dog.clone().run(client.clone(), events_tx.clone())));
    let code = tokio::select! {
        event = events.recv() => fail(event, &backends, app, plan, grace).await,
        _ = sigterm.recv() => stop(&backends, grace, "SIGTERM").await,
        _ = sigint.recv() => stop(&backends, grace, "SIGINT").await,
    };
    monitor.abort();
    if let Some(dog) = dog {
        dog.abort();
    }
    code
}

fn display_host(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// A signal: stop the backends in order and exit cleanly.
async fn stop(backends: &[Backend], grace: Duration, what: &str) -> i32 {
    eprintln!("1bit serve: {what}: stopping");
    for line in supervisor::stop_all(backends, grace).await {
        eprintln!("1bit serve: {line}");
    }
    exit::OK
}

/// A backend exited or the route asked to stop: say so, stop the rest, exit 1.
async fn fail(
    event: Option<Event>,
    backends: &[Backend],
    app: &Arc<App>,
    plan: &Plan,
    grace: Duration,
) -> i32 {
    let message = match event {
        Some(Event::Exited { index, how }) => {
            let b = &backends[index];
            let last = b
                .tail()
                .pop()
                .map(|l| format!(" (its last line: {})", l.trim()))
                .unwrap_or_default();
            metrics::bump(&app.metrics.state, |c| c.backend_exits += 1).await;
            format!(
                "the {} backend ({}, port {}, pid {}) {how}{last}; exiting",
                plan.device, b.spec.engine, b.spec.port, b.pid
            )
        }
        Some(Event::Hung { index, line }) => {
            return hung(index, &line, backends, app, grace).await;
        }
        Some(Event::RouteStop { index, reason }) => {
            if let Some(b) = backends.get(index) {
                b.signal(Signal::SIGKILL);
            }
            format!("{reason}; killing the {} backend and exiting", plan.device)
        }
        None => "the backends' event channel closed; exiting".to_string(),
    };
    let message = match tokio::task::spawn_blocking(crate::rpc::watch::name_lost).await {
        Ok(Some(lost)) => format!(
            "{lost}: the {} backend cannot go on without the layers it held; {message}",
            plan.device
        ),
        _ => message,
    };
    app.set_status(Status::Failed(message.clone()));
    eprintln!("1bit serve: {message}");
    for line in supervisor::stop_all(backends, grace).await {
        eprintln!("1bit serve: {line}");
    }
    exit::BACKEND
}

/// The watchdog fired: say what it saw (the request, Tctl, the backend's last lines), SIGKILL
/// the backend, count the kill, stop the rest, exit 1.
async fn hung(
    index: usize,
    line: &str,
    backends: &[Backend],
    app: &Arc<App>,
    grace: Duration,
) -> i32 {
    app.set_status(Status::Failed(format!("the watchdog fired: {line}")));
    eprintln!("1bit serve: watchdog: {line}");
    let root = app.metrics.sysfs_root.clone();
    if let Ok(Some(t)) = tokio::task::spawn_blocking(move || metrics::tctl_celsius(&root)).await {
        eprintln!("1bit serve: watchdog: Tctl {t:.1} C");
    }
    if let Some(b) = backends.get(index) {
        let tail = b.tail();
        if !tail.is_empty() {
            eprintln!("1bit serve: watchdog: the backend's last lines:");
            for l in tail {
                eprintln!("1bit serve: watchdog: | {l}");
            }
        }
        b.signal(Signal::SIGKILL);
        if !supervisor::wait_exited(std::slice::from_ref(b), Duration::from_secs(5)).await {
            eprintln!(
                "1bit serve: watchdog: the {} backend (pid {}) did not die after SIGKILL (stuck in the kernel?); exiting anyway",
                b.spec.engine, b.pid
            );
        }
    }
    metrics::bump(&app.metrics.state, |c| c.watchdog_kills += 1).await;
    for said in supervisor::stop_all(backends, grace).await {
        eprintln!("1bit serve: {said}");
    }
    exit::BACKEND
}

/// Poll a backend's health route until it answers 200. Connection refused means it has not
/// bound yet, 503 that it is loading.
///
/// Asked every `READY_POLL`: a backoff up to 250 ms made serve ready up to 250 ms after its
/// backend was, and an answer from llama-server's HTTP thread while it loads costs it nothing.
async fn wait_ready(client: &BackendClient, backend: &Backend) {
    loop {
        if let Ok(200) = backend_status(client, backend.spec.port, &backend.spec.health_path).await
        {
            return;
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

async fn backend_status(client: &BackendClient, port: u16, path: &str) -> Result<u16, String> {
    let request = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let call = async {
        let reply = client.request(request).await.map_err(|e| e.to_string())?;
        let status = reply.status().as_u16();
        let _ = reply.into_body().collect().await;
        Ok(status)
    };
    tokio::time::timeout(HEALTH_TIMEOUT, call)
        .await
        .map_err(|_| format!("did not answer within {} s", HEALTH_TIMEOUT.as_secs_f64()))?
}

async fn backend_post(
    client: &BackendClient,
    backend: &Backend,
    path: &str,
    body: &serde_json::Value,
) -> Result<(), String> {
    let request = hyper::Request::post(format!("http://127.0.0.1:{}{path}", backend.spec.port))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let reply = client.request(request).await.map_err(|e| e.to_string())?;
    let status = reply.status();
    let _ = reply.into_body().collect().await;
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("status {status}"))
    }
}

/// Once ready, ask every backend's health route (each within 1.5 s) a quarter
/// second after the last round ended; `/health` reports what the route makes of the answers,
/// so it never waits on a backend itself. An exit is reported by the supervisor, not here.
async fn monitor_health(
    app: Arc<App>,
    client: BackendClient,
    route: LoadedRoute,
    backends: Vec<(u16, String)>,
) {
    loop {
        tokio::time::sleep(HEALTH_EVERY).await;
        let mut probe = HealthProbe::default();
        for (port, path) in &backends {
            probe
                .backends
                .push(match backend_status(&client, *port, path).await {
                    Ok(200) => BackendHealth {
                        ok: true,
                        reason: String::new(),
                    },
                    Ok(status) => BackendHealth {
                        ok: false,
                        reason: format!("the backend on port {port} answered {path} with {status}"),
                    },
                    Err(e) => BackendHealth {
                        ok: false,
                        reason: format!("the backend on port {port} {e} on {path}"),
                    },
                });
        }
        let verdict = {
            let route = route.clone();
            tokio::task::spawn_blocking(move || route.health(&probe)).await
        };
        let health = match verdict {
            Ok(Ok(h)) => h,
            Ok(Err(e)) => onebit_plugin_api::Health {
                ok: false,
                reason: format!("the route's health check failed: {e}"),
            },
            Err(e) => onebit_plugin_api::Health {
                ok: false,
                reason: format!("the route's health check failed: {e}"),
            },
        };
        let worker_down = crate::rpc::watch::down();
        if matches!(app.status(), Status::Down(_) | Status::Ready) {
            app.set_status(if let Some(why) = worker_down {
                Status::Down(why)
            } else if health.ok {
                Status::Ready
            } else {
                Status::Down(health.reason)
            });
        }
    }
}
