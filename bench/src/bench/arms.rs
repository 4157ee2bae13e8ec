//! The servers a benchmark compares: llama-server alone, `1bit serve` in front of its own
//! llama-server, nginx in front of the first, and the fake backend; each a child stopped on drop.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::client::{self, Conn};
use crate::{Failure, process};

/// llama-server's HTTP threads, on every arm: one keep-alive connection holds one thread, and
/// its default (cores + 1 or slots + 2) would leave most of the 64 load clients waiting.
pub const THREADS_HTTP: &str = "80";

/// A server under test: its address and the child that runs it, stopped (SIGTERM, then
/// SIGKILL after 10 s) when this is dropped, so no error path leaves one behind.
pub struct Server {
    pub name: &'static str,
    pub addr: SocketAddr,
    child: Child,
    log: PathBuf,
}

impl Server {
    /// Starts `command` with its stdout and stderr in `<scratch>/<name>.log`.
    pub fn spawn(
        name: &'static str,
        addr: SocketAddr,
        command: &mut Command,
        scratch: &Path,
    ) -> Result<Server, Failure> {
        let log = scratch.join(format!("{name}-{}.log", addr.port()));
        let out = File::create(&log).map_err(|e| {
            Failure::new(
                format!("cannot create {}: {e}", log.display()),
                "check /tmp",
            )
        })?;
        let err = out.try_clone().map_err(|e| Failure(e.to_string()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| {
                Failure::new(
                    format!("cannot start `{}`: {e}", process::describe(command)),
                    "check that it is installed",
                )
            })?;
        Ok(Server {
            name,
            addr,
            child,
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `GET /health` every 5 ms (as serve polls its own backend) until it answers 200; returns how long that took from
    /// `since`. Fails when the child exits or `limit` passes, naming its log.
    pub fn wait_healthy(&mut self, since: Instant, limit: Duration) -> Result<Duration, Failure> {
        let request = client::get(self.addr, "/health");
        loop {
            if let Ok(mut conn) = Conn::open(self.addr)
                && let Ok(reply) = conn.exchange(&request)
                && reply.status == 200
            {
                return Ok(since.elapsed());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(self.failure(format!("exited ({status}) before /health answered 200")));
            }
            if since.elapsed() > limit {
                return Err(self.failure(format!("/health did not answer 200 within {limit:?}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, without waiting (its drop waits).
    pub fn terminate(&self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
    }

    /// How it exited, when it did.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    pub fn failure(&self, what: String) -> Failure {
        Failure::new(
            format!("{} on {}: {what}", self.name, self.addr),
            format!("see its log, {}", self.log.display()),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = kill(pid, Signal::SIGTERM);
            let began = Instant::now();
            while matches!(self.child.try_wait(), Ok(None)) {
                if began.elapsed() > Duration::from_secs(10) {
                    let _ = self.child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = self.child.wait();
    }
}

/// A loopback port the kernel has just handed out and taken back.
pub fn free_addr() -> Result<SocketAddr, Failure> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| {
            Failure::new(
                format!("cannot bind 127.0.0.1:0: {e}"),
                "check the loopback interface",
            )
        })
}

/// llama-server as serve's cpu route starts it (docs/serve.md), plus `--threads-http`.
pub fn llama_server(llama: &Path, model: &Path, addr: SocketAddr) -> Command {
    let mut command = Command::new(llama);
    command
        .arg("-m")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
        .args(["--metrics", "--jinja", "-ngl", "0", "-c", "4096"])
        .args(["--threads-http", THREADS_HTTP]);
    command
}

/// `1bit serve` on the cpu route; its llama-server gets `--threads-http` through llama.cpp's
/// `LLAMA_ARG_THREADS_HTTP` (serve passes its environment on).
pub fn serve(onebit: &Path, model: &Path, addr: SocketAddr, backend: Option<&Path>) -> Command {
    let mut command = Command::new(onebit);
    command
        .arg("serve")
        .arg("-m")
        .arg(model)
        .args(["--device", "cpu", "--host", "127.0.0.1"])
        .args(["--port", &addr.port().to_string()])
        .env("LLAMA_ARG_THREADS_HTTP", THREADS_HTTP);
    if let Some(backend) = backend {
        command.arg("--llama-server").arg(backend);
    }
    command
}

/// The nginx binary, installing Debian's nginx-light with apt-get when there is none.
pub fn nginx_binary() -> Result<PathBuf, Failure> {
    let find = || {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain([PathBuf::from("/usr/sbin")])
            .map(|dir| dir.join("nginx"))
            .find(|p| p.is_file())
    };
    if let Some(found) = find() {
        return Ok(found);
    }
    println!("==> nginx is absent: apt-get install -y nginx-light (the comparison reverse proxy)");
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "nginx-light"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install() {
        println!("==> apt-get update, then install again");
        let mut update = Command::new("apt-get");
        update.arg("update");
        process::run(
            &mut update,
            "apt-get update failed: check the network and apt sources",
        )?;
        if !install() {
            return Err(Failure::new(
                "apt-get install -y nginx-light failed",
                "install nginx (any build with the proxy module) and rerun",
            ));
        }
    }
    // The package enables and starts a system nginx on port 80; the benchmark never uses it.
    find().ok_or_else(|| {
        Failure::new(
            "nginx-light installed but no nginx binary was found",
            "check `dpkg -L nginx-light`",
        )
    })
}

/// nginx as a tuned reverse proxy for `upstream`: keep-alive both ways, no buffering (SSE),
/// no access log; run in the foreground from its own prefix directory under `scratch`.
pub fn nginx(
    binary: &Path,
    scratch: &Path,
    addr: SocketAddr,
    upstream: SocketAddr,
) -> Result<Command, Failure> {
    let prefix = scratch.join(format!("nginx-{}", addr.port()));
    std::fs::create_dir_all(&prefix)
        .map_err(|e| Failure(format!("cannot create {}: {e}", prefix.display())))?;
    let conf = prefix.join("nginx.conf");
    let text = format!(
        "worker_processes auto;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    upstream backend {{
        server {upstream};
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen {addr};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
        }}
    }}
}}
",
        prefix = prefix.display()
    );
    std::fs::write(&conf, text)
        .map_err(|e| Failure(format!("cannot write {}: {e}", conf.display())))?;
    let mut command = Command::new(binary);
    command
        .arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(&conf)
        .arg("-e")
        .arg(prefix.join("error.log"))
        .args(["-g", "daemon off;"]);
    Ok(command)
}

/// The resident memory of one process (its children excluded), in KiB.
pub fn vm_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
