//! `cargo xtask bench inproc`: what an in-process route (ABI 1.2 `respond`) costs serve in
//! memory while a client reads a 50 MB stream slowly, and how soon the route learns that a
//! client went away. Uses the test fixture route `tests/fixtures/inproc-route`, built outside
//! the workspace as the ABI tests build it. Debug builds: the figures are memory and time to
//! notice a close, which optimisation does not change much.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{Failure, Workspace, process};

/// Run it; `quick` reads for 3 s and closes 5 streams, else 20 s and 20.
pub fn run(ws: &Workspace, quick: bool) -> Result<ExitCode, Failure> {
    let (read_for, closes) = if quick {
        (Duration::from_secs(3), 5)
    } else {
        (Duration::from_secs(20), 20)
    };
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host"]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "the build failed: fix the errors above")?;
    let plugins = build_fixture(&ws.root)?;
    let scratch = std::env::temp_dir().join(format!("onebit-bench-inproc-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| Failure::new(e, "check /tmp"))?;
    let model = scratch.join("inproc.bin");
    std::fs::write(&model, b"the fixture serves anything")
        .map_err(|e| Failure::new(e, "check /tmp"))?;
    let port = free_port()?;
    let serve = ServeChild(
        Command::new(ws.root.join("target/debug/1bit"))
            .arg("serve")
            .arg("-m")
            .arg(&model)
            .args([
                "--device",
                "inproc",
                "--port",
                &port.to_string(),
                "--plugin-dir",
            ])
            .arg(&plugins)
            .env("ONEBIT_STATE_DIR", &scratch)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Failure::new(format!("cannot start 1bit serve: {e}"), "build it"))?,
    );
    let started = Instant::now();
    while get(port, "/health").0 != 200 {
        if started.elapsed() > Duration::from_secs(30) {
            return Err(Failure::new(
                "serve did not become ready",
                "run it by hand to see why",
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = serve.0.id();

    // Warm up (the blocking thread, the buffers), then idle.
    read_all(port, r#"{"stream":true,"events":200,"event_bytes":1000}"#)?;
    std::thread::sleep(Duration::from_millis(300));
    let idle = super::arms::vm_rss_kib(pid).unwrap_or(0);

    // A 50 MB stream read at 100 KB/s.
    let mut tcp = open(port, r#"{"stream":true,"events":50000,"event_bytes":1000}"#)?;
    let mut peak = idle;
    let mut read = 0usize;
    let mut buf = vec![0u8; 10_000];
    let began = Instant::now();
    while began.elapsed() < read_for {
        let n = tcp
            .read(&mut buf)
            .map_err(|e| Failure::new(e, "the stream broke"))?;
        if n == 0 {
            break;
        }
        read += n;
        peak = peak.max(super::arms::vm_rss_kib(pid).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(tcp);

    // Cancellation: close a paced stream, see when the route's send failed.
    let mut delays = Vec::new();
    for _ in 0..closes {
        let before = metric(port, "fixture_sends_refused_total");
        let mut tcp = open(
            port,
            r#"{"stream":true,"events":100000,"event_bytes":100,"pace_ms":5}"#,
        )?;
        let mut seen = 0;
        while seen < 2000 {
            seen += tcp
                .read(&mut buf)
                .map_err(|e| Failure::new(e, "the stream broke"))?;
        }
        let closed = now_ns();
        drop(tcp);
        let waited = Instant::now();
        while metric(port, "fixture_sends_refused_total") == before {
            if waited.elapsed() > Duration::from_secs(5) {
                return Err(Failure::new(
                    "the route never saw the client leave",
                    "a bug in the sink",
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        delays.push(metric(port, "fixture_stopped_at_ns").saturating_sub(closed) as f64 / 1e6);
    }
    delays.sort_by(f64::total_cmp);
    let median = delays[delays.len() / 2];
    let max = delays[delays.len() - 1];
    drop(serve);
    let _ = std::fs::remove_dir_all(&scratch);

    let rise = peak.saturating_sub(idle);
    println!("in-process route (debug build), serve pid {pid}:");
    println!(
        "  RSS: idle {idle} KiB, peak {peak} KiB while a client read {:.1} MB of a 50 MB stream at 100 KB/s over {:.0} s: +{rise} KiB (target: under 5120 KiB)",
        read as f64 / 1e6,
        read_for.as_secs_f64()
    );
    println!(
        "  cancellation: the route's send failed {median:.1} ms after the client closed (median of {closes}, max {max:.1} ms; target: 50 ms)"
    );
    Ok(if rise < 5 * 1024 && max <= 50.0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The fixture route built against this plugin-api; the folder holding only its library.
pub(super) fn build_fixture(root: &Path) -> Result<PathBuf, Failure> {
    let base = root.join("target/bench-inproc");
    let (api, route) = (base.join("plugin-api"), base.join("route"));
    let io = |e: std::io::Error| Failure::new(e, "check the target folder");
    std::fs::create_dir_all(api.join("src")).map_err(io)?;
    std::fs::create_dir_all(route.join("src")).map_err(io)?;
    // Every source file: a list here went stale when plugin-api's types moved into modules.
    for entry in std::fs::read_dir(root.join("plugin-api/src")).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            std::fs::copy(
                &path,
                api.join("src").join(path.file_name().unwrap_or_default()),
            )
            .map_err(io)?;
        }
    }
    let manifest = std::fs::read_to_string(root.join("plugin-api/Cargo.toml")).map_err(io)?;
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .ok_or_else(|| Failure::new("plugin-api/Cargo.toml names no version", "fix it"))?;
    std::fs::write(
        api.join("Cargo.toml"),
        format!(
            "[package]\nname = \"onebit-plugin-api\"\nversion = \"{version}\"\nedition = \"2024\"\n\n\
             [dependencies]\nabi_stable = \"0.11.3\"\nlibc = \"0.2\"\nsemver = \"1\"\n\
             serde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n\n[features]\nhost = []\n"
        ),
    )
    .map_err(io)?;
    std::fs::copy(
        root.join("tests/fixtures/inproc-route/src/lib.rs"),
        route.join("src/lib.rs"),
    )
    .map_err(io)?;
    std::fs::write(
        route.join("Cargo.toml"),
        "[package]\nname = \"onebit-route-inproc\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n\
         [lib]\nname = \"onebit_route_inproc\"\ncrate-type = [\"cdylib\"]\n\n\
         [dependencies]\nonebit-plugin-api = { path = \"../plugin-api\" }\n\
         serde = { version = \"1\", features = [\"derive\"] }\nserde_json = \"1\"\n",
    )
    .map_err(io)?;
    std::fs::write(
        base.join("Cargo.toml"),
        "[workspace]\nresolver = \"3\"\nmembers = [\"plugin-api\", \"route\"]\n",
    )
    .map_err(io)?;
    std::fs::copy(root.join("Cargo.lock"), base.join("Cargo.lock")).map_err(io)?;
    let mut cargo = process::cargo();
    cargo
        .args(["build", "--quiet", "--offline", "--manifest-path"])
        .arg(base.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", base.join("target"))
        .env("FIXTURE_ROUTE_NAME", "inproc");
    println!("==> building the in-process fixture route");
    process::run(
        &mut cargo,
        "the fixture route does not build: fix the errors above",
    )?;
    let plugins = base.join("plugins");
    std::fs::create_dir_all(&plugins).map_err(io)?;
    std::fs::copy(
        base.join("target/debug/libonebit_route_inproc.so"),
        plugins.join("libonebit_route_inproc.so"),
    )
    .map_err(io)?;
    Ok(plugins)
}

/// serve, killed when dropped.
struct ServeChild(Child);

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16, Failure> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Failure::new(e, "the kernel has no free port"))
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A chat request on a fresh connection; the reply is left to read.
fn open(port: u16, body: &str) -> Result<TcpStream, Failure> {
    let mut tcp =
        TcpStream::connect(("127.0.0.1", port)).map_err(|e| Failure::new(e, "is serve up?"))?;
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| Failure::new(e, "is serve up?"))?;
    Ok(tcp)
}

fn read_all(port: u16, body: &str) -> Result<Vec<u8>, Failure> {
    let mut tcp = open(port, body)?;
    let mut out = Vec::new();
    tcp.read_to_end(&mut out)
        .map_err(|e| Failure::new(e, "the stream broke"))?;
    Ok(out)
}

/// (status, body) of a GET; status 0 when the server could not be reached.
pub(super) fn get(port: u16, path: &str) -> (u16, String) {
    let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        tcp,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut reply = String::new();
    let _ = tcp.read_to_string(&mut reply);
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// One of the fixture's series in serve's /metrics (0 when absent).
fn metric(port: u16, name: &str) -> u64 {
    get(port, "/metrics")
        .1
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}
