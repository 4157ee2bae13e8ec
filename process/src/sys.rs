//! The calls of this crate that have no safe equivalent: the pre-exec hook that runs in the
//! forked child (its own process group, the parent-death signal, its group told to the
//! keeper), kill(2) of a group, the keeper's start and life (`keeper`), which run between a
//! fork and an `_exit` in a threaded process, the unit of `/proc`'s times (`cpu_time`), and
//! this process's own end (`exit`).

// Unsafe is allowed here alone in this crate: the spawner's pre-exec hook (setpgid, prctl, send) runs in the forked child, kill(2) of a group, the keeper's forks and system calls, sysconf, and fflush and _exit.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use crate::groups::{Groups, PRUNE_EVERY_MS};

/// Make the child die with this process, even when it is SIGKILLed, lead its own process
/// group (so a terminal's Ctrl-C reaches the starter alone, and a stop reaches what the child
/// started), and tell the keeper (`keeper`'s socket) that group before it execs.
pub(crate) fn die_with_starter(command: &mut Command, keeper: RawFd) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and calls only
    // async-signal-safe functions (setpgid, prctl, getppid, getpid, send, _exit); it allocates
    // nothing.
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
            // Our group, to the keeper. A keeper that is gone (killed by hand) costs the
            // guard over our own children, not the start: the send's failure is ignored.
            let group = libc::getpid().to_ne_bytes();
            libc::send(
                keeper,
                group.as_ptr().cast(),
                group.len(),
                libc::MSG_NOSIGNAL,
            );
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

/// Start the keeper (see `keeper`): a socket pair, a fork whose child starts a session of its
/// own and forks the keeper, then exits (so the keeper is not this process's child); returns
/// this process's end once the keeper said it is ready. Blocks for that.
pub(crate) fn start_keeper() -> io::Result<OwnedFd> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: socketpair writes two descriptors into the array it is given, which has two.
    let made = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if made != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made by socketpair and belong to nothing else.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // Read before the fork: the child may only make system calls.
    let open_limit = open_limit();
    // SAFETY: the child runs `between` alone, which makes only async-signal-safe calls and
    // ends in _exit: nothing of this process's other threads (locks, allocator) is touched.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        between(theirs.as_raw_fd(), open_limit);
    }
    drop(theirs);
    let mut status = 0;
    // SAFETY: waitpid writes the status of our own child into `status`.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            break; // reaped by someone else: the ready message below says whether it worked
        }
    }
    let mut ready = [0u8; 4];
    loop {
        // SAFETY: recv writes at most ready.len() bytes into `ready`.
        let got =
            unsafe { libc::recv(ours.as_raw_fd(), ready.as_mut_ptr().cast(), ready.len(), 0) };
        if got == ready.len() as isize {
            return Ok(ours);
        }
        let e = io::Error::last_os_error();
        if got < 0 && e.kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return Err(if got < 0 {
            e
        } else {
            io::Error::other("the keeper ended before it was ready")
        });
    }
}

/// The descriptors a process may have open, for closing them one by one where close_range(2)
/// is missing.
fn open_limit() -> libc::c_int {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    limit.rlim_cur.min(65536) as libc::c_int
}

/// The first fork's child: a session of its own, then the keeper forked, then gone.
fn between(socket: RawFd, open_limit: libc::c_int) -> ! {
    // SAFETY: setsid, fork and _exit are async-signal-safe; the grandchild runs `keep`,
    // which is too, and never returns.
    unsafe {
        libc::setsid();
        match libc::fork() {
            0 => keep(socket, open_limit),
            -1 => libc::_exit(1),
            _ => libc::_exit(0),
        }
    }
}

/// The keeper's life: signals, name, folder and descriptors made its own, ready said, then the
/// groups learned until the socket ends, and each SIGKILLed.
fn keep(socket: RawFd, open_limit: libc::c_int) -> ! {
    const FD: RawFd = 3;
    // SAFETY: every call here is an async-signal-safe system call on values this function
    // owns (its descriptors, its stack); nothing allocates, and it ends in _exit.
    unsafe {
        for signal in 1..=64 {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT] {
            libc::signal(signal, libc::SIG_IGN);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::prctl(libc::PR_SET_NAME, c"onebit-keeper".as_ptr());
        libc::chdir(c"/".as_ptr());
        if socket != FD && libc::dup2(socket, FD) != FD {
            libc::_exit(1);
        }
        for fd in 0..FD {
            libc::close(fd);
        }
        if libc::syscall(libc::SYS_close_range, FD + 1, libc::c_uint::MAX, 0) != 0 {
            for fd in FD + 1..open_limit {
                libc::close(fd);
            }
        }
        let ready = 0i32.to_ne_bytes();
        libc::send(FD, ready.as_ptr().cast(), ready.len(), libc::MSG_NOSIGNAL);
        let mut groups = Groups::new();
        loop {
            let mut readable = libc::pollfd {
                fd: FD,
                events: libc::POLLIN,
                revents: 0,
            };
            let wait = if groups.is_empty() {
                -1
            } else {
                PRUNE_EVERY_MS
            };
            let polled = libc::poll(&mut readable, 1, wait);
            if polled == 0 {
                groups.retain(group_exists);
                continue;
            }
            if polled < 0 {
                if errno() == libc::EINTR {
                    continue;
                }
                break;
            }
            let mut record = [0u8; 4];
            let got = libc::recv(FD, record.as_mut_ptr().cast(), record.len(), 0);
            if got == record.len() as isize {
                let group = i32::from_ne_bytes(record);
                groups.retain(group_exists);
                groups.learn(group);
            } else if got == 0 {
                break; // every copy of the other end closed: the starter is gone
            } else if got < 0 && !matches!(errno(), libc::EINTR | libc::EAGAIN) {
                break;
            }
        }
        for &group in groups.ids() {
            libc::kill(-group, libc::SIGKILL);
        }
        libc::_exit(0)
    }
}

/// Whether process group `group` has a member (one we may not signal counts).
fn group_exists(group: i32) -> bool {
    // SAFETY: kill(2) with signal 0 sends nothing; errno is this thread's.
    unsafe { libc::kill(-group, 0) == 0 || errno() == libc::EPERM }
}

/// This thread's errno, read without allocating.
fn errno() -> i32 {
    // SAFETY: __errno_location returns this thread's errno, always valid to read.
    unsafe { *libc::__errno_location() }
}

/// The unit of `/proc`'s times (`_SC_CLK_TCK`; 100, Linux's, when it cannot be read).
pub(crate) fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a constant of the system; it takes no pointer and has no
    // precondition.
    match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as u64,
        _ => 100,
    }
}

/// C's stdio buffers flushed (a route's library may have printed through them), then
/// `_exit(code)`: no `atexit` handler runs (`exit`).
pub(crate) fn flush_stdio_and_exit(code: i32) -> ! {
    // SAFETY: fflush(NULL) flushes every open output stream under stdio's own locks; _exit
    // ends the process without touching any state of this one.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}
