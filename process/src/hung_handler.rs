//! Seeing a process hang in its own SIGTERM handler, from `/proc` (Linux): how
//! [`crate::stop_all`] knows not to wait out the grace for it.
//!
//! A handler that takes a lock the thread it interrupted holds waits forever, and the process
//! can never exit by itself: llama-server's does (its handler takes the task queue's mutex,
//! which the main thread it runs on holds for much of each decode step; seen in the suite, one
//! stop in eight under load). Waiting out a stop's grace for such a process only delays the kill.
//!
//! While a thread runs a handler, the kernel blocks that signal in the thread's mask. So a
//! thread whose mask did not hold SIGTERM before it was sent, holds it now, and sleeps in
//! `futex` is inside the handler waiting on a lock; seen so for [`HUNG_AFTER`] on end, it is
//! taken as hung. A handler that only sets a flag (tokio's, most servers') returns in
//! microseconds; a program that ignores SIGTERM, or catches it on a thread of its own with
//! `sigwait`, never shows the pattern, and gets the whole grace as before.

use std::time::{Duration, Instant};

/// How long a thread must be seen waiting on a lock inside its SIGTERM handler to be hung.
pub(crate) const HUNG_AFTER: Duration = Duration::from_millis(500);

/// SIGTERM's bit in the masks of `/proc/PID/status` (bit N-1 for signal N).
const SIGTERM_BIT: u64 = 1 << (libc::SIGTERM - 1);

/// One process's threads as they were before SIGTERM was sent, and since when one of them has
/// looked hung.
pub(crate) struct Watch {
    pid: u32,
    /// The threads that did not block SIGTERM before it was sent (threads started later are
    /// not watched: their masks have no "before").
    threads: Vec<u32>,
    since: Option<Instant>,
}

impl Watch {
    /// Look at `pid` before SIGTERM is sent to it. `None` when it does not catch SIGTERM (its
    /// default action ends it, no handler can hang) or `/proc` says nothing.
    pub(crate) fn before_sigterm(pid: u32) -> Option<Watch> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        if !mask_has_sigterm(field(&status, "SigCgt")?) {
            return None;
        }
        let threads: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .ok()?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|tid| {
                read_task(pid, *tid, "status")
                    .and_then(|s| field(&s, "SigBlk").map(|m| !mask_has_sigterm(m)))
                    .unwrap_or(false)
            })
            .collect();
        (!threads.is_empty()).then_some(Watch {
            pid,
            threads,
            since: None,
        })
    }

    /// Whether, looked at `now`, a watched thread has waited on a lock inside its SIGTERM
    /// handler for [`HUNG_AFTER`] on end. Call it every few tens of milliseconds.
    pub(crate) fn hung(&mut self, now: Instant) -> bool {
        let waiting = self.threads.iter().any(|tid| {
            let (Some(status), Some(syscall)) = (
                read_task(self.pid, *tid, "status"),
                read_task(self.pid, *tid, "syscall"),
            ) else {
                return false;
            };
            waits_on_a_lock_in_its_handler(&status, &syscall)
        });
        if !waiting {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        now.duration_since(since) >= HUNG_AFTER
    }
}

fn read_task(pid: u32, tid: u32, file: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{file}")).ok()
}

/// From a thread's `status` and `syscall` files: SIGTERM is blocked in its mask, it sleeps,
/// and the call it sleeps in is `futex` (a mutex or a condition variable).
fn waits_on_a_lock_in_its_handler(status: &str, syscall: &str) -> bool {
    let blocked = field(status, "SigBlk").is_some_and(mask_has_sigterm);
    let sleeping = field(status, "State").is_some_and(|s| s.starts_with('S'));
    let in_futex = syscall
        .split_whitespace()
        .next()
        .and_then(|n| n.parse::<libc::c_long>().ok())
        == Some(libc::SYS_futex);
    blocked && sleeping && in_futex
}

/// The value of `key:` in a `/proc` status file.
fn field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k == key).then(|| v.trim())
    })
}

/// Whether a hexadecimal signal mask from `/proc` holds SIGTERM (an unreadable mask does not).
fn mask_has_sigterm(mask: &str) -> bool {
    u64::from_str_radix(mask, 16).is_ok_and(|m| m & SIGTERM_BIT != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread's status as `/proc` writes it, the lines that matter here.
    fn status(state: &str, blocked: &str) -> String {
        format!(
            "Name:\tllama-server\nState:\t{state}\nSigQ:\t0/95044\nSigPnd:\t0000000000000000\nSigBlk:\t{blocked}\nSigIgn:\t0000000000001000\nSigCgt:\t0000000100004002\n"
        )
    }

    #[test]
    fn a_thread_asleep_in_futex_with_sigterm_blocked_waits_in_its_handler() {
        let futex = format!(
            "{} 0x5574 0x80 0x2 0x0 0x0 0x0 0x7ffc 0x7fa8",
            libc::SYS_futex
        );
        // What the suite's hung llama-server's main thread showed (SigBlk 0x4000: SIGTERM).
        assert!(waits_on_a_lock_in_its_handler(
            &status("S (sleeping)", "0000000000004000"),
            &futex
        ));
        // Not blocked: an ordinary wait on a lock.
        assert!(!waits_on_a_lock_in_its_handler(
            &status("S (sleeping)", "0000000000000000"),
            &futex
        ));
        // Blocked but running, or asleep in another call (a handler writing to a pipe).
        assert!(!waits_on_a_lock_in_its_handler(
            &status("R (running)", "0000000000004000"),
            "running"
        ));
        assert!(!waits_on_a_lock_in_its_handler(
            &status("S (sleeping)", "0000000000004000"),
            "1 0x3 0x7f 0x1 0x0 0x0 0x0 0x7ffc 0x7fa8"
        ));
        // SIGINT alone (bit 1) is not SIGTERM.
        assert!(!waits_on_a_lock_in_its_handler(
            &status("S (sleeping)", "0000000000000002"),
            &futex
        ));
    }

    #[test]
    fn masks_and_fields_are_read_as_proc_writes_them() {
        assert!(mask_has_sigterm("0000000000004000"));
        assert!(mask_has_sigterm("fffffffe7ffbfeff"));
        assert!(!mask_has_sigterm("fffffffe7fffbeff"));
        assert!(!mask_has_sigterm("not hex"));
        let s = status("S (sleeping)", "0000000000004000");
        assert_eq!(field(&s, "SigCgt"), Some("0000000100004002"));
        assert_eq!(field(&s, "Sig"), None);
    }

    #[test]
    fn a_process_that_does_not_catch_sigterm_is_not_watched_and_one_that_does_is() {
        // `sleep` keeps SIGTERM's default action: nothing can hang in a handler it lacks.
        let mut sleep = std::process::Command::new("sleep");
        sleep.arg("30");
        let p = crate::spawn(sleep).unwrap();
        assert!(Watch::before_sigterm(p.pid()).is_none());
        p.stop(Duration::from_secs(2));
        // A shell that traps TERM catches it, and its one thread does not block it.
        let mut sh = std::process::Command::new("/bin/sh");
        sh.args(["-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]);
        let p = crate::spawn(sh).unwrap();
        let caught = (0..100).find_map(|_| {
            std::thread::sleep(Duration::from_millis(10));
            Watch::before_sigterm(p.pid())
        });
        assert_eq!(caught.map(|w| w.threads), Some(vec![p.pid()]));
        p.stop(Duration::from_secs(2));
    }
}
