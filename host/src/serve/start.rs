//! Starting the backends: each spawned on its reserved port, then watched until it holds that
//! port; one that lost it before binding it (another program took the port in the window after
//! serve let go of it) is planned again on new ports and started again, at most
//! [`RESTARTS`] times, with one line each time, so that no start fails for it.
//!
//! This runs before serve builds what serves requests (`App`, which holds every backend's
//! port): a backend started again on another port changes nothing that was already made.

use std::net::TcpListener as StdListener;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use onebit_plugin_api::PlanRequest;
use tokio::signal::unix::{Signal as Signals, SignalKind, signal};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::{StopBound, make_run_dir, say_fatal, stop, stop_grace};
use crate::ports::{self, HeldPorts};
use crate::prepare;
use onebit_command::cli::ServeArgs;
use onebit_command::error::Fatal;
use onebit_features::laya::start::RoutePlan;
use onebit_features::prompt_cache;
use onebit_supervision::backends::port_owner::{self, Listener};
use onebit_supervision::backends::supervisor::{self, Backend, Event};

/// How many times a backend that lost its port is started again on another one.
const RESTARTS: usize = 2;
/// How much CPU time a backend may use without holding its port before serve serves anyway (a
/// backend that binds later and loses its port fails as before). llama-server binds before it
/// loads the model, after some tens of milliseconds of its own CPU; serve answers nothing (its
/// own `/health` included) until then. The backend's CPU time, not the clock: on a starved
/// machine seconds can pass before a backend has run at all, and a port lost in that window
/// must still be replaced.
const BIND_CPU_LIMIT: Duration = Duration::from_secs(2);
/// The wall-clock bound on the same wait, for a backend that neither binds nor runs (one that
/// sleeps on a device before it listens).
const BIND_LIMIT: Duration = Duration::from_secs(20);
/// How often the backends' ports are looked at while they start.
const BIND_POLL: Duration = Duration::from_millis(10);

/// The started backends, and the channel their events come on.
pub(super) struct Started {
    pub backends: Vec<Backend>,
    pub events_tx: UnboundedSender<Event>,
    pub events: UnboundedReceiver<Event>,
}

/// SIGTERM and SIGINT, installed before the first backend starts (a stop while they start
/// stops them in order).
pub(super) struct Stops {
    pub term: Signals,
    pub int: Signals,
}

/// What serve planned, which a start on other ports changes: the plans (the main one first),
/// the main plan's prompt-cache setup, and the request they were planned with.
pub(super) struct Planned<'a> {
    pub placed: &'a mut [RoutePlan],
    pub prompt_cache: &'a mut Option<prompt_cache::Setup>,
    pub request: &'a PlanRequest,
}

/// serve's run folder made (the backends write there), SIGTERM and SIGINT installed, then
/// every plan's backends started on their ports (`held` lets go of them first), waiting until
/// each holds its port, or has run long enough not to ([`BIND_CPU_LIMIT`]), or one exited for
/// another reason (its event is handed on, for serve to report as a failed load). A backend
/// that lost its port is started again, with every other backend (they were starting, so
/// nothing is lost), on a plan made again on new ports. Err is serve's exit status: a backend
/// could not be started, or a signal came.
pub(super) async fn backends(
    args: &ServeArgs,
    planned: Planned<'_>,
    held: HeldPorts,
    run_dir: &Path,
) -> Result<(Started, Stops), i32> {
    if let Err(fatal) = make_run_dir(run_dir).await {
        return Err(say_fatal(&fatal));
    }
    let (Ok(term), Ok(int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return Err(say_fatal(&Fatal::backend("cannot install signal handlers")));
    };
    let mut stops = Stops { term, int };
    match started(args, planned, held, &mut stops).await {
        Ok(started) => Ok((started, stops)),
        Err(code) => {
            let _ = std::fs::remove_dir_all(run_dir);
            Err(code)
        }
    }
}

/// The stop's bound of a signal that came now.
fn signalled(args: &ServeArgs) -> StopBound {
    StopBound::from(
        tokio::time::Instant::now(),
        Duration::from_secs_f64(args.drain_s),
    )
}

async fn started(
    args: &ServeArgs,
    planned: Planned<'_>,
    held: HeldPorts,
    stops: &mut Stops,
) -> Result<Started, i32> {
    let Planned {
        placed,
        prompt_cache,
        request,
    } = planned;
    let mut held = held;
    let grace = stop_grace(args);
    for restart in 0..=RESTARTS {
        let (events_tx, mut events) = unbounded_channel();
        held.release();
        let backends = spawn_backends(args, placed, &events_tx).await?;
        let bound = tokio::select! {
            bound = bound(&backends, &mut events) => bound,
            _ = stops.term.recv() => return Err(stop(&backends, grace, "SIGTERM", signalled(args)).await),
            _ = stops.int.recv() => return Err(stop(&backends, grace, "SIGINT", signalled(args)).await),
        };
        let lost = match bound {
            Bound::Lost(index, event) if restart < RESTARTS => {
                for b in &backends {
                    b.signal(Signal::SIGKILL);
                }
                supervisor::wait_exited(&backends, Duration::from_secs(5)).await;
                drop(event);
                index
            }
            Bound::Lost(_, event) | Bound::Handed(event) => {
                if let Some(event) = event {
                    let _ = events_tx.send(event);
                }
                return Ok(Started {
                    backends,
                    events_tx,
                    events,
                });
            }
            Bound::All => {
                return Ok(Started {
                    backends,
                    events_tx,
                    events,
                });
            }
        };
        held = HeldPorts::default();
        let (which, old_port) = plan_of(placed, lost);
        let main = which == 0 && prompt_cache.is_some();
        let replanned = {
            let ports = ports::reserve(&held, 4, args.port).map_err(|f| say_fatal(&f))?;
            let (args, request, route) = (args.clone(), request.clone(), placed[which].0.clone());
            tokio::task::spawn_blocking(move || {
                prepare::replan(&args, &request, &route, ports, main)
            })
            .await
            .unwrap_or_else(|e| Err(Fatal::backend(format!("the re-plan failed: {e}"))))
        };
        let (mut plan, setup) = replanned.map_err(|f| say_fatal(&f))?;
        let new_port = plan
            .backends
            .get(lost - first_of(placed, which))
            .map(|b| b.port);
        tracing::info!(
            "1bit serve: port {old_port}, which serve gave the {} backend, was taken by another program before the backend could listen on it; starting the backends again with it on port {}",
            plan.device,
            new_port.map_or("another".to_string(), |p| p.to_string())
        );
        plan.notes = std::mem::take(&mut placed[which].1.notes);
        placed[which].1 = plan;
        if main {
            *prompt_cache = setup;
        }
    }
    unreachable!("the last restart returns")
}

/// Which plan backend `index` (in serve's order) belongs to, and its port.
fn plan_of(placed: &[RoutePlan], index: usize) -> (usize, u16) {
    let mut first = 0;
    for (which, (_, plan)) in placed.iter().enumerate() {
        if let Some(b) = plan.backends.get(index - first) {
            return (which, b.port);
        }
        first += plan.backends.len();
    }
    (0, 0)
}

/// The index (in serve's order) of plan `which`'s first backend.
fn first_of(placed: &[RoutePlan], which: usize) -> usize {
    placed[..which].iter().map(|(_, p)| p.backends.len()).sum()
}

/// Every plan's backends started in serve's order, each with its line; on a failure, those
/// started are stopped and the exit status is returned.
async fn spawn_backends(
    args: &ServeArgs,
    placed: &[RoutePlan],
    events_tx: &UnboundedSender<Event>,
) -> Result<Vec<Backend>, i32> {
    let mut backends: Vec<Backend> = Vec::new();
    let specs = placed.iter().flat_map(|(route, plan)| {
        plan.backends
            .iter()
            .map(move |spec| (route, spec, &plan.device))
    });
    for (index, (route, spec, device)) in specs.enumerate() {
        tracing::info!(
            "1bit serve: starting {} on the {device} route (port {}): {}",
            spec.engine,
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

/// How the wait for the backends' ports ended.
enum Bound {
    /// Each holds its port, or has run (or waited) long enough not to.
    All,
    /// Backend `index` exited without its port: another program holds it.
    Lost(usize, Option<Event>),
    /// Something else happened first (a backend exited for its own reason): for serve.
    Handed(Option<Event>),
}

/// Wait until every backend listens on its port (seen in /proc, on a blocking thread) or
/// another process listens there, one exits, or those still waiting have each used
/// [`BIND_CPU_LIMIT`] of CPU time (a wrapper's own: its children's are not counted), or
/// [`BIND_LIMIT`] passed.
async fn bound(backends: &[Backend], events: &mut UnboundedReceiver<Event>) -> Bound {
    let deadline = tokio::time::Instant::now() + BIND_LIMIT;
    let mut waiting: Vec<(usize, u16, u32)> = backends
        .iter()
        .enumerate()
        .map(|(index, b)| (index, b.spec.port, b.pid))
        .collect();
    loop {
        let looked = waiting.clone();
        // Settled: the backend listens, or another process does (serve's check of who holds
        // the port refuses that once the backend answers; waiting longer would not change it).
        let (settled, all_ran) = tokio::task::spawn_blocking(move || {
            let proc = Path::new("/proc");
            let settled = looked
                .iter()
                .filter(|(_, port, pid)| {
                    port_owner::listener(proc, *port, *pid) != Listener::Unknown
                })
                .map(|(index, _, _)| *index)
                .collect::<Vec<usize>>();
            let all_ran = looked
                .iter()
                .filter(|(index, _, _)| !settled.contains(index))
                .all(|(_, _, pid)| {
                    onebit_process::cpu_time(*pid).is_some_and(|t| t >= BIND_CPU_LIMIT)
                });
            (settled, all_ran)
        })
        .await
        .unwrap_or_default();
        waiting.retain(|(index, _, _)| !settled.contains(index));
        if waiting.is_empty() || all_ran || tokio::time::Instant::now() >= deadline {
            return Bound::All;
        }
        tokio::select! {
            event = events.recv() => {
                return match event {
                    Some(Event::Exited { index, .. })
                        if waiting.iter().any(|w| w.0 == index)
                            && lost_its_port(&backends[index]) =>
                    {
                        Bound::Lost(index, event)
                    }
                    other => Bound::Handed(other),
                };
            }
            _ = tokio::time::sleep(BIND_POLL) => {}
        }
    }
}

/// Whether a backend that exited before it listened did so because its port was taken: its
/// last lines say it could not bind (llama-server: "couldn't bind HTTP server socket"; most
/// servers: "Address already in use"), or the port cannot be bound now.
fn lost_its_port(backend: &Backend) -> bool {
    let said = backend.tail().iter().any(|line| {
        let line = line.to_ascii_lowercase();
        [
            "address already in use",
            "couldn't bind",
            "could not bind",
            "bind failed",
        ]
        .iter()
        .any(|words| line.contains(words))
    });
    said || port_is_taken(backend.spec.port)
}

/// Whether another socket holds `port` on loopback (a listener, or a connection that was
/// given it as its source port).
fn port_is_taken(port: u16) -> bool {
    matches!(
        StdListener::bind(("127.0.0.1", port)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse
    )
}
