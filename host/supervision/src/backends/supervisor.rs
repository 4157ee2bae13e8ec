//! Backend processes: starting them through the one spawner (`onebit_process`: they
//! die with serve and lead their own process groups), passing their stderr through, noticing
//! when they exit, and stopping them with its one stop sequence.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{BackendLine, BackendSpec};
use onebit_process::{Process, Stopped};
use tokio::sync::mpsc::UnboundedSender;

/// How many of a backend's last stderr lines serve keeps for its reports.
const TAIL_LINES: usize = 40;
/// How long an exit's report waits for the backend's last stderr lines.
const LAST_LINES_WAIT: Duration = Duration::from_millis(200);

/// Something that happened to a backend, for serve's main loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The backend exited; `how` says how ("exited with status 1", "was killed by SIGSEGV"),
    /// and `signal` is the signal that killed it, if one did.
    Exited {
        index: usize,
        how: String,
        signal: Option<Signal>,
    },
    /// The route asked serve to stop, for this reason (a lost GPU, say).
    RouteStop { index: usize, reason: String },
    /// The progress watchdog judged the backend hung; `line` is the first line of its report.
    Hung { index: usize, line: String },
}

/// A running backend process.
pub struct Backend {
    pub spec: BackendSpec,
    pub pid: u32,
    process: Arc<Process>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

impl Backend {
    pub fn has_exited(&self) -> bool {
        self.process.has_exited()
    }

    /// The last lines it printed on stderr, oldest first.
    pub fn tail(&self) -> Vec<String> {
        self.tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Send `signal` to the backend's process group (it leads its own, so this reaches
    /// anything it started).
    pub fn signal(&self, signal: Signal) {
        self.process.signal_group(signal as i32);
    }
}

/// Keep serve's own settings from a backend: llama-server's key variable (serve checks the key,
/// and a backend with one would refuse serve's relayed requests), and Google's AIP port (serve
/// listens on it; in AIP mode the backend gets its own private port there instead, since
/// llama-server lets AIP_HTTP_PORT override its --port).
fn serves_own_settings(command: &mut Command, port: u16) {
    command.env_remove("LLAMA_API_KEY");
    if std::env::var_os("AIP_MODE").is_some() {
        command.env("AIP_HTTP_PORT", port.to_string());
    }
}

/// Start `spec` as backend `index`: serve's environment plus the plan's entries (a variable
/// the user already set wins), stdout inherited, stderr passed through line by line.
pub fn spawn(
    index: usize,
    spec: &BackendSpec,
    route: &LoadedRoute,
    events: UnboundedSender<Event>,
) -> std::io::Result<Backend> {
    let (program, args) = spec
        .argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("the plan's backend has an empty argv"))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped());
    for (key, value) in &spec.env {
        if std::env::var_os(key).is_none() {
            command.env(key, value);
        }
    }
    command.envs(&spec.env_combined);
    serves_own_settings(&mut command, spec.port);
    let mut child = onebit_process::spawn(command)?;

    let pid = child.pid();
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    // Dropped by the stderr thread at the pipe's end, so an exit is reported with its last
    // lines in the tail (why it failed: "couldn't bind", say).
    let (stderr_open, stderr_closed) = std::sync::mpsc::channel::<()>();
    if let Some(stderr) = child.stderr.take() {
        let (tail, route, events) = (tail.clone(), route.clone(), events.clone());
        std::thread::Builder::new()
            .name(format!("backend-{index}-stderr"))
            .spawn(move || {
                pump_stderr(index, stderr, &tail, &route, &events);
                drop(stderr_open);
            })?;
    } else {
        drop(stderr_open);
    }
    let process = Arc::new(child);
    {
        let process = process.clone();
        std::thread::Builder::new()
            .name(format!("backend-{index}-wait"))
            .spawn(move || {
                let (how, signal) = match process.wait() {
                    Ok(status) => (
                        describe_exit(status),
                        status.signal().and_then(|sig| Signal::try_from(sig).ok()),
                    ),
                    Err(e) => (format!("could not be waited for ({e})"), None),
                };
                // A child the backend left behind may hold the pipe open: not waited for long.
                let _ = stderr_closed.recv_timeout(LAST_LINES_WAIT);
                let _ = events.send(Event::Exited { index, how, signal });
            })?;
    }
    Ok(Backend {
        spec: spec.clone(),
        pid,
        process,
        tail,
    })
}

/// Pass each stderr line through unchanged, keep the tail, and show it to the route.
fn pump_stderr(
    index: usize,
    stderr: std::process::ChildStderr,
    tail: &Mutex<VecDeque<String>>,
    route: &LoadedRoute,
    events: &UnboundedSender<Event>,
) {
    let mut reader = BufReader::new(stderr);
    let mut raw = Vec::with_capacity(256);
    // The backend's lines name their source (in JSON; text writes the line alone).
    let source = tracing::info_span!(
        "backend",
        source = "backend",
        route = %route.info.name,
        backend = index
    );
    loop {
        raw.clear();
        match reader.read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let passed = String::from_utf8_lossy(raw.strip_suffix(b"\n").unwrap_or(&raw));
        source.in_scope(|| tracing::info!(target: onebit_command::log::BACKEND, "{passed}"));
        let line = passed.trim_end_matches('\r').to_string();
        if let Ok(mut tail) = tail.lock() {
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line.clone());
        }
        match route.on_backend_line(&BackendLine {
            backend: index,
            line,
        }) {
            Ok(verdict) => {
                for said in verdict.say {
                    tracing::info!("1bit serve: {said}");
                }
                if let Some(reason) = verdict.stop {
                    let _ = events.send(Event::RouteStop { index, reason });
                }
            }
            Err(e) => tracing::info!("1bit serve: route {}: {e}", route.info.name),
        }
    }
}

/// "exited with status 1", "was killed by SIGKILL".
pub fn describe_exit(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        format!("exited with status {code}")
    } else if let Some(sig) = status.signal() {
        match Signal::try_from(sig) {
            Ok(s) => format!("was killed by {}", s.as_str()),
            Err(_) => format!("was killed by signal {sig}"),
        }
    } else {
        "ended".to_string()
    }
}

/// Stop every backend with the spawner's one sequence (SIGTERM to each group, up to `grace` or
/// until one is seen hung in its SIGTERM handler, SIGKILL to the groups, reaped). A backend
/// that already exited costs no wait. Returns lines worth saying (a backend that had to be
/// killed, or one that would not die). Runs the sequence on a blocking thread.
pub async fn stop_all(backends: &[Backend], grace: Duration) -> Vec<String> {
    let processes: Vec<Arc<Process>> = backends.iter().map(|b| b.process.clone()).collect();
    let outcome = tokio::task::spawn_blocking(move || {
        let refs: Vec<&Process> = processes.iter().map(Arc::as_ref).collect();
        onebit_process::stop_all(&refs, grace)
    })
    .await
    .unwrap_or_default();
    backends
        .iter()
        .zip(outcome)
        .filter_map(|(b, stopped)| match stopped {
            Stopped::Exited => None,
            Stopped::Killed => Some(format!(
                "the {} backend (pid {}) {}",
                b.spec.engine,
                b.pid,
                why_killed(&b.process, grace)
            )),
            Stopped::Stuck => Some(format!(
                "the {} backend (pid {}) did not die after SIGKILL (stuck in the kernel?); exiting anyway",
                b.spec.engine, b.pid
            )),
        })
        .collect()
}

/// How long before a stop's bound the backends still running are SIGKILLed: what their death,
/// its reaping and serve's own exit take on a starved machine (measured: 0.1 s with a CPU hog
/// on each core).
pub const KILL_BEFORE_THE_BOUND: Duration = Duration::from_millis(250);
/// How long before the bound serve stops waiting for a killed backend to be reaped.
const REAPED_BEFORE_THE_BOUND: Duration = Duration::from_millis(50);

/// The stop a signal asks for, bounded: the one sequence as in [`stop_all`], but the backends
/// still running [`KILL_BEFORE_THE_BOUND`] before `bound` are SIGKILLed then, whatever is left
/// of `grace`, and serve waits for them to die only until just before `bound` (a backend stuck
/// in the kernel is left to the keeper and the parent-death signal). `bound` is the stop's
/// promise (docs/serve.md: the drain window and 1 s from the signal). Returns lines worth
/// saying, as [`stop_all`] does; a backend killed for the bound is said so.
pub async fn stop_all_by(
    backends: &[Backend],
    grace: Duration,
    bound: tokio::time::Instant,
    bound_said: &str,
) -> Vec<String> {
    let kill_at = bound.checked_sub(KILL_BEFORE_THE_BOUND).unwrap_or(bound);
    let left = kill_at.saturating_duration_since(tokio::time::Instant::now());
    let cut = left < grace;
    let processes: Vec<Arc<Process>> = backends.iter().map(|b| b.process.clone()).collect();
    let sequence = tokio::task::spawn_blocking(move || {
        let refs: Vec<&Process> = processes.iter().map(Arc::as_ref).collect();
        onebit_process::stop_all(&refs, left.min(grace))
    });
    let reaped_by = bound.checked_sub(REAPED_BEFORE_THE_BOUND).unwrap_or(bound);
    let outcome = match tokio::time::timeout_at(reaped_by, sequence).await {
        Ok(outcome) => outcome.unwrap_or_default(),
        // Not reaped yet: SIGKILLed (again, should the starved sequence not have come to it)
        // and left to die on its own.
        Err(_) => backends
            .iter()
            .map(|b| {
                b.signal(Signal::SIGKILL);
                if b.has_exited() {
                    Stopped::Exited
                } else {
                    Stopped::Stuck
                }
            })
            .collect(),
    };
    backends
        .iter()
        .zip(outcome)
        .filter_map(|(b, stopped)| match stopped {
            Stopped::Exited => None,
            Stopped::Killed if cut && !b.process.hung_in_sigterm_handler() => Some(format!(
                "the {} backend (pid {}) had not stopped when the stop's time ran out ({bound_said}); killing it",
                b.spec.engine, b.pid
            )),
            Stopped::Killed => Some(format!(
                "the {} backend (pid {}) {}",
                b.spec.engine,
                b.pid,
                why_killed(&b.process, grace)
            )),
            Stopped::Stuck => Some(format!(
                "the {} backend (pid {}) had not died of SIGKILL when the stop's time ran out ({bound_said}); exiting anyway",
                b.spec.engine, b.pid
            )),
        })
        .collect()
}

/// Why the stop sequence killed `process`, as the end of a line that names it: it hung in its
/// SIGTERM handler, or outlived `grace`.
pub fn why_killed(process: &Process, grace: Duration) -> String {
    if process.hung_in_sigterm_handler() {
        "hung in its own SIGTERM handler (a thread of it waits on a lock it cannot get, so it can never exit); killing it".to_string()
    } else {
        format!(
            "did not stop within {} s of SIGTERM; killing it",
            grace.as_secs_f64()
        )
    }
}

/// Wait until every backend exited, or `limit` passed; true when all exited.
pub async fn wait_exited(backends: &[Backend], limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if backends.iter().all(Backend::has_exited) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_are_described_by_status_or_signal() {
        assert_eq!(
            describe_exit(ExitStatus::from_raw(1 << 8)),
            "exited with status 1"
        );
        assert_eq!(
            describe_exit(ExitStatus::from_raw(9)),
            "was killed by SIGKILL"
        );
    }
}
