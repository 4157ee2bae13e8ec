//! `1bit-prefill-llama`: a prefill provider for `--device hybrid` (docs/hybrid.md) that computes
//! the prompt on a separate llama-server (one it starts, or one named by a URL), saves that
//! server's slot, and hands the file to the decoder: disaggregated prefill across processes.
//!
//! ```text
//! 1bit-prefill-llama --tokens IDS --out NAME --model MODEL [--elfs DIR] [--prefill-url URL]
//! ```
//! Environment: `ONEBIT_HYBRID_SLOT_DIR` (set by serve: where NAME goes), `ONEBIT_PREFILL_URL`
//! (as `--prefill-url`), `ONEBIT_PREFILL_SLOT_DIR` (that server's `--slot-save-path`, as a path
//! here; needed with a URL), `ONEBIT_PREFILL_LLAMA_SERVER` (the server to start: serve sets
//! it to the decoder's; run by hand, found as serve finds one), `ONEBIT_PREFILL_CTX` (its
//! context, default 4096).
#![forbid(unsafe_code)]

use std::fmt;
use std::io;
use std::num::ParseIntError;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use onebit_plugin_api::PlanRequest;
use onebit_process::Process;
use serde_json::{Value, json};

/// How long a started llama-server may take to load the model.
const LOAD_LIMIT: Duration = Duration::from_secs(300);
/// How long the started llama-server has to exit after SIGTERM (it is idle by then).
const STOP_GRACE: Duration = Duration::from_secs(5);

fn main() -> std::process::ExitCode {
    // `run`'s values are dropped before main returns: the llama-server it started is stopped.
    match run() {
        Ok(report) => {
            println!("{report}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("1bit-prefill-llama: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Why the provider failed: this binary's one error type (it is a crate of its own; the route's
/// library, a cdylib, cannot be linked into it). `main` prints it as the one line serve's log
/// shows, and exits non-zero; the line includes the cause's own text.
#[derive(Debug)]
enum PrefillError {
    /// A flag or variable the provider needs is absent; the text names it and what to do.
    Usage(&'static str),
    /// The ids file cannot be read.
    ReadTokens { file: String, source: io::Error },
    /// A line of the ids file is not a token id.
    BadToken {
        file: String,
        line: String,
        source: ParseIntError,
    },
    /// No llama-server to start: serve's own search's refusal.
    NoServer(String),
    /// `ONEBIT_PREFILL_CTX` is not a number.
    BadCtx(String),
    /// The kernel gave no loopback port.
    NoPort(io::Error),
    /// The started server's slot directory cannot be made.
    SlotDir { dir: PathBuf, source: io::Error },
    /// The server cannot be started.
    Spawn { binary: String, source: io::Error },
    /// The started server exited before it was ready; `how` is its exit status.
    Exited {
        binary: String,
        model: String,
        how: String,
    },
    /// The started server was not ready within [`LOAD_LIMIT`].
    LoadTimeout { binary: String, model: String },
    /// The prefill server at `url` (the whole address called) did not answer.
    Unreachable { url: String, source: ureq::Error },
    /// The prefill server at `url` answered another status than 200.
    Status {
        url: String,
        status: u16,
        text: String,
    },
    /// The prefill server at `url` answered 200 without JSON.
    NotJson {
        url: String,
        source: serde_json::Error,
    },
    /// The prefill server saved another number of tokens than the prompt has.
    Saved { saved: Value, prompt: usize },
    /// The state file cannot be copied into the decoder's slot directory.
    Copy {
        from: PathBuf,
        to: PathBuf,
        source: io::Error,
    },
}

impl fmt::Display for PrefillError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PrefillError::Usage(text) => f.write_str(text),
            PrefillError::ReadTokens { file, source } => write!(f, "{file}: {source}"),
            PrefillError::BadToken { file, line, source } => {
                write!(f, "{file}: {line:?}: {source}")
            }
            PrefillError::NoServer(refusal) => f.write_str(refusal),
            PrefillError::BadCtx(value) => {
                write!(f, "ONEBIT_PREFILL_CTX={value}: not a number of tokens")
            }
            PrefillError::NoPort(e) => write!(f, "no free loopback port ({e})"),
            PrefillError::SlotDir { dir, source } => write!(f, "{}: {source}", dir.display()),
            PrefillError::Spawn { binary, source } => write!(f, "cannot start {binary} ({source})"),
            PrefillError::Exited { binary, model, how } => {
                write!(f, "{binary} exited while loading {model} ({how})")
            }
            PrefillError::LoadTimeout { binary, model } => write!(
                f,
                "{binary} did not load {model} within {} s",
                LOAD_LIMIT.as_secs()
            ),
            PrefillError::Unreachable { url, source } => write!(f, "{url}: {source}"),
            PrefillError::Status { url, status, text } => {
                write!(f, "{url}: status {status}: {text}")
            }
            PrefillError::NotJson { url, source } => write!(f, "{url}: {source}"),
            PrefillError::Saved { saved, prompt } => write!(
                f,
                "the prefill server saved {saved} tokens, not the prompt's {prompt}"
            ),
            PrefillError::Copy { from, to, source } => write!(
                f,
                "cannot copy {} to {} ({source})",
                from.display(),
                to.display()
            ),
        }
    }
}

impl std::error::Error for PrefillError {}

/// The llama-server this provider started (by the one spawner, so it dies with this provider,
/// which dies with serve), stopped and its slot directory removed on drop. The directory is
/// inside serve's own (`ONEBIT_HYBRID_SLOT_DIR`), so a provider killed with serve leaves
/// nothing that serve's cleanup does not remove.
struct Started {
    child: Process,
    dir: PathBuf,
}

impl Drop for Started {
    fn drop(&mut self) {
        self.child.stop(STOP_GRACE);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run() -> Result<Value, PrefillError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let tokens = value("--tokens").ok_or(PrefillError::Usage("--tokens IDS is missing"))?;
    let out = value("--out").ok_or(PrefillError::Usage("--out NAME is missing"))?;
    let model = value("--model").ok_or(PrefillError::Usage("--model MODEL is missing"))?;
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let target_dir = env("ONEBIT_HYBRID_SLOT_DIR").ok_or(PrefillError::Usage(
        "ONEBIT_HYBRID_SLOT_DIR is not set (serve sets it: the decoder's slot directory)",
    ))?;
    let ids: Vec<i64> = std::fs::read_to_string(&tokens)
        .map_err(|source| PrefillError::ReadTokens {
            file: tokens.clone(),
            source,
        })?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim()
                .parse::<i64>()
                .map_err(|source| PrefillError::BadToken {
                    file: tokens.clone(),
                    line: l.to_string(),
                    source,
                })
        })
        .collect::<Result<_, _>>()?;

    let mut started = None;
    let (url, slot_dir) = match value("--prefill-url").or_else(|| env("ONEBIT_PREFILL_URL")) {
        Some(url) => {
            let dir = env("ONEBIT_PREFILL_SLOT_DIR").ok_or(PrefillError::Usage(
                "ONEBIT_PREFILL_SLOT_DIR is not set: with a URL, name that server's --slot-save-path as a path here",
            ))?;
            (url.trim_end_matches('/').to_string(), PathBuf::from(dir))
        }
        None => {
            let server = start_server(&model, ids.len(), Path::new(&target_dir))?;
            let url = server.0;
            let dir = server.1.dir.clone();
            started = Some(server.1);
            (url, dir)
        }
    };

    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let post = |path: &str, body: Value| -> Result<Value, PrefillError> {
        let url = format!("{url}{path}");
        let mut reply = agent
            .post(&url)
            .header("content-type", "application/json")
            .send(body.to_string())
            .map_err(|source| PrefillError::Unreachable {
                url: url.clone(),
                source,
            })?;
        let status = reply.status().as_u16();
        let text = reply.body_mut().read_to_string().unwrap_or_default();
        if status != 200 {
            return Err(PrefillError::Status { url, status, text });
        }
        serde_json::from_str(&text).map_err(|source| PrefillError::NotJson { url, source })
    };
    let began = Instant::now();
    let done = post(
        "/completion",
        json!({"prompt": ids, "n_predict": 0, "id_slot": 0, "cache_prompt": true,
               "temperature": 0, "return_tokens": true}),
    )?;
    let prefill_ms = done["timings"]["prompt_ms"]
        .as_f64()
        .unwrap_or_else(|| began.elapsed().as_secs_f64() * 1000.0);
    let saved = post("/slots/0?action=save", json!({"filename": out}))?;
    if saved["n_saved"].as_u64() != Some(ids.len() as u64) {
        return Err(PrefillError::Saved {
            saved: saved["n_saved"].clone(),
            prompt: ids.len(),
        });
    }
    let from = slot_dir.join(&out);
    let to = Path::new(&target_dir).join(&out);
    let partial = Path::new(&target_dir).join(format!("{out}.part"));
    std::fs::copy(&from, &partial)
        .and_then(|_| std::fs::rename(&partial, &to))
        .map_err(|source| PrefillError::Copy {
            from: from.clone(),
            to: to.clone(),
            source,
        })?;
    let _ = std::fs::remove_file(&from);
    drop(started);
    Ok(json!({
        "n_tokens": ids.len(),
        "argmax": done["tokens"].get(0).cloned().unwrap_or(Value::Null),
        "prefill_ms": prefill_ms,
    }))
}

/// Start a llama-server of the decoder's kind on the CPU, one slot, f16 cache and flash
/// attention as llama-server defaults them (the decoder's settings), and wait until it is ready.
fn start_server(model: &str, n: usize, under: &Path) -> Result<(String, Started), PrefillError> {
    let request = PlanRequest {
        env: std::env::vars().collect(),
        ..Default::default()
    };
    let binary = match request.env.get("ONEBIT_PREFILL_LLAMA_SERVER") {
        Some(b) if !b.is_empty() => b.clone(),
        _ => {
            llama_server::server_binary(&request).map_err(|r| PrefillError::NoServer(r.message))?
        }
    };
    let ctx: usize = match request.env.get("ONEBIT_PREFILL_CTX") {
        Some(c) => c
            .trim()
            .parse()
            .map_err(|_| PrefillError::BadCtx(c.clone()))?,
        None => 4096,
    };
    let ctx = ctx.max(n + 1);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(PrefillError::NoPort)?;
    let dir = under.join(format!("1bit-prefill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| PrefillError::SlotDir {
        dir: dir.clone(),
        source,
    })?;
    let mut command = Command::new(&binary);
    command
        .args([
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args([
            "-ngl",
            "0",
            "-c",
            &ctx.to_string(),
            "-np",
            "1",
            "--slot-save-path",
        ])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = onebit_process::spawn(command).map_err(|source| PrefillError::Spawn {
        binary: binary.clone(),
        source,
    })?;
    let started = Started { child, dir };
    let url = format!("http://127.0.0.1:{port}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    let deadline = Instant::now() + LOAD_LIMIT;
    loop {
        if let Ok(r) = agent.get(format!("{url}/health")).call()
            && r.status().as_u16() == 200
        {
            return Ok((url, started));
        }
        if let Some(status) = started.child.wait_timeout(Duration::ZERO) {
            let how = status
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string());
            return Err(PrefillError::Exited {
                binary,
                model: model.to_string(),
                how,
            });
        }
        if Instant::now() > deadline {
            return Err(PrefillError::LoadTimeout {
                binary,
                model: model.to_string(),
            });
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}
