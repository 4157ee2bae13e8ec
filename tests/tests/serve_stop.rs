//! Nothing outlives serve, and every stop fits Lemonade's window (SIGTERM, then SIGKILL 5 s
//! later), on the routes that need no real llama-server: `kill -9` of serve during a `--pm`
//! delegation and with an in-process route streaming leaves no process of its tree and (once
//! the next serve starts) no temporary folder; SIGTERM with an in-process stream in flight cuts
//! it at the drain window's end, tells the route, and exits within drain + 1 s; and with a
//! stream in flight, a CPU hog on every core and a backend that ignores SIGTERM, serve still
//! exits within drain + 1 s (the stop's bound kills the backend).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::bounds::{self, Hog, worst_wake_up_lateness};
use onebit_tests::*;

/// The in-process fixture route, built once per run against this plugin-api.
fn fixture() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        route_fixture::Fixture::current(
            "inproc",
            "tests/fixtures/inproc-route/src/lib.rs",
            onebit_plugin_api::ABI_VERSION,
        )
        .build()
    })
}

fn serve_inproc(extra: &[&str]) -> Serve {
    let dir = temp_dir("stop-inproc");
    let model = dummy_model(&dir, "smol.gguf");
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "inproc",
        "--plugin-dir",
        fixture().to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let serve = Serve::start(&args, &[]);
    serve.ready();
    serve
}

/// A request written on a fresh connection and read on its own thread.
struct Reading {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
}

fn request(port: u16, body: &str) -> Reading {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(40))).unwrap();
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let bytes = Arc::new(Mutex::new(Vec::new()));
    let sink = bytes.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = tcp.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    Reading { bytes, reader }
}

impl Reading {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes.lock().unwrap()).into_owned()
    }

    fn wait_for(&self, text: &str) {
        assert!(
            wait_until(Duration::from_secs(10), || self.text().contains(text)),
            "no {text:?} in {}",
            self.text()
        );
    }

    fn finish(self) -> String {
        self.reader.join().unwrap();
        String::from_utf8_lossy(&self.bytes.lock().unwrap()).into_owned()
    }
}

const LONG_STREAM: &str = r#"{"stream":true,"events":300,"event_bytes":8,"pace_ms":100}"#;

#[test]
fn kill_9_with_an_in_process_route_streaming_leaves_nothing() {
    let serve = serve_inproc(&[]);
    let stream = request(serve.port, LONG_STREAM);
    stream.wait_for("data: {");
    kill9_leaves_nothing(serve);
    assert!(!stream.finish().contains("[DONE]"));
}

#[test]
fn kill_9_during_a_pm_delegation_leaves_nothing() {
    let dir = temp_dir("stop-pm");
    let lemonade = FakeLemonade::start(LemonadeAnswer::Hold);
    let model = dummy_model(&dir, "zaya1-8b-Q4_K_M.gguf");
    let serve = Serve::with_fake(&model, &["--pm", "--lemonade-url", &lemonade.url()], &[]);
    serve.ready();
    assert!(
        !serve.children().is_empty(),
        "no backend: {}",
        serve.output()
    );
    let asked = request(
        serve.port,
        r#"{"messages":[{"role":"user","content":"fake_delegate=code Write a Rust function that sums a slice."}]}"#,
    );
    assert!(
        wait_until(Duration::from_secs(10), || !lemonade.received().is_empty()),
        "the delegation never reached Lemonade: {}",
        serve.output()
    );
    kill9_leaves_nothing(serve);
    drop(asked);
}

#[test]
fn sigterm_with_an_in_process_stream_in_flight_cuts_it_at_the_window_and_tells_the_route() {
    let mut serve = serve_inproc(&["--drain-s", "1"]);
    let stream = request(serve.port, LONG_STREAM);
    stream.wait_for("data: {");
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .expect("serve exits");
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    assert!(took >= Duration::from_millis(900), "no drain: {took:?}");
    // The stop's bound (drain + 1 s) and a busy machine's margin.
    let within = bounds::stop_within(Duration::from_secs(1));
    assert!(
        took < within,
        "{took:?} (bound {within:?}): {}",
        serve.output()
    );
    let reply = stream.finish();
    assert!(reply.matches("data: {").count() >= 5, "{reply}");
    assert!(!reply.contains("[DONE]"), "{reply}");
    assert!(
        !reply.ends_with("0\r\n\r\n"),
        "a cut stream ended as finished"
    );
    assert!(
        serve
            .output()
            .contains("fixture: send refused: the host is stopping"),
        "{}",
        serve.output()
    );
    assert!(!run_dir_of(serve.pid()).exists());
}

/// A route's library mid-compute when serve exits (llama.cpp's CPU backend in a decode the stop
/// cut, on a starved machine): serve ends without running the `atexit` handlers (C++'s static
/// destructors) under it, so it exits 0, not killed by the crash of a kernel on freed state.
#[test]
fn a_stop_with_a_routes_kernel_mid_compute_exits_0_without_running_exit_handlers_under_it() {
    let mut serve = serve_inproc(&["--drain-s", "1"]);
    let stream = request(
        serve.port,
        r#"{"stream":true,"events":3,"kernel_ms":30000}"#,
    );
    stream.wait_for("200 OK");
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(10))
        .expect("serve exits");
    assert_eq!(
        status.code(),
        Some(0),
        "{status:?} (a signal: a kernel crashed on state torn down at exit): {}",
        serve.output()
    );
    assert!(!serve.output().contains("torn down"), "{}", serve.output());
    let _ = stream.finish();
}

#[test]
fn sigterm_of_an_idle_in_process_serve_exits_at_once() {
    let mut serve = serve_inproc(&[]);
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    let status = serve
        .wait_exit(Duration::from_secs(5))
        .expect("serve exits");
    assert_eq!(status.code(), Some(0), "{}", serve.output());
    // 0.5 s is the target (cargo xtask bench stop); loose here.
    assert!(
        signalled.elapsed() < Duration::from_secs(2),
        "{:?}",
        signalled.elapsed()
    );
    assert!(!run_dir_of(serve.pid()).exists());
}

/// SIGTERM with a stream in flight on a starved machine (a hog on each core beside the
/// backend's own streaming), to a backend that ignores SIGTERM, as a llama-server whose stop
/// is starved does not exit for seconds (issue 53: 6.06 s from SIGTERM to serve's exit with a
/// 3 s window): serve kills it at the stop's bound and exits within the window + 1 s, not
/// after the 30 s grace.
#[test]
fn sigterm_on_a_starved_machine_with_a_backend_that_will_not_stop_exits_within_the_bound() {
    let dir = temp_dir("stop-starved");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(
        &model,
        &["--drain-s", "1"],
        &[
            ("FAKE_IGNORE_SIGTERM", "1"),
            ("FAKE_SSE_EVENTS", "1000"),
            ("FAKE_SSE_INTERVAL_MS", "50"),
        ],
    );
    serve.ready();
    let backend = serve.children()[0];
    let stream = request(
        serve.port,
        r#"{"stream":true,"messages":[{"role":"user","content":"go on"}]}"#,
    );
    stream.wait_for("data: {");
    let hog = Hog::start(Duration::from_secs(60));
    let lateness = worst_wake_up_lateness();
    let signalled = Instant::now();
    serve.signal(Signal::SIGTERM);
    // Timed to serve's exit itself (a zombie until reaped below), not to the end of its
    // output, which a backend still dying holds open (its stdout is serve's).
    wait_until(Duration::from_secs(40), || !alive(serve.pid()));
    let took = signalled.elapsed();
    let status = serve.wait_exit(Duration::from_secs(5));
    drop(hog);
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{took:?}: {}",
        serve.output()
    );
    // The bound is the window (1 s) + 1 s; the margin is what the starved test itself adds
    // to its timing: its look at the exit every 20 ms and its own late wake-ups, twice the
    // worst measured, and 100 ms for the signal's delivery and serve's exit beyond the
    // bound's reaping (measured: 1.93 to 1.98 s from SIGTERM to exit here, 2 cores).
    let margin = Duration::from_millis(100) + lateness * 2;
    eprintln!("SIGTERM to exit: {took:?} (wake-ups late by up to {lateness:?})");
    assert!(
        took < Duration::from_secs(2) + margin,
        "{took:?} from SIGTERM to exit (the bound: 2 s, the margin {margin:?}):\n{}",
        serve.output()
    );
    assert!(
        serve.output().contains(
            "had not stopped when the stop's time ran out (2 s after SIGTERM: the 1 s drain window and 1 s); killing it"
        ),
        "{}",
        serve.output()
    );
    assert!(
        wait_until(Duration::from_secs(2), || !alive(backend)),
        "the backend outlived serve"
    );
    assert!(!stream.finish().contains("[DONE]"));
}
