//! `1bit rpc-worker` under test: started on a free port (optionally inside a network
//! namespace), its one announcement line read, killed when dropped.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{children_of, installed_llama_server, onebit, wait_until};

/// A running `1bit rpc-worker`.
pub struct RpcWorker {
    child: Child,
    /// `HOST:PORT` it listens on, from its announcement.
    pub endpoint: String,
    /// Its one stdout line.
    pub announcement: String,
    stderr: Arc<Mutex<String>>,
    status: Option<ExitStatus>,
}

impl RpcWorker {
    /// `1bit rpc-worker --port 0 ARGS` (in network namespace `netns` when given, through
    /// `ip netns exec`), once it announced itself; panics with its stderr when it does not
    /// within 60 s. The pinned ggml-rpc-server is found beside the test llama-server.
    pub fn start(args: &[&str], netns: Option<&str>) -> RpcWorker {
        Self::try_start(args, netns).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`RpcWorker::start`], but a worker that never announces itself is an error with
    /// its exit status and stderr.
    pub fn try_start(args: &[&str], netns: Option<&str>) -> Result<RpcWorker, String> {
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(onebit());
                c
            }
            None => Command::new(onebit()),
        };
        command
            .arg("rpc-worker")
            .args(["--port", "0"])
            .args(args)
            .env("ONEBIT_LLAMA_SERVER", installed_llama_server())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|e| format!("1bit rpc-worker: {e}"))?;
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut s) = child.stderr.take() {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(out);
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                let _ = tx.send(line);
                // Keep draining so the worker never blocks on a full pipe.
                let mut rest = String::new();
                let _ = reader.read_to_string(&mut rest);
            });
        }
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
        if line.is_empty() {
            let _ = child.kill();
            let status = child.wait().ok();
            return Err(format!(
                "1bit rpc-worker did not announce itself ({status:?}):\n{}",
                stderr.lock().unwrap()
            ));
        }
        let endpoint = line
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_default()
            .to_string();
        Ok(RpcWorker {
            child,
            endpoint,
            announcement: line.trim_end().to_string(),
            stderr,
            status: None,
        })
    }

    /// The `1bit rpc-worker` process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The ggml-rpc-server it runs (inside `ip netns exec`, a grandchild), once there.
    pub fn server_pid(&self) -> Option<u32> {
        let mut pids = vec![self.child.id()];
        while let Some(pid) = pids.pop() {
            for c in children_of(pid) {
                let comm = std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
                if comm.trim() == "ggml-rpc-server" {
                    return Some(c);
                }
                pids.push(c);
            }
        }
        None
    }

    /// What it wrote on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal);
    }

    /// Its exit status, within `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        if self.status.is_none() {
            let child = &mut self.child;
            let mut status = None;
            wait_until(limit, || {
                status = child.try_wait().ok().flatten();
                status.is_some()
            });
            self.status = status;
        }
        self.status
    }
}

impl Drop for RpcWorker {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// POST `body` (a streamed chat) to serve on `port` and return the connection once the first
/// content event arrived, with what was read; the caller reads the rest (or sees it cut).
pub fn stream_started(port: u16, body: &str) -> (std::net::TcpStream, String) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("serve listens");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains("\"content\":\"") {
        let n = s.read(&mut buf).expect("the stream starts");
        assert!(n > 0, "the stream ended before its first token: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    (s, seen)
}
