//! Everything before a process starts: the flags checked, the model's facts, the route chosen
//! and its plan made, the memory check, `--mem-check` and `--print-backend`. Pure but for
//! reading files and reserving ports; `serve.rs` runs what this decides.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{Plan, PlanOutcome, PlanRequest, Purpose, RouteOption, ServeOptions};

use crate::ports::{self, HeldPorts};
use crate::routes;
use laya::start::RoutePlan;
use onebit_command::cli::ServeArgs;
use onebit_command::error::{Fatal, exit};
use onebit_command::{llama_server_cli, model};
use onebit_features::guard::key::ApiKey;
use onebit_features::{laya, pm, prompt_cache};
use onebit_supervision::{admission, rpc, run_dir};

/// What serve calls the served model in router mode, where llama-server names each model itself
/// (systemd's status line, the backend's lines).
pub const ROUTER_NAME: &str = "llama-server's router";

/// What `prepare` settled: exit now with a status (`--mem-check`, `--print-backend`), or serve.
pub enum Prepared {
    Exit(i32),
    Serve(Box<ServePlan>),
}

/// What serve runs: the route, its plan and what serve was asked around it.
pub struct ServePlan {
    pub args: ServeArgs,
    pub route: LoadedRoute,
    pub plan: Plan,
    pub served_name: String,
    pub run_dir: PathBuf,
    /// `--pm`: the checked experts file and Lemonade's address.
    pub pm: Option<(pm::Experts, pm::LemonadeUrl)>,
    /// `--laya`: the policy (and `--laya-model`'s daemon), and the plans of the other devices
    /// it can pick (their backends follow `plan`'s in serve's order).
    pub laya: Option<(laya::start::Settled, Vec<RoutePlan>)>,
    pub api_key: Option<ApiKey>,
    /// The persistent prompt cache of backend 0, when this serve keeps one.
    pub prompt_cache: Option<prompt_cache::Setup>,
    /// serve's own counters for this run (`/metrics`); the Laya daemon counts into them from
    /// its start.
    pub counters: onebit_metrics::Counters,
    /// The backends' loopback ports, held until they are about to start.
    pub held_ports: HeldPorts,
    /// What the route planned with, for [`replan`].
    pub request: PlanRequest,
    /// `--rpc`'s workers, watched while serve runs (empty without the flag).
    pub rpc_workers: rpc::watch::Workers,
}

/// Everything before a process starts: the flags, the model, the route, the plan.
pub fn prepare(args: &ServeArgs) -> Result<Prepared, Fatal> {
    let printing = args.print_backend || args.print_backend_env;
    let api_key = checked_flags(args, printing)?;
    let pm = pm::start::settings(args)?;
    let policy = laya::start::settings(args)?;
    let route_options = route_options(args)?;
    if args.llama_router && printing {
        return Err(needs_serve("router mode (no -m)".to_string()));
    }
    let facts = if args.llama_router {
        onebit_plugin_api::ModelFacts::default()
    } else {
        model::facts(args.model())?
    };
    if printing && facts.is_dir {
        return Err(needs_serve(format!(
            "the model directory {}",
            args.model().display()
        )));
    }
    let served_name = if args.llama_router {
        ROUTER_NAME.to_string()
    } else {
        model::served_name(args.model(), args.alias.as_deref())
    };

    let (loaded, unusable) = routes::loaded(
        routes::discover(&routes::search_dirs(&args.plugin_dir)),
        &args.device,
    );

    let held_ports = HeldPorts::default();
    let ports = if printing {
        vec![args.port]
    } else {
        ports::reserve(&held_ports, 4, args.port)?
    };
    let run_dir = run_dir::for_this_serve(&std::env::temp_dir());
    let request = PlanRequest {
        purpose: if printing {
            Purpose::PrintBackend
        } else if args.mem_check {
            Purpose::MemCheck
        } else {
            Purpose::Serve
        },
        options: serve_options(args, &served_name, route_options),
        model: facts,
        env: environment(),
        ports,
        run_dir: run_dir.to_string_lossy().into_owned(),
        ..PlanRequest::default()
    };

    let refused_flag = refused_flag(args);
    let device = device_of(args)?;
    let route = chosen(
        device,
        (&loaded, &unusable),
        &request,
        refused_flag.is_none(),
    )?;
    route_can_take(route, &request.options.route_options)?;
    let plan = planned(route, &request)?;
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
            let (first, more) = laya::start::plans(&policy, &loaded, &request, auto, |n| {
                ports::reserve(&held_ports, n, args.port)
            })?;
            (first.0, first.1, Some((policy, more)))
        }
        None => (route.clone(), plan, None),
    };
    finish_plans(args, &mut plan, &mut laya)?;
    if pm.is_some() {
        pm::start::check_plan(&plan)?;
    }
    let checked = match &laya {
        Some((_, more)) => laya::start::needs_together(&plan, more),
        None => plan.clone(),
    };

    let workers = rpc::before_start(args, &plan)?;
    if let Some(code) = rpc::split::admit(args, &served_name, &plan, &workers)? {
        return Ok(Prepared::Exit(code));
    }
    if args.mem_check {
        return Ok(Prepared::Exit(mem_check(args, &served_name, &checked)?));
    }
    if args.llama_router {
        tracing::info!(
            "1bit serve: router mode (no -m): llama-server loads the models it is asked for itself; serve's memory check, progress watchdog and backend metrics do not apply"
        );
    } else if workers.is_empty() && !admission::skipped(args.no_mem_check, args.env.no_mem_check())
    {
        admit(args, &served_name, &checked)?;
    }
    say_notes(&mut plan, laya.as_ref().map(|(_, more)| more.as_slice()));
    if printing {
        return print_backend(args, &plan).map(Prepared::Exit);
    }
    let prompt_cache = prompt_cache::start::setup(args, &mut plan)?;
    let counters = onebit_metrics::Counters::default();
    if let Some((settled, _)) = &mut laya {
        laya::start::start_scorer(settled, args, &counters)?;
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
        prompt_cache,
        counters,
        held_ports,
        request,
        rpc_workers: rpc::watch::Workers::watching(&workers),
    })))
}

/// The plan's notes, with those of the other devices `--laya` can pick, each said as a line.
fn say_notes(plan: &mut Plan, more: Option<&[RoutePlan]>) {
    for (_, other) in more.unwrap_or_default() {
        plan.notes.extend(other.notes.iter().cloned());
    }
    for note in &plan.notes {
        tracing::info!("1bit serve: {note}");
    }
}

/// Every plan (one per device with --laya): llama.cpp's KV sized where the plan asks the host
/// to, the drop-in's llama-server arguments passed to its llama-server, and each backend run as
/// `--backend-standin`'s program when given.
fn finish_plans(
    args: &ServeArgs,
    plan: &mut Plan,
    laya: &mut Option<(laya::start::Settled, Vec<RoutePlan>)>,
) -> Result<(), Fatal> {
    let more = laya.iter_mut().flat_map(|(_, more)| more.iter_mut());
    for each in std::iter::once(plan).chain(more.map(|(_, p)| p)) {
        finish_plan(args, each)?;
    }
    Ok(())
}

/// One plan finished as [`finish_plans`] says.
fn finish_plan(args: &ServeArgs, each: &mut Plan) -> Result<(), Fatal> {
    admission::llama_kv::size(each, args.model());
    admission::passed_kv::count(each, args.model(), &args.backend_args);
    llama_server_cli::pass_to_backend(each, &args.backend_args)?;
    llama_server_cli::refuse_self(each)?;
    let env = |name: &str| std::env::var(name).ok();
    llama_server_cli::align_rules(
        each,
        &args.backend_args,
        llama_server_cli::aip_predict_route(&env).as_deref(),
    );
    // The user's CORS policy reaches the llama-server too, so what it relays carries the
    // same headers as serve's own answers.
    if let Some(cors) = onebit_features::guard::cors::Cors::from_args(args) {
        for backend in &mut each.backends {
            if backend.engine == llama_server_cli::LLAMA_SERVER {
                backend.argv.extend(cors.backend_args());
            }
        }
    }
    if let Some(standin) = &args.backend_standin {
        stand_in(each, standin);
    }
    Ok(())
}

/// `route`'s plan made again with `ports` instead of those it was given, and finished as the
/// first was: called by serve's start when a backend lost its port before it bound it (another
/// program took it), so the route itself writes the new port wherever its plan names one. For
/// the main plan (`main`), the prompt cache's arguments are added again and its setup returned.
/// The plan's notes were said with the first plan and are not said again. Blocks (the route
/// plans, files are read): call it on a blocking thread.
pub fn replan(
    args: &ServeArgs,
    request: &PlanRequest,
    route: &LoadedRoute,
    ports: Vec<u16>,
    main: bool,
) -> Result<(Plan, Option<prompt_cache::Setup>), Fatal> {
    let asked = PlanRequest {
        ports,
        ..request.clone()
    };
    let mut plan = planned(route, &asked)?;
    finish_plan(args, &mut plan)?;
    let setup = if main {
        prompt_cache::start::setup(args, &mut plan)?
    } else {
        None
    };
    Ok((plan, setup))
}

/// The device asked for: router mode runs on the cpu route alone.
fn device_of(args: &ServeArgs) -> Result<&str, Fatal> {
    if args.llama_router && !matches!(args.device.as_str(), "auto" | "cpu") {
        return Err(Fatal::usage(format!(
            "--device {}: llama-server's router mode (no -m) runs on the cpu route; pass -m MODEL.gguf to serve one model there",
            args.device
        )));
    }
    Ok(if args.llama_router {
        "cpu"
    } else {
        args.device.as_str()
    })
}

/// The route for `device`, and the line saying which `--device auto` chose (unless a flag is
/// about to be refused anyway).
fn chosen<'a>(
    device: &str,
    (loaded, unusable): (&'a [LoadedRoute], &[routes::Unusable]),
    request: &PlanRequest,
    say: bool,
) -> Result<&'a LoadedRoute, Fatal> {
    let (route, claim) = routes::choose(device, loaded, unusable, request)?;
    if let Some(claim) = claim.filter(|_| say) {
        tracing::info!(
            "1bit serve: --device auto chose {} ({})",
            route.info.name,
            claim.reason
        );
    }
    Ok(route)
}

/// serve's environment as a route reads it (names and values lossily UTF-8).
fn environment() -> std::collections::BTreeMap<String, String> {
    std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect()
}

/// The flags checked before anything is read: removed ones, the numbers, the API key, and
/// what `--print-backend` cannot do. The key, when one is set.
fn checked_flags(args: &ServeArgs, printing: bool) -> Result<Option<ApiKey>, Fatal> {
    if let Some(why) = args.removed() {
        return Err(Fatal::usage(why));
    }
    if let Some(tps) = args.watchdog_prompt_tps
        && !(tps.is_finite() && tps > 0.0)
    {
        return Err(Fatal::usage(format!(
            "--watchdog-prompt-tps {tps}: not a positive number of tokens per second; pass one such as 50"
        )));
    }
    let api_key = ApiKey::from_args(args.api_key.as_deref(), args.api_key_file.as_deref())?;
    if !(args.drain_s.is_finite() && (0.0..=3600.0).contains(&args.drain_s)) {
        return Err(Fatal::usage(format!(
            "--drain-s {}: not a number of seconds from 0 to 3600; pass one such as 3",
            args.drain_s
        )));
    }
    if !(args.drain_notice_s.is_finite() && (0.0..=3600.0).contains(&args.drain_notice_s)) {
        return Err(Fatal::usage(format!(
            "--drain-notice-s {}: not a number of seconds from 0 to 3600; pass one such as 3",
            args.drain_notice_s
        )));
    }
    prompt_cache::start::checked(args)?;
    if printing && let Some(flag) = args.needs_serve_in_path() {
        return Err(needs_serve(flag.to_string()));
    }
    Ok(api_key)
}

/// `--print-backend` refused for what needs serve in the request path.
fn needs_serve(why: String) -> Fatal {
    Fatal {
        code: exit::NEEDS_SERVE,
        message: format!(
            "--print-backend: {why} needs 1bit serve in the request path; run 1bit serve itself"
        ),
    }
}

/// The command line as a route reads it.
fn serve_options(
    args: &ServeArgs,
    served_name: &str,
    route_options: Vec<RouteOption>,
) -> ServeOptions {
    ServeOptions {
        model: args.model().to_string_lossy().into_owned(),
        served_name: served_name.to_string(),
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
    }
}

/// The route's plan, or its refusal as serve exits with it.
fn planned(route: &LoadedRoute, request: &PlanRequest) -> Result<Plan, Fatal> {
    match route.plan(request) {
        Ok(PlanOutcome::Plan(plan)) => Ok(plan),
        Ok(PlanOutcome::Refused(refusal)) => Err(Fatal {
            code: refusal.exit_status(),
            message: refusal.message,
        }),
        Err(e) => Err(Fatal::backend(format!(
            "the {} route failed to plan: {e}",
            route.info.name
        ))),
    }
}

/// `--backend-standin PROGRAM` (what `1bit plugins check` runs a child-process route with):
/// each backend of the plan runs as PROGRAM with the plan's own arguments and environment.
fn stand_in(plan: &mut Plan, standin: &Path) {
    for backend in &mut plan.backends {
        if let Some(program) = backend.argv.first_mut() {
            tracing::info!(
                "1bit serve: --backend-standin: the {} backend runs as {} with the plan's arguments",
                backend.engine,
                standin.display()
            );
            *program = standin.to_string_lossy().into_owned();
        }
    }
}

/// `--route-opt` and `--npu-opt` as the pairs a route gets, in order; a value without `=` is
/// refused in one line. `1bit plugins check --route-opt` is parsed here too.
pub(crate) fn route_options(args: &ServeArgs) -> Result<Vec<RouteOption>, Fatal> {
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

/// Route options for a route that cannot read them are refused in one line (exit 2) rather
/// than dropped. `1bit plugins check` asks this too.
pub(crate) fn route_can_take(route: &LoadedRoute, options: &[RouteOption]) -> Result<(), Fatal> {
    match options.first() {
        Some(RouteOption { flag, .. }) if !takes_route_options(route) => {
            Err(Fatal::usage(format!(
                "{flag}: the {} route was built against route ABI {}, which takes no route options; remove {flag} or rebuild the route against onebit-plugin-api 1.2 or later",
                route.info.name, route.abi_version
            )))
        }
        _ => Ok(()),
    }
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
            args.model().display()
        );
        return Ok(exit::OK);
    };
    let free = admission::free_for(need, &admission::Sources::from_env())?;
    let verdict = admission::judge(name, args.model(), need, &free);
    println!("{}", verdict.line);
    for warning in &verdict.warnings {
        println!("warning: {warning}");
    }
    Ok(if verdict.fits { exit::OK } else { exit::NO_FIT })
}

/// The check before a load: say the estimate, refuse with exit 3 when it does not fit.
fn admit(args: &ServeArgs, name: &str, plan: &Plan) -> Result<(), Fatal> {
    if let Some(why) = &plan.memory_unknown {
        tracing::warn!(
            "1bit serve: warning: {}",
            admission::unknown_line(name, why)
        );
        return Ok(());
    }
    let Some(need) = &plan.memory else {
        return Ok(());
    };
    let free = admission::free_for(need, &admission::Sources::from_env())?;
    let verdict = admission::judge(name, args.model(), need, &free);
    if !verdict.fits {
        return Err(Fatal {
            code: exit::NO_FIT,
            message: verdict.line,
        });
    }
    tracing::info!("1bit serve: {}", verdict.line);
    for warning in &verdict.warnings {
        tracing::warn!("1bit serve: warning: {warning}");
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
