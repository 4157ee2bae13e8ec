//! The CPU hog of the starved soak and of `bench hop --hog`: one busy-looping process per core
//! at serve's own priority, bounded in time by `timeout` even if the caller dies, killed when
//! dropped.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::Failure;

/// One `sh` loop per core, each under `timeout -s KILL` in a process group of its own; every
/// group SIGKILLed when dropped (on an error path too).
pub(crate) struct Hog {
    loops: Vec<Child>,
}

impl Hog {
    /// Start one busy loop per core (`available_parallelism`), each ended by `timeout` after
    /// `limit` whatever becomes of the caller. Called once per starved soak or `--hog` bench run,
    /// on its thread.
    pub(crate) fn start(limit: Duration) -> Result<Hog, Failure> {
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
    pub(crate) fn cores(&self) -> usize {
        self.loops.len()
    }

    /// Kill every loop's group and reap it; the pids (`timeout` and its `sh`) still in /proc
    /// afterwards, which should be none.
    pub(crate) fn stop(mut self) -> Vec<u32> {
        self.kill_all()
    }

    /// Each loop's `timeout` is sent SIGTERM, which it passes to its `sh` and then reaps it
    /// before it exits itself, so no loop is left a zombie for PID 1 to reap (here PID 1 may
    /// never do so); a group that has not ended within a second is SIGKILLed.
    fn kill_all(&mut self) -> Vec<u32> {
        let mut members = Vec::new();
        for child in &self.loops {
            members.push(child.id());
            members.extend(super::children(child.id()));
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        }
        for child in &mut self.loops {
            let ends = std::time::Instant::now() + Duration::from_secs(1);
            while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < ends {
                std::thread::sleep(Duration::from_millis(10));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                let _ = child.wait();
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Stopped, the hog leaves nothing behind, not even a zombie loop waiting for PID 1 (seen
    /// in CI when every group was SIGKILLed: `timeout` died before it could reap its `sh`).
    #[test]
    fn a_stopped_hog_leaves_no_loop_behind() {
        let hog = Hog::start(Duration::from_secs(20)).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let loops: Vec<u32> = hog
            .loops
            .iter()
            .flat_map(|c| super::super::children(c.id()))
            .collect();
        assert_eq!(loops.len(), hog.cores(), "one sh per core under timeout");
        assert_eq!(hog.stop(), Vec::<u32>::new());
        for pid in loops {
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "loop {pid} is still in /proc"
            );
        }
    }
}
