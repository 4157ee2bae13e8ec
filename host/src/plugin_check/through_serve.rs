//! A route whose plan runs child processes, checked through serve itself: `1bit serve` with
//! the route, each backend run as the fake backend with the plan's own arguments
//! (`--backend-standin`), or with `--real-backends` as the plan's own programs; a whole and a
//! streamed chat relayed by serve's own relay, what each backend was started with, what
//! `/health` and `/metrics` said, and after the stop, that no process serve started is left
//! (the engines' own children included). So a plugin author tests such a route on any
//! machine without its engine, and on the engine's machine with it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use onebit_plugin_api::Plan;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_process::Process;

use super::Report;

/// How long the processes serve started have to be gone after it exited.
const GONE_LIMIT: Duration = Duration::from_secs(5);
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
    /// `--real-backends`: the plan's programs run, not the fake backend.
    pub real_backends: bool,
    /// How long serve has to say ready.
    pub ready: Duration,
    /// The trust store serve is run with (a package's check: an empty one).
    pub trust_dir: Option<PathBuf>,
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
    let fake = if subject.real_backends {
        None
    } else {
        let Some(fake) = fake_backend() else {
            report.skip(
                "answers",
                "the plan runs child processes: install the fake backend (`cargo xtask install` puts 1bit-fake-backend beside 1bit) or set ONEBIT_FAKE_BACKEND to relay chats through serve to it; or pass --real-backends to run the plan's own programs",
            );
            return;
        };
        Some(fake)
    };
    let work =
        std::env::temp_dir().join(format!("1bit-plugins-check-serve-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&work);
    let outcome = run_serve(subject, fake.as_deref(), &work, report);
    if let Err(line) = outcome {
        report.fail("serve", line);
    }
    let _ = std::fs::remove_dir_all(&work);
}

fn run_serve(
    subject: &Subject,
    fake: Option<&Path>,
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
        .args(
            fake.iter()
                .flat_map(|f| [std::ffi::OsStr::new("--backend-standin"), f.as_os_str()]),
        )
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
    if let Some(trust) = &subject.trust_dir {
        command.env(onebit_route_package::keys::TrustStore::DIR_VAR, trust);
    }
    let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    command.stdout(out).stderr(err);
    let serve = onebit_process::spawn(command).map_err(|e| format!("serve did not start: {e}"))?;
    let mut started = Vec::new();
    let outcome = exercise(&serve, port, &record, subject, &mut started, report);
    let stopping = Instant::now();
    let stopped = serve.stop(Duration::from_secs(10));
    let took = stopping.elapsed();
    match (&outcome, serve.wait_timeout(Duration::ZERO)) {
        (Ok(()), Some(Ok(status))) if status.success() => report.ok(
            "stop",
            format!(
                "serve stopped cleanly on SIGTERM in {:.2} s",
                took.as_secs_f64()
            ),
        ),
        (Ok(()), status) => report.fail(
            "stop",
            format!("serve did not stop cleanly: {status:?} ({stopped:?})"),
        ),
        (Err(_), _) => {}
    }
    if outcome.is_ok() {
        // Seen again at the stop: what the engines started while they served.
        started.extend(descendants(serve.pid()));
        left_behind(&started, report);
    }
    outcome.map_err(|why| format!("{why}; serve's last lines: {}", tail(&log)))
}

/// After serve exited: every process it started (and they started) must be gone within
/// [`GONE_LIMIT`]; one line for the first left.
fn left_behind(started: &[(u32, String)], report: &mut Report) {
    let deadline = Instant::now() + GONE_LIMIT;
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                stat.rsplit_once(')')
                    .map(|(_, rest)| rest.trim().to_string())
            })
            .is_some_and(|rest| !rest.starts_with('Z'))
    };
    loop {
        let left: Vec<&(u32, String)> = started.iter().filter(|(pid, _)| alive(*pid)).collect();
        match left.first() {
            None => {
                report.ok(
                    "nothing left",
                    format!("the {} processes serve started are gone", started.len()),
                );
                return;
            }
            Some((pid, cmd)) if Instant::now() >= deadline => {
                report.fail(
                    "nothing left",
                    format!(
                        "process {pid} ({cmd}) outlived serve by {} s; an engine's children must stay in its process group (no setsid), so serve's stop reaches them",
                        GONE_LIMIT.as_secs()
                    ),
                );
                return;
            }
            Some(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Every process below `root` now (its children, theirs, ...): pid and command line.
fn descendants(root: u32) -> Vec<(u32, String)> {
    let mut parent_of = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parent_of.push((pid, ppid));
        }
    }
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for &(pid, _) in parent_of.iter().filter(|(_, ppid)| *ppid == parent) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .split('\0')
                        .filter(|a| !a.is_empty())
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            found.push((pid, cmd));
            frontier.push(pid);
        }
    }
    found
}

/// Wait until serve's `/health` says 200, within `subject.ready`; the error names the engines
/// and serve's last answer.
fn wait_ready(serve: &Process, port: u16, subject: &Subject) -> Result<(), String> {
    let started = Instant::now();
    let mut last_health = String::new();
    loop {
        if serve.has_exited() {
            return Err("serve exited before it was ready".to_string());
        }
        match http(port, "GET", "/health", None) {
            Ok((200, _)) => return Ok(()),
            Ok((status, body)) => last_health = format!("{status} {}", body.trim()),
            Err(_) => {}
        }
        if started.elapsed() > subject.ready {
            let engines: Vec<&str> = subject
                .plan
                .backends
                .iter()
                .map(|b| b.engine.as_str())
                .collect();
            return Err(format!(
                "{} never answered its health route with 200 within {} s (serve's /health: {}); pass --ready-s for an engine that loads longer",
                engines.join(" and "),
                subject.ready.as_secs(),
                if last_health.is_empty() {
                    "no answer"
                } else {
                    &last_health
                }
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn exercise(
    serve: &Process,
    port: u16,
    record: &Path,
    subject: &Subject,
    started_processes: &mut Vec<(u32, String)>,
    report: &mut Report,
) -> Result<(), String> {
    let started = Instant::now();
    wait_ready(serve, port, subject)?;
    report.ok(
        "serve",
        format!(
            "ready on {} in {:.2} s",
            if subject.real_backends {
                "the plan's own programs"
            } else {
                "the fake backend"
            },
            started.elapsed().as_secs_f64()
        ),
    );
    *started_processes = descendants(serve.pid());
    if subject.real_backends {
        real_start(started_processes, subject.plan, report);
    } else {
        recorded_start(record, subject.plan, report);
    }
    let chat = |stream: bool| {
        serde_json::json!({
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, "stream": stream,
        })
        .to_string()
    };
    let asked = Instant::now();
    match http(port, "POST", "/v1/chat/completions", Some(&chat(false))) {
        Ok((200, body)) => match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(v) if v["choices"][0]["message"].is_object() => report.ok(
                "relayed chat",
                format!(
                    "200 in {:.1} ms, model {}, {:?}",
                    asked.elapsed().as_secs_f64() * 1000.0,
                    v["model"],
                    v["choices"][0]["message"]["content"]
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
    let asked = Instant::now();
    match http(port, "POST", "/v1/chat/completions", Some(&chat(true))) {
        Ok((200, body)) => {
            let events = body.lines().filter(|l| l.starts_with("data: ")).count();
            if body.trim_end().ends_with("data: [DONE]") {
                report.ok(
                    "relayed stream",
                    format!(
                        "200 in {:.1} ms, {events} events ending in data: [DONE]",
                        asked.elapsed().as_secs_f64() * 1000.0
                    ),
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
            let samples: Vec<&str> = body
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .collect();
            // serve's own series are onebit_*; the rest came from the engines' metrics routes.
            let engines = samples.iter().filter(|l| !l.starts_with("onebit_")).count();
            let declared = subject
                .plan
                .backends
                .iter()
                .any(|b| b.metrics_path.is_some());
            if subject.real_backends && declared && engines == 0 {
                report.fail(
                    "metrics",
                    "the plan names a metrics route, but serve's /metrics holds none of the engine's samples",
                );
            } else {
                report.ok(
                    "metrics",
                    format!(
                        "200, {} samples, {engines} of them the engines'",
                        samples.len()
                    ),
                );
            }
        }
        Ok((status, body)) => report.fail("metrics", format!("{status} {body:.200}")),
        Err(e) => report.fail("metrics", e),
    }
    Ok(())
}

/// What the plan's own programs were started with, read from `/proc`: each backend's argv
/// and the plan's variables in its environment.
fn real_start(processes: &[(u32, String)], plan: &Plan, report: &mut Report) {
    for (i, backend) in plan.backends.iter().enumerate() {
        let program = backend.argv.first().map(String::as_str).unwrap_or_default();
        let Some((pid, cmd)) = processes
            .iter()
            .find(|(_, cmd)| cmd.split(' ').next() == Some(program))
        else {
            report.fail(
                &format!("backend {i} start"),
                format!("no process of serve's runs {program}"),
            );
            continue;
        };
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let environ = String::from_utf8_lossy(&environ);
        let set: Vec<&str> = environ.split('\0').collect();
        let wanted: Vec<String> = backend
            .env
            .iter()
            .chain(&backend.env_combined)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let missing: Vec<&String> = wanted
            .iter()
            .filter(|kv| {
                let key = kv.split('=').next().unwrap_or_default();
                !set.iter().any(|s| s.starts_with(&format!("{key}=")))
            })
            .collect();
        if missing.is_empty() {
            report.ok(
                &format!("backend {i} start"),
                format!(
                    "pid {pid}: {cmd} (env: {})",
                    if wanted.is_empty() {
                        "none added".to_string()
                    } else {
                        wanted.join(" ")
                    }
                ),
            );
        } else {
            report.fail(
                &format!("backend {i} start"),
                format!("pid {pid}: its environment lacks {missing:?}"),
            );
        }
    }
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
