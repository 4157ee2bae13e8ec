//! What serve tells the service manager that started it (systemd's `Type=notify`, the sd_notify
//! protocol): `MAINPID=` and a `STATUS=` line while loading, `READY=1` once `/health` answers
//! 200, `STOPPING=1` when a drain or an exit begins, and `WATCHDOG=1` every half
//! `WATCHDOG_USEC` while serve is healthy. Without `NOTIFY_SOCKET` every call does nothing.
//!
//! The protocol is one datagram per message, newline-separated `KEY=VALUE` lines, sent to the
//! `AF_UNIX` socket `NOTIFY_SOCKET` names: a path (`/run/user/1000/systemd/notify`) or, after a
//! leading `@`, a Linux abstract-namespace name. The kernel attaches serve's credentials, which
//! systemd checks against the unit's main pid. serve's `notify` calls go through the functions
//! below, from any thread; each sends at most one small datagram and never waits longer than
//! [`SEND_LIMIT`].

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use onebit_supervision::backends::health::{Status, StatusCell};

/// The longest a send may block (a service manager that stopped reading its socket).
const SEND_LIMIT: Duration = Duration::from_secs(1);

/// Where serve's messages go, read from the environment once.
struct Notifier {
    socket: UnixDatagram,
    to: SocketAddr,
    /// `NOTIFY_SOCKET` as given, for the warning a failed send prints.
    named: String,
    /// `WATCHDOG_USEC` when it is set for this process.
    watchdog: Option<Duration>,
    /// Whether a failed send was already reported (once is enough).
    warned: AtomicBool,
}

/// The service manager's socket. A static because the operating system makes it one per
/// process: systemd names it in this process's environment and checks the datagrams' sender
/// against the unit's main pid, so every part of serve that reports (the start, the stop, the
/// watchdog pings) reports on the same one. Opened by [`open`], before serve starts.
static NOTIFIER: OnceLock<Option<Notifier>> = OnceLock::new();

/// Open the service manager's socket `NOTIFY_SOCKET` names, or none when serve is not the
/// service: `under_lemonade` (`1bit llama-server`), whose supervisor is Lemonade, so a
/// `NOTIFY_SOCKET` it inherited names Lemonade's own service. Called once by serve before it
/// reports anything; later calls change nothing.
pub fn open(under_lemonade: bool) {
    if under_lemonade {
        let _ = NOTIFIER.set(None);
    }
    let _ = notifier();
}

fn notifier() -> Option<&'static Notifier> {
    NOTIFIER
        .get_or_init(|| {
            let named = std::env::var("NOTIFY_SOCKET").ok()?;
            let watchdog = watchdog_period(
                std::env::var("WATCHDOG_USEC").ok().as_deref(),
                std::env::var("WATCHDOG_PID").ok().as_deref(),
                std::process::id(),
            );
            match Notifier::open(&named, watchdog) {
                Ok(n) => Some(n),
                Err(why) => {
                    tracing::warn!(
                        "1bit serve: warning: NOTIFY_SOCKET={named}: {why}; serve will not tell the service manager when it is ready"
                    );
                    None
                }
            }
        })
        .as_ref()
}

impl Notifier {
    fn open(named: &str, watchdog: Option<Duration>) -> Result<Notifier, String> {
        let to = socket_address(named)?;
        let socket = UnixDatagram::unbound().map_err(|e| format!("no datagram socket ({e})"))?;
        socket
            .set_write_timeout(Some(SEND_LIMIT))
            .map_err(|e| format!("no send timeout ({e})"))?;
        Ok(Notifier {
            socket,
            to,
            named: named.to_string(),
            watchdog,
            warned: AtomicBool::new(false),
        })
    }

    fn send(&self, message: &str) {
        if let Err(e) = self.socket.send_to_addr(message.as_bytes(), &self.to)
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                "1bit serve: warning: cannot notify the service manager at {} ({e}); serve goes on without it",
                self.named
            );
        }
    }
}

/// The socket `NOTIFY_SOCKET` names: a path when it starts with `/`, an abstract name after a
/// leading `@` (the byte systemd writes for the name's leading NUL).
fn socket_address(named: &str) -> Result<SocketAddr, String> {
    if let Some(name) = named.strip_prefix('@') {
        SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| format!("not a usable abstract socket name ({e})"))
    } else if named.starts_with('/') {
        SocketAddr::from_pathname(named).map_err(|e| format!("not a usable socket path ({e})"))
    } else {
        Err("neither a socket path (/…) nor an abstract socket name (@…)".to_string())
    }
}

/// The watchdog's period from `WATCHDOG_USEC`, when it is a positive number of microseconds
/// and `WATCHDOG_PID` (if set) names this process: the manager sets both for the main process,
/// and a child that inherited them must not answer for it.
fn watchdog_period(usec: Option<&str>, pid: Option<&str>, me: u32) -> Option<Duration> {
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    match pid {
        Some(p) if p.trim().parse::<u32>().ok() != Some(me) => None,
        _ => Some(Duration::from_micros(usec)),
    }
}

/// One line of a `STATUS=`: a message's newlines would start new `KEY=` lines.
fn status_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

fn send(message: impl FnOnce() -> String) {
    if let Some(n) = notifier() {
        n.send(&message());
    }
}

/// serve starts loading `model` on the `device` route: its pid and a status line.
pub fn loading(model: &str, device: &str) {
    send(|| {
        format!(
            "MAINPID={}\nSTATUS={}",
            std::process::id(),
            status_line(&format!("loading {model} on the {device} route"))
        )
    });
}

/// `/health` answers 200 from now on: `READY=1` and what is served where.
pub fn ready(model: &str, url: &str, device: &str) {
    send(|| {
        format!(
            "READY=1\nSTATUS={}",
            status_line(&format!("serving {model} on {url} (the {device} route)"))
        )
    });
}

/// A drain begins (`what`: the signal): `STOPPING=1` and how long requests in flight get.
pub fn draining(what: &str, window: Duration) {
    send(|| {
        format!(
            "STOPPING=1\nSTATUS={}",
            status_line(&format!(
                "draining ({what}): no new connections; requests in flight get up to {:.1} s",
                window.as_secs_f64()
            ))
        )
    });
}

/// serve is about to stop its backends and exit, for `reason` (the line it prints).
pub fn exiting(reason: &str) {
    send(|| {
        format!(
            "STOPPING=1\nSTATUS={}",
            status_line(&format!("exiting: {reason}"))
        )
    });
}

/// When the manager asked for a watchdog (`WATCHDOG_USEC`): a task on the runtime that sends
/// `WATCHDOG=1` every half period while `status` is [`Status::Ready`] (every backend answers its
/// health route, no backend failed, the progress watchdog has not fired). A serve whose
/// backends stop answering, or whose runtime stops running tasks, stops pinging, and the
/// manager restarts it after `WatchdogSec`. Abort the handle when serving ends.
pub fn spawn_watchdog(status: Arc<StatusCell>) -> Option<tokio::task::JoinHandle<()>> {
    let n = notifier()?;
    let period = n.watchdog? / 2;
    Some(tokio::spawn(async move {
        let mut every = tokio::time::interval(period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if status.get() == Status::Ready {
                n.send("WATCHDOG=1");
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_and_an_abstract_name_are_sockets_and_anything_else_is_refused() {
        let path = socket_address("/run/user/1000/systemd/notify").unwrap();
        assert_eq!(
            path.as_pathname(),
            Some(std::path::Path::new("/run/user/1000/systemd/notify"))
        );
        let abstract_name = socket_address("@/org/freedesktop/systemd1/notify/42").unwrap();
        assert_eq!(
            abstract_name.as_abstract_name(),
            Some(&b"/org/freedesktop/systemd1/notify/42"[..])
        );
        assert!(socket_address("vsock:2:1234").is_err());
        assert!(socket_address("").is_err());
    }

    #[test]
    fn the_watchdog_period_is_for_the_process_it_names() {
        let me = 4242;
        assert_eq!(
            watchdog_period(Some("30000000"), None, me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            watchdog_period(Some("30000000"), Some("4242"), me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(watchdog_period(Some("30000000"), Some("1"), me), None);
        assert_eq!(watchdog_period(Some("0"), None, me), None);
        assert_eq!(watchdog_period(Some("soon"), None, me), None);
        assert_eq!(watchdog_period(None, Some("4242"), me), None);
    }

    #[test]
    fn a_status_stays_one_line() {
        assert_eq!(status_line("a\nb\rc"), "a b c");
    }
}
