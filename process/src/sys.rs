//! The two calls of this crate that have no safe equivalent: the pre-exec hook that runs in the
//! forked child (its own process group, the parent-death signal), and kill(2) of a group.

// Unsafe is allowed here alone in this crate: the spawner's pre-exec hook (setpgid, prctl) runs in the forked child, and kill(2) of a group.
#![allow(unsafe_code)]

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Make the child die with this process, even when it is SIGKILLed, and lead its own process
/// group (so a terminal's Ctrl-C reaches the starter alone, and a stop reaches what the child
/// started).
pub(crate) fn die_with_starter(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (setpgid, prctl, getppid, _exit); it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            libc::setpgid(0, 0);
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The starter may have died between fork and prctl; then nobody would kill us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Send `signal` to the process group `group` (a process's id, as each leads its own group).
pub(crate) fn kill_group(group: u32, signal: i32) {
    // SAFETY: kill(2) with a negative pid (a process group) has no memory effects.
    unsafe {
        libc::kill(-(group as libc::pid_t), signal);
    }
}
