//! What `--laya` needs settled before serve starts: the flags checked, the policy read, a plan
//! for each device the policy can pick that runs the model, their memory counted together,
//! `--laya-model`'s daemon started, and the router over them. Called by serve's start, on the
//! main thread (`router`: in the runtime, once), before any backend starts.

use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{Plan, PlanOutcome, PlanRequest};

use super::scorer::{Scorer, Setup};
use onebit_command::cli::ServeArgs;
use onebit_command::error::Fatal;

/// One route's plan. serve runs one, or with `--laya` one per device the policy can pick.
pub type RoutePlan = (LoadedRoute, Plan);

/// What `--laya` settled: the policy, and with `--laya-model` the daemon's setup (checked
/// before anything starts) and, once [`start_scorer`] ran, the daemon itself.
pub struct Settled {
    policy: super::Policy,
    model: Option<Setup>,
    scorer: Option<Scorer>,
}

/// `--laya`, `--laya-model` (which implies `--laya`), `--route-policy`: the policy read and
/// checked, the model's path checked, and the combinations refused, before anything starts.
pub fn settings(args: &ServeArgs) -> Result<Option<Settled>, Fatal> {
    let model = match &args.laya_model {
        Some(given) => Some(Setup::from_args(args, given)?),
        None => None,
    };
    if !args.laya && model.is_none() {
        if args.route_policy.is_some() {
            return Err(Fatal::usage(
                "--route-policy only applies with --laya; add --laya or remove --route-policy",
            ));
        }
        return Ok(None);
    }
    if args.device != "auto" {
        return Err(Fatal::usage(format!(
            "--laya routes among devices; leave --device at auto (not {})",
            args.device
        )));
    }
    if !args.rpc.is_empty() {
        // The workers' layer split and memory check are one plan's; Laya runs one per device.
        return Err(Fatal::usage(
            "--laya does not combine with --rpc: the RPC workers take one device's layers; remove one",
        ));
    }
    if args.embedding || args.reranking || args.embed.is_some() || args.rerank.is_some() {
        return Err(Fatal::usage(
            "--laya does not combine with --embedding/--reranking or --embed/--rerank",
        ));
    }
    let policy = super::Policy::load(args.route_policy.as_deref())?;
    Ok(Some(Settled {
        policy,
        model,
        scorer: None,
    }))
}

/// `--laya-model`: the runtime found and the daemon started, ready (exit 1 with its line when
/// it cannot be); nothing without it. Blocks serve's main thread up to the ready bound; called
/// last before serve starts listening, so every earlier refusal starts nothing.
pub fn start_scorer(
    settled: &mut Settled,
    args: &ServeArgs,
    counters: &onebit_metrics::Counters,
) -> Result<(), Fatal> {
    let Some(setup) = settled.model.as_mut() else {
        return Ok(());
    };
    setup.find_runtime(args)?;
    settled.scorer = Some(Scorer::start(setup, counters)?);
    Ok(())
}

/// The plans of the devices the policy can pick that run this model, the one to fall back to
/// first: the policy's default when it runs, else the device `--device auto` chose (`auto`,
/// already planned). A device without a route, whose route does not claim the model, or that
/// refuses to plan it is said and left out.
pub fn plans(
    settled: &Settled,
    loaded: &[LoadedRoute],
    request: &PlanRequest,
    auto: RoutePlan,
    reserve_ports: impl Fn(usize) -> Result<Vec<u16>, Fatal>,
) -> Result<(RoutePlan, Vec<RoutePlan>), Fatal> {
    let policy = &settled.policy;
    let names = policy.devices();
    let mut ports = reserve_ports(4 * (names.len() + 1))?;
    ports.retain(|p| !request.ports.contains(p));
    let mut running: Vec<RoutePlan> = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if *name == auto.0.info.name {
            running.push(auto.clone());
            continue;
        }
        let not =
            |why: String| tracing::info!("1bit serve: laya: {name} is not a candidate: {why}");
        let Some(route) = loaded.iter().find(|r| r.info.name == *name) else {
            not("no route of that name was found".into());
            continue;
        };
        match route.claim(request) {
            Ok(claim) if claim.strength > 0 => {}
            Ok(_) => {
                not(format!("the route does not run {}", request.options.model));
                continue;
            }
            Err(e) => {
                not(e.to_string());
                continue;
            }
        }
        let mut asked = request.clone();
        asked.ports = ports.iter().skip(4 * i).take(4).copied().collect();
        match route.plan(&asked) {
            Ok(PlanOutcome::Plan(plan)) => running.push((route.clone(), plan)),
            Ok(PlanOutcome::Refused(r)) => not(r.message),
            Err(e) => not(e.to_string()),
        }
    }
    let default_runs = running.iter().any(|(r, _)| r.info.name == policy.default);
    let first_name = if default_runs {
        policy.default.clone()
    } else {
        tracing::info!(
            "1bit serve: laya: the default device {} does not run this model; falling back to {}",
            policy.default,
            auto.0.info.name
        );
        if !running.iter().any(|(r, _)| r.info.name == auto.0.info.name) {
            running.push(auto.clone());
        }
        auto.0.info.name.clone()
    };
    let at = running
        .iter()
        .position(|(r, _)| r.info.name == first_name)
        .expect("the fallback is among the running devices");
    let first = running.remove(at);
    Ok((first, running))
}

/// The plan whose memory the check judges: the first device's, with every other device's
/// weights, KV and compute added (their backends load together). Judged against the first
/// device's pool: on an APU the GPU's GTT and the CPU's RAM are the same memory.
pub fn needs_together(first: &Plan, more: &[RoutePlan]) -> Plan {
    let mut plan = first.clone();
    for (_, other) in more {
        let Some(extra) = &other.memory else { continue };
        match &mut plan.memory {
            Some(need) => {
                need.weights_bytes += extra.weights_bytes;
                need.kv_bytes += extra.kv_bytes;
                need.compute_bytes += extra.compute_bytes;
            }
            None => plan.memory = Some(extra.clone()),
        }
    }
    plan
}

/// `--laya`'s router over the devices that run, each with its first backend's index in
/// serve's order; says at start, in one line, what classifies (the Laya daemon, or the rules)
/// and where each device runs.
pub fn router(settled: Settled, placed: &[RoutePlan], policy_file: Option<&str>) -> super::Laya {
    let Settled { policy, scorer, .. } = settled;
    let mut devices = Vec::new();
    let mut index = 0;
    for (_, plan) in placed {
        devices.push((plan.device.clone(), index));
        index += plan.backends.len();
    }
    let names: Vec<&str> = devices.iter().map(|(d, _)| d.as_str()).collect();
    let classifier = scorer
        .as_ref()
        .map_or(super::CLASSIFIER, |s| s.summary.as_str());
    tracing::info!(
        "1bit serve: laya: {classifier}, policy {}, devices {} (default first)",
        policy_file.unwrap_or("built in"),
        names.join(", ")
    );
    super::Laya::new(policy, devices).with_scorer(scorer)
}
