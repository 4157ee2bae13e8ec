//! Backend processes: spawning them so they die with serve, passing their stderr through,
//! noticing when they exit, and stopping them.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{BackendLine, BackendSpec};
use tokio::sync::mpsc::UnboundedSender;

/// How many of a backend's last stderr lines serve keeps for its reports.
const TAIL_LINES: usize = 40;

/// Something that happened to a backend, for serve's main loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The backend exited; `how` says how ("exited with status 1", "was killed by SIGSEGV").
    Exited { index: usize, how: String },
    /// The route asked serve to stop, for this reason (a lost GPU, say).
    RouteStop { index: usize, reason: String },
    /// The progress watchdog judged the backend hung; `line` is the first line of its report.
    Hung { index: usize, line: String },
}

/// A running backend process.
pub struct Backend {
    pub spec: BackendSpec,
    pub pid: u32,
    exited: Arc<AtomicBool>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

impl Backend {
    pub fn has_exited(&self) -> bool {
        self.exited.load(Ordering::SeqCst)
    }

    /// The last lines it printed on stderr, oldest first.
    pub fn tail(&self) -> Vec<String> {
        self.tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Send `signal` to the backend's process group, unless it already exited.
    pub fn signal(&self, signal: Signal) {
        if !self.has_exited() {
            // The backend leads its own process group, so this reaches anything it started.
            let _ = killpg(Pid::from_raw(self.pid as i32), signal);
        }
    }
}

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Linux sends a child's parent-death signal when the *thread* that forked it ends, so every
/// backend is forked by one thread that lives as long as serve does.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnJob>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (jobs, queue) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("backend-spawner".into())
            .spawn(move || {
                for (mut command, reply) in queue {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("a thread can be started at start-up");
        Mutex::new(jobs)
    })
}

/// Make the child die with serve, even when serve is SIGKILLed, and put it in its own process
/// group so a terminal's Ctrl-C reaches serve alone (serve then stops it in order).
#[allow(unsafe_code)]
pub(crate) fn die_with_serve(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (setpgid, prctl, getppid, _exit); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            libc::setpgid(0, 0);
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // serve may have died between fork and prctl; then nobody would kill us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
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
    die_with_serve(&mut command);
    let (reply, answer) = mpsc::channel();
    spawner()
        .lock()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?
        .send((command, reply))
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    let mut child = answer
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))??;

    let pid = child.id();
    let exited = Arc::new(AtomicBool::new(false));
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    if let Some(stderr) = child.stderr.take() {
        let (tail, route, events) = (tail.clone(), route.clone(), events.clone());
        std::thread::Builder::new()
            .name(format!("backend-{index}-stderr"))
            .spawn(move || pump_stderr(index, stderr, &tail, &route, &events))?;
    }
    {
        let exited = exited.clone();
        std::thread::Builder::new()
            .name(format!("backend-{index}-wait"))
            .spawn(move || {
                let how = match child.wait() {
                    Ok(status) => describe_exit(status),
                    Err(e) => format!("could not be waited for ({e})"),
                };
                exited.store(true, Ordering::SeqCst);
                let _ = events.send(Event::Exited { index, how });
            })?;
    }
    Ok(Backend {
        spec: spec.clone(),
        pid,
        exited,
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
    loop {
        raw.clear();
        match reader.read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        {
            let mut out = std::io::stderr().lock();
            let _ = out.write_all(&raw);
            if raw.last() != Some(&b'\n') {
                let _ = out.write_all(b"\n");
            }
        }
        let line = String::from_utf8_lossy(&raw)
            .trim_end_matches(['\n', '\r'])
            .to_string();
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
                    eprintln!("1bit serve: {said}");
                }
                if let Some(reason) = verdict.stop {
                    let _ = events.send(Event::RouteStop { index, reason });
                }
            }
            Err(e) => eprintln!("1bit serve: route {}: {e}", route.info.name),
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

/// Stop every backend: SIGTERM, up to `grace` for them to exit, then SIGKILL. A backend that
/// already exited costs no wait. Returns lines worth saying (a backend that had to be killed,
/// or one that would not die).
pub async fn stop_all(backends: &[Backend], grace: Duration) -> Vec<String> {
    let mut said = Vec::new();
    for b in backends {
        b.signal(Signal::SIGTERM);
    }
    if wait_exited(backends, grace).await {
        return said;
    }
    for b in backends.iter().filter(|b| !b.has_exited()) {
        said.push(format!(
            "the {} backend (pid {}) did not stop within {} s of SIGTERM; killing it",
            b.spec.engine,
            b.pid,
            grace.as_secs()
        ));
        b.signal(Signal::SIGKILL);
    }
    if !wait_exited(backends, Duration::from_secs(5)).await {
        for b in backends.iter().filter(|b| !b.has_exited()) {
            said.push(format!(
                "the {} backend (pid {}) did not die after SIGKILL (stuck in the kernel?); exiting anyway",
                b.spec.engine, b.pid
            ));
        }
    }
    said
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
