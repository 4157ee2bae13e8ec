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
    // The default port held (by this test, or already by whatever else has it): a usage error
    // is found before any port is taken, so it is the error reported.
    let _default_port = std::net::TcpListener::bind("127.0.0.1:50052");
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
        (
            vec!["--traffic", "/nonexistent/dir/t.json"],
            "--traffic /nonexistent/dir/t.json: cannot write it",
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

#[test]
fn traffic_counts_each_command_that_crosses_the_link_in_a_file() {
    let dir = temp_dir("rpc-traffic");
    let file = dir.join("traffic.json");
    let mut worker = RpcWorker::start(
        &["--traffic", file.to_str().unwrap(), "--threads", "1"],
        None,
    );
    // The command's own probe (HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY per device) went through
    // the relay before the announcement.
    let read = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap_or_default())
            .unwrap_or_default()
    };
    assert!(
        wait_until(
            Duration::from_secs(5),
            || read()["commands"]["GET_DEVICE_MEMORY"]["answers"] == 1
        ),
        "{}",
        read()
    );
    let counts = read();
    for cmd in ["HELLO", "DEVICE_COUNT", "GET_DEVICE_MEMORY"] {
        let c = &counts["commands"][cmd];
        assert_eq!(c["requests"], 1, "{cmd}: {counts}");
        assert_eq!(c["answers"], 1, "{cmd}: {counts}");
        assert!(c["request_bytes"].as_u64().unwrap() >= 9, "{cmd}: {counts}");
    }
    // GET_DEVICE_MEMORY's answer: its 8-byte size and free and total.
    assert_eq!(
        counts["commands"]["GET_DEVICE_MEMORY"]["answer_bytes"],
        8 + 16
    );
    assert_eq!(counts["round_trips"], 3, "{counts}");
    // The worker stays usable through the relay: a client of its own is counted too.
    let port: u16 = worker.endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    {
        use std::io::{Read, Write};
        // HELLO with its (zeroed) capabilities, as llama.cpp sends it.
        let caps = 24u64;
        let mut hello = vec![14u8];
        hello.extend_from_slice(&caps.to_le_bytes());
        hello.extend_from_slice(&vec![0u8; caps as usize]);
        conn.write_all(&hello).unwrap();
        let mut size = [0u8; 8];
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conn.read_exact(&mut size).unwrap();
        let mut answer = vec![0u8; u64::from_le_bytes(size) as usize];
        conn.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], 7, "the protocol's major version");
    }
    drop(conn);
    worker.signal(Signal::SIGTERM);
    assert_eq!(
        worker
            .wait_exit(Duration::from_secs(15))
            .and_then(|s| s.code()),
        Some(0)
    );
    let last = read();
    assert_eq!(
        last["commands"]["HELLO"]["answers"], 2,
        "written at exit: {last}"
    );
    assert!(!dir.join("traffic.json.tmp").exists());
}
