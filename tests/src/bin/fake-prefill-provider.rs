//! The test prefill provider of `--device hybrid` (docs/hybrid.md): it makes a real state file
//! through the decoding backend itself (prefill the ids into slot 0, save the slot under the
//! `--out` name, erase slot 0, so only serve's restore can bring the prompt back), and can
//! misbehave on request.
//!
//! `FAKE_PREFILL` (or the first line of the file `FAKE_PREFILL_FILE`, read per run) picks the
//! behaviour: `ok` (default), `fail` (exit 3), `hang` (never finish), `lie` (report one token
//! more), `nofile` (report success, write nothing), `garbage` (write a file the restore
//! refuses), `short` (write a plain token list one id short). `FAKE_PREFILL_LOG` names a file
//! that gets one JSON line per run: its argv and the contract's variables.
#![forbid(unsafe_code)]

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("fake-prefill-provider: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let tokens = value("--tokens").ok_or("--tokens is missing")?;
    let out = value("--out").ok_or("--out is missing")?;
    value("--model").ok_or("--model is missing")?;
    let url = std::env::var("ONEBIT_HYBRID_BACKEND_URL")
        .map_err(|_| "ONEBIT_HYBRID_BACKEND_URL is not set")?;
    let slot_dir = std::env::var("ONEBIT_HYBRID_SLOT_DIR").unwrap_or_default();
    if let Ok(log) = std::env::var("FAKE_PREFILL_LOG") {
        let line = serde_json::json!({
            "args": args, "backend_url": url, "slot_dir": slot_dir,
            "llama_server": std::env::var("ONEBIT_PREFILL_LLAMA_SERVER").ok(),
        });
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("{log}: {e}"))?;
        writeln!(file, "{line}").map_err(|e| e.to_string())?;
    }
    let mode = match std::env::var("FAKE_PREFILL_FILE") {
        Ok(file) => std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .next()
            .unwrap_or("ok")
            .trim()
            .to_string(),
        Err(_) => std::env::var("FAKE_PREFILL").unwrap_or_else(|_| "ok".to_string()),
    };
    let ids: Vec<i64> = std::fs::read_to_string(&tokens)
        .map_err(|e| format!("{tokens}: {e}"))?
        .lines()
        .map(|l| l.trim().parse::<i64>().map_err(|e| format!("{l:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let n = ids.len();
    let report = |n_tokens: usize, prefill_ms: f64| {
        println!(
            "{}",
            serde_json::json!({"n_tokens": n_tokens, "argmax": 0, "prefill_ms": prefill_ms})
        );
    };
    let state = PathBuf::from(&slot_dir).join(&out);
    match mode.as_str() {
        "fail" => {
            eprintln!("fake-prefill-provider: failing as FAKE_PREFILL=fail asks");
            std::process::exit(3);
        }
        "hang" => loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        },
        "nofile" => {
            report(n, 1.0);
            return Ok(());
        }
        "garbage" => {
            std::fs::write(&state, b"not a state file").map_err(|e| e.to_string())?;
            report(n, 1.0);
            return Ok(());
        }
        "short" => {
            // The plain token-list form an external writer uses, one id short.
            let mut bytes = Vec::new();
            for word in [0x6767_7371u32, 4, (n - 1) as u32] {
                bytes.extend_from_slice(&word.to_le_bytes());
            }
            for id in &ids[..n - 1] {
                bytes.extend_from_slice(&(*id as i32).to_le_bytes());
            }
            std::fs::write(&state, bytes).map_err(|e| e.to_string())?;
            report(n, 1.0);
            return Ok(());
        }
        _ => {}
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let post = |path: &str, body: serde_json::Value| -> Result<serde_json::Value, String> {
        let mut reply = agent
            .post(format!("{url}{path}"))
            .header("content-type", "application/json")
            .send(body.to_string())
            .map_err(|e| format!("{path}: {e}"))?;
        let status = reply.status().as_u16();
        let text = reply.body_mut().read_to_string().unwrap_or_default();
        if status != 200 {
            return Err(format!("{path}: status {status}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))
    };
    let started = Instant::now();
    let done = post(
        "/completion",
        serde_json::json!({"prompt": ids, "n_predict": 0, "id_slot": 0, "cache_prompt": true,
            "temperature": 0}),
    )?;
    let prefill_ms = done["timings"]["prompt_ms"]
        .as_f64()
        .unwrap_or_else(|| started.elapsed().as_secs_f64() * 1000.0);
    post("/slots/0?action=save", serde_json::json!({"filename": out}))?;
    post("/slots/0?action=erase", serde_json::json!({}))?;
    report(if mode == "lie" { n + 1 } else { n }, prefill_ms);
    Ok(())
}
