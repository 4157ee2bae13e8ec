//! Setup's proof that a llama.cpp build runs on this machine: the default model loaded and a few
//! greedy tokens decoded through the built llama-server and through the shared libraries the
//! inproc add-on loads (llama.cpp's own `llama-simple`, linked to them), before setup calls
//! either installed. A crash or a wrong answer is one line: which binary, how it ended, what to do.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{Failure, process};

/// The question the README's example asks, and the word the default model answers it with.
const QUESTION: &str = "What is the capital of France? Answer in one word.";
const ANSWER: &str = "Paris";
/// A raw prompt the default model continues greedily with the answer.
const PROMPT: &str = "The capital of France is";

/// How long the model may take to load and answer; seconds are normal here.
const LIMIT: Duration = Duration::from_secs(120);

/// Starts `llama_server` on the model with no extra flags, asks the README's question greedily
/// and wants [`ANSWER`] in the reply; stops it. Fails with one line on a crash, a failed
/// load, a timeout or a wrong answer.
pub fn prove_llama_server(llama_server: &Path, model: &Path, redo: &str) -> Result<(), Failure> {
    let started = Instant::now();
    let addr = free_addr()?;
    let mut command = Command::new(llama_server);
    command
        .arg("-m")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()]);
    let mut running = Running::start(command, llama_server, redo)?;
    let reply = running.answer(addr)?;
    running.stop();
    if !reply.contains(ANSWER) {
        let said = format!("answered {reply:?} to {QUESTION:?}");
        return Err(wrong_answer(llama_server, &said, "the build", redo));
    }
    println!(
        "self-test: llama-server answered {:?} in {:.1} s",
        reply.trim(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs `llama_simple` (linked to the shared libraries in `lib_dir`) on [`PROMPT`] for a few
/// greedy tokens and wants [`ANSWER`] among them.
pub fn prove_shared_libs(
    llama_simple: &Path,
    lib_dir: &Path,
    model: &Path,
    redo: &str,
) -> Result<(), Failure> {
    let started = Instant::now();
    let mut command = Command::new(llama_simple);
    command
        .arg("-m")
        .arg(model)
        .args(["-n", "6", PROMPT])
        .env("LD_LIBRARY_PATH", lib_dir);
    let mut running = Running::start(command, llama_simple, redo)?;
    let status = running.wait_until(started + LIMIT)?;
    let mut stdout = String::new();
    if let Some(mut out) = running.child.stdout.take() {
        let _ = out.read_to_string(&mut stdout);
    }
    if !status.success() {
        return Err(running.ended(status));
    }
    let continuation = stdout
        .trim()
        .strip_prefix(PROMPT)
        .unwrap_or(stdout.trim())
        .trim();
    if !continuation.contains(ANSWER) {
        let said = format!("continued {PROMPT:?} with {continuation:?}");
        return Err(wrong_answer(
            llama_simple,
            &said,
            "the shared libraries",
            redo,
        ));
    }
    println!(
        "self-test: llama.cpp's shared libraries continued {PROMPT:?} with {:?} in {:.1} s",
        continuation,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The line for a program that ran but did not answer [`ANSWER`]: what it `said`, and that
/// `which` (the build, the shared libraries) computes wrong results here.
fn wrong_answer(program: &Path, said: &str, which: &str, redo: &str) -> Failure {
    Failure::new(
        format!("self-test: {} {said}, not {ANSWER:?}", program.display()),
        format!("{which} computes wrong results on this CPU; {redo}"),
    )
}

/// A program under test: its process, the last lines of its stderr, and what to tell the user.
struct Running {
    child: Child,
    program: String,
    tail: Arc<Mutex<VecDeque<String>>>,
    redo: String,
}

impl Running {
    fn start(mut command: Command, program: &Path, redo: &str) -> Result<Self, Failure> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = command.spawn().map_err(|err| {
            Failure::new(
                format!("self-test: cannot start {}: {err}", program.display()),
                redo,
            )
        })?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(stderr) = child.stderr.take() {
            let tail = tail.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if tail.len() == 20 {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            });
        }
        Ok(Running {
            child,
            program: program.display().to_string(),
            tail,
            redo: redo.to_owned(),
        })
    }

    /// Waits for /health, then asks the question; the reply's message content.
    fn answer(&mut self, addr: SocketAddr) -> Result<String, Failure> {
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(status) = self.exited()? {
                return Err(self.ended(status));
            }
            if matches!(http(addr, "GET", "/health", ""), Ok((200, _))) {
                break;
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(self.timed_out("to load the model"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 12,
        })
        .to_string();
        let reply = http(addr, "POST", "/v1/chat/completions", &body);
        if let Some(status) = self.exited()? {
            return Err(self.ended(status));
        }
        match reply {
            Ok((200, body)) => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|reply| {
                    reply["choices"][0]["message"]["content"]
                        .as_str()
                        .map(str::to_owned)
                })
                .ok_or_else(|| {
                    Failure::new(
                        format!(
                            "self-test: {} sent a reply with no message: {}",
                            self.program,
                            String::from_utf8_lossy(&body)
                        ),
                        &self.redo,
                    )
                }),
            Ok((status, body)) => Err(Failure::new(
                format!(
                    "self-test: {} answered status {status}: {}",
                    self.program,
                    String::from_utf8_lossy(&body).trim()
                ),
                &self.redo,
            )),
            Err(err) => {
                // A crash mid-answer closes the connection: give it a moment to be reaped.
                std::thread::sleep(Duration::from_millis(200));
                if let Some(status) = self.exited()? {
                    return Err(self.ended(status));
                }
                self.stop();
                Err(Failure::new(
                    format!("self-test: asking {} failed: {err}", self.program),
                    &self.redo,
                ))
            }
        }
    }

    fn exited(&mut self) -> Result<Option<ExitStatus>, Failure> {
        self.child.try_wait().map_err(|err| {
            Failure::new(
                format!("self-test: cannot wait for {}: {err}", self.program),
                &self.redo,
            )
        })
    }

    fn wait_until(&mut self, deadline: Instant) -> Result<ExitStatus, Failure> {
        loop {
            if let Some(status) = self.exited()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(self.timed_out("to decode"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The line for a program that ended before it answered: how, and its last stderr line.
    fn ended(&self, status: ExitStatus) -> Failure {
        // The stderr reader may still be taking the last lines.
        std::thread::sleep(Duration::from_millis(50));
        let last = self
            .tail
            .lock()
            .ok()
            .and_then(|tail| tail.back().cloned())
            .map(|line| format!(" (its last line: {})", line.trim()))
            .unwrap_or_default();
        let crashed = matches!(
            process::signal_name(status),
            Some("SIGSEGV" | "SIGILL" | "SIGBUS" | "SIGFPE")
        );
        let what = if crashed {
            "the llama.cpp build does not run on this CPU (docs/setup.md says which paths are left out and why)"
        } else {
            "see its last line"
        };
        Failure::new(
            format!(
                "self-test: {} {}{last}",
                self.program,
                process::how_it_ended(status)
            ),
            format!("{what}; {}", self.redo),
        )
    }

    fn timed_out(&self, what: &str) -> Failure {
        Failure::new(
            format!(
                "self-test: {} took over {} s {what}",
                self.program,
                LIMIT.as_secs()
            ),
            &self.redo,
        )
    }

    /// SIGTERM to its group, SIGKILL after 10 s, reaped.
    fn stop(&mut self) {
        let group = Pid::from_raw(-(self.child.id() as i32));
        let _ = kill(group, Signal::SIGTERM);
        let began = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) {
            if began.elapsed() > Duration::from_secs(10) {
                let _ = kill(group, Signal::SIGKILL);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.wait();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

fn free_addr() -> Result<SocketAddr, Failure> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map_err(|err| {
            Failure::new(
                format!("self-test: cannot bind 127.0.0.1:0: {err}"),
                "check the loopback interface",
            )
        })
}

/// One HTTP/1.1 exchange with `Connection: close`: the status and the body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(LIMIT))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP reply");
    let head_end = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(bad)?;
    let status = std::str::from_utf8(&reply[..head_end])
        .ok()
        .and_then(|head| head.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(bad)?;
    Ok((status, reply[head_end + 4..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    /// A stand-in program made of a shell script, in a folder of its own.
    fn stand_in(name: &str, script: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("onebit-self-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    const REDO: &str = "delete the cache and rerun `cargo xtask setup`";

    #[test]
    fn a_llama_server_that_crashes_at_load_fails_setup_naming_the_binary_and_signal() {
        let crashing = stand_in(
            "llama-server",
            "echo 'init: llama threadpool init, n_threads = 2' >&2\nkill -SEGV $$",
        );
        let err = prove_llama_server(&crashing, Path::new("model.gguf"), REDO)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&crashing.display().to_string()), "{err}");
        assert!(err.contains("was killed by SIGSEGV"), "{err}");
        assert!(
            err.contains("its last line: init: llama threadpool init, n_threads = 2"),
            "{err}"
        );
        assert!(err.contains("does not run on this CPU"), "{err}");
        assert!(err.ends_with(REDO), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }

    #[test]
    fn shared_libraries_that_crash_or_answer_wrong_fail_setup() {
        let illegal = stand_in("llama-simple", "kill -ILL $$");
        let err = prove_shared_libs(&illegal, Path::new("/lib"), Path::new("m.gguf"), REDO)
            .unwrap_err()
            .to_string();
        assert!(err.contains("was killed by SIGILL"), "{err}");

        let wrong = stand_in("llama-simple-wrong", &format!("echo '{PROMPT} Lyon, and'"));
        let err = prove_shared_libs(&wrong, Path::new("/lib"), Path::new("m.gguf"), REDO)
            .unwrap_err()
            .to_string();
        assert!(err.contains("with \"Lyon, and\", not \"Paris\""), "{err}");

        let right = stand_in("llama-simple-right", &format!("echo '{PROMPT} Paris.'"));
        prove_shared_libs(&right, Path::new("/lib"), Path::new("m.gguf"), REDO).unwrap();
    }

    #[test]
    fn a_llama_server_that_answers_wrong_fails_setup() {
        // A python stand-in that serves /health and a chat reply naming the wrong city on the
        // port it is given, as llama-server would.
        let script = r#"exec python3 -c '
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self): self.reply({"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.reply({"choices": [{"message": {"content": "Lyon."}}]})
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
' "$@""#;
        let wrong = stand_in("llama-server-wrong", script);
        let err = prove_llama_server(&wrong, Path::new("model.gguf"), REDO)
            .unwrap_err()
            .to_string();
        assert!(err.contains("answered \"Lyon.\""), "{err}");
        assert!(err.contains("wrong results on this CPU"), "{err}");
    }
}
