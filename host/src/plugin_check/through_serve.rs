//! A route whose plan runs child processes, checked through serve itself: `1bit serve` with
//! the route, each backend run as the fake backend with the plan's own arguments
//! (`--backend-standin`), a whole and a streamed chat relayed by serve's own relay, and what
//! the backend was started with, what `/health` and `/metrics` said. So a plugin author tests
//! such a route on any machine, without its engine.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use onebit_plugin_api::Plan;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_process::Process;

use super::Report;

/// How long serve may take to say ready with the fake backend.
const READY_LIMIT: Duration = Duration::from_secs(60);
/// How long one relayed request may take.
const REQUEST_LIMIT: Duration = Duration::from_secs(30);

/// The fake backend: `$ONEBIT_FAKE_BACKEND`, else `1bit-fake-backend` (as `cargo xtask
/// install` places it) or `fake-backend` (as `cargo build` does) beside this binary.
pub fn fake_backend() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ONEBIT_FAKE_BACKEND").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    ["1bit-fake-backend", "fake-backend"]
        .into_iter()
        .map(|name| dir.join(name))
        .find(|p| p.is_file())
}

/// What the check runs serve with.
pub struct Subject<'a> {
    /// The route, loaded by the check.
    pub route: &'a LoadedRoute,
    /// The folder serve is given with `--plugin-dir` to find it.
    pub plugin_dir: &'a Path,
    /// The model.
    pub model: &'a Path,
    /// `--route-opt` as given.
    pub route_opt: &'a [String],
    /// The plan the check got from the route.
    pub plan: &'a Plan,
}

/// Run the checks; each outcome goes to `report`.
pub fn check(subject: &Subject, report: &mut Report) {
    for (i, backend) in subject.plan.backends.iter().enumerate() {
        let env: Vec<String> = backend
            .env
            .iter()
            .chain(&backend.env_combined)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        report.ok(
            &format!("backend {i}"),
            format!(
                "{}: {} (env: {})",
                backend.engine,
                backend.argv.join(" "),
                if env.is_empty() {
                    "none added".to_string()
                } else {
                    env.join(" ")
                }
            ),
        );
    }
    let Some(fake) = fake_backend() else {
        report.skip(
            "answers",
            "the plan runs child processes: install the fake backend (`cargo xtask install` puts 1bit-fake-backend beside 1bit) or set ONEBIT_FAKE_BACKEND to relay chats through serve to it",
        );
        return;
    };
    let work =
        std::env::temp_dir().join(format!("1bit-plugins-check-serve-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&work);
    let outcome = run_serve(subject, &fake, &work, report);
    if let Err(line) = outcome {
        report.fail("serve", line);
    }
    let _ = std::fs::remove_dir_all(&work);
}

fn run_serve(
    subject: &Subject,
    fake: &Path,
    work: &Path,
    report: &mut Report,
) -> Result<(), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let log = work.join("serve.log");
    let record = work.join("backend-start.json");
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this 1bit: {e}"))?;
    let mut command = Command::new(exe);
    command
        .arg("serve")
        .arg("-m")
        .arg(subject.model)
        .args([
            "--device",
            &subject.route.info.name,
            "--port",
            &port.to_string(),
        ])
        .arg("--plugin-dir")
        .arg(subject.plugin_dir)
        .arg("--backend-standin")
        .arg(fake)
        .args(
            subject
                .route_opt
                .iter()
                .flat_map(|o| ["--route-opt", o.as_str()]),
        )
        .env("FAKE_RECORD_START", &record)
        // serve's state (metrics counters, the prompt cache) stays in the check's own folder.
        .env("ONEBIT_STATE_DIR", work.join("state"))
        .stdin(Stdio::null());
    let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    command.stdout(out).stderr(err);
    let serve = onebit_process::spawn(command).map_err(|e| format!("serve did not start: {e}"))?;
    let outcome = exercise(&serve, port, &record, subject, report);
    let stopped = serve.stop(Duration::from_secs(10));
    match (&outcome, serve.wait_timeout(Duration::ZERO)) {
        (Ok(()), Some(Ok(status))) if status.success() => {
            report.ok("stop", "serve stopped cleanly on SIGTERM")
        }
        (Ok(()), status) => report.fail(
            "stop",
            format!("serve did not stop cleanly: {status:?} ({stopped:?})"),
        ),
        (Err(_), _) => {}
    }
    outcome.map_err(|why| format!("{why}; serve's last lines: {}", tail(&log)))
}

fn exercise(
    serve: &Process,
    port: u16,
    record: &Path,
    subject: &Subject,
    report: &mut Report,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if serve.has_exited() {
            return Err("serve exited before it was ready".to_string());
        }
        if matches!(http(port, "GET", "/health", None), Ok((200, _))) {
            break;
        }
        if started.elapsed() > READY_LIMIT {
            return Err(format!(
                "serve was not ready within {} s",
                READY_LIMIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    report.ok(
        "serve",
        format!(
            "ready on the fake backend in {:.1} s",
            started.elapsed().as_secs_f64()
        ),
    );
    recorded_start(record, subject.plan, report);
    let chat = |stream: bool| {
        serde_json::json!({
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "stream": stream,
        })
        .to_string()
    };
    match http(port, "POST", "/v1/chat/completions", Some(&chat(false))) {
        Ok((200, body)) => match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(v) if v["choices"][0]["message"].is_object() => report.ok(
                "relayed chat",
                format!(
                    "200, model {}, {:?}",
                    v["model"], v["choices"][0]["message"]["content"]
                ),
            ),
            _ => report.fail(
                "relayed chat",
                format!("200 but not a chat completion: {body:.200}"),
            ),
        },
        Ok((status, body)) => report.fail("relayed chat", format!("{status}: {body:.200}")),
        Err(e) => report.fail("relayed chat", e),
    }
    match http(port, "POST", "/v1/chat/completions", Some(&chat(true))) {
        Ok((200, body)) => {
            let events = body.lines().filter(|l| l.starts_with("data: ")).count();
            if body.trim_end().ends_with("data: [DONE]") {
                report.ok(
                    "relayed stream",
                    format!("200, {events} events ending in data: [DONE]"),
                );
            } else {
                report.fail(
                    "relayed stream",
                    format!("no data: [DONE] at its end: {body:.200}"),
                );
            }
        }
        Ok((status, body)) => report.fail("relayed stream", format!("{status}: {body:.200}")),
        Err(e) => report.fail("relayed stream", e),
    }
    match http(port, "GET", "/health", None) {
        Ok((200, body)) => report.ok("health", format!("200 {}", body.trim())),
        Ok((status, body)) => report.fail("health", format!("{status} {}", body.trim())),
        Err(e) => report.fail("health", e),
    }
    match http(port, "GET", "/metrics", None) {
        Ok((200, body)) => {
            let series = body
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .count();
            report.ok("metrics", format!("200, {series} samples"));
        }
        Ok((status, body)) => report.fail("metrics", format!("{status} {body:.200}")),
        Err(e) => report.fail("metrics", e),
    }
    Ok(())
}

/// What the fake backend recorded of its start: the plan's variables must be in its
/// environment.
fn recorded_start(record: &Path, plan: &Plan, report: &mut Report) {
    let Ok(text) = std::fs::read_to_string(record) else {
        report.fail("backend start", "the fake backend recorded no start");
        return;
    };
    let Ok(seen) = serde_json::from_str::<serde_json::Value>(&text) else {
        report.fail("backend start", "the fake backend's record is not JSON");
        return;
    };
    let argv: Vec<&str> = seen["argv"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str())
        .collect();
    let wanted = plan
        .backends
        .iter()
        .flat_map(|b| b.env.keys().chain(b.env_combined.keys()));
    let missing: Vec<&String> = wanted
        .filter(|k| seen["env"].get(k.as_str()).is_none())
        .collect();
    if missing.is_empty() {
        report.ok("backend start", format!("started as {}", argv.join(" ")));
    } else {
        report.fail(
            "backend start",
            format!("the backend's environment lacks {missing:?}"),
        );
    }
}

/// One HTTP/1.1 request to serve on loopback (`Connection: close`): status and body, a
/// chunked body decoded.
fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), String> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(REQUEST_LIMIT))
        .map_err(|e| e.to_string())?;
    let body = body.unwrap_or("");
    write!(
        tcp,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    tcp.read_to_end(&mut raw)
        .map_err(|e| format!("{method} {path}: {e}"))?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP reply")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let rest = &raw[split + 4..];
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no HTTP status")?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// A chunked body's data; a malformed or cut chunk ends it.
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&rest[..line_end]);
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        let after = &rest[line_end + 2..];
        if n == 0 || after.len() < n {
            break;
        }
        out.extend_from_slice(&after[..n]);
        rest = after[n..].strip_prefix(b"\r\n").unwrap_or(&after[n..]);
    }
    out
}

/// The last lines of serve's log, joined for one line.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_chunked_body_is_decoded() {
        let body = super::dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n");
        assert_eq!(body, b"hello world");
        // A cut chunk ends the body without a panic.
        assert_eq!(super::dechunk(b"5\r\nhel"), b"");
        assert_eq!(super::dechunk(b"zz\r\nhello"), b"");
    }
}
