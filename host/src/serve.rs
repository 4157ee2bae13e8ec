//! `1bit serve`: plan with the chosen route, start its backends, serve until told to stop or
//! until a backend fails, and stop everything in order.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use onebit_plugin_api::{Plan, Started};

use crate::notify;
use crate::prepare::{Prepared, ServePlan, prepare};
use onebit_command::cli::ServeArgs;
use onebit_command::error::Fatal;
use onebit_features::guard::Guard;
use onebit_features::laya::start::RoutePlan;
use onebit_metrics as metrics;
use onebit_relay::front::accept::accept_loop;
use onebit_relay::front::drain::{Cut, Drain};
use onebit_relay::reply_loop::ReplySettings;
use onebit_relay::settings::{self, Settings};
use onebit_relay::traffic::Traffic;
use onebit_relay::{App, pool};
use onebit_supervision::backends::health::{
    self, ProbeClient, Status, StatusCell, backend_post, monitor_health, wait_ready,
};
use onebit_supervision::backends::idle_before_stop;
use onebit_supervision::backends::route_calls::{RouteCalls, install_host_services};
use onebit_supervision::backends::supervisor::{self, Backend};
use onebit_supervision::backends::watchdog::{self, Watchdog};
use onebit_supervision::run_dir;

mod shutdown;
mod start;
use shutdown::{Ended, Loading, StopBound, fail, impostor, port_taken, stop, worker_lost};

/// A client must send a request's headers within this long; `ONEBIT_HEADER_READ_TIMEOUT_S`
/// changes it.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long past the drain window a stop waits for the prompt cache's saves under way.
const SAVES_PAST_THE_WINDOW: Duration = Duration::from_millis(300);
/// How long past the drain window a stop waits for the backends to let go of the requests it
/// cut (llama-server looks once a second while it prefills, and half a second past the window
/// when a hog shares its cores): what is left of the stop's bound (`StopBound`) is the idle
/// backend's own stop, and a backend still running at the bound is killed.
const PAST_THE_WINDOW: Duration = Duration::from_millis(500);

/// How long the runtime's shutdown waits for blocking tasks still running.
const RUNTIME_SHUTDOWN: Duration = Duration::from_millis(200);

/// Run `1bit serve` and return its exit status.
pub fn run(mut args: ServeArgs) -> i32 {
    notify::open(args.under_lemonade);
    if let Err(fatal) =
        onebit_command::llama_server_cli::adopt_backend_ctx(&mut args.ctx_size, &args.backend_args)
    {
        return say_fatal(&fatal);
    }
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
            let (code, bound) = runtime.block_on(serve_plan(*prepared));
            // Blocking tasks still running (a route's busy `respond`, a stop sequence waiting on
            // a backend stuck in the kernel) are not waited for past a signal's stop bound.
            let wait = bound.map_or(RUNTIME_SHUTDOWN, |at| {
                at.saturating_duration_since(tokio::time::Instant::now())
                    .min(RUNTIME_SHUTDOWN)
            });
            runtime.shutdown_timeout(wait);
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

/// Serve `p` until told to stop or a failure: the exit status, and a signal's stop bound.
async fn serve_plan(p: ServePlan) -> (i32, Option<tokio::time::Instant>) {
    let ServePlan {
        args,
        route,
        plan,
        served_name,
        run_dir,
        pm,
        laya,
        api_key,
        mut prompt_cache,
        counters,
        held_ports,
        request,
        rpc_workers,
    } = p;
    let traffic = Traffic::new(onebit_relay::busy_poll::parse_budget(
        args.env.busy_poll_us.as_deref(),
    ));
    let (policy, more) = match laya {
        Some((policy, more)) => (Some(policy), more),
        None => (None, Vec::new()),
    };
    let mut placed: Vec<RoutePlan> = std::iter::once((route.clone(), plan)).chain(more).collect();
    // serve's own port is bound before any backend starts, so no start can take it.
    let listeners = match bind_all(&args).await {
        Ok(listeners) => listeners,
        Err(fatal) => return (say_fatal(&fatal), None),
    };
    notify::loading(&served_name, &placed[0].1.device);
    let guard = Guard::for_bind(&args.host);
    if !guard.loopback_bind && api_key.is_none() {
        warn_open(&args);
    }
    // The backends start before what serves requests is made, since a backend started again
    // on another port (start.rs) changes the ports it holds.
    let planned = start::Planned {
        placed: &mut placed,
        prompt_cache: &mut prompt_cache,
        request: &request,
    };
    let (started, stops) = match start::backends(&args, planned, held_ports, &run_dir).await {
        Ok(started) => started,
        Err(code) => return (code, None),
    };
    let plan = placed[0].1.clone();
    let all_backends: Vec<&onebit_plugin_api::BackendSpec> =
        placed.iter().flat_map(|(_, p)| &p.backends).collect();
    // serve's own calls (readiness, health, warm-ups, the watchdog's questions, the route's
    // host services, metrics) go on a client that never busy-polls; relayed requests do.
    let client = health::probe_client();
    let state = open_state(&plan, &served_name).await;
    let ports = all_backends.iter().map(|b| b.port).collect();
    let settings = Settings::new(&args, &plan, &served_name, ports, guard, api_key);
    let replies = Arc::new(ReplySettings::new(&settings, &counters));
    let app = Arc::new(App {
        settings,
        replies,
        status: Arc::new(StatusCell::new(Status::Loading)),
        client: pool::backend_client(&traffic),
        probes: client.clone(),
        forward_turn: Arc::new(tokio::sync::Mutex::new(())),
        route: RouteCalls {
            route: route.clone(),
        },
        watchdog: OnceLock::new(),
        metrics: metric_sources(state, &all_backends, counters, args.under_lemonade),
        pool: pool::BackendPool::new(&traffic),
        requests: Default::default(),
        pm: pm.map(|(experts, url)| {
            let pm =
                onebit_features::pm::Pm::new(experts, url, served_name.clone(), client.clone());
            tracing::info!("1bit serve: {}", pm.summary());
            Arc::new(pm)
        }),
        laya: policy.map(|policy| {
            let policy_file = args.route_policy.as_deref();
            Arc::new(onebit_features::laya::start::router(
                policy,
                &placed,
                policy_file,
            ))
        }),
        prompt_cache: prompt_cache.map(|setup| {
            let port = plan.backends[0].port;
            Arc::new(onebit_features::prompt_cache::PromptCache::new(
                setup,
                port,
                client.clone(),
            ))
        }),
        generations: Default::default(),
        traffic: traffic.clone(),
        rpc_workers,
    });
    install_host_services(
        tokio::runtime::Handle::current(),
        client.clone(),
        app.settings.ports.clone(),
    );

    onebit_supervision::heap_trim::start();
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(accept_loop(
        listeners,
        app.clone(),
        settings::env_secs(args.env.header_read_timeout_s.as_deref())
            .unwrap_or(HEADER_READ_TIMEOUT),
        shutdown_rx,
    ));

    let mut drain = Drain::new(
        shutdown_tx,
        server,
        Duration::from_secs_f64(args.drain_s),
        Duration::from_secs_f64(args.drain_notice_s),
        &traffic,
    );
    if let Some(cache) = app.prompt_cache.clone() {
        drain.before_cut(move || cache.cutting());
    }
    let (code, bound) =
        supervise(&args, &placed, &app, &client, (&mut drain, started, stops)).await;
    drain.finish().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    (code, bound)
}

/// The line for a serve reachable from other machines without a key.
fn warn_open(args: &ServeArgs) {
    let addr = format!("{}:{}", display_host(first_host(&args.host)), args.port);
    tracing::warn!(
        "1bit serve: warning: {addr} is reachable from other machines and no --api-key is set: anyone who can reach this port can use the model; pass --api-key KEY (or ONEBIT_API_KEY, or --api-key-file)"
    );
}

/// What `/metrics` reads besides the status: the state file, each backend's own series, the
/// machine's files, this run's counters, and the route's label.
fn metric_sources(
    state: Option<Arc<metrics::StateFile>>,
    backends: &[&onebit_plugin_api::BackendSpec],
    counters: metrics::Counters,
    under_lemonade: bool,
) -> metrics::Sources {
    metrics::Sources {
        state,
        backends: backends
            .iter()
            .map(|b| (b.port, b.metrics_path.clone()))
            .collect(),
        sysfs_root: metrics::sysfs_root(),
        counters,
        route_label: metrics::text::route_label(under_lemonade),
    }
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
    placed: &[RoutePlan],
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
/// stop them. `placed[0]` is the main plan (its rules are serve's). The exit status, and the
/// stop's bound when a signal stopped serve.
async fn supervise(
    args: &ServeArgs,
    placed: &[RoutePlan],
    app: &Arc<App>,
    client: &ProbeClient,
    (drain, started, stops): (&mut Drain, start::Started, start::Stops),
) -> (i32, Option<tokio::time::Instant>) {
    let plan = &placed[0].1;
    // Each backend's device, in serve's order, for what is said about it.
    let devices: Vec<String> = placed
        .iter()
        .flat_map(|(_, p)| p.backends.iter().map(|_| p.device.clone()))
        .collect();
    let start::Stops {
        term: mut sigterm,
        int: mut sigint,
    } = stops;
    let start::Started {
        backends,
        events_tx,
        mut events,
    } = started;
    let grace = stop_grace(args);
    let window = Duration::from_secs_f64(args.drain_s);
    arm_watchdog(args, &plan.device, &backends, app);

    // Loading: wait until every backend answers its health route, or fails, or we are told
    // to stop.
    let ready = async {
        for b in &backends {
            wait_ready(client, b).await;
        }
    };
    let signal = tokio::select! {
        _ = ready => None,
        event = events.recv() => {
            return (fail(event, Loading::Yes, &backends, app, &devices, grace).await, None);
        }
        _ = sigterm.recv() => Some("SIGTERM"),
        _ = sigint.recv() => Some("SIGINT"),
    };
    if let Some(what) = signal {
        let by = StopBound::from(tokio::time::Instant::now(), window);
        return (stop(&backends, grace, what, by).await, Some(by.at));
    }
    // What answered must be the backend serve started, not a process holding its port.
    if let Some(line) = impostor(&backends) {
        supervisor::stop_all(&backends, grace).await;
        return (say_fatal(&Fatal::backend(line)), None);
    }

    if let Err(code) = start_routes(placed, &backends, client, grace).await {
        return (code, None);
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

    app.rpc_workers.spawn();
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
        {
            let workers = app.rpc_workers.clone();
            move || workers.down()
        },
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
        _ = app.rpc_workers.lost() => Ended::WorkerLost,
    };
    let mut bound = None;
    let code = match ended {
        Ended::Backend(event) => fail(event, Loading::No, &backends, app, &devices, grace).await,
        Ended::Signal(what) => {
            let by = StopBound::from(tokio::time::Instant::now(), window);
            bound = Some(by.at);
            drained_stop(what, by, drain, app, &backends, grace).await
        }
        Ended::WorkerLost => worker_lost(&mut events, &backends, app, &devices, grace).await,
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
    (code, bound)
}

/// A signal while serving: the drain, the prompt cache's saves, the backends let go of what
/// was cut, then their stop; each step bounded so serve exits within `by` (docs/serve.md).
async fn drained_stop(
    what: &'static str,
    by: StopBound,
    drain: &mut Drain,
    app: &Arc<App>,
    backends: &[Backend],
    grace: Duration,
) -> i32 {
    let window = by.window();
    let stopping = by.signalled();
    notify::draining(what, window);
    let cut = drain.run(what).await;
    // The states of the replies that ended in the window are saved before the backend
    // stops; a save still running at its deadline is given up.
    if let Some(cache) = &app.prompt_cache {
        cache
            .settle(stopping + window + SAVES_PAST_THE_WINDOW)
            .await;
    }
    // A backend told to stop while it still serves a request serve closed waits on it
    // (llama-server: 30 s); it is stopped once it let go of them (`idle_before_stop`), or at
    // this wait's end (the backend's own stop follows, killed at the stop's bound).
    // Tool calls alone are ended by the stop itself, so it is not put off for them.
    if cut == Cut::Served {
        let ports: Vec<u16> = backends.iter().map(|b| b.spec.port).collect();
        let held =
            idle_before_stop::until_let_go(&ports, stopping + window + PAST_THE_WINDOW).await;
        if held > 0 {
            tracing::debug!("{held} cut connection(s) not yet closed by the backend");
        }
    }
    stop(backends, grace, what, by).await
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
