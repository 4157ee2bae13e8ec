//! `cargo xtask bench prompt-cache [--quick]`: the time to first token of a conversation's
//! second request after a restart, with serve's persistent prompt cache, without it
//! (`--no-prompt-cache`) and on llama-server alone (issue 29). The conversation: a
//! ~2,000-token system prompt and a question (turn one, greedy, whole), then the same with the
//! answer and a second question (turn two, greedy, streamed, timed); the server is restarted
//! between the two. The arms take turns round by round; the state file's size per token and
//! serve's restore time are reported beside the table. Release builds.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use super::client::{self, Conn};
use super::inproc_llama::{Running, free_port, median, settle, wait_ready};
use crate::{Failure, Workspace, process};

/// The arms, in the table's order.
const ARMS: [&str; 3] = [
    "serve, prompt cache",
    "serve, --no-prompt-cache",
    "llama-server alone",
];
/// The first byte of a cold 2,000-token prefill can take a minute on a busy 2-core VM.
const READ_LIMIT: Duration = Duration::from_secs(300);
const MAX_TOKENS: u32 = 48;
/// The target: the second request's time to first token with the cache at most this
/// share of the time without it.
const TARGET: f64 = 0.25;

/// The issue's ~2,000-token system prompt: this many rules.
const RULES: usize = 41;
/// More lengths, one round each, so the figure does not hang on where one prompt ends
/// against llama-server's runs of the cpu route's micro-batch, 256 tokens (a rule is about 48
/// tokens: these step about 144).
const SWEEP: [usize; 3] = [44, 47, 50];

/// The system prompt: an agent's rules and tool list, ~2,000 tokens at [`RULES`].
fn system_prompt(rules: usize) -> String {
    let tools = [
        "read_file",
        "write_file",
        "list_dir",
        "run_tests",
        "search_code",
        "open_url",
    ];
    let mut out = String::from(
        "You are a careful coding agent working in a user's repository. Follow every rule below.\n",
    );
    for i in 0..rules {
        let tool = tools[i % tools.len()];
        out.push_str(&format!(
            "Rule {i}: before you call {tool}, say in one sentence why; never call it twice with the same arguments; \
             report its errors to the user word for word, and stop when a call fails {} times.\n",
            i % 5 + 2
        ));
    }
    out
}

/// One arm's figures for one round.
struct Round {
    ttft_ms: f64,
    prompt_tokens: u64,
    first_reply: String,
    second_reply: String,
    restore_ms: Option<f64>,
}

pub fn run(ws: &Workspace, quick: bool) -> Result<ExitCode, Failure> {
    let rounds = if quick { 1 } else { 3 };
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
    let model = ws.layout.model(ws.pins.default_model());
    let onebit = ws.root.join("target/release/1bit");
    let llama_server = ws.layout.llama_server();
    let scratch =
        std::env::temp_dir().join(format!("onebit-bench-prompt-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).map_err(|e| Failure::new(e, "check /tmp"))?;
    let system = system_prompt(RULES);
    let kit = Kit {
        model,
        onebit,
        llama_server,
        scratch: scratch.clone(),
    };

    let mut results: Vec<Vec<Round>> = (0..ARMS.len()).map(|_| Vec::new()).collect();
    let mut state = None;
    for round in 0..rounds {
        for i in (0..ARMS.len()).map(|i| (i + round) % ARMS.len()) {
            let cache = scratch.join(format!("cache-{round}"));
            let (first, second) = conversation(&kit, i, &system, &cache)?;
            if i == 0 && state.is_none() {
                state = state_size(&cache);
            }
            println!(
                "  round {}: {}: {:.0} ms to the first token{}",
                round + 1,
                ARMS[i],
                second.ttft_ms,
                second
                    .restore_ms
                    .map(|ms| format!(" (restored in {ms:.0} ms)"))
                    .unwrap_or_default()
            );
            results[i].push(Round {
                ttft_ms: second.ttft_ms,
                prompt_tokens: second.prompt_tokens,
                first_reply: first.text,
                second_reply: second.text,
                restore_ms: second.restore_ms,
            });
        }
    }
    if !quick {
        sweep(&kit)?;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    report(ws, &results, state, rounds)
}

/// What every conversation needs: the binaries, the model, the scratch folder.
struct Kit {
    model: PathBuf,
    onebit: PathBuf,
    llama_server: PathBuf,
    scratch: PathBuf,
}

/// One conversation on arm `i`: turn one, a restart (serve and its llama-server, or
/// llama-server alone), turn two streamed. The cache arm keeps its states in `cache`.
fn conversation(
    kit: &Kit,
    i: usize,
    system: &str,
    cache: &Path,
) -> Result<(Answer, Answer), Failure> {
    let arm = ARMS[i];
    let start = || {
        let port = free_port()?;
        let mut command = arm_command(i, port, &kit.model, &kit.onebit, &kit.llama_server, cache);
        command.env("ONEBIT_STATE_DIR", &kit.scratch);
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Failure::new(format!("cannot start {arm}: {e}"), "run setup"))?;
        let running = Running(child);
        wait_ready(port, arm)?;
        Ok::<_, Failure>((port, running))
    };
    let (port, running) = start()?;
    let first = ask(port, &turn_one(system), false, arm)?;
    stop(running, arm)?;
    let (port, running) = start()?;
    settle();
    let second = ask(port, &turn_two(system, &first.text), true, arm)?;
    stop(running, arm)?;
    Ok((first, second))
}

/// The cache and no-cache arms once each at the [`SWEEP`] lengths: the prompt, what the
/// restore brought (a multiple of 256 within the exact part of turn one's state), both times to
/// the first token and their ratio, and whether the replies match. Printed, not judged.
fn sweep(kit: &Kit) -> Result<(), Failure> {
    println!(
        "\nWhere the prompt ends against llama-server's 256-token runs (the cpu route's -ub; one round each):"
    );
    println!(
        "  {:>6} {:>14} {:>9} {:>12} {:>15} {:>8} {:>10}",
        "rules", "prompt tokens", "restored", "cache (ms)", "no cache (ms)", "ratio", "identical"
    );
    for (k, rules) in SWEEP.into_iter().enumerate() {
        let system = system_prompt(rules);
        let cache = kit.scratch.join(format!("sweep-{k}"));
        let (c1, cached) = conversation(kit, 0, &system, &cache)?;
        let (u1, uncached) = conversation(kit, 1, &system, &cache)?;
        println!(
            "  {rules:>6} {:>14} {:>9} {:>12.0} {:>15.0} {:>8.3} {:>10}",
            cached.prompt_tokens,
            cached.restored,
            cached.ttft_ms,
            uncached.ttft_ms,
            cached.ttft_ms / uncached.ttft_ms,
            if c1.text == u1.text && cached.text == uncached.text {
                "yes"
            } else {
                "NO"
            }
        );
    }
    Ok(())
}

fn report(
    ws: &Workspace,
    results: &[Vec<Round>],
    state: Option<(u64, u64)>,
    rounds: usize,
) -> Result<ExitCode, Failure> {
    let ttft: Vec<f64> = results
        .iter()
        .map(|r| median(&mut r.iter().map(|x| x.ttft_ms).collect::<Vec<_>>()))
        .collect();
    let reference = &results[1][0].second_reply;
    println!(
        "\nTime to first token of a conversation's second request ({} prompt tokens) after a restart (default model, cpu route, median of {rounds}):",
        results[1][0].prompt_tokens
    );
    println!(
        "  {:<26} {:>10} {:>16} {:>22}",
        "arm", "TTFT ms", "x without cache", "reply = uncached one"
    );
    let mut identical = true;
    for (i, arm) in ARMS.iter().enumerate() {
        let same = results[i]
            .iter()
            .all(|r| &r.second_reply == reference && r.first_reply == results[1][0].first_reply);
        identical &= same;
        println!(
            "  {arm:<26} {:>10.0} {:>16.3} {:>22}",
            ttft[i],
            ttft[i] / ttft[1],
            if same { "yes" } else { "NO" }
        );
    }
    let restore: Vec<f64> = results[0].iter().filter_map(|r| r.restore_ms).collect();
    let restore_ms = (!restore.is_empty()).then(|| median(&mut restore.clone()));
    if let Some((bytes, tokens)) = state {
        println!(
            "  state file: {:.1} MB for {tokens} tokens, {:.1} KB per token",
            bytes as f64 / 1e6,
            bytes as f64 / tokens.max(1) as f64 / 1e3
        );
    }
    match restore_ms {
        Some(ms) => println!("  restore (serve's timings.cache.restore_ms, median): {ms:.0} ms"),
        None => println!("  restore: the cache arm restored nothing (see serve's lines)"),
    }
    let ratio = ttft[0] / ttft[1];
    let met = ratio <= TARGET && identical;
    println!(
        "  target: with the cache <= {TARGET} x without, the greedy reply identical: {} ({ratio:.3})",
        if met { "met" } else { "missed" }
    );
    let json = json!({
        "rounds": rounds,
        "arms": ARMS.iter().zip(&ttft).map(|(a, t)| json!({"arm": a, "ttft_ms": t})).collect::<Vec<_>>(),
        "ratio_cache_to_no_cache": ratio,
        "replies_identical": identical,
        "state_bytes": state.map(|s| s.0),
        "state_tokens": state.map(|s| s.1),
        "restore_ms": restore_ms,
    });
    let dir = ws.root.join("results");
    std::fs::create_dir_all(&dir).map_err(|e| Failure::new(e, "check the repository"))?;
    std::fs::write(dir.join("prompt-cache.json"), json.to_string())
        .map_err(|e| Failure::new(e, "check the repository"))?;
    Ok(if met {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn turn_one(system: &str) -> Value {
    json!({
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Which rule tells you when to stop calling a tool? Answer in one sentence."},
        ],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    })
}

fn turn_two(system: &str, answer: &str) -> Value {
    json!({
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Which rule tells you when to stop calling a tool? Answer in one sentence."},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And what must you say before calling read_file?"},
        ],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

fn arm_command(
    arm: usize,
    port: u16,
    model: &Path,
    onebit: &Path,
    llama_server: &Path,
    cache: &Path,
) -> Command {
    let port = port.to_string();
    if arm == 2 {
        let mut c = Command::new(llama_server);
        c.arg("-m").arg(model).args([
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--ctx-size",
            "4096",
            "-ngl",
            "0",
            "--jinja",
        ]);
        return c;
    }
    let mut c = Command::new(onebit);
    c.arg("serve")
        .arg("-m")
        .arg(model)
        .args(["--port", &port, "--ctx-size", "4096", "--device", "cpu"])
        .arg("--llama-server")
        .arg(llama_server);
    if arm == 0 {
        c.arg("--prompt-cache-dir").arg(cache);
    } else {
        c.arg("--no-prompt-cache");
    }
    c
}

/// SIGTERM and the exit (serve's drain saves the slot's state before its backend stops).
fn stop(mut running: Running, arm: &str) -> Result<(), Failure> {
    let _ = kill(Pid::from_raw(running.0.id() as i32), Signal::SIGTERM);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(60) {
        if let Ok(Some(_)) = running.0.try_wait() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(Failure::new(
        format!("{arm} did not exit within 60 s of SIGTERM"),
        "run it by hand",
    ))
}

/// One answered request: its text, the time to its first text, and the disk restore's time.
struct Answer {
    text: String,
    prompt_tokens: u64,
    ttft_ms: f64,
    restore_ms: Option<f64>,
    /// Tokens the restore brought (`timings.cache.n`).
    restored: u64,
}

/// Send a chat and read it: whole, or streamed event by event (time to the first event
/// with text, the text, the last event's `timings.cache`).
fn ask(port: u16, body: &Value, streamed: bool, arm: &str) -> Result<Answer, Failure> {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let broke = |e: std::io::Error| {
        Failure::new(
            format!("{arm}: a request failed: {e}"),
            "run the arm by hand",
        )
    };
    let mut conn = Conn::open(addr).map_err(broke)?;
    conn.set_read_timeout(READ_LIMIT).map_err(broke)?;
    let request = client::post_json(addr, "/v1/chat/completions", &body.to_string(), true);
    let sent = SystemTime::now();
    let mut bytes = Vec::new();
    let mut first: Option<SystemTime> = None;
    let mut pending = Vec::new();
    let mut text = String::new();
    let mut restore_ms = None;
    let mut restored = 0;
    let mut prompt_tokens = 0;
    let reply = conn
        .stream(&request, |piece, at| {
            if !streamed {
                bytes.extend_from_slice(piece);
                return;
            }
            pending.extend_from_slice(piece);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data: ") else {
                    continue;
                };
                let Ok(event) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(delta) = event["choices"][0]["delta"]["content"].as_str()
                    && !delta.is_empty()
                {
                    first.get_or_insert(at);
                    text.push_str(delta);
                }
                if let Some(ms) = event["timings"]["cache"]["restore_ms"].as_f64() {
                    restore_ms = Some(ms);
                    restored = event["timings"]["cache"]["n"].as_u64().unwrap_or(0);
                }
                if let Some(n) = event["usage"]["prompt_tokens"].as_u64() {
                    prompt_tokens = n;
                }
            }
        })
        .map_err(broke)?;
    if reply.status != 200 {
        return Err(Failure::new(
            format!("{arm}: the chat answered {}", reply.status),
            "run the arm by hand",
        ));
    }
    if !streamed {
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        prompt_tokens = value["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
        text = value["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
    }
    let ttft_ms = first
        .and_then(|f| f.duration_since(sent).ok())
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
    Ok(Answer {
        text,
        prompt_tokens,
        ttft_ms,
        restore_ms,
        restored,
    })
}

/// The state the cache arm saved: its bytes and tokens (its description's token list).
fn state_size(cache: &Path) -> Option<(u64, u64)> {
    let entries: Vec<PathBuf> = std::fs::read_dir(cache)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .collect();
    let described = entries
        .iter()
        .find(|p| p.extension().is_some_and(|e| e == "json"))?;
    let description: Value =
        serde_json::from_str(&std::fs::read_to_string(described).ok()?).ok()?;
    let bytes = description["bytes"].as_u64()?;
    let tokens = description["tokens"].as_array()?.len() as u64;
    Some((bytes, tokens))
}
