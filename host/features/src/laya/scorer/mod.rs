//! `--laya-model`: the Laya scorer daemon (ggmlc's `laya daemon`), started by the one spawner
//! before serve listens, asked each new conversation's class over its stdin and stdout
//! (`protocol`), and stopped with serve. A question it does not answer in time, an answer
//! outside the protocol, or its death sends that decision to the rule-based classifier, said
//! once and counted in `/metrics`; a conversation is never held up longer than the bound.
//!
//! Three threads of its own: one writes each question and waits for its answer (questions go
//! one at a time; an answer that comes after its question's bound is owed, and read and
//! dropped before the next question), one reads the daemon's stdout into lines, one its stderr
//! (the last line is kept for what is said when it fails). The request's task only awaits a
//! reply with a timeout.

mod protocol;
pub mod setup;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use onebit_process::Process;
use tokio::sync::oneshot;

pub use setup::Setup;

use super::classify::Decision;
use onebit_command::error::Fatal;
use onebit_metrics::{Counters, LayaFallback};
use onebit_supervision::backends::supervisor::describe_exit;

/// How long the daemon has to exit by itself once its stdin closed (its own cue to stop),
/// then how long after SIGTERM before it is killed.
const EXIT_AT_EOF: Duration = Duration::from_secs(1);
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How much longer than the bound a request's task waits for the asking thread's reply (the
/// thread keeps the bound itself; this only covers a thread stuck writing to a daemon that
/// reads nothing).
const REPLY_MARGIN: Duration = Duration::from_millis(50);

type Reply = Result<Decision, (LayaFallback, String)>;

/// One question: the text, when its bound ends, and where its answer goes.
struct Job {
    text: String,
    deadline: Instant,
    reply: oneshot::Sender<Reply>,
}

/// The running daemon. Dropping it stops the daemon (stdin closed, then the spawner's stop
/// sequence).
pub struct Scorer {
    process: Arc<Process>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// Told by the asking thread once it ended and closed the daemon's stdin.
    closed: Mutex<mpsc::Receiver<()>>,
    answer_within: Duration,
    /// Set once its stdout ended: every decision is the rules' from then on.
    gone: Arc<AtomicBool>,
    /// Set when serve stops it, so its end is not reported as a death.
    stopping: Arc<AtomicBool>,
    /// Whether each kind of fallback was said already (timeout, bad answer).
    said: [AtomicBool; 2],
    /// What the start line says classifies.
    pub summary: String,
    /// Where its state and the rules' fallbacks are counted (`/metrics`).
    counters: Counters,
}

/// What the threads share about the daemon's output.
#[derive(Clone)]
struct Watch {
    process: Arc<Process>,
    ready: Arc<AtomicBool>,
    gone: Arc<AtomicBool>,
    stopping: Arc<AtomicBool>,
    /// Its last stderr line, and whether its stderr ended.
    last_line: Arc<Mutex<(String, bool)>>,
    /// Where its death is counted (`/metrics`).
    counters: Counters,
}

impl Scorer {
    /// Start the daemon and wait for its ready line. Err: the one line (exit 1) for a daemon
    /// that cannot start, exits, reports an error or is not ready in time; it is stopped
    /// first. Blocks (up to the ready bound): called on serve's main thread before it listens.
    pub fn start(setup: &Setup, counters: &Counters) -> Result<Scorer, Fatal> {
        let Some(runtime) = setup.runtime.as_deref() else {
            return Err(Fatal::backend("laya: the Laya runtime was not looked for"));
        };
        let argv = setup.argv();
        let env: Vec<String> = setup.env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
        tracing::info!(
            "1bit serve: laya: starting the Laya daemon: {}{} {}",
            env.concat(),
            runtime.display(),
            argv.join(" ")
        );
        let started = Instant::now();
        let (stdin, lines, watch) = spawn(runtime, &argv, &setup.env, counters)?;
        let process = watch.process.clone();
        let pid = process.pid();
        let failed = |why: String| {
            process.stop(Duration::from_secs(1));
            let last = last_line(&watch.last_line);
            Fatal::backend(format!(
                "laya: the Laya daemon ({} daemon, pid {pid}) {why}{last}",
                runtime.display()
            ))
        };
        wait_ready(&lines, setup.ready_within, &process).map_err(failed)?;
        watch.ready.store(true, Ordering::SeqCst);
        counters.laya_scorer_up(true);
        let (jobs_tx, jobs) = mpsc::channel::<Job>();
        let (closed_tx, closed) = mpsc::channel();
        std::thread::Builder::new()
            .name("laya-ask".into())
            .spawn(move || {
                converse(stdin, &lines, jobs);
                let _ = closed_tx.send(());
            })
            .map_err(|e| Fatal::backend(format!("laya: cannot start a thread ({e})")))?;
        let summary = format!(
            "the Laya model ({} on {}, by the laya daemon, pid {pid}, ready in {} ms; long_doc by size)",
            setup.gguf.display(),
            setup.device,
            started.elapsed().as_millis()
        );
        Ok(Scorer {
            process,
            jobs: Mutex::new(Some(jobs_tx)),
            closed: Mutex::new(closed),
            answer_within: setup.answer_within,
            gone: watch.gone,
            stopping: watch.stopping,
            said: [AtomicBool::new(false), AtomicBool::new(false)],
            summary,
            counters: counters.clone(),
        })
    }

    /// The daemon's decision on `text` (shorter than the size gate), or None when the rules
    /// must decide: it was late, answered outside the protocol, or is gone (said once per
    /// kind, counted each time). Awaits at most the bound; never blocks the thread.
    pub async fn ask(&self, text: &str) -> Option<Decision> {
        if self.gone.load(Ordering::SeqCst) {
            return self.fell_back(LayaFallback::Exited, "");
        }
        let (reply, answer) = oneshot::channel();
        let job = Job {
            text: text.to_string(),
            deadline: Instant::now() + self.answer_within,
            reply,
        };
        let sent = self
            .jobs
            .lock()
            .ok()
            .and_then(|jobs| jobs.as_ref().map(|j| j.send(job).is_ok()));
        if sent != Some(true) {
            return self.fell_back(LayaFallback::Exited, "");
        }
        match tokio::time::timeout(self.answer_within + REPLY_MARGIN, answer).await {
            Ok(Ok(Ok(decision))) => Some(decision),
            Ok(Ok(Err((why, said)))) if said.is_empty() && why == LayaFallback::Timeout => {
                self.fell_back(why, &self.late())
            }
            Ok(Ok(Err((why, said)))) => self.fell_back(why, &said),
            Ok(Err(_)) => self.fell_back(LayaFallback::Exited, ""),
            Err(_) => self.fell_back(LayaFallback::Timeout, &self.late()),
        }
    }

    fn late(&self) -> String {
        format!(
            "it did not answer within {} ms (ONEBIT_LAYA_ANSWER_MS)",
            self.answer_within.as_millis()
        )
    }

    /// Count a decision the rules make in the daemon's place, and say why the first time.
    fn fell_back(&self, why: LayaFallback, said: &str) -> Option<Decision> {
        self.counters.laya_fallback(why);
        let first = match why {
            LayaFallback::Timeout => !self.said[0].swap(true, Ordering::SeqCst),
            LayaFallback::BadAnswer => !self.said[1].swap(true, Ordering::SeqCst),
            // Its death is said by the thread that saw it.
            LayaFallback::Exited => false,
        };
        if first {
            tracing::warn!(
                "1bit serve: laya: the Laya daemon (pid {}) failed a question: {said}; the rule-based classifier decides that conversation, and each time this happens again (said once; counted in onebit_laya_fallbacks_total)",
                self.process.pid()
            );
        }
        None
    }
}

impl Drop for Scorer {
    /// Stop the daemon with serve: its stdin closed (the asking thread ends, at most a bound
    /// after a question it waits on, and drops it), which is the daemon's own cue to exit;
    /// then the spawner's stop sequence for what is left. Blocks (a few seconds at most).
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Ok(mut jobs) = self.jobs.lock() {
            jobs.take();
        }
        if let Ok(closed) = self.closed.lock()
            && closed
                .recv_timeout(self.answer_within + REPLY_MARGIN)
                .is_ok()
        {
            self.process.wait_timeout(EXIT_AT_EOF);
        }
        self.process.stop(STOP_GRACE);
    }
}

/// The daemon started by the one spawner (parent-death signal, its own process group), its
/// stdin, its stdout as lines, and the threads that watch its output.
fn spawn(
    runtime: &Path,
    argv: &[String],
    env: &[(String, String)],
    counters: &Counters,
) -> Result<(std::io::PipeWriter, mpsc::Receiver<String>, Watch), Fatal> {
    let cannot = |e: std::io::Error| {
        Fatal::backend(format!(
            "laya: could not start the Laya daemon {} ({e})",
            runtime.display()
        ))
    };
    // The spawner keeps no stdin of the child, so serve makes the pipe and keeps its end.
    let (stdin_read, stdin) = std::io::pipe().map_err(cannot)?;
    let mut command = Command::new(runtime);
    command
        .args(argv)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::from(stdin_read))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut process = onebit_process::spawn(command).map_err(cannot)?;
    let (stdout, stderr) = (process.stdout.take(), process.stderr.take());
    let watch = Watch {
        process: Arc::new(process),
        ready: Arc::default(),
        gone: Arc::default(),
        stopping: Arc::default(),
        last_line: Arc::default(),
        counters: counters.clone(),
    };
    if let Some(stderr) = stderr {
        let last = watch.last_line.clone();
        thread("laya-stderr", move || keep_stderr(stderr, &last)).map_err(cannot)?;
    }
    let (lines_tx, lines) = mpsc::channel();
    let Some(stdout) = stdout else {
        return Err(cannot(std::io::Error::other("no stdout")));
    };
    let seen = watch.clone();
    thread("laya-stdout", move || read_stdout(stdout, &lines_tx, &seen)).map_err(cannot)?;
    Ok((stdin, lines, watch))
}

fn thread(name: &str, run: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(run)
        .map(|_| ())
}

/// Each stderr line at debug level, the last one kept.
fn keep_stderr(stderr: impl Read, last: &Mutex<(String, bool)>) {
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        tracing::debug!("1bit serve: laya daemon: {line}");
        if !line.trim().is_empty()
            && let Ok(mut last) = last.lock()
        {
            last.0 = line;
        }
    }
    if let Ok(mut last) = last.lock() {
        last.1 = true;
    }
}

/// Each stdout line to the asking side; at its end (the daemon exited), once it had been
/// ready and serve is not stopping it, the death is said and shown in `/metrics`.
fn read_stdout(stdout: impl Read, lines: &mpsc::Sender<String>, watch: &Watch) {
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        if lines.send(line).is_err() {
            break;
        }
    }
    watch.gone.store(true, Ordering::SeqCst);
    if !watch.ready.load(Ordering::SeqCst) || watch.stopping.load(Ordering::SeqCst) {
        return;
    }
    watch.counters.laya_scorer_up(false);
    let how = match watch.process.wait_timeout(Duration::from_secs(2)) {
        Some(Ok(status)) => describe_exit(status),
        _ => "closed its output".to_string(),
    };
    if watch.stopping.load(Ordering::SeqCst) {
        return;
    }
    tracing::error!(
        "1bit serve: laya: the Laya daemon (pid {}) {how}{}; the rule-based classifier decides every new conversation from now on (onebit_laya_scorer_up 0)",
        watch.process.pid(),
        last_line(&watch.last_line)
    );
}

/// " (its last line: …)" for a daemon that exited: once its stderr is read to the end (up to
/// half a second), so the line is the last it wrote.
fn last_line(last: &Mutex<(String, bool)>) -> String {
    let until = Instant::now() + Duration::from_millis(500);
    while !last.lock().map(|l| l.1).unwrap_or(true) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    match last.lock().map(|l| l.0.trim().to_string()) {
        Ok(line) if !line.is_empty() => format!(" (its last line: {line})"),
        _ => String::new(),
    }
}

/// Wait for the ready line within `limit`. Err: why not, for the line.
fn wait_ready(
    lines: &mpsc::Receiver<String>,
    limit: Duration,
    process: &Process,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => match protocol::ready(&line) {
                Some(Ok(())) => return Ok(()),
                Some(Err(why)) => return Err(format!("did not start: {why}")),
                None => tracing::debug!("1bit serve: laya daemon: {line}"),
            },
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "did not say it was ready within {} s (ONEBIT_LAYA_READY_S)",
                    limit.as_secs_f64()
                ));
            }
            Err(RecvTimeoutError::Disconnected) => {
                let how = match process.wait_timeout(Duration::from_secs(2)) {
                    Some(Ok(status)) => describe_exit(status),
                    _ => "closed its output".to_string(),
                };
                return Err(format!("{how} before it said it was ready"));
            }
        }
    }
}

/// The asking thread: each question in turn, until serve drops the scorer (then its stdin
/// closes with it). A question whose asker gave up while it waited is not asked.
fn converse(mut stdin: impl Write, lines: &mpsc::Receiver<String>, jobs: mpsc::Receiver<Job>) {
    let mut owed = 0usize;
    for job in jobs {
        if job.reply.is_closed() {
            continue;
        }
        let answer = ask_one(&mut stdin, lines, &mut owed, &job);
        let _ = job.reply.send(answer);
    }
}

fn ask_one(
    stdin: &mut impl Write,
    lines: &mpsc::Receiver<String>,
    owed: &mut usize,
    job: &Job,
) -> Reply {
    let left = || job.deadline.saturating_duration_since(Instant::now());
    let gone = || (LayaFallback::Exited, String::new());
    // Answers to questions that ran out of time come first, in order; they are dropped.
    while *owed > 0 {
        match lines.recv_timeout(left()) {
            Ok(_) => *owed -= 1,
            Err(RecvTimeoutError::Timeout) => {
                return Err((
                    LayaFallback::Timeout,
                    "it had still not answered an earlier question".to_string(),
                ));
            }
            Err(RecvTimeoutError::Disconnected) => return Err(gone()),
        }
    }
    // Asked once its bound is over, it could only be late: it is not asked at all.
    if left().is_zero() {
        return Err((
            LayaFallback::Timeout,
            "it was still busy with earlier questions".to_string(),
        ));
    }
    let asked = protocol::question(&job.text);
    if stdin
        .write_all(asked.as_bytes())
        .and_then(|()| stdin.flush())
        .is_err()
    {
        return Err(gone());
    }
    match lines.recv_timeout(left()) {
        Ok(line) => protocol::answer(&line).map_err(|why| (LayaFallback::BadAnswer, why)),
        Err(RecvTimeoutError::Timeout) => {
            *owed += 1;
            Err((LayaFallback::Timeout, String::new()))
        }
        Err(RecvTimeoutError::Disconnected) => Err(gone()),
    }
}
