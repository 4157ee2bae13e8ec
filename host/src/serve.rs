//! `1bit serve`: plan with the chosen route, start its backends, serve until told to stop or
//! until a backend fails, and stop everything in order.

use std::collections::BTreeMap;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{
    Plan, PlanOutcome, PlanRequest, Purpose, RouteOption, ServeOptions, Started,
};
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
use crate::guard::key::ApiKey;
use crate::laya::start::Placed;
use crate::relay::{App, pool};
use crate::settings::{self, Settings};
use crate::{admission, llama_server_cli, metrics, model, routes};

/// A client must send a request's headers within this long; `ONEBIT_HEADER_READ_TIMEOUT_S`
/// changes it.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Ports Lemonade scans for its own servers; backends never take one.
const LEMONADE_PORTS: std::ops::RangeInclusive<u16> = 8001..=9000;

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
    /// `--pm`: the checked experts file and Lemonade's address.
    pm: Option<(crate::pm::Experts, crate::pm::LemonadeUrl)>,
    /// `--laya`: the policy, and the plans of the other devices it can pick (their backends
    /// follow `plan`'s in serve's order).
    laya: Option<(crate::laya::Policy, Vec<Placed>)>,
    api_key: Option<ApiKey>,
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
    let api_key = ApiKey::from_args(args.api_key.as_deref(), args.api_key_file.as_deref())
        .map_err(Fatal::usage)?;
    if !(args.drain_s.is_finite() && (0.0..=3600.0).contains(&args.drain_s)) {
        return Err(Fatal::usage(format!(
            "--drain-s {}: not a number of seconds from 0 to 3600; pass one such as 3",
            args.drain_s
        )));
    }
    if printing && let Some(flag) = args.needs_serve_in_path() {
        return Err(needs_serve(flag.to_string()));
    }
    let pm = crate::pm::start::settings(args)?;
    let policy = crate::laya::start::settings(args)?;
    let route_options = route_options(args)?;
    let facts = model::facts(&args.model)?;
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
            llama_server: args
                .llama_server
                .clone()
                .or_else(llama_server_cli::installed_beside),
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
            args: args.command_line.clone(),
            route_options,
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
    if !request.options.route_options.is_empty() && !takes_route_options(route) {
        let flag = &request.options.route_options[0].flag;
        return Err(Fatal::usage(format!(
            "{flag}: the {} route was built against route ABI {}, which takes no route options; remove {flag} or rebuild the route against onebit-plugin-api 1.2 or later",
            route.info.name, route.abi_version
        )));
    }
    let plan = match route.plan(&request) {
        Ok(PlanOutcome::Plan(plan)) => plan,
        Ok(PlanOutcome::Refused(refusal)) => {
            return Err(Fatal {
                code: refusal.exit_status(),
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
    // --laya: the device --device auto chose is one candidate; every other device the policy
    // names is planned too, and the memory check counts them together.
    let (route, mut plan, mut laya) = match policy {
        Some(policy) => {
            let auto = (route.clone(), plan);
            let (first, more) =
                crate::laya::start::plans(&policy, &loaded, &request, auto, reserve_ports)?;
            (first.0, first.1, Some((policy, more)))
        }
        None => (route.clone(), plan, None),
    };
    // The drop-in's llama-server arguments reach every plan's llama-server (one per device
    // with --laya).
    let more = laya.iter_mut().flat_map(|(_, more)| more.iter_mut());
    for each in std::iter::once(&mut plan).chain(more.map(|(_, p)| p)) {
        llama_server_cli::pass_to_backend(each, &args.backend_args)?;
        llama_server_cli::refuse_self(each)?;
        llama_server_cli::align_rules(each, &args.backend_args);
    }
    if pm.is_some() {
        crate::pm::start::check_plan(&plan)?;
    }
    let checked = match &laya {
        Some((_, more)) => crate::laya::start::needs_together(&plan, more),
        None => plan.clone(),
    };

    let workers = crate::rpc::before_start(args, &plan)?;
    if let Some(code) = crate::rpc::split::admit(args, &served_name, &plan, &workers)? {
        return Ok(Prepared::Exit(code));
    }
    if args.mem_check {
        return Ok(Prepared::Exit(mem_check(args, &served_name, &checked)?));
    }
    if workers.is_empty() && !admission::skipped(args.no_mem_check) {
        admit(args, &served_name, &checked)?;
    }
    if let Some((_, more)) = &laya {
        for (_, other) in more {
            plan.notes.extend(other.notes.iter().cloned());
        }
    }
    for note in &plan.notes {
        eprintln!("1bit serve: {note}");
    }
    if printing {
        return print_backend(args, &plan).map(Prepared::Exit);
    }
    Ok(Prepared::Serve(Box::new(ServePlan {
        args: args.clone(),
        route,
        plan,
        served_name,
        run_dir,
        pm,
        laya,
        api_key,
    })))
}

/// `--route-opt` and `--npu-opt` as the pairs a route gets, in order; a value without `=` is
/// refused in one line.
fn route_options(args: &ServeArgs) -> Result<Vec<RouteOption>, Fatal> {
    let given = args
        .route_opt
        .iter()
        .map(|o| ("--route-opt", o))
        .chain(args.npu_opt.iter().map(|o| ("--npu-opt", o)));
    let mut options = Vec::new();
    for (flag, option) in given {
        match option.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => options.push(RouteOption {
                flag: flag.to_string(),
                key: key.trim().to_string(),
                value: value.to_string(),
            }),
            _ => {
                return Err(Fatal::usage(format!(
                    "{flag} {option}: not KEY=VALUE; pass it as {flag} KEY=VALUE"
                )));
            }
        }
    }
    Ok(options)
}

/// Whether the route reads route options: built against ABI 1.2 or later (an older route
/// would ignore them without a word).
fn takes_route_options(route: &LoadedRoute) -> bool {
    semver::Version::parse(&route.abi_version).is_ok_and(|v| v >= semver::Version::new(1, 2, 0))
}

/// A flag this build parses but refuses on every route, as the one line serve exits 2 with.
fn refused_flag(args: &ServeArgs) -> Option<Fatal> {
    if let Some(flag) = args.refused_in_this_build() {
        return Some(Fatal::usage(format!(
            "{flag} is not available in this build: the expert streamer lived in the removed Vulkan llama.cpp pin and moves to HRX together with Qwen3.8-Flash-Next; remove {flag}"
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
    if let Some(why) = &plan.memory_unknown {
        println!("{}", admission::unknown_line(name, why));
        return Ok(exit::OK);
    }
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
    if let Some(why) = &plan.memory_unknown {
        eprintln!(
            "1bit serve: warning: {}",
            admission::unknown_line(name, why)
        );
        return Ok(());
    }
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
            let what = if plan.serve_in_path.is_empty() {
                format!("--device {}", plan.device)
            } else {
                plan.serve_in_path.clone()
            };
            return Err(Fatal {
                code: exit::NEEDS_SERVE,
                message: format!(
                    "--print-backend: {what} needs 1bit serve in the request path; run 1bit serve itself"
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
    } = p;
    crate::relay::sse_keepalive::configure(args.sse_keepalive_s);
    let (policy, more) = match laya {
        Some((policy, more)) => (Some(policy), more),
        None => (None, Vec::new()),
    };
    let placed: Vec<Placed> = std::iter::once((route.clone(), plan.clone()))
        .chain(more)
        .collect();
    let all_backends: Vec<&onebit_plugin_api::BackendSpec> =
        placed.iter().flat_map(|(_, p)| &p.backends).collect();
    let addr = format!("{}:{}", args.host, args.port);
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(l) => l,
        Err(e) => {
            return say_fatal(&Fatal::backend(format!(
                "cannot listen on {addr} ({e}); pass another --port or --host"
            )));
        }
    };
    let guard = Guard::for_bind(&args.host);
    if !guard.loopback_bind && api_key.is_none() {
        eprintln!(
            "1bit serve: warning: {addr} is reachable from other machines and no --api-key is set: anyone who can reach this port can use the model; pass --api-key KEY (or ONEBIT_API_KEY, or --api-key-file)"
        );
    }
    if let Err(e) = std::fs::create_dir_all(&run_dir) {
        return say_fatal(&Fatal::backend(format!(
            "cannot create {} ({e})",
            run_dir.display()
        )));
    }
    // serve's own calls (readiness, health, warm-ups, the watchdog's questions, the route's
    // host services, metrics) go on a client that never busy-polls; relayed requests do.
    let client = health::probe_client();
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
    let settings = Settings {
        served_name: served_name.clone(),
        device: plan.device.clone(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        rules: plan.rules.clone(),
        ports: all_backends.iter().map(|b| b.port).collect(),
        body_limit: env_number("ONEBIT_MAX_BODY_BYTES")
            .filter(|n| *n >= 1.0)
            .map(|n| n as usize)
            .unwrap_or(settings::DEFAULT_BODY_LIMIT),
        body_timeout: env_secs("ONEBIT_BODY_READ_TIMEOUT_S")
            .unwrap_or(settings::DEFAULT_BODY_TIMEOUT),
        guard,
        api_key,
        side_models: plan.side_models.clone(),
        rename_in_streams: plan.rename_in_streams,
        precise: args.precise || std::env::var("ONEBIT_PRECISE").is_ok_and(|v| v.trim() == "1"),
        serialize_forwards: plan.serialize_forwards,
    };
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
            eprintln!("1bit serve: {}", pm.summary());
            Arc::new(pm)
        }),
        laya: policy.map(|policy| {
            let policy_file = args.route_policy.as_deref();
            Arc::new(crate::laya::start::router(policy, &placed, policy_file))
        }),
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

    let mut drain = Drain::new(shutdown_tx, server, Duration::from_secs_f64(args.drain_s));
    let code = supervise(&args, &placed, &app, &client, &mut drain).await;
    drain.finish().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    code
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
    let mut backends: Vec<Backend> = Vec::new();
    let specs = placed
        .iter()
        .flat_map(|(route, plan)| plan.backends.iter().map(move |spec| (route, spec)));
    for (index, (route, spec)) in specs.enumerate() {
        eprintln!(
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
            return fail(event, &backends, app, &devices, grace).await;
        }
        _ = sigterm.recv() => return stop(&backends, grace, "SIGTERM").await,
        _ = sigint.recv() => return stop(&backends, grace, "SIGINT").await,
    }
    // What answered must be the backend serve started, not a process holding its port.
    if let Some(line) = impostor(&backends) {
        supervisor::stop_all(&backends, grace).await;
        return say_fatal(&Fatal::backend(line));
    }

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
            supervisor::stop_all(&backends, grace).await;
            return say_fatal(&Fatal::backend(format!(
                "the {} route failed to start: {e}",
                plan.device
            )));
        }
        for warmup in &plan.warmups {
            if let Err(e) = backend_post(client, &mine[0], &warmup.path, &warmup.body).await {
                eprintln!("1bit serve: warm-up {} failed: {e}", warmup.path);
            }
        }
        first += plan.backends.len();
    }
    app.set_status(Status::Ready);
    eprintln!(
        "1bit serve: ready on http://{}:{}",
        display_host(&args.host),
        args.port
    );

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
    let signal = tokio::select! {
        event = events.recv() => Err(event),
        _ = sigterm.recv() => Ok("SIGTERM"),
        _ = sigint.recv() => Ok("SIGINT"),
    };
    let code = match signal {
        Err(event) => fail(event, &backends, app, &devices, grace).await,
        Ok(what) => {
            drain.run(what).await;
            stop(&backends, grace, what).await
        }
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

/// The line to exit 1 with when another process, not the backend, listens on a backend's port
/// (port_owner.rs); None when each port is its backend's or cannot be judged.
fn impostor(backends: &[Backend]) -> Option<String> {
    backends.iter().find_map(|b| {
        match port_owner::listener(Path::new("/proc"), b.spec.port, b.pid) {
            port_owner::Listener::Other(owner) => Some(port_owner::impostor_line(
                &b.spec.engine,
                b.spec.port,
                &owner,
            )),
            port_owner::Listener::Backend | port_owner::Listener::Unknown => None,
        }
    })
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
    devices: &[String],
    grace: Duration,
) -> i32 {
    let device = |index: usize| devices.get(index).map(String::as_str).unwrap_or("");
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
