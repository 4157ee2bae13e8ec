//! How serving ends: another process on a backend's port, a signal's orderly stop, a
//! backend's exit or the route's stop verdict, and the watchdog's kill; each says its line,
//! stops the backends and gives serve's exit status.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::notify;
use onebit_command::error::exit;
use onebit_metrics as metrics;
use onebit_relay::App;
use onebit_supervision::backends::health::Status;
use onebit_supervision::backends::port_owner;
use onebit_supervision::backends::supervisor::{self, Backend, Event};
use tokio::sync::mpsc::UnboundedReceiver;

/// The line to exit 1 with when another process, not the backend, listens on a backend's port
/// (port_owner.rs); None when each port is its backend's or cannot be judged.
pub(super) fn impostor(backends: &[Backend]) -> Option<String> {
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
pub(super) enum Ended {
    /// A backend exited, or the route asked to stop.
    Backend(Option<Event>),
    /// SIGTERM or SIGINT.
    Signal(&'static str),
    /// Another process answers on a backend's port (`impostor`'s line).
    PortTaken(String),
    /// An RPC worker was lost (`Workers::lost`).
    WorkerLost,
}

/// How long, once an RPC worker is seen lost, serve waits for the backend's own failure (with
/// a request in flight llama.cpp aborts at its next RPC call, within a token or a prefill
/// batch, and its line is then said) before it ends the backend itself: an idle backend, or
/// one whose request has not reached it, would notice only at its next request, and serve's
/// /health answers 503 meanwhile, so no request would ever come.
pub(super) const LOST_WORKER_WAIT: Duration = Duration::from_secs(2);

/// An RPC worker was lost: its layers are gone for good, so serve ends, with the backend's own
/// failure when it comes within [`LOST_WORKER_WAIT`], else with the worker's line; exit 1
/// (a supervisor starts serve again, which probes the workers anew).
pub(super) async fn worker_lost(
    events: &mut UnboundedReceiver<Event>,
    backends: &[Backend],
    app: &Arc<App>,
    devices: &[String],
    grace: Duration,
) -> i32 {
    let event = match tokio::time::timeout(LOST_WORKER_WAIT, events.recv()).await {
        Ok(event) => event,
        Err(_) => Some(Event::RouteStop {
            index: 0,
            reason: format!(
                "llama-server would notice only at its next request, which serve refuses with 503 (waited {} s)",
                LOST_WORKER_WAIT.as_secs()
            ),
        }),
    };
    fail(event, Loading::No, backends, app, devices, grace).await
}

/// How often, while serving, the backends' ports are checked again for another process.
const PORT_RECHECK: Duration = Duration::from_secs(2);

/// While serving: every [`PORT_RECHECK`], whether each backend's port is still held by the
/// backend serve started (a backend that closed its listener and a process that took the
/// port over, or a restarted engine that is not serve's). Resolves with `impostor`'s line.
/// The /proc reads run on a blocking thread, never on a thread that relays.
pub(super) async fn port_taken(backends: &[Backend]) -> String {
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

/// When a signal's stop must be over: the drain window and [`STOP_PAST_THE_WINDOW`] from the
/// signal (docs/serve.md), and how serve's lines name that bound.
#[derive(Clone, Copy)]
pub(super) struct StopBound {
    pub(super) at: tokio::time::Instant,
    window: Duration,
}

impl StopBound {
    /// The drain window the bound was counted with.
    pub(super) fn window(&self) -> Duration {
        self.window
    }

    /// When the signal came.
    pub(super) fn signalled(&self) -> tokio::time::Instant {
        self.at - self.window - STOP_PAST_THE_WINDOW
    }
}

/// How long past the drain window a signal's stop may take, the backends' stop sequence
/// included: serve exits within the window and this (inside Lemonade's 5 s before its SIGKILL
/// with the default 3 s window), whatever the backends or a starved machine do.
pub(super) const STOP_PAST_THE_WINDOW: Duration = Duration::from_secs(1);

impl StopBound {
    /// The bound of a stop whose signal came at `signalled`, with drain window `window`.
    pub(super) fn from(signalled: tokio::time::Instant, window: Duration) -> StopBound {
        StopBound {
            at: signalled + window + STOP_PAST_THE_WINDOW,
            window,
        }
    }
}

/// A signal: stop the backends in order, within the stop's bound, and exit cleanly. A backend
/// still running when the bound nears is killed (`supervisor::stop_all_by`).
pub(super) async fn stop(backends: &[Backend], grace: Duration, what: &str, by: StopBound) -> i32 {
    tracing::info!("1bit serve: {what}: stopping");
    notify::exiting(&format!("{what}: stopping the backends"));
    let said = format!(
        "{} s after {what}: the {} s drain window and {} s",
        (by.window + STOP_PAST_THE_WINDOW).as_secs_f64(),
        by.window.as_secs_f64(),
        STOP_PAST_THE_WINDOW.as_secs_f64()
    );
    for line in supervisor::stop_all_by(backends, grace, by.at, &said).await {
        tracing::info!("1bit serve: {line}");
    }
    tracing::debug!(
        "1bit serve: {what}: the backends stopped {:.3} s before the stop's bound",
        by.at
            .saturating_duration_since(tokio::time::Instant::now())
            .as_secs_f64()
    );
    exit::OK
}

/// Whether the backends were still loading (not yet all ready) when one failed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Loading {
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
pub(super) async fn fail(
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
    let workers = app.rpc_workers.clone();
    let message = match tokio::task::spawn_blocking(move || workers.name_lost()).await {
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
