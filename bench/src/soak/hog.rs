//! The starved soak's CPU hog: one busy-looping process per core at serve's own priority,
//! bounded in time by `timeout` even if the soak itself dies, killed when dropped.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::Failure;

/// One `sh` loop per core, each under `timeout -s KILL` in a process group of its own; every
/// group SIGKILLed when dropped (on an error path too).
pub(super) struct Hog {
    loops: Vec<Child>,
}

impl Hog {
    /// Start one busy loop per core (`available_parallelism`), each ended by `timeout` after
    /// `limit` whatever becomes of the soak. Called once per starved run, on the soak's thread.
    pub(super) fn start(limit: Duration) -> Result<Hog, Failure> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut hog = Hog { loops: Vec::new() };
        for _ in 0..cores {
            let child = Command::new("timeout")
                .args(["-s", "KILL", &format!("{}s", limit.as_secs().max(1))])
                .args(["sh", "-c", "while :; do :; done"])
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| {
                    Failure::new(
                        format!("cannot start the CPU hog (timeout sh -c ...): {e}"),
                        "install coreutils' timeout and a POSIX sh",
                    )
                })?;
            hog.loops.push(child);
        }
        Ok(hog)
    }

    /// How many busy loops run (one per core).
    pub(super) fn cores(&self) -> usize {
        self.loops.len()
    }

    /// Kill every loop's group and reap it; the pids (`timeout` and its `sh`) still in /proc
    /// afterwards, which should be none.
    pub(super) fn stop(mut self) -> Vec<u32> {
        self.kill_all()
    }

    fn kill_all(&mut self) -> Vec<u32> {
        let mut members = Vec::new();
        for child in &mut self.loops {
            let group = child.id();
            members.push(group);
            members.extend(super::children(group));
            let _ = killpg(Pid::from_raw(group as i32), Signal::SIGKILL);
            let _ = kill(Pid::from_raw(group as i32), Signal::SIGKILL);
            let _ = child.wait();
        }
        self.loops.clear();
        std::thread::sleep(Duration::from_millis(100));
        super::still_running(members)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        self.kill_all();
    }
}
