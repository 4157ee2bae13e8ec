//! The one way the host (`1bit serve`, `1bit rpc-worker`, `1bit plugins check`), a route, and a
//! program they start (such as `1bit-prefill-llama`) start a process: it dies with its starter,
//! leads its own process group, and is stopped by one sequence (SIGTERM to the group, a grace,
//! SIGKILL to the group, reaped). `clippy.toml` bans a bare `Command::spawn` in serve's code for
//! this crate's [`spawn`].
//!
//! Not part of the route ABI (onebit-plugin-api): ordinary Rust code that the host, each route
//! library and each shipped program link as any library, each its own copy, so a change here
//! bumps no ABI version and needs no route rebuilt. Each copy forks on its own thread that
//! lives as long as the process, because Linux sends a child's parent-death signal when the
//! *thread* that forked it ends, and tokio's blocking threads come and go.
//!
//! A process started here gets `PR_SET_PDEATHSIG` (SIGKILL), so a `kill -9` of its starter
//! kills it too; a program started here that starts its own children starts them here as well,
//! so the guard reaches the whole tree. What a started program forks by other means (a vendor's
//! closed engine and its own helpers) has no parent-death signal, but stays in the program's
//! process group, so the stop sequence reaches it, and so does the keeper when the starter dies
//! without a stop: a process of this crate's (`keeper`), started with the first [`spawn`], that
//! SIGKILLs every group started here once the starter is gone, `kill -9` included. A process
//! that leaves its group (`setsid`, `setpgid`) escapes both; nothing here can follow it.
//!
//! The stop does not wait out the grace for a process that hung in its own SIGTERM handler
//! (`hung_handler`): it can never exit by itself, so it is SIGKILLed once seen so.
//!
//! `unsafe` (denied in the workspace) is allowed in one private module, `sys`: the pre-exec
//! hook (setpgid, prctl, the group told to the keeper) that runs in the forked child, kill(2)
//! of a process group, the keeper's forks and system calls, sysconf (the unit of the CPU
//! time [`cpu_time`] reads from `/proc`), and fflush and `_exit` for [`exit`], this process's
//! own end without the `atexit` handlers that would run under a route's working threads.

#![deny(missing_docs)]

mod cpu_time;
mod exit;
mod groups;
mod hung_handler;
mod keeper;
mod sys;

pub use cpu_time::cpu_time;
pub use exit::exit;

use std::io;
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

/// How long a process group has to die after SIGKILL before [`stop_all`] gives up on it (a
/// process stuck in the kernel, say in a GPU driver).
pub const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often [`stop_all`] looks at the processes it waits for within the grace.
const STOP_POLL: Duration = Duration::from_millis(25);

/// A process started by [`spawn`]. Its exit is reaped by a thread of its own, so
/// [`Process::wait`], [`Process::has_exited`] and the stop sequence may be asked from any thread.
pub struct Process {
    pid: u32,
    /// Its stdout, when the command piped it; take it once.
    pub stdout: Option<ChildStdout>,
    /// Its stderr, when the command piped it; take it once.
    pub stderr: Option<ChildStderr>,
    exit: Arc<(Mutex<Option<io::Result<ExitStatus>>>, Condvar)>,
    /// Set by [`stop_all`] when it killed the process for hanging in its SIGTERM handler.
    hung_in_sigterm_handler: AtomicBool,
}

/// How [`stop_all`] ended for one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// It had exited already, or exited within the grace after SIGTERM.
    Exited,
    /// It outlived the grace, or hung in its SIGTERM handler before the grace ended
    /// ([`Process::hung_in_sigterm_handler`] says which), and was SIGKILLed (its group with
    /// it), then reaped.
    Killed,
    /// It outlived SIGKILL by [`KILL_WAIT`] (stuck in the kernel); nothing more can be done.
    Stuck,
}

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// The thread that forks every process this copy of the crate starts (see the crate doc).
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnJob>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (jobs, queue) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("spawner".into())
            .spawn(move || {
                for (mut command, reply) in queue {
                    let _ = reply.send(spawn_retrying_busy(&mut command));
                }
            })
            .expect("a thread can be started");
        Mutex::new(jobs)
    })
}

/// Spawn, retrying briefly while the program file is "busy" (ETXTBSY): a program that was just
/// written can still be open for writing in a process another thread is forking.
// The one place a process is spawned; everything else calls `spawn` here.
#[allow(clippy::disallowed_methods)]
fn spawn_retrying_busy(command: &mut Command) -> io::Result<Child> {
    const ETXTBSY: i32 = 26;
    let mut tries = 0;
    loop {
        match command.spawn() {
            Err(e) if e.raw_os_error() == Some(ETXTBSY) && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// Start `command` under the guard (parent-death signal, own process group, the check for a
/// starter that died while it was being started, the group told to the keeper). Blocks for the
/// fork only (and, on the first call, for the keeper's start); callable from any thread. The
/// command's stdin, stdout and stderr are as the caller set them; piped ones are in
/// [`Process::stdout`] and [`Process::stderr`]. Fails, saying so, when the keeper cannot start.
pub fn spawn(mut command: Command) -> io::Result<Process> {
    sys::die_with_starter(&mut command, keeper::socket()?);
    let gone = || io::Error::other("the spawner thread is gone");
    let (reply, answer) = mpsc::channel();
    spawner()
        .lock()
        .map_err(|_| gone())?
        .send((command, reply))
        .map_err(|_| gone())?;
    let mut child = answer.recv().map_err(|_| gone())??;
    let exit = Arc::new((Mutex::new(None), Condvar::new()));
    let process = Process {
        pid: child.id(),
        stdout: child.stdout.take(),
        stderr: child.stderr.take(),
        exit: exit.clone(),
        hung_in_sigterm_handler: AtomicBool::new(false),
    };
    std::thread::Builder::new()
        .name(format!("reap-{}", process.pid))
        .spawn(move || {
            let status = child.wait();
            let (cell, changed) = &*exit;
            if let Ok(mut cell) = cell.lock() {
                *cell = Some(status);
            }
            changed.notify_all();
        })?;
    Ok(process)
}

impl Process {
    /// The process id (also its process group id: each process leads a group of its own).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether it exited (and was reaped).
    pub fn has_exited(&self) -> bool {
        self.exit.0.lock().map(|c| c.is_some()).unwrap_or(true)
    }

    /// Wait up to `limit` for it to exit; its status when it did. Blocks.
    pub fn wait_timeout(&self, limit: Duration) -> Option<io::Result<ExitStatus>> {
        let deadline = Instant::now() + limit;
        let (cell, changed) = &*self.exit;
        let mut cell = cell.lock().ok()?;
        loop {
            if let Some(status) = cell.as_ref() {
                return Some(match status {
                    Ok(s) => Ok(*s),
                    Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                });
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            cell = changed.wait_timeout(cell, left).ok()?.0;
        }
    }

    /// Wait for it to exit. Blocks.
    pub fn wait(&self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.wait_timeout(Duration::from_secs(3600)) {
                return status;
            }
        }
    }

    /// Send `signal` (a `libc::SIG*` number) to its process group. After it exited, the
    /// group may still hold what it started, so the signal is sent all the same.
    pub fn signal_group(&self, signal: i32) {
        sys::kill_group(self.pid, signal);
    }

    /// Whether [`stop_all`] killed it before its grace ended because it hung in its own
    /// SIGTERM handler (waiting on a lock it cannot get).
    pub fn hung_in_sigterm_handler(&self) -> bool {
        self.hung_in_sigterm_handler.load(Ordering::Relaxed)
    }

    /// The stop sequence for this one process: see [`stop_all`]. Blocks.
    pub fn stop(&self, grace: Duration) -> Stopped {
        stop_all(&[self], grace)[0]
    }
}

/// The one stop sequence: SIGTERM to each process's group, up to `grace` for all of them to
/// exit, then SIGKILL to the groups of those left and up to [`KILL_WAIT`] for them to be
/// reaped. A process seen hanging in its own SIGTERM handler is SIGKILLed then, not at the
/// grace's end ([`Process::hung_in_sigterm_handler`]). A process that already exited costs no
/// wait; its group still gets the SIGKILL, so nothing it started outlives it. Blocks (at most
/// `grace` + [`KILL_WAIT`]).
pub fn stop_all(processes: &[&Process], grace: Duration) -> Vec<Stopped> {
    let mut watches: Vec<Option<hung_handler::Watch>> = processes
        .iter()
        .map(|p| {
            (!p.has_exited())
                .then(|| hung_handler::Watch::before_sigterm(p.pid))
                .flatten()
        })
        .collect();
    for p in processes.iter().filter(|p| !p.has_exited()) {
        p.signal_group(libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    let mut outcome = vec![Stopped::Exited; processes.len()];
    loop {
        let mut waiting = None;
        for (i, p) in processes.iter().enumerate() {
            if outcome[i] == Stopped::Killed || p.has_exited() {
                continue;
            }
            if watches[i].as_mut().is_some_and(|w| w.hung(Instant::now())) {
                p.hung_in_sigterm_handler.store(true, Ordering::Relaxed);
                p.signal_group(libc::SIGKILL);
                outcome[i] = Stopped::Killed;
                watches[i] = None;
                continue;
            }
            waiting.get_or_insert(i);
        }
        let Some(first) = waiting else { break };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        // A process without a watch needs no look until the grace ends.
        let look_in = if watches.iter().any(Option::is_some) {
            left.min(STOP_POLL)
        } else {
            left
        };
        processes[first].wait_timeout(look_in);
    }
    for (i, p) in processes.iter().enumerate() {
        if !p.has_exited() {
            outcome[i] = Stopped::Killed;
        }
    }
    for p in processes {
        p.signal_group(libc::SIGKILL);
    }
    let deadline = Instant::now() + KILL_WAIT;
    for (i, p) in processes.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        if outcome[i] == Stopped::Killed && p.wait_timeout(left).is_none() {
            outcome[i] = Stopped::Stuck;
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.args(["-c", script]);
        c
    }

    fn alive(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z ")
    }

    #[test]
    fn a_process_leads_its_own_group_and_its_exit_is_seen() {
        let p = spawn(sh("exit 3")).unwrap();
        let status = p.wait_timeout(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(status.code(), Some(3));
        assert!(p.has_exited());
        let p = spawn(sh("sleep 30")).unwrap();
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.pid())).unwrap();
        let after = stat.rsplit_once(')').unwrap().1;
        let pgrp: u32 = after.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert_eq!(pgrp, p.pid());
        assert_eq!(p.stop(Duration::from_secs(2)), Stopped::Exited);
    }

    #[test]
    fn a_process_that_ignores_sigterm_is_killed_with_its_group_after_the_grace() {
        let mut command = sh("trap '' TERM; sleep 30 & echo $!; wait");
        command.stdout(std::process::Stdio::piped());
        let mut p = spawn(command).unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(p.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let grandchild: u32 = line.trim().parse().unwrap();
        let started = Instant::now();
        assert_eq!(p.stop(Duration::from_millis(300)), Stopped::Killed);
        assert!(started.elapsed() < Duration::from_secs(3));
        let gone = Instant::now() + Duration::from_secs(2);
        while alive(grandchild) && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive(grandchild), "the group's sleep outlived the stop");
    }

    /// The variable that makes this test binary, run again, the starter below.
    const STARTER: &str = "ONEBIT_PROCESS_TEST_STARTER";

    #[test]
    // The test's own starter is a plain child: it is what gets `kill -9`.
    #[allow(clippy::disallowed_methods)]
    fn a_kill_9_of_the_starter_kills_what_its_processes_forked() {
        let mut starter = Command::new(std::env::current_exe().unwrap());
        starter
            .args(["--exact", "tests::starter", "--ignored", "--nocapture"])
            .env(STARTER, "1")
            .stdout(std::process::Stdio::piped());
        let mut starter = starter.spawn().unwrap();
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(starter.stdout.take().unwrap()));
        let forked: u32 = lines
            .find_map(|l| l.ok()?.strip_prefix("forked ")?.trim().parse().ok())
            .expect("the starter says what its process forked");
        assert!(alive(forked));
        starter.kill().unwrap();
        starter.wait().unwrap();
        let gone = Instant::now() + Duration::from_secs(5);
        while alive(forked) && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(10));
        }
        let survived = alive(forked);
        if survived {
            sys::kill_group(forked, libc::SIGKILL);
        }
        assert!(
            !survived,
            "a process forked (not spawned here) by a started process outlived kill -9 of the starter"
        );
    }

    /// Run by the test above as a process of its own: starts a shell that forks a sleep that
    /// ignores SIGTERM (no parent-death signal: the shell forked it), says the sleep's pid, and
    /// waits to be killed.
    #[test]
    #[ignore = "a helper: run by a_kill_9_of_the_starter_kills_what_its_processes_forked"]
    fn starter() {
        if std::env::var_os(STARTER).is_none() {
            return;
        }
        let mut command = sh("trap '' TERM; sleep 60 & echo $!; wait");
        command.stdout(std::process::Stdio::piped());
        let mut p = spawn(command).unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(p.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        println!("forked {}", line.trim());
        std::thread::sleep(Duration::from_secs(60));
    }
}
