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

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use onebit_plugin_api::PlanRequest;
use onebit_plugin_api::process::{self, Process};
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

fn run() -> Result<Value, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let tokens = value("--tokens").ok_or("--tokens IDS is missing")?;
    let out = value("--out").ok_or("--out NAME is missing")?;
    let model = value("--model").ok_or("--model MODEL is missing")?;
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let target_dir = env("ONEBIT_HYBRID_SLOT_DIR")
        .ok_or("ONEBIT_HYBRID_SLOT_DIR is not set (serve sets it: the decoder's slot directory)")?;
    let ids: Vec<i64> = std::fs::read_to_string(&tokens)
        .map_err(|e| format!("{tokens}: {e}"))?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim()
                .parse::<i64>()
                .map_err(|e| format!("{tokens}: {l:?}: {e}"))
        })
        .collect::<Result<_, _>>()?;

    let mut started = None;
    let (url, slot_dir) = match value("--prefill-url").or_else(|| env("ONEBIT_PREFILL_URL")) {
        Some(url) => {
            let dir = env("ONEBIT_PREFILL_SLOT_DIR").ok_or(
                "ONEBIT_PREFILL_SLOT_DIR is not set: with a URL, name that server's --slot-save-path as a path here",
            )?;
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
    let post = |path: &str, body: Value| -> Result<Value, String> {
        let mut reply = agent
            .post(format!("{url}{path}"))
            .header("content-type", "application/json")
            .send(body.to_string())
            .map_err(|e| format!("{url}{path}: {e}"))?;
        let status = reply.status().as_u16();
        let text = reply.body_mut().read_to_string().unwrap_or_default();
        if status != 200 {
            return Err(format!("{url}{path}: status {status}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{url}{path}: {e}"))
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
        return Err(format!(
            "the prefill server saved {} tokens, not the prompt's {}",
            saved["n_saved"],
            ids.len()
        ));
    }
    let from = slot_dir.join(&out);
    let to = Path::new(&target_dir).join(&out);
    let partial = Path::new(&target_dir).join(format!("{out}.part"));
    std::fs::copy(&from, &partial)
        .and_then(|_| std::fs::rename(&partial, &to))
        .map_err(|e| format!("cannot copy {} to {} ({e})", from.display(), to.display()))?;
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
fn start_server(model: &str, n: usize, under: &Path) -> Result<(String, Started), String> {
    let request = PlanRequest {
        env: std::env::vars().collect(),
        ..Default::default()
    };
    let binary = match request.env.get("ONEBIT_PREFILL_LLAMA_SERVER") {
        Some(b) if !b.is_empty() => b.clone(),
        _ => llama_server::server_binary(&request).map_err(|r| r.message)?,
    };
    let ctx: usize = match request.env.get("ONEBIT_PREFILL_CTX") {
        Some(c) => c
            .trim()
            .parse()
            .map_err(|_| format!("ONEBIT_PREFILL_CTX={c}: not a number of tokens"))?,
        None => 4096,
    };
    let ctx = ctx.max(n + 1);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port ({e})"))?;
    let dir = under.join(format!("1bit-prefill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
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
    let child = process::spawn(command).map_err(|e| format!("cannot start {binary} ({e})"))?;
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
            return Err(format!("{binary} exited while loading {model} ({how})"));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{binary} did not load {model} within {} s",
                LOAD_LIMIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}
