//! The vendor's path after the build and the user's after the install, run as a vendor's CI
//! would: the route and the engine program it carries made into a signed package with
//! `1bit plugins package`, the key trusted in a scratch trust store, the package installed
//! into a scratch prefix (the engine still executable), then `1bit serve --device zeta` from
//! the installed package: a whole and a streamed chat relayed to the engine, the engine's
//! counters in serve's `/metrics`, SIGTERM a clean exit, and after a `kill -9` of serve neither
//! the engine nor the device monitor the engine forked is left.
//!
//! It runs `1bit`: `$ONEBIT_BIN`, else `1bit` on PATH (`cargo xtask test` sets `ONEBIT_BIN`).

// A test drives the CLI as its user does: through processes it starts and waits for.
#![allow(clippy::disallowed_methods)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `1bit` to run.
fn onebit() -> PathBuf {
    if let Some(bin) = std::env::var_os("ONEBIT_BIN").filter(|b| !b.is_empty()) {
        return PathBuf::from(bin);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("1bit"))
        .find(|p| p.is_file())
        .expect("this test runs 1bit: put it on PATH, or set ONEBIT_BIN to its path")
}

/// A scratch home: the trust store and the user's folders are in it, never the real ones.
struct Home {
    work: PathBuf,
}

impl Home {
    fn new(name: &str) -> Home {
        let work = std::env::temp_dir().join(format!("zeta-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(work.join("home")).unwrap();
        Home { work }
    }

    /// `1bit` with this home's environment.
    fn command(&self) -> Command {
        let mut command = Command::new(onebit());
        command
            .env("ONEBIT_TRUST_DIR", self.work.join("trust"))
            .env("HOME", self.work.join("home"))
            .env("XDG_CONFIG_HOME", self.work.join("home/.config"))
            .env("ZETA_DEVICE", self.work.join("zeta0"))
            .env_remove("ONEBIT_PLUGIN_PATH");
        command
    }

    /// `1bit ARGS`: its exit status, stdout, and stderr.
    fn run(&self, args: &[&str]) -> (i32, String, String) {
        let out = self.command().args(args).output().expect("1bit runs");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn text(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// `1bit serve` under test, its output gathered; killed if the test ends without stopping it.
struct Serve {
    child: Child,
    port: u16,
    output: Arc<Mutex<String>>,
}

impl Serve {
    fn start(home: &Home, model: &Path, plugins: &Path) -> Serve {
        let serve = Serve::spawn(home, model, plugins, "zeta");
        let ready = wait_until(Duration::from_secs(30), || {
            request(serve.port, "GET", "/health", "").is_some_and(|(status, _)| status == 200)
        });
        assert!(ready, "serve never became healthy:\n{}", serve.output());
        serve
    }

    /// `1bit serve --device DEVICE`, the cpu route's llama-server the fake backend beside 1bit.
    fn spawn(home: &Home, model: &Path, plugins: &Path, device: &str) -> Serve {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut child = home
            .command()
            .args([
                "serve",
                "-m",
                text(model),
                "--device",
                device,
                "--plugin-dir",
            ])
            .arg(plugins)
            .args(["--port", &port.to_string()])
            .arg("--llama-server")
            .arg(onebit().with_file_name("fake-backend"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("1bit serve starts");
        let output = Arc::new(Mutex::new(String::new()));
        for stream in [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let output = Arc::clone(&output);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    output.lock().unwrap().push_str(&format!("{line}\n"));
                }
            });
        }
        Serve {
            child,
            port,
            output,
        }
    }

    fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// The engine: serve's child.
    fn engine(&self) -> u32 {
        let children = children_of(self.child.id());
        assert_eq!(
            children.len(),
            1,
            "serve runs one engine: {children:?}\n{}",
            self.output()
        );
        children[0]
    }

    /// Wait up to `limit` for serve to exit: its exit code (None: killed by a signal).
    fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let mut code = None;
        let exited = wait_until(limit, || match self.child.try_wait() {
            Ok(Some(status)) => {
                code = status.code();
                true
            }
            _ => false,
        });
        assert!(exited, "serve did not exit:\n{}", self.output());
        code
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `check` held within `limit`, asked every 20 ms.
fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
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

/// One HTTP/1.1 request on a connection of its own: the status and the body (de-chunked), or
/// None when nothing listens.
fn request(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).ok()?;
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let (head, rest) = reply.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Some((
        status,
        if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        },
    ))
}

/// A chunked body's bytes.
fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || after.len() < size {
            break;
        }
        body.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    body
}

/// The direct children of `pid`, from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// Whether `pid` is a live process (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next());
        !matches!(state, Some("Z" | "X") | None)
    })
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// The engine and the device monitor it forked, both running.
fn engine_and_monitor(serve: &Serve) -> (u32, u32) {
    let engine = serve.engine();
    assert!(
        cmdline(engine).contains("zeta-engine"),
        "{}",
        cmdline(engine)
    );
    let monitors = children_of(engine);
    assert_eq!(
        monitors.len(),
        1,
        "the engine forked one monitor: {monitors:?}"
    );
    let monitor = monitors[0];
    assert!(
        cmdline(monitor).contains("--device-monitor"),
        "{}",
        cmdline(monitor)
    );
    (engine, monitor)
}

/// Fails naming each of `pids` still alive 5 s from now, after killing it.
fn all_gone(pids: &[u32], after: &str) {
    let gone = wait_until(Duration::from_secs(5), || pids.iter().all(|p| !alive(*p)));
    let left: Vec<String> = pids
        .iter()
        .filter(|p| alive(**p))
        .map(|p| format!("{p}: {}", cmdline(*p)))
        .collect();
    for p in pids.iter().filter(|p| alive(**p)) {
        let _ = Command::new("kill")
            .args(["-KILL", &p.to_string()])
            .status();
    }
    assert!(gone, "alive 5 s after {after}:\n{}", left.join("\n"));
}

/// The route library cargo built beside `engine`: `cargo build` puts it there, `cargo test`
/// alone leaves it in `deps/` (a package with a binary target does not get its cdylib copied
/// up by a test build).
fn route_library(engine: &Path) -> PathBuf {
    const FILE: &str = "libonebit_route_zeta.so";
    let beside = engine.with_file_name(FILE);
    let in_deps = engine.with_file_name("deps").join(FILE);
    let route = [&beside, &in_deps]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "cargo built neither {} nor {}",
                beside.display(),
                in_deps.display()
            )
        });
    route.clone()
}

/// `1bit plugins package` of the built route carrying `engine` as `zeta-engine` 1.0.0, signed
/// with `key` when given, into `dist`: the archive's path.
fn package(home: &Home, engine: &Path, key: Option<&Path>, dist: &Path) -> PathBuf {
    let route = route_library(engine);
    let carry = format!("{}=1.0.0", text(engine));
    let mut args = vec![
        "plugins",
        "package",
        text(&route),
        "--version",
        "1.0.0",
        "--vendor",
        "Zeta Devices Inc.",
        "--license",
        "LicenseRef-Zeta-Proprietary",
        "--carry",
        &carry,
        "--out",
        text(dist),
    ];
    if let Some(key) = key {
        args.extend(["--sign", text(key)]);
    }
    let (code, out, err) = home.run(&args);
    assert_eq!(code, 0, "{out}{err}");
    PathBuf::from(out.lines().last().expect("the archive's path").trim())
}

/// `--device zeta` refuses to start, exit 1, with one line holding `says`; `--device auto`
/// falls back to the cpu route.
fn refused_at_start(home: &Home, model: &Path, plugins: &Path, says: &str) {
    let mut refused = Serve::spawn(home, model, plugins, "zeta");
    assert_eq!(refused.wait_exit(Duration::from_secs(15)), Some(1));
    let out = refused.output();
    let line = out
        .lines()
        .find(|l| l.contains("--device zeta: package zeta 1.0.0"))
        .unwrap_or_else(|| panic!("the refusal is said:\n{out}"));
    assert!(line.contains(says), "{line}");
    let fallback = Serve::spawn(home, model, plugins, "auto");
    let chose_cpu = wait_until(Duration::from_secs(30), || {
        fallback.output().contains("--device auto chose cpu")
    });
    assert!(chose_cpu, "{}", fallback.output());
}

const CHAT: &str = r#"{"messages":[{"role":"user","content":"the engine is a program"}]}"#;
const STREAM: &str =
    r#"{"stream":true,"messages":[{"role":"user","content":"the engine is a program"}]}"#;

#[test]
fn the_engine_ships_in_a_signed_package_and_serves_and_dies_with_serve() {
    // The route library and the engine program, built by cargo into the same target folder.
    let engine = PathBuf::from(env!("CARGO_BIN_EXE_zeta-engine"));
    let home = Home::new("package");
    let work = &home.work;
    std::fs::write(work.join("zeta0"), "the stand-in Zeta device").unwrap();
    let model = work.join("model.gguf");
    let (code, out, err) = home.run(&["gguf", "stub", text(&model), "--arch", "llama"]);
    assert_eq!(code, 0, "{out}{err}");

    // The vendor: a key, then a signed package carrying the engine.
    let key = work.join("zeta");
    let (code, out, err) = home.run(&["plugins", "keygen", text(&key), "--comment", "Zeta"]);
    assert_eq!(code, 0, "{out}{err}");
    let dist = work.join("dist");
    let archive = package(&home, &engine, Some(&work.join("zeta.key")), &dist);
    assert_eq!(archive, dist.join("zeta-1.0.0.tar.gz"));

    // The user: trusts the key, installs; the engine is still a program.
    let (code, out, err) = home.run(&["plugins", "trust", text(&work.join("zeta.pub"))]);
    assert_eq!(code, 0, "{out}{err}");
    let prefix = work.join("prefix");
    let (code, out, err) = home.run(&[
        "plugins",
        "install",
        text(&archive),
        "--prefix",
        text(&prefix),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let plugins = prefix.join("lib/1bit/plugins");
    let installed = plugins.join("zeta").join("zeta-engine");
    let mode = std::fs::metadata(&installed).unwrap().permissions().mode();
    assert_ne!(
        mode & 0o111,
        0,
        "the installed engine {} lost its executable bit (mode {:o})",
        installed.display(),
        mode & 0o7777
    );

    // serve from the installed package: a whole and a streamed chat, the engine's counters.
    let mut serve = Serve::start(&home, &model, &plugins);
    assert!(
        serve.output().contains("(package zeta 1.0.0)"),
        "serve runs the packaged engine:\n{}",
        serve.output()
    );
    let (status, body) = request(serve.port, "POST", "/v1/chat/completions", CHAT).unwrap();
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "program a is engine the"
    );
    assert_eq!(reply["model"], "model", "serve's served name");
    let (status, body) = request(serve.port, "POST", "/v1/chat/completions", STREAM).unwrap();
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let streamed: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .inspect(|e| assert_eq!(e["object"], "chat.completion.chunk", "{e}"))
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, "program a is engine the");
    let (status, metrics) = request(serve.port, "GET", "/metrics", "").unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("zeta_engine_generations_total 2"),
        "the engine's counters in serve's /metrics:\n{metrics}"
    );

    // SIGTERM: a clean exit, and neither the engine nor its monitor is left.
    let (engine_pid, monitor_pid) = engine_and_monitor(&serve);
    let term = Command::new("kill")
        .args(["-TERM", &serve.child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert_eq!(
        serve.wait_exit(Duration::from_secs(15)),
        Some(0),
        "{}",
        serve.output()
    );
    all_gone(&[engine_pid, monitor_pid], "serve's SIGTERM");

    // kill -9 of serve: the engine dies by its parent-death signal, the monitor it forked by
    // serve's keeper (onebit-process), which kills the engine's process group.
    let mut serve = Serve::start(&home, &model, &plugins);
    let (engine_pid, monitor_pid) = engine_and_monitor(&serve);
    serve.child.kill().unwrap();
    assert_eq!(serve.wait_exit(Duration::from_secs(5)), None);
    all_gone(&[engine_pid, monitor_pid], "kill -9 of serve");

    // The installed engine's mode changed, then one byte of it: refused at start in one line
    // naming the file and the repair, --device auto falls back to cpu; then put back, it serves.
    let mode_of = |mode: u32| {
        std::fs::set_permissions(&installed, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    mode_of(0o644);
    refused_at_start(
        &home,
        &model,
        &plugins,
        "zeta-engine is not executable, but its manifest records it executable",
    );
    mode_of(0o755);
    let original = std::fs::read(&installed).unwrap();
    let mut changed = original.clone();
    let middle = changed.len() / 2;
    changed[middle] ^= 1;
    std::fs::write(&installed, &changed).unwrap();
    refused_at_start(
        &home,
        &model,
        &plugins,
        "zeta-engine's sha256 does not match its manifest",
    );
    std::fs::write(&installed, &original).unwrap();
    drop(Serve::start(&home, &model, &plugins));

    std::fs::remove_dir_all(work).unwrap();
}

#[test]
fn plugins_check_runs_the_real_engine_and_names_a_bad_one_in_one_line() {
    let engine = PathBuf::from(env!("CARGO_BIN_EXE_zeta-engine"));
    let home = Home::new("check");
    let work = &home.work;
    std::fs::write(work.join("zeta0"), "the stand-in Zeta device").unwrap();
    let model = work.join("model.gguf");
    let (code, out, err) = home.run(&["gguf", "stub", text(&model), "--arch", "llama"]);
    assert_eq!(code, 0, "{out}{err}");
    let archive = package(&home, &engine, None, &work.join("dist"));
    let check = |archive: &Path, env: &[(&str, &str)]| {
        let out = home
            .command()
            .args([
                "plugins",
                "check",
                "--real-backends",
                "--ready-s",
                "5",
                "-m",
            ])
            .arg(&model)
            .arg(archive)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.code(), text)
    };

    // The real engine: started from the package, healthy, relays, its metrics, nothing left.
    let (code, report) = check(&archive, &[]);
    assert_eq!(code, Some(0), "{report}");
    for line in [
        "ok   program 0: ",
        "carried by package zeta 1.0.0 (zeta-engine 1.0.0), executable",
        "ok   serve: ready on the plan's own programs in ",
        "ok   backend 0 start: pid ",
        "ok   relayed chat: 200 in ",
        "ok   relayed stream: 200 in ",
        "ok   stop: serve stopped cleanly on SIGTERM in ",
        "ok   nothing left: the ",
    ] {
        assert!(report.contains(line), "{line:?} in:\n{report}");
    }
    let engines = report
        .lines()
        .find_map(|l| l.strip_prefix("ok   metrics: 200, "))
        .and_then(|l| l.split(", ").nth(1))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<u32>().ok());
    assert!(
        engines.is_some_and(|n| n > 0),
        "the engine's samples:\n{report}"
    );

    // The engine made non-executable in the package folder: one line naming it and the fix.
    let folder = work.join("dist/zeta-1.0.0");
    let engine_in_package = folder.join("zeta-engine");
    std::fs::set_permissions(&engine_in_package, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, report) = check(&folder, &[]);
    assert_eq!(code, Some(1), "{report}");
    let failed: Vec<&str> = report.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(failed.len(), 1, "{report}");
    assert!(
        failed[0].contains("zeta-engine is not executable, but its manifest records it executable")
            && failed[0].contains("1bit plugins install"),
        "{report}"
    );
    std::fs::set_permissions(&engine_in_package, std::fs::Permissions::from_mode(0o755)).unwrap();

    // An engine that never answers health: the check says which, within --ready-s.
    let (code, report) = check(&archive, &[("ZETA_LOAD_MS", "600000")]);
    assert_eq!(code, Some(1), "{report}");
    let failed: Vec<&str> = report.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(failed.len(), 1, "{report}");
    assert!(
        failed[0].contains("zeta-engine never answered its health route with 200 within 5 s"),
        "{report}"
    );
    std::fs::remove_dir_all(work).unwrap();
}
