//! The keeper: a small process each copy of this crate starts once, which SIGKILLs the process
//! groups this process started when this process is gone, however it died.
//!
//! The parent-death signal kills the processes [`crate::spawn`] starts, but not what *they*
//! start with a plain fork (an engine's own helpers): those are orphaned and live on after a
//! `kill -9` of serve. They stay in their starter's process group unless they leave it, so the
//! keeper kills that group. It learns each group from the child itself, before the child's
//! exec (no window in which the child runs unknown to it), over a socket whose other end only
//! this process holds; the socket reaching its end (every copy of that end closed, which the
//! kernel does for any death, `kill -9` included, and for a clean exit) is its signal. It
//! forgets a group within [`crate::groups::PRUNE_EVERY_MS`] of the group emptying, so a process id the
//! system reuses later is never killed.
//!
//! Where it lives: double-forked from this process (so it is nobody's child here, and
//! `/proc/PID/task/*/children` of serve lists the backends alone), in a session of its own (a
//! terminal's Ctrl-C and hang-up do not reach it), with every descriptor closed (it holds no
//! socket, port or pipe of serve's), SIGTERM, SIGINT, SIGHUP and SIGQUIT ignored (a stop of
//! serve's service does not end it before serve: it ends itself once serve has), and the name
//! `onebit-keeper` (`/proc/PID/comm`; its command line stays its starter's, as it never execs).
//! It runs only what is safe after a fork in a threaded process: system calls, no allocation.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use crate::sys;

/// This process's end of the keeper's socket: started by the first [`crate::spawn`], held
/// for the process's life (its closing, at death, is what the keeper waits for); or why the
/// keeper could not start.
// A static because the guard is the process's: one keeper for every thread that spawns.
static KEEPER: OnceLock<Result<OwnedFd, String>> = OnceLock::new();

/// The socket a child announces itself on, the keeper started on first use. Blocks for the
/// keeper's start (two forks and its ready message) on the first call only.
pub(crate) fn socket() -> std::io::Result<RawFd> {
    match KEEPER.get_or_init(|| sys::start_keeper().map_err(|e| e.to_string())) {
        Ok(fd) => Ok(fd.as_raw_fd()),
        Err(why) => Err(std::io::Error::other(format!(
            "cannot start the keeper that kills what this process's children start should it die ({why})"
        ))),
    }
}
