use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::*;

/// The pinned ggml-rpc-server, beside the test llama-server or in the default cache.
pub(crate) fn pinned_rpc_server() -> PathBuf {
    let path = crate::rpc::worker::rpc_server_binary(None).unwrap_or_else(|e| {
        panic!("{e} (the RPC tests run the real worker; `cargo xtask setup` builds it)")
    });
    assert!(path.exists());
    path
}

/// A real worker on a free loopback port, killed when dropped.
pub(crate) struct RealWorker {
    pub endpoint: String,
    child: Child,
}

impl RealWorker {
    // The test's own worker, killed on drop: it stands where a user's worker host would be.
    #[allow(clippy::disallowed_methods)]
    pub(crate) fn start() -> RealWorker {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(pinned_rpc_server())
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--threads",
                "1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let endpoint = format!("127.0.0.1:{port}");
        let started = Instant::now();
        while TcpStream::connect(&endpoint).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "worker did not listen"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        RealWorker { endpoint, child }
    }
}

impl Drop for RealWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn meminfo_total() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib * 1024
}

#[test]
fn the_real_worker_answers_hello_and_its_cpu_memory() {
    let worker = RealWorker::start();
    let offer = ask(&worker.endpoint, ANSWER_WITHIN).unwrap();
    assert_eq!(offer.version.0, PROTO_MAJOR);
    assert_eq!(offer.devices.len(), 1, "{offer:?}");
    // A CPU worker reports the machine's physical memory as both free and total.
    let total = meminfo_total();
    let d = offer.devices[0];
    assert_eq!(d.free, d.total);
    assert!(
        d.total.abs_diff(total) < (64 << 20),
        "{d:?} vs MemTotal {total}"
    );
    // The probe closed its connection: the worker takes the next client at once.
    let again = ask(&worker.endpoint, ANSWER_WITHIN).unwrap();
    assert_eq!(again, offer);
}

#[test]
fn a_closed_port_is_named_at_once() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let e = ask(&endpoint, ANSWER_WITHIN).unwrap_err();
    assert!(started.elapsed() < ANSWER_WITHIN);
    assert!(
        e.starts_with(&format!("RPC worker {endpoint} does not answer")),
        "{e}"
    );
}

#[test]
fn a_worker_that_accepts_but_stays_silent_is_refused_within_the_second() {
    // A listener nobody accepts on: the kernel completes the handshake, then silence, as a
    // worker busy with another llama-server behaves.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("127.0.0.1:{}", silent.local_addr().unwrap().port());
    let started = Instant::now();
    let e = ask(&endpoint, Duration::from_millis(300)).unwrap_err();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_millis(800),
        "{took:?}"
    );
    assert!(e.contains("did not answer within 0.3 s"), "{e}");
    assert!(e.contains(&endpoint), "{e}");
}

/// A fake worker that answers HELLO with `version` and then closes.
fn fake_hello(version: [u8; 3]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("127.0.0.1:{}", listener.local_addr().unwrap().port());
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut request = [0u8; 1 + 8 + CONN_CAPS];
        s.read_exact(&mut request).unwrap();
        assert_eq!(request[0], CMD_HELLO);
        assert_eq!(
            u64::from_le_bytes(request[1..9].try_into().unwrap()),
            CONN_CAPS as u64
        );
        let mut answer = (4 + CONN_CAPS as u64).to_le_bytes().to_vec();
        answer.extend_from_slice(&[version[0], version[1], version[2], 0]);
        answer.extend_from_slice(&[0u8; CONN_CAPS]);
        s.write_all(&answer).unwrap();
    });
    endpoint
}

#[test]
fn another_protocol_version_is_refused_as_llama_server_would() {
    let e = ask(&fake_hello([6, 0, 0]), ANSWER_WITHIN).unwrap_err();
    assert!(e.contains("speaks RPC protocol 6.0.0"), "{e}");
    let e = ask(
        &fake_hello([PROTO_MAJOR, PROTO_MINOR + 1, 0]),
        ANSWER_WITHIN,
    )
    .unwrap_err();
    assert!(e.contains("run the same llama.cpp build there"), "{e}");
}

#[test]
fn endpoints_are_host_colon_port() {
    assert_eq!(
        parse_endpoint("10.77.1.2:50052").unwrap(),
        ("10.77.1.2".into(), 50052)
    );
    for bad in ["10.77.1.2", ":50052", "h:0", "h:65536", "h:x", "a b:1"] {
        let e = parse_endpoint(bad).unwrap_err();
        assert!(e.starts_with(&format!("--rpc {bad}: not HOST:PORT")), "{e}");
    }
}
