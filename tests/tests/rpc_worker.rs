//! `1bit rpc-worker`: the pinned ggml-rpc-server started, announced, and supervised like a
//! backend (no orphan, its exit passed on, SIGTERM forwarded).

use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::rpc_worker::RpcWorker;
use onebit_tests::*;

#[test]
fn it_announces_its_loopback_address_and_the_memory_it_offers_in_one_line() {
    let worker = RpcWorker::start(&["--threads", "1"], None);
    let line = &worker.announcement;
    assert!(
        line.starts_with("1bit rpc-worker: listening on 127.0.0.1:"),
        "{line}"
    );
    assert!(line.contains("(RPC protocol 7.0."), "{line}");
    assert!(
        line.contains("offering ") && line.contains(" GiB (device 0: "),
        "{line}"
    );
    assert!(
        line.ends_with(&format!("pass --rpc {} to 1bit serve", worker.endpoint)),
        "{line}"
    );
    // Loopback: no exposure warning.
    assert!(
        !worker.stderr().contains("no authentication"),
        "{}",
        worker.stderr()
    );
    let port: u16 = worker.endpoint.rsplit(':').next().unwrap().parse().unwrap();
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
}

#[test]
fn sigterm_stops_the_worker_and_exits_0() {
    let mut worker = RpcWorker::start(&[], None);
    let server = worker
        .server_pid()
        .expect("ggml-rpc-server runs under 1bit rpc-worker");
    worker.signal(Signal::SIGTERM);
    let status = worker.wait_exit(Duration::from_secs(15)).expect("it exits");
    assert_eq!(status.code(), Some(0), "{}", worker.stderr());
    assert!(!alive(server), "the worker was stopped with it");
    assert!(
        worker.stderr().contains("SIGTERM: stopping the worker"),
        "{}",
        worker.stderr()
    );
}

#[test]
fn a_killed_rpc_worker_command_leaves_no_orphan() {
    let worker = RpcWorker::start(&[], None);
    let server = worker.server_pid().unwrap();
    worker.signal(Signal::SIGKILL);
    assert!(
        wait_until(Duration::from_secs(5), || !alive(server)),
        "ggml-rpc-server {server} outlived 1bit rpc-worker"
    );
}

#[test]
fn the_workers_own_exit_is_passed_on_with_a_line() {
    let mut worker = RpcWorker::start(&[], None);
    let server = worker.server_pid().unwrap();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(server as i32), Signal::SIGKILL);
    let status = worker.wait_exit(Duration::from_secs(5)).expect("it exits");
    assert_eq!(status.code(), Some(128 + 9));
    assert!(
        worker.stderr().contains("was killed by SIGKILL"),
        "{}",
        worker.stderr()
    );
}

#[test]
fn a_non_loopback_address_prints_what_anyone_reaching_the_port_can_do() {
    let worker = RpcWorker::start(&["--host", "0.0.0.0"], None);
    let warning: Vec<String> = worker
        .stderr()
        .lines()
        .filter(|l| l.starts_with("1bit rpc-worker: warning:"))
        .map(str::to_string)
        .collect();
    assert_eq!(warning.len(), 1, "{}", worker.stderr());
    for what in [
        "no authentication",
        "allocate",
        "read and write",
        "run compute graphs",
    ] {
        assert!(warning[0].contains(what), "{}", warning[0]);
    }
    assert!(
        worker.announcement.contains("listening on 0.0.0.0:"),
        "{}",
        worker.announcement
    );
}

#[test]
fn bad_usage_is_refused_in_one_line_with_status_2() {
    for (args, says) in [
        (
            vec!["--host", "localhost"],
            "--host localhost: ggml-rpc-server listens on an IPv4 address only",
        ),
        (
            vec!["--threads", "0"],
            "--threads 0: pass a positive number",
        ),
        (
            vec!["--mem", "0"],
            "--mem 0: pass the GiB to offer as a positive number",
        ),
        (
            vec!["--rpc-server", "/nonexistent/x"],
            "--rpc-server /nonexistent/x: no such file",
        ),
    ] {
        let started = Instant::now();
        let mut child = Command::new(onebit())
            .arg("rpc-worker")
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Bounded: a refusal that regressed into a running worker must not hang the suite.
        let exited = wait_until(Duration::from_secs(10), || {
            child.try_wait().ok().flatten().is_some()
        });
        if !exited {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with(&format!("1bit rpc-worker: {says}")),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn mem_caps_what_the_worker_offers_through_its_relay() {
    let worker = RpcWorker::start(&["--mem", "0.5", "--threads", "1"], None);
    assert!(
        worker
            .announcement
            .contains("offering 0.5 GiB (device 0: 0.5 GiB free of 0.5)"),
        "{}",
        worker.announcement
    );
    // The worker itself listens on a private loopback port behind the relay.
    let server = worker.server_pid().unwrap();
    let cmdline = std::fs::read_to_string(format!("/proc/{server}/cmdline")).unwrap();
    assert!(
        !cmdline.contains(worker.endpoint.rsplit(':').next().unwrap()),
        "{cmdline:?}"
    );
}
