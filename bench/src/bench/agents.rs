//! `cargo xtask bench agents [--quick]`: the recorded sessions of the pinned coding agents
//! (tests/data/agents/: Claude Code on the Messages API, the Codex CLI on Responses) replayed
//! against llama-server alone and against serve in front of the same llama-server (the same
//! model, SmolLM2, the cpu route's flags, a context both sessions fit in), one session alone
//! and two interleaved turn by turn (issue 54.3). Each run starts its server cold; the arms
//! take turns run by run in the hop bench's Williams order. Per arm: the prompt tokens
//! prefilled, in all and per turn, against the tokens each turn adds to its session's prompt;
//! the time to first token per turn (p50, p90 over the runs); the session's wall time. A table,
//! and `results/agents.json`. Release builds.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::inproc_llama::{Running, free_port, wait_ready};
use crate::{Failure, Workspace, process};

/// The arms, in the table's order.
const ARMS: [&str; 2] = ["llama-server alone", "serve"];
/// The recorded sessions (tests/data/agents/README.md).
const AGENTS: [(&str, &str); 2] = [
    ("Claude Code 2.1.197", "claude-code-2.1.197.jsonl"),
    ("Codex CLI 0.171.0", "codex-0.171.0.jsonl"),
];
/// Tokens each replayed reply generates (greedy): the prefill is what is measured.
const REPLY_TOKENS: usize = 8;
/// Two sessions' prompts (about 3,000 and 4,600 SmolLM2 tokens, growing) fit in it together.
const CTX: &str = "16384";
/// A cold prefill of 4,600 tokens can take minutes on a busy 2-core VM.
const READ_LIMIT: Duration = Duration::from_secs(900);
/// What is judged, for both agents: serve's later turns' time to first token at most this
/// share of llama-server alone's (10 % for noise), and serve's later turns prefilling at most
/// [`PREFILL_BOUND`] times the tokens they added. Issue 54 expected Claude Code's share under
/// 0.25, taking its attribution line to change every turn; 2.1.197 sends a local server one
/// line a session (tests/data/agents/README.md), so llama-server alone reuses the prefix too
/// and no server can prefill less than the new tokens: the share is printed, not judged so.
const TTFT_SHARE: f64 = 1.1;
/// The replay test's bound (issue 54.4): a later turn prefills at most this many times the
/// tokens new in it.
const PREFILL_BOUND: f64 = 1.2;

/// One request of a recorded session.
struct Request {
    session: String,
    turn: usize,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

/// Reads a session file: each body whole or as pieces of the line before it.
fn load(path: &Path) -> Result<Vec<Request>, Failure> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Failure::new(
            format!("{}: {e}", path.display()),
            "the recorded sessions are in the repository (tests/data/agents/)",
        )
    })?;
    let mut out: Vec<Request> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let bad = || {
            Failure::new(
                format!("{}: a line that is not a request", path.display()),
                "record the sessions again (tests/data/agents/README.md)",
            )
        };
        let v: Value = serde_json::from_str(line).map_err(|_| bad())?;
        let body = match v["body"].as_str() {
            Some(body) => body.to_string(),
            None => {
                let previous = &out.last().ok_or_else(bad)?.body;
                let mut body = String::new();
                for op in v["body_delta"].as_array().ok_or_else(bad)? {
                    match op {
                        Value::String(text) => body.push_str(text),
                        Value::Array(range) => {
                            let start = range.first().and_then(Value::as_u64).ok_or_else(bad)?;
                            let length = range.get(1).and_then(Value::as_u64).ok_or_else(bad)?;
                            body.push_str(
                                previous
                                    .get(start as usize..(start + length) as usize)
                                    .ok_or_else(bad)?,
                            );
                        }
                        _ => return Err(bad()),
                    }
                }
                body
            }
        };
        out.push(Request {
            session: v["session"].as_str().ok_or_else(bad)?.to_string(),
            turn: v["turn"].as_u64().ok_or_else(bad)? as usize,
            path: v["path"].as_str().ok_or_else(bad)?.to_string(),
            headers: v["headers"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect(),
            body,
        });
    }
    Ok(out)
}

/// Session a alone, or a and b interleaved turn by turn.
fn scenario(all: &[Request], two: bool) -> Vec<&Request> {
    let a: Vec<&Request> = all.iter().filter(|r| r.session == "a").collect();
    let b: Vec<&Request> = all.iter().filter(|r| r.session == "b").collect();
    if !two {
        return a;
    }
    let mut out = Vec::new();
    for turn in 0..a.len().max(b.len()) {
        out.extend(a.get(turn).copied());
        out.extend(b.get(turn).copied());
    }
    out
}

/// What one replayed request got.
#[derive(Clone, Debug, Default)]
struct Replayed {
    prompt_tokens: usize,
    cached_tokens: usize,
    ttft_ms: f64,
    wall_ms: f64,
    generated: String,
}

/// The recorded body, greedy and bounded to [`REPLY_TOKENS`], every other byte as sent.
fn replay_body(request: &Request) -> String {
    let rest = request.body.trim_start().strip_prefix('{').unwrap_or("");
    if request.path.starts_with("/v1/responses") {
        return format!("{{\"temperature\":0,\"max_output_tokens\":{REPLY_TOKENS},{rest}");
    }
    let asked = serde_json::from_str::<Value>(&request.body)
        .map(|v| v["max_tokens"].clone())
        .unwrap_or(Value::Null);
    let rest = rest.replacen(
        &format!("\"max_tokens\":{asked}"),
        &format!("\"max_tokens\":{REPLY_TOKENS}"),
        1,
    );
    format!("{{\"temperature\":0,{rest}")
}

/// Sends one request, streamed as recorded, and reads its events to the end: the usage, the
/// first generated text's time, the text.
fn replay(port: u16, request: &Request, arm: &str) -> Result<Replayed, Failure> {
    let broke = |e: std::io::Error| {
        Failure::new(
            format!(
                "{arm}: session {} turn {}: {e}",
                request.session, request.turn
            ),
            "run the arm by hand",
        )
    };
    let body = replay_body(request);
    let mut head = format!(
        "POST {} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        request.path,
        body.len()
    );
    for (k, v) in &request.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let started = Instant::now();
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).map_err(broke)?;
    tcp.set_read_timeout(Some(READ_LIMIT)).map_err(broke)?;
    tcp.write_all(head.as_bytes()).map_err(broke)?;
    tcp.write_all(body.as_bytes()).map_err(broke)?;
    let mut reader = BufReader::new(tcp);
    let mut status = String::new();
    reader.read_line(&mut status).map_err(broke)?;
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(Failure::new(
            format!(
                "{arm}: session {} turn {} answered {}",
                request.session,
                request.turn,
                status.trim()
            ),
            "run the arm by hand",
        ));
    }
    let mut out = Replayed::default();
    let mut line = Vec::new();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line).map_err(broke)? == 0 {
            break;
        }
        let text = String::from_utf8_lossy(&line);
        let Some(data) = text.trim_end().strip_prefix("data:") else {
            continue;
        };
        let Ok(event) = serde_json::from_str::<Value>(data.trim()) else {
            continue;
        };
        read_event(&event, &mut out, started);
    }
    out.wall_ms = ms(started.elapsed());
    Ok(out)
}

/// One event of a Messages or Responses stream: generated text, and usage.
fn read_event(event: &Value, out: &mut Replayed, started: Instant) {
    let delta = match event["type"].as_str().unwrap_or("") {
        "content_block_delta" => event["delta"]["text"]
            .as_str()
            .or(event["delta"]["partial_json"].as_str())
            .or(event["delta"]["thinking"].as_str()),
        "response.output_text.delta"
        | "response.function_call_arguments.delta"
        | "response.reasoning_text.delta" => event["delta"].as_str(),
        _ => None,
    };
    if let Some(text) = delta.filter(|t| !t.is_empty()) {
        if out.generated.is_empty() {
            out.ttft_ms = ms(started.elapsed());
        }
        out.generated.push_str(text);
    }
    let usage = event["message"]["usage"]
        .as_object()
        .or(event["usage"].as_object());
    if let Some(usage) = usage
        && let Some(cached) = usage.get("cache_read_input_tokens").and_then(Value::as_u64)
    {
        let fresh = usage
            .get("input_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if fresh + cached > 0 {
            out.prompt_tokens = (fresh + cached) as usize;
            out.cached_tokens = cached as usize;
        }
    }
    let usage = &event["response"]["usage"];
    if let Some(total) = usage["input_tokens"].as_u64() {
        out.prompt_tokens = total as usize;
        out.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as usize;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The arm's server, cold: llama-server with the cpu route's flags, or serve at its defaults
/// (its prompt cache in a folder of this run's) in front of the same llama-server.
fn arm_command(arm: usize, port: u16, kit: &Kit, run: usize) -> Command {
    let port = port.to_string();
    if arm == 0 {
        let mut c = Command::new(&kit.llama_server);
        c.arg("-m").arg(&kit.model).args([
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--metrics",
            "--jinja",
            "-ngl",
            "0",
            "-c",
            CTX,
            "-ub",
            "256",
        ]);
        return c;
    }
    let mut c = Command::new(&kit.onebit);
    c.arg("serve")
        .arg("-m")
        .arg(&kit.model)
        .args(["--port", &port, "--ctx-size", CTX, "--device", "cpu"])
        .arg("--llama-server")
        .arg(&kit.llama_server)
        .arg("--prompt-cache-dir")
        .arg(kit.scratch.join(format!("cache-{run}")))
        .env("ONEBIT_STATE_DIR", &kit.scratch);
    c
}

struct Kit {
    model: PathBuf,
    onebit: PathBuf,
    llama_server: PathBuf,
    scratch: PathBuf,
}

/// One scenario's run on one arm: every request in order on a cold server.
fn one_run(
    kit: &Kit,
    arm: usize,
    requests: &[&Request],
    run: usize,
) -> Result<Vec<Replayed>, Failure> {
    let port = free_port()?;
    let child = arm_command(arm, port, kit, run)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            Failure::new(
                format!("cannot start {}: {e}", ARMS[arm]),
                "run `cargo xtask setup`",
            )
        })?;
    let running = Running(child);
    wait_ready(port, ARMS[arm])?;
    let mut out = Vec::new();
    for r in requests {
        out.push(replay(port, r, ARMS[arm])?);
    }
    drop(running);
    Ok(out)
}

/// One arm's figures for one scenario, over its runs.
#[derive(Default)]
struct Figures {
    /// Per request position: (prefilled, prompt, the tokens the turn added, ttft ms) per run.
    per_request: Vec<Vec<(usize, usize, usize, f64)>>,
    walls_ms: Vec<f64>,
    replies: Vec<Vec<String>>,
}

pub fn run(ws: &Workspace, quick: bool) -> Result<ExitCode, Failure> {
    let runs = if quick { 1 } else { 2 };
    let mut cargo = process::cargo();
    cargo.current_dir(&ws.root).args([
        "build",
        "--release",
        "-p",
        "onebit-host",
        "-p",
        "onebit-route-cpu",
    ]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "the release build failed: fix the errors above")?;
    let scratch = std::env::temp_dir().join(format!("onebit-bench-agents-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| Failure::new(e, "check /tmp"))?;
    let kit = Kit {
        model: ws.layout.model(ws.pins.default_model()),
        onebit: ws.root.join("target/release/1bit"),
        llama_server: ws.layout.llama_server(),
        scratch: scratch.clone(),
    };
    println!(
        "{} run(s) per arm and scenario, each on a cold server; {} arms in Williams order; load {}",
        runs,
        ARMS.len(),
        super::loadavg()
    );
    let mut table = Vec::new();
    let mut block = 0;
    let sessions = AGENTS
        .iter()
        .map(|(agent, file)| Ok((*agent, load(&ws.root.join("tests/data/agents").join(file))?)))
        .collect::<Result<Vec<_>, Failure>>()?;
    for (agent, all) in &sessions {
        let agent = *agent;
        for two in [false, true] {
            let requests = scenario(all, two);
            let name = if two {
                "two sessions interleaved"
            } else {
                "one session"
            };
            let mut figures: Vec<Figures> = (0..ARMS.len()).map(|_| Figures::default()).collect();
            for run in 0..runs {
                for arm in super::block_order(block, ARMS.len()) {
                    let began = Instant::now();
                    let got = one_run(&kit, arm, &requests, block)?;
                    let wall = ms(began.elapsed());
                    let rows = rows(&requests, &got);
                    println!(
                        "  {agent}, {name}, run {}: {}: prefilled {} tokens in all, {:.1} s",
                        run + 1,
                        ARMS[arm],
                        rows.iter().map(|r| r.0).sum::<usize>(),
                        wall / 1000.0
                    );
                    let f = &mut figures[arm];
                    f.per_request.resize(rows.len(), Vec::new());
                    for (i, row) in rows.into_iter().enumerate() {
                        f.per_request[i].push(row);
                    }
                    f.walls_ms.push(got.iter().map(|g| g.wall_ms).sum::<f64>());
                    f.replies
                        .push(got.iter().map(|g| g.generated.clone()).collect());
                }
                block += 1;
            }
            table.push((agent, name, requests, figures));
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    report(ws, &table, runs)
}

/// Per request: (prefilled, prompt tokens, the tokens it added to its session's previous
/// prompt (all of them for a session's first), time to first token).
fn rows(requests: &[&Request], got: &[Replayed]) -> Vec<(usize, usize, usize, f64)> {
    let mut previous: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    requests
        .iter()
        .zip(got)
        .map(|(r, g)| {
            let new = g
                .prompt_tokens
                .saturating_sub(previous.get(r.session.as_str()).copied().unwrap_or(0));
            previous.insert(&r.session, g.prompt_tokens);
            (
                g.prompt_tokens.saturating_sub(g.cached_tokens),
                g.prompt_tokens,
                new,
                g.ttft_ms,
            )
        })
        .collect()
}

fn quantile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    super::percentile(&v, q)
}

type Scenario<'a> = (&'a str, &'a str, Vec<&'a Request>, Vec<Figures>);

fn report(ws: &Workspace, table: &[Scenario], runs: usize) -> Result<ExitCode, Failure> {
    let mut json_scenarios = Vec::new();
    let mut met = true;
    for (agent, name, requests, figures) in table {
        println!("\n{agent}, {name} ({} requests):", requests.len());
        println!(
            "  {:<22} {:>8} {:>8} {:>10} {:>14} {:>14} {:>12}",
            "arm", "session", "turn", "prompt", "prefilled", "added", "TTFT p50/p90 (s)"
        );
        let mut arms_json = Vec::new();
        let mut later_ttft = Vec::new();
        let mut later_prefill = Vec::new();
        for (arm, f) in figures.iter().enumerate() {
            let mut turns = Vec::new();
            let mut later = Vec::new();
            for (i, r) in requests.iter().enumerate() {
                let samples = &f.per_request[i];
                let ttfts: Vec<f64> = samples.iter().map(|s| s.3).collect();
                let (p50, p90) = (quantile(&ttfts, 0.5), quantile(&ttfts, 0.9));
                let prefilled = samples.iter().map(|s| s.0).max().unwrap_or(0);
                let (prompt, added) = (samples[0].1, samples[0].2);
                println!(
                    "  {:<22} {:>8} {:>8} {:>10} {:>14} {:>14} {:>8.1}/{:.1}",
                    ARMS[arm],
                    r.session,
                    r.turn,
                    prompt,
                    prefilled,
                    added,
                    p50 / 1000.0,
                    p90 / 1000.0
                );
                if r.turn > 0 {
                    later.extend(ttfts.iter().copied());
                }
                turns.push(json!({
                    "session": r.session, "turn": r.turn, "prompt_tokens": prompt,
                    "prefilled_tokens": samples.iter().map(|s| s.0).collect::<Vec<_>>(),
                    "added_tokens": added, "ttft_ms_p50": p50, "ttft_ms_p90": p90,
                }));
            }
            let total: usize = (0..requests.len())
                .map(|i| f.per_request[i].iter().map(|s| s.0).max().unwrap_or(0))
                .sum();
            let later_new: usize = requests
                .iter()
                .enumerate()
                .filter(|(_, r)| r.turn > 0)
                .map(|(i, _)| f.per_request[i][0].2)
                .sum();
            let later_prefilled: usize = requests
                .iter()
                .enumerate()
                .filter(|(_, r)| r.turn > 0)
                .map(|(i, _)| f.per_request[i].iter().map(|s| s.0).max().unwrap_or(0))
                .sum();
            let wall = quantile(&f.walls_ms, 0.5);
            println!(
                "  {:<22} prefilled {total} tokens in all; later turns {later_prefilled} against {later_new} added ({:.2}x); later turns' TTFT p50 {:.2} s, p90 {:.2} s; session wall time {:.1} s (median)",
                ARMS[arm],
                later_prefilled as f64 / later_new.max(1) as f64,
                quantile(&later, 0.5) / 1000.0,
                quantile(&later, 0.9) / 1000.0,
                wall / 1000.0
            );
            later_ttft.push(quantile(&later, 0.5));
            later_prefill.push(later_prefilled as f64 / later_new.max(1) as f64);
            arms_json.push(json!({
                "arm": ARMS[arm], "turns": turns, "prefilled_total": total,
                "later_prefilled": later_prefilled, "later_added": later_new,
                "later_ttft_ms_p50": quantile(&later, 0.5), "later_ttft_ms_p90": quantile(&later, 0.9),
                "session_wall_ms_median": wall, "walls_ms": f.walls_ms,
            }));
        }
        let ratio = later_ttft[1] / later_ttft[0];
        let serve_prefill = later_prefill[1];
        let ok = ratio <= TTFT_SHARE && serve_prefill <= PREFILL_BOUND;
        // serve drops Claude Code's attribution line, so the arms' prompts differ there: the
        // replay test compares serve's replies with a cold serve's instead.
        let claude = agent.starts_with("Claude");
        let same = figures[0].replies == figures[1].replies;
        println!(
            "  serve's later turns: TTFT p50 {ratio:.3} × llama-server alone's (at most {TTFT_SHARE}), prefilled {serve_prefill:.2} × the tokens they added (at most {PREFILL_BOUND}): {}; greedy replies the same on both arms: {}",
            if ok { "met" } else { "MISSED" },
            match (claude, same) {
                (_, true) => "yes",
                (true, false) => "no (serve's prompt lacks the attribution line)",
                (false, false) => "NO",
            }
        );
        met &= ok;
        json_scenarios.push(json!({
            "agent": agent, "scenario": name, "arms": arms_json,
            "later_ttft_ratio_serve_to_llama_server": ratio,
            "later_prefilled_to_added_serve": serve_prefill, "met": ok, "replies_same": same,
        }));
    }
    let out = json!({"runs": runs, "reply_tokens": REPLY_TOKENS, "ctx": CTX, "load": super::loadavg(), "scenarios": json_scenarios});
    let dir = ws.root.join("results");
    std::fs::create_dir_all(&dir).map_err(|e| Failure::new(e, "check the repository"))?;
    std::fs::write(dir.join("agents.json"), out.to_string())
        .map_err(|e| Failure::new(e, "check the repository"))?;
    println!("\nwrote results/agents.json");
    Ok(if met {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
