//! `1bit serve`: plan with the chosen route, start its backends, serve until told to stop or
//! until a backend fails, and stop everything in order.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nix::sys::signal::Signal;
use onebit_plugin_api::{Plan, Started};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc::unbounded_channel;

use crate::backends::health::{
    self, ProbeClient, Status, StatusCell, backend_post, monitor_health, wait_ready,
};
use crate::backends::port_owner;
use crate::backends::route_calls::{RouteCalls, install_host_services};
use crate::backends::supervisor::{self, Backend, Event};
use crate::backends::watchdog::{self, Watchdog};
use crate::cli::ServeArgs;
use crate::error::{Fatal, exit};
use crate::front::accept::accept_loop;
use crate::front::drain::Drain;
use crate::guard::Guard;
use crate::laya::start::Placed;
use crate::metrics;
use crate::notify;
use crate::prepare::{Prepared, ServePlan, prepare};
use crate::relay::{App, pool};
use crate::run_dir;
use crate::settings::{self, Settings};

/// A client must send a request's headers within this long; `ONEBIT_HEADER_READ_TIMEOUT_S`
/// changes it.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

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
    tracing::error!("1bit serve: {}", fatal.message);
    notify::exiting(&fatal.message);
    fatal.code
}

/// How long to wait for a backend to stop after SIGTERM: `ONEBIT_BACKEND_STOP_GRACE_S`, else 30 s.
fn stop_grace(args: &ServeArgs) -> Duration {
    let secs = args
        .env
        .backend_stop_grace_s
        .as_deref()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(30.0);
    Duration::from_secs_f64(secs)
}

async fn serve_plan(p: ServePlan) -> i32 {
    let ServePlan {
        args,
        route,
        plan,
        served_name,
        run_dir,
        pm,
        laya,
        api_key,
        prompt_cache,
    } = p;
    crate::relay::sse_keepalive::configure(args.sse_keepalive_s);
    crate::relay::busy_poll::configure(args.env.busy_poll_us.as_deref());
    let (policy, more) = match laya {
        Some((policy, more)) => (Some(policy), more),
        None => (None, Vec::new()),
    };
    let placed: Vec<Placed> = std::iter::once((route.clone(), plan.clone()))
        .chain(more)
        .collect();
    let all_backends: Vec<&onebit_plugin_api::BackendSpec> =
        placed.iter().flat_map(|(_, p)| &p.backends).collect();
    let listeners = match bind_all(&args).await {
        Ok(listeners) => listeners,
        Err(fatal) => return say_fatal(&fatal),
    };
    let addr = format!("{}:{}", display_host(first_host(&args.host)), args.port);
    if let Some(cors) = crate::guard::cors::Cors::from_args(&args) {
        crate::guard::cors::set(cors);
    }
    notify::loading(&served_name, &plan.device);
    let guard = Guard::for_bind(&args.host);
    if !guard.loopback_bind && api_key.is_none() {
        tracing::warn!(
            "1bit serve: warning: {addr} is reachable from other machines and no --api-key is set: anyone who can reach this port can use the model; pass --api-key KEY (or ONEBIT_API_KEY, or --api-key-file)"
        );
    }
    if let Err(fatal) = make_run_dir(&run_dir).await {
        return say_fatal(&fatal);
    }
    // serve's own calls (readiness, health, warm-ups, the watchdog's questions, the route's
    // host services, metrics) go on a client that never busy-polls; relayed requests do.
    let client = health::probe_client();
    let state = open_state(&plan, &served_name).await;
    let ports = all_backends.iter().map(|b| b.port).collect();
    let settings = Settings::new(&args, &plan, &served_name, ports, guard, api_key);
    let app = Arc::new(App {
        settings,
        status: Arc::new(StatusCell::new(Status::Loading)),
        client: pool::backend_client(),
        probes: client.clone(),
        forward_turn: Arc::new(tokio::sync::Mutex::new(())),
        route: RouteCalls {
            route: route.clone(),
        },
        watchdog: OnceLock::new(),
        metrics: metrics::Sources {
            state,
            backends: all_backends
                .iter()
                .map(|b| (b.port, b.metrics_path.clone()))
                .collect(),
            sysfs_root: metrics::sysfs_root(),
        },
        pool: Default::default(),
        requests: Default::default(),
        pm: pm.map(|(experts, url)| {
            let pm = crate::pm::Pm::new(experts, url, served_name.clone(), client.clone());
            tracing::info!("1bit serve: {}", pm.summary());
            Arc::new(pm)
        }),
        laya: policy.map(|policy| {
            let policy_file = args.route_policy.as_deref();
            Arc::new(crate::laya::start::router(policy, &placed, policy_file))
        }),
        prompt_cache: prompt_cache.map(|setup| {
            let port = plan.backends[0].port;
            Arc::new(crate::prompt_cache::PromptCache::new(
                setup,
                port,
                client.clone(),
            ))
        }),
    });
    install_host_services(
        tokio::runtime::Handle::current(),
        client.clone(),
        app.ports.clone(),
    );

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(accept_loop(
        listeners,
        app.clone(),
        settings::env_secs(args.env.header_read_timeout_s.as_deref())
            .unwrap_or(HEADER_READ_TIMEOUT),
        shutdown_rx,
    ));

    let mut drain = Drain::new(shutdown_tx, server, Duration::from_secs_f64(args.drain_s));
    let code = supervise(&args, &placed, &app, &client, &mut drain).await;
    drain.finish().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    code
}

/// A listener on each address of `--host` (llama-server's comma list) at `--port`.
async fn bind_all(args: &ServeArgs) -> Result<Vec<tokio::net::TcpListener>, Fatal> {
    // `--host` may list addresses (llama-server's comma list): each is bound.
    let mut listeners = Vec::new();
    for host in args
        .host
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
    {
        let addr = format!("{}:{}", display_host(host), args.port);
        match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => listeners.push(l),
            Err(e) => {
                return Err(Fatal::backend(format!(
                    "cannot listen on {addr} ({e}); pass another --port or --host"
                )));
            }
        }
    }
    if listeners.is_empty() {
        return Err(Fatal::usage(format!(
            "--host {:?} names no address; pass one such as 127.0.0.1",
            args.host
        )));
    }
    Ok(listeners)
}

/// serve's temporary folder, made after removing those of serves that are gone.
async fn make_run_dir(run_dir: &Path) -> Result<(), Fatal> {
    if let Some(tmp) = run_dir.parent() {
        let tmp = tmp.to_path_buf();
        let removed =
            tokio::task::spawn_blocking(move || run_dir::remove_stale(&tmp, Path::new("/proc")))
                .await
                .unwrap_or_default();
        for dir in removed {
            tracing::info!(
                "1bit serve: removed {}, left by a serve that is gone",
                dir.display()
            );
        }
    }
    if let Err(e) = std::fs::create_dir_all(run_dir) {
        return Err(Fatal::backend(format!(
            "cannot create {} ({e})",
            run_dir.display()
        )));
    }
    Ok(())
}

/// The state file's counters for this model, a serve start counted (none for a plan
/// without backends).
async fn open_state(plan: &Plan, served_name: &str) -> Option<Arc<metrics::StateFile>> {
    if plan.backends.is_empty() {
        None
    } else {
        let name = served_name.to_string();
        tokio::task::spawn_blocking(move || {
            let dir = metrics::state_dir()?;
            let state = metrics::StateFile::open(&dir, &name);
            state.bump(|c| c.serve_starts += 1);
            Some(Arc::new(state))
        })
        .await
        .ok()
        .flatten()
    }
}

/// Every plan's backends started in serve's order, each with its line; on a failure, those
/// started are stopped and the exit status is returned.
async fn spawn_backends(
    args: &ServeArgs,
    placed: &[Placed],
    devices: &[String],
    events_tx: &tokio::sync::mpsc::UnboundedSender<Event>,
) -> Result<Vec<Backend>, i32> {
    let mut backends: Vec<Backend> = Vec::new();
    let specs = placed
        .iter()
        .flat_map(|(route, plan)| plan.backends.iter().map(move |spec| (route, spec)));
    for (index, (route, spec)) in specs.enumerate() {
        tracing::info!(
            "1bit serve: starting {} on the {} route (port {}): {}",
            spec.engine,
            devices[index],
            spec.port,
            spec.argv.join(" ")
        );
        match supervisor::spawn(index, spec, route, events_tx.clone()) {
            Ok(b) => backends.push(b),
            Err(e) => {
                let program = spec.argv.first().map(String::as_str).unwrap_or("");
                supervisor::stop_all(&backends, stop_grace(args)).await;
                return Err(say_fatal(&Fatal::backend(format!(
                    "could not start {} ({program}): {e}",
                    spec.engine
                ))));
            }
        }
    }
    Ok(backends)
}

/// The progress watchdog over every backend, unless `--watchdog 0` turns it off.
fn arm_watchdog(args: &ServeArgs, device: &str, backends: &[Backend], app: &App) {
    let limit = watchdog::limit_secs(args.watchdog, args.env.watchdog_secs.as_deref());
    if limit > 0 {
        let dog = Watchdog::new(
            Duration::from_secs(limit),
            args.watchdog_prompt_tps
                .unwrap_or(watchdog::DEFAULT_PROMPT_TPS),
            device,
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
}

/// Each route told its backends are up (`DeviceRoute::start`), then its plan's warm-ups; a
/// route that fails to start stops every backend, and the exit status is returned.
async fn start_routes(
    placed: &[Placed],
    backends: &[Backend],
    client: &ProbeClient,
    grace: Duration,
) -> Result<(), i32> {
    let mut first = 0;
    for (route, plan) in placed {
        let mine = &backends[first..first + plan.backends.len()];
        let started = Started {
            plan: plan.clone(),
            pids: mine.iter().map(|b| b.pid).collect(),
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
            supervisor::stop_all(backends, grace).await;
            return Err(say_fatal(&Fatal::backend(format!(
                "the {} route failed to start: {e}",
                plan.device
            ))));
        }
        for warmup in &plan.warmups {
            if let Err(e) = backend_post(client, &mine[0], &warmup.path, &warmup.body).await {
                tracing::info!("1bit serve: warm-up {} failed: {e}", warmup.path);
            }
        }
        first += plan.backends.len();
    }
    Ok(())
}

/// Start the backends of every plan, wait for them, serve until a signal or a failure, then
/// stop them. `placed[0]` is the main plan (its rules are serve's).
async fn supervise(
    args: &ServeArgs,
    placed: &[Placed],
    app: &Arc<App>,
    client: &ProbeClient,
    drain: &mut Drain,
) -> i32 {
    let plan = &placed[0].1;
    // Each backend's device, in serve's order, for what is said about it.
    let devices: Vec<String> = placed
        .iter()
        .flat_map(|(_, p)| p.backends.iter().map(|_| p.device.clone()))
        .collect();
    let (Ok(mut sigterm), Ok(mut sigint)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return say_fatal(&Fatal::backend("cannot install signal handlers"));
    };
    let (events_tx, mut events) = unbounded_channel();
    crate::prepare::release_ports();
    let backends = match spawn_backends(args, placed, &devices, &events_tx).await {
        Ok(backends) => backends,
        Err(code) => return code,
    };
    let grace = stop_grace(args);
    arm_watchdog(args, &plan.device, &backends, app);

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
            return fail(event, Loading::Yes, &backends, app, &devices, grace).await;
        }
        _ = sigterm.recv() => return stop(&backends, grace, "SIGTERM").await,
        _ = sigint.recv() => return stop(&backends, grace, "SIGINT").await,
    }
    // What answered must be the backend serve started, not a process holding its port.
    if let Some(line) = impostor(&backends) {
        supervisor::stop_all(&backends, grace).await;
        return say_fatal(&Fatal::backend(line));
    }

    if let Err(code) = start_routes(placed, &backends, client, grace).await {
        return code;
    }
    if let Some(cache) = &app.prompt_cache {
        cache.open().await;
    }
    app.set_status(Status::Ready);
    let url = format!(
        "http://{}:{}",
        display_host(first_host(&args.host)),
        args.port
    );
    tracing::info!("1bit serve: ready on {url}");
    notify::ready(&app.settings.served_name, &url, &plan.device);
    let pings = notify::spawn_watchdog(app.status.clone());

    crate::rpc::watch::spawn();
    let mut watched = Vec::new();
    let mut first = 0;
    for (route, plan) in placed {
        let ports = backends[first..first + plan.backends.len()]
            .iter()
            .map(|b| (b.spec.port, b.spec.health_path.clone()))
            .collect();
        watched.push((route.clone(), ports));
        first += plan.backends.len();
    }
    let monitor = tokio::spawn(monitor_health(
        app.status.clone(),
        client.clone(),
        watched,
        // An RPC worker that stopped answering downs the backend that holds layers on it.
        crate::rpc::watch::down,
    ));
    let dog = app
        .watchdog
        .get()
        .map(|dog| tokio::spawn(dog.clone().run(client.clone(), events_tx.clone())));
    let ended = tokio::select! {
        event = events.recv() => Ended::Backend(event),
        _ = sigterm.recv() => Ended::Signal("SIGTERM"),
        _ = sigint.recv() => Ended::Signal("SIGINT"),
        line = port_taken(&backends) => Ended::PortTaken(line),
    };
    let code = match ended {
        Ended::Backend(event) => fail(event, Loading::No, &backends, app, &devices, grace).await,
        Ended::Signal(what) => {
            notify::draining(what, Duration::from_secs_f64(args.drain_s));
            drain.run(what).await;
            // The states of the replies just ended are saved before the backend stops.
            if let Some(cache) = &app.prompt_cache {
                cache.settle().await;
            }
            stop(&backends, grace, what).await
        }
        Ended::PortTaken(line) => {
            app.set_status(Status::Failed(line.clone()));
            supervisor::stop_all(&backends, grace).await;
            say_fatal(&Fatal::backend(line))
        }
    };
    monitor.abort();
    for task in [dog, pings].into_iter().flatten() {
        task.abort();
    }
    code
}

/// The first address of a `--host` list, the one serve's lines name.
fn first_host(hosts: &str) -> &str {
    hosts
        .split(',')
        .map(str::trim)
        .find(|h| !h.is_empty())
        .unwrap_or(hosts)
}

fn display_host(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

/// The line to exit 1 with when another process, not the backend, listens on a backend's port
/// (port_owner.rs); None when each port is its backend's or cannot be judged.
fn impostor(backends: &[Backend]) -> Option<String> {
    let held: Vec<Held> = backends.iter().map(Held::of).collect();
    impostor_among(&held)
}

/// What the port check needs of a backend, owned so the check can run on a blocking thread.
#[derive(Clone)]
struct Held {
    engine: String,
    port: u16,
    pid: u32,
}

impl Held {
    fn of(b: &Backend) -> Held {
        Held {
            engine: b.spec.engine.clone(),
            port: b.spec.port,
            pid: b.pid,
        }
    }
}

fn impostor_among(held: &[Held]) -> Option<String> {
    held.iter().find_map(
        |b| match port_owner::listener(Path::new("/proc"), b.port, b.pid) {
            port_owner::Listener::Other(owner) => {
                Some(port_owner::impostor_line(&b.engine, b.port, &owner))
            }
            port_owner::Listener::Backend | port_owner::Listener::Unknown => None,
        },
    )
}

/// Why serving ended.
enum Ended {
    /// A backend exited, or the route asked to stop.
    Backend(Option<Event>),
    /// SIGTERM or SIGINT.
    Signal(&'static str),
    /// Another process answers on a backend's port (`impostor`'s line).
    PortTaken(String),
}

/// How often, while serving, the backends' ports are checked again for another process.
const PORT_RECHECK: Duration = Duration::from_secs(2);

/// While serving: every [`PORT_RECHECK`], whether each backend's port is still held by the
/// backend serve started (a backend that closed its listener and a process that took the
/// port over, or a restarted engine that is not serve's). Resolves with `impostor`'s line.
/// The /proc reads run on a blocking thread, never on a thread that relays.
async fn port_taken(backends: &[Backend]) -> String {
    let held: Vec<Held> = backends.iter().map(Held::of).collect();
    loop {
        tokio::time::sleep(PORT_RECHECK).await;
        let checked = held.clone();
        if let Ok(Some(line)) = tokio::task::spawn_blocking(move || impostor_among(&checked)).await
        {
            return line;
        }
    }
}

/// A signal: stop the backends in order and exit cleanly.
async fn stop(backends: &[Backend], grace: Duration, what: &str) -> i32 {
    tracing::info!("1bit serve: {what}: stopping");
    notify::exiting(&format!("{what}: stopping the backends"));
    for line in supervisor::stop_all(backends, grace).await {
        tracing::info!("1bit serve: {line}");
    }
    exit::OK
}

/// Whether the backends were still loading (not yet all ready) when one failed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Loading {
    Yes,
    No,
}

/// The line after a backend's crash line when it crashed while loading: a SIGSEGV or SIGILL
/// there is what a llama.cpp build that does not suit this CPU does (AMX, or a cache built on
/// another machine; docs/setup.md).
fn crash_at_load_hint(signal: Option<Signal>, program: &str) -> Option<String> {
    let signal = signal.filter(|signal| matches!(signal, Signal::SIGSEGV | Signal::SIGILL))?;
    Some(format!(
        "{program} crashed with {} before it was ready, which is what a llama.cpp build that does not suit this CPU does: rebuild it on this machine (`cargo xtask setup` rebuilds the one it installed; docs/setup.md) or pass --llama-server a build made here",
        signal.as_str()
    ))
}

/// A backend exited or the route asked to stop: say so, stop the rest, exit 1.
async fn fail(
    event: Option<Event>,
    loading: Loading,
    backends: &[Backend],
    app: &Arc<App>,
    devices: &[String],
    grace: Duration,
) -> i32 {
    let device = |index: usize| devices.get(index).map(String::as_str).unwrap_or("");
    let mut hint = None;
    let message = match event {
        Some(Event::Exited { index, how, signal }) => {
            let b = &backends[index];
            if loading == Loading::Yes {
                let program = b.spec.argv.first().map_or(b.spec.engine.as_str(), |p| {
                    std::path::Path::new(p)
                        .file_name()
                        .and_then(|name| name.to_str())
                        .unwrap_or(p)
                });
                hint = crash_at_load_hint(signal, program);
            }
            let last = b
                .tail()
                .pop()
                .map(|l| format!(" (its last line: {})", l.trim()))
                .unwrap_or_default();
            metrics::bump(&app.metrics.state, |c| c.backend_exits += 1).await;
            format!(
                "the {} backend ({}, port {}, pid {}) {how}{last}; exiting",
                device(index),
                b.spec.engine,
                b.spec.port,
                b.pid
            )
        }
        Some(Event::Hung { index, line }) => {
            return hung(index, &line, backends, app, grace).await;
        }
        Some(Event::RouteStop { index, reason }) => {
            if let Some(b) = backends.get(index) {
                b.signal(Signal::SIGKILL);
            }
            format!(
                "{reason}; killing the {} backend and exiting",
                device(index)
            )
        }
        None => "the backends' event channel closed; exiting".to_string(),
    };
    let message = match tokio::task::spawn_blocking(crate::rpc::watch::name_lost).await {
        Ok(Some(lost)) => format!(
            "{lost}: the {} backend cannot go on without the layers it held; {message}",
            device(0)
        ),
        _ => message,
    };
    app.set_status(Status::Failed(message.clone()));
    tracing::error!("1bit serve: {message}");
    if let Some(hint) = hint {
        tracing::info!("1bit serve: {hint}");
    }
    notify::exiting(&message);
    for line in supervisor::stop_all(backends, grace).await {
        tracing::info!("1bit serve: {line}");
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
    tracing::error!("1bit serve: watchdog: {line}");
    notify::exiting(&format!("the watchdog fired: {line}"));
    let root = app.metrics.sysfs_root.clone();
    if let Ok(Some(t)) = tokio::task::spawn_blocking(move || metrics::tctl_celsius(&root)).await {
        tracing::info!("1bit serve: watchdog: Tctl {t:.1} C");
    }
    if let Some(b) = backends.get(index) {
        let tail = b.tail();
        if !tail.is_empty() {
            tracing::info!("1bit serve: watchdog: the backend's last lines:");
            for l in tail {
                tracing::info!("1bit serve: watchdog: | {l}");
            }
        }
        b.signal(Signal::SIGKILL);
        if !supervisor::wait_exited(std::slice::from_ref(b), Duration::from_secs(5)).await {
            tracing::info!(
                "1bit serve: watchdog: the {} backend (pid {}) did not die after SIGKILL (stuck in the kernel?); exiting anyway",
                b.spec.engine,
                b.pid
            );
        }
    }
    metrics::bump(&app.metrics.state, |c| c.watchdog_kills += 1).await;
    for said in supervisor::stop_all(backends, grace).await {
        tracing::info!("1bit serve: {said}");
    }
    exit::BACKEND
}
