//! A stand-in for ggmlc's `laya daemon`, written for the tests from its protocol as documented
//! (docs/laya.md): one JSON object a line; it prints `{"status": "ready", …}` once "loaded",
//! then answers each request line (`{"state": TEXT, "questions": {"cls": {"type": "choice",
//! …}}}`) with `{"answers": {"cls": {"type": "choice", "choice": …, "confidence": …,
//! "probabilities": {…}}}}`, and exits at the end of its stdin.
//!
//! It answers by keywords: a text with "function" or "Rust" is code (0.87), one with
//! "explain" prose (0.73), anything else short (0.64). The environment changes it:
//!
//! - `FAKE_LAYA_RECORD=FILE`: its argv, pid and `IREE_HAL_AMDGPU_LIBHSA_PATH` as the first
//!   line, then each line it was sent, as sent, and `{"ended": "stdin closed"}` 0.3 s after
//!   the end of its stdin, when it exits.
//! - `FAKE_LAYA_MODE`: `never_ready` (says nothing, waits), `exit_at_start` (exits 3 before
//!   ready), `garbage` (answers a line that is not JSON), `die_after` (exits 3 after
//!   `FAKE_LAYA_DIE_AFTER` answers).
//! - `FAKE_LAYA_DELAY_MS`: waits this long before each answer; `FAKE_LAYA_SLOW_FIRST_MS`
//!   before the first only.

use std::io::{BufRead, Write};
use std::time::Duration;

use serde_json::{Value, json};

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn millis(name: &str) -> u64 {
    env(name).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn record(line: &str) {
    if let Some(path) = env("FAKE_LAYA_RECORD") {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("the record file opens");
        writeln!(file, "{line}").expect("the record file takes a line");
    }
}

fn answer(text: &str) -> Value {
    let lower = text.to_lowercase();
    let (choice, confidence) = if lower.contains("function") || lower.contains("rust") {
        ("code", 0.87)
    } else if lower.contains("explain") {
        ("prose", 0.73)
    } else {
        ("short", 0.64)
    };
    let rest = (1.0 - confidence) / 2.0;
    let probabilities: serde_json::Map<String, Value> = ["code", "prose", "short"]
        .iter()
        .map(|c| {
            let p = if *c == choice { confidence } else { rest };
            (c.to_string(), json!(p))
        })
        .collect();
    json!({"model": "laya", "family": "typed-decisions", "answers": {"cls": {
        "type": "choice", "choice": choice, "confidence": confidence,
        "probabilities": probabilities, "action": {"act_probability": 1}}},
        "usage": {"input_tokens": 12, "output_tokens": 0, "latency_ms": 1}})
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    record(
        &json!({"argv": argv, "pid": std::process::id(),
            "libhsa": env("IREE_HAL_AMDGPU_LIBHSA_PATH")})
        .to_string(),
    );
    let mode = env("FAKE_LAYA_MODE").unwrap_or_default();
    eprintln!(
        "fake-laya: loading {}",
        argv.get(1).map_or("", String::as_str)
    );
    let mut out = std::io::stdout().lock();
    match mode.as_str() {
        "never_ready" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        "exit_at_start" => {
            eprintln!("fake-laya: cannot open the model");
            std::process::exit(3);
        }
        _ => {}
    }
    // A banner line first: the protocol's reader passes over what is not JSON before ready.
    writeln!(out, "laya daemon (fake) loading").unwrap();
    writeln!(out, "{}", json!({"status": "ready", "model": "laya"})).unwrap();
    out.flush().unwrap();
    let die_after: Option<u64> = env("FAKE_LAYA_DIE_AFTER").and_then(|v| v.parse().ok());
    let mut answered = 0u64;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        record(&line);
        let wait = millis("FAKE_LAYA_DELAY_MS")
            + if answered == 0 {
                millis("FAKE_LAYA_SLOW_FIRST_MS")
            } else {
                0
            };
        std::thread::sleep(Duration::from_millis(wait));
        let text = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v["state"].as_str().map(str::to_string))
            .unwrap_or_default();
        if mode == "garbage" {
            writeln!(out, "the answer is code, probably").unwrap();
        } else {
            writeln!(out, "{}", answer(&text)).unwrap();
        }
        out.flush().unwrap();
        answered += 1;
        if mode == "die_after" && die_after.is_some_and(|n| answered >= n) {
            eprintln!("fake-laya: dying after {answered} answers");
            std::process::exit(3);
        }
    }
    // A real daemon takes a moment to let its model go; a serve that waits for it sees this
    // line written, one that exits at once has it killed (its parent-death signal) before.
    std::thread::sleep(Duration::from_millis(300));
    record(&json!({"ended": "stdin closed"}).to_string());
}
