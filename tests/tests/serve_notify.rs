//! sd_notify: the test plays systemd, binding the datagram socket `NOTIFY_SOCKET` names (a path,
//! and an abstract name), and watches what `1bit serve` says against the real llama-server:
//! `MAINPID=` and a loading status, `READY=1` only once `/health` answers 200, `WATCHDOG=1` at
//! half `WATCHDOG_USEC` while healthy and none while the backend is stopped, `STOPPING=1` and
//! the drain on SIGTERM; and a backend that exits leaves its reason in the status. The drop-in
//! (`1bit llama-server`, over the fake backend) never writes to the socket it inherits.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::*;

/// One datagram serve sent, when it came, and for a `READY=1`, what `/health` answered the
/// moment it came.
struct Message {
    at: Instant,
    text: String,
    health_then: Option<u16>,
}

impl Message {
    fn has(&self, line: &str) -> bool {
        self.text.lines().any(|l| l == line)
    }

    fn value(&self, key: &str) -> Option<&str> {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
    }
}

/// The service manager's end: a bound datagram socket and a thread that reads it.
struct Manager {
    /// What `NOTIFY_SOCKET` is set to.
    name: String,
    messages: Receiver<Message>,
}

impl Manager {
    /// A socket at a path in `dir`; `health` is serve's `/health` URL, asked on `READY=1`.
    fn at_path(dir: &Path, health: String) -> Manager {
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
        Manager::reading(socket, path.display().to_string(), health)
    }

    /// A socket with an abstract name, as `@NAME` in `NOTIFY_SOCKET`.
    fn at_abstract_name(health: String) -> Manager {
        let name = format!("1bit-test-notify-{}-{}", std::process::id(), free_port());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let socket = UnixDatagram::bind_addr(&addr).expect("bind the abstract notify socket");
        Manager::reading(socket, format!("@{name}"), health)
    }

    fn reading(socket: UnixDatagram, name: String, health: String) -> Manager {
        let (tx, messages) = channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                let at = Instant::now();
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                let health_then = text.lines().any(|l| l == "READY=1").then(|| get(&health).0);
                if tx
                    .send(Message {
                        at,
                        text,
                        health_then,
                    })
                    .is_err()
                {
                    break;
                }
            }
        });
        Manager { name, messages }
    }

    /// The next message that has `line`, within `limit`; the ones before it are returned too.
    fn until(&self, line: &str, limit: Duration) -> (Option<Message>, Vec<Message>) {
        let deadline = Instant::now() + limit;
        let mut before = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.messages.recv_timeout(left) {
                Ok(m) if m.has(line) => return (Some(m), before),
                Ok(m) => before.push(m),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    return (None, before);
                }
            }
        }
    }

    /// Every message that comes within `window`.
    fn during(&self, window: Duration) -> Vec<Message> {
        let deadline = Instant::now() + window;
        let mut got = Vec::new();
        while let Ok(m) = self
            .messages
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            got.push(m);
        }
        got
    }
}

/// `1bit serve` of SmolLM2 with the real llama-server, told to notify `manager`, its
/// persisted counters under `state` through `STATE_DIRECTORY` (as the unit's
/// `StateDirectory=` sets it).
fn serve_notifying(
    manager: &Manager,
    port: u16,
    watchdog_usec: Option<&str>,
    state: &Path,
) -> Serve {
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let mut command = Command::new(onebit());
    command
        .arg("serve")
        .arg("-m")
        .arg(&model)
        .args(["--device", "cpu", "--ctx-size", "2048", "--llama-server"])
        .arg(installed_llama_server())
        .args(["--port", &port.to_string()])
        .env("NOTIFY_SOCKET", &manager.name)
        .env("STATE_DIRECTORY", state)
        .env_remove("ONEBIT_STATE_DIR")
        .env_remove("WATCHDOG_PID");
    match watchdog_usec {
        Some(usec) => command.env("WATCHDOG_USEC", usec),
        None => command.env_remove("WATCHDOG_USEC"),
    };
    Serve::spawn(command, port)
}

fn health_url(port: u16) -> String {
    format!("http://127.0.0.1:{port}/health")
}

fn pings(messages: &[Message]) -> Vec<Instant> {
    messages
        .iter()
        .filter(|m| m.has("WATCHDOG=1"))
        .map(|m| m.at)
        .collect()
}

#[test]
fn serve_tells_a_path_socket_its_pid_ready_after_health_pings_while_healthy_and_stopping() {
    let dir = temp_dir("notify-path");
    let state = temp_dir("notify-state");
    let port = free_port();
    let manager = Manager::at_path(&dir, health_url(port));
    let mut serve = serve_notifying(&manager, port, Some("1000000"), &state);

    let (ready, before) = manager.until("READY=1", Duration::from_secs(120));
    let ready = ready.unwrap_or_else(|| panic!("no READY=1:\n{}", serve.output()));
    let first = before.first().expect("a message before READY=1");
    assert_eq!(
        first.value("MAINPID"),
        Some(serve.pid().to_string().as_str()),
        "{}",
        first.text
    );
    assert_eq!(
        first.value("STATUS"),
        Some("loading SmolLM2-135M-Instruct-Q4_1 on the cpu route")
    );
    assert_eq!(
        ready.health_then,
        Some(200),
        "READY=1 came before /health was 200"
    );
    assert_eq!(
        ready.value("STATUS").map(str::to_string),
        Some(format!(
            "serving SmolLM2-135M-Instruct-Q4_1 on http://127.0.0.1:{} (the cpu route)",
            serve.port
        ))
    );
    assert!(
        pings(&before).is_empty(),
        "no WATCHDOG=1 before ready: {:?}",
        before.iter().map(|m| &m.text).collect::<Vec<_>>()
    );

    // WATCHDOG_USEC=1 s: a ping every half second while healthy.
    let healthy = pings(&manager.during(Duration::from_secs(3)));
    assert!(
        (4..=8).contains(&healthy.len()),
        "{} pings in 3 s",
        healthy.len()
    );
    let spread = healthy[healthy.len() - 1] - healthy[0];
    let mean = spread.as_secs_f64() / (healthy.len() - 1) as f64;
    assert!(
        (0.35..=0.7).contains(&mean),
        "mean ping interval {mean:.3} s"
    );

    // The persisted counters are under the unit's StateDirectory.
    // (Beside the prompt cache's folder.)
    let files: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .collect();
    assert_eq!(files.len(), 1, "one state file in {}", state.display());

    // A backend that stops answering: /health goes 503, and the pings stop with it.
    let backend = serve.children()[0];
    let pid = nix::unistd::Pid::from_raw(backend as i32);
    nix::sys::signal::kill(pid, Signal::SIGSTOP).unwrap();
    let down = serve.wait_health(503, Duration::from_secs(5));
    let stale = manager.during(Duration::from_millis(200));
    let silent = pings(&manager.during(Duration::from_millis(2500)));
    nix::sys::signal::kill(pid, Signal::SIGCONT).unwrap();
    assert!(down, "/health stayed 200 with the backend stopped");
    drop(stale);
    assert!(
        silent.is_empty(),
        "{} WATCHDOG=1 while the backend did not answer",
        silent.len()
    );
    assert!(serve.wait_health(200, Duration::from_secs(5)));
    let (again, _) = manager.until("WATCHDOG=1", Duration::from_secs(2));
    assert!(again.is_some(), "no ping once the backend answered again");

    serve.signal(Signal::SIGTERM);
    let (stopping, _) = manager.until("STOPPING=1", Duration::from_secs(5));
    let stopping = stopping.expect("STOPPING=1 on SIGTERM");
    assert_eq!(
        stopping.value("STATUS"),
        Some("draining (SIGTERM): no new connections; requests in flight get up to 3.0 s")
    );
    let (exiting, _) = manager.until(
        "STATUS=exiting: SIGTERM: stopping the backends",
        Duration::from_secs(10),
    );
    assert!(exiting.is_some(), "{}", serve.output());
    assert_eq!(
        serve
            .wait_exit(Duration::from_secs(40))
            .and_then(|s| s.code()),
        Some(0)
    );
}

#[test]
fn serve_tells_an_abstract_socket_ready_after_health_and_no_ping_unasked() {
    let state = temp_dir("notify-state");
    let port = free_port();
    let manager = Manager::at_abstract_name(health_url(port));
    let mut serve = serve_notifying(&manager, port, None, &state);
    let (ready, _) = manager.until("READY=1", Duration::from_secs(120));
    let ready = ready.unwrap_or_else(|| panic!("no READY=1:\n{}", serve.output()));
    assert_eq!(
        ready.health_then,
        Some(200),
        "READY=1 came before /health was 200"
    );
    // No WATCHDOG_USEC: no pings.
    assert!(pings(&manager.during(Duration::from_millis(1500))).is_empty());
    serve.signal(Signal::SIGTERM);
    let (stopping, _) = manager.until("STOPPING=1", Duration::from_secs(5));
    assert!(stopping.is_some(), "{}", serve.output());
    assert_eq!(
        serve
            .wait_exit(Duration::from_secs(40))
            .and_then(|s| s.code()),
        Some(0)
    );
}

#[test]
fn a_backend_that_exits_leaves_the_reason_in_the_status() {
    let dir = temp_dir("notify-exit");
    let model = dummy_model(&dir, "m.gguf");
    let port = free_port();
    let manager = Manager::at_path(&dir, health_url(port));
    let fake = fake_backend();
    let mut command = Command::new(onebit());
    command
        .arg("serve")
        .arg("-m")
        .arg(&model)
        .args(["--device", "cpu", "--llama-server"])
        .arg(&fake)
        .args(["--port", &port.to_string()])
        .env("NOTIFY_SOCKET", &manager.name)
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .env("FAKE_EXIT_AFTER_MS", "1500");
    let mut serve = Serve::spawn(command, port);
    let (ready, _) = manager.until("READY=1", Duration::from_secs(30));
    assert!(ready.is_some(), "{}", serve.output());
    let (stopping, _) = manager.until("STOPPING=1", Duration::from_secs(10));
    let stopping = stopping.unwrap_or_else(|| panic!("no STOPPING=1:\n{}", serve.output()));
    let status = stopping.value("STATUS").unwrap_or("");
    assert!(
        status.starts_with("exiting: the cpu backend (") && status.ends_with("; exiting"),
        "{status}"
    );
    assert_eq!(
        serve
            .wait_exit(Duration::from_secs(10))
            .and_then(|s| s.code()),
        Some(1)
    );
}

/// `1bit llama-server` (the drop-in) runs under Lemonade, whose own service a `NOTIFY_SOCKET` it
/// inherits names: it never writes there, from start to stop; `1bit serve` given the same
/// socket and the same fake backend does (so the socket is one serve can reach).
#[test]
fn the_drop_in_never_notifies_the_socket_it_inherits() {
    let dir = temp_dir("notify-dropin");
    let model = dummy_model(&dir, "m.gguf");
    for (words, notifies) in [
        (&["llama-server"][..], false),
        (&["serve", "--device", "cpu"], true),
    ] {
        let port = free_port();
        let manager = Manager::at_path(&dir, health_url(port));
        let mut command = Command::new(onebit());
        command
            .args(words)
            .args(["-m", model.to_str().unwrap(), "--port", &port.to_string()])
            .env("NOTIFY_SOCKET", &manager.name)
            .env("ONEBIT_STATE_DIR", temp_dir("notify-dropin-state"))
            .env("ONEBIT_LLAMA_SERVER", fake_backend())
            .env("ONEBIT_HRX_PRESENT", "0");
        let mut serve = Serve::spawn(command, port);
        serve.ready();
        serve.signal(Signal::SIGTERM);
        assert!(
            serve.wait_exit(Duration::from_secs(10)).is_some(),
            "{}",
            serve.output()
        );
        let said = manager.during(Duration::from_millis(500));
        assert_eq!(
            !said.is_empty(),
            notifies,
            "{words:?}: {:?}\n{}",
            said.iter().map(|m| &m.text).collect::<Vec<_>>(),
            serve.output()
        );
    }
}
