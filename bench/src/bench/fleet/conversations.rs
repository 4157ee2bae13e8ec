//! The fleet's third figure in `cargo xtask bench fleet` (issue 44): two serves of the real,
//! pinned llama-server and the default model (cpu route) behind the gateway, and multi-turn
//! conversations with long system prompts, in three arms: the gateway's cache-aware policy with
//! both serves given one `--prompt-cache-dir` (docs/fleet.md, "One prompt cache for the
//! fleet"), the same with llama-server's `--no-cache-idle-slots` (see [`ARMS`]), and
//! round-robin with no prompt cache (`--no-prompt-cache`).
//!
//! Each conversation has a system prompt of its own (about 1,580 tokens); each of its turns is
//! the previous turn with the reply and a new question, greedy, a few tokens, streamed. The
//! conversations take turns, and there is an odd number of them, so round-robin sends a
//! conversation's turns to the two workers in turn. The arms' fleets run side by side and take
//! turns request by request, one request in flight in all: the load of a shared machine falls
//! on every arm alike. Figures per
//! arm: the prompt tokens; those the workers prefilled (the prompt less the reply's
//! `usage.prompt_tokens_details.cached_tokens`); of those, the ones an earlier turn of the
//! conversation had prefilled already (what a cache could have kept); and the time to the
//! first streamed text at the client, for the first turns and for the later ones.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

use super::{Backend, Fleet, Spec, percentile};
use crate::Failure;
use crate::bench::client::{self, Conn};

/// What the arms run: the binaries, the model, where the logs and the prompt cache go.
pub struct Kit {
    pub onebit: PathBuf,
    pub smg: PathBuf,
    pub llama_server: PathBuf,
    pub model: PathBuf,
    pub model_name: String,
    pub scratch: PathBuf,
}

/// One arm: the gateway's policy, whether the serves share one prompt-cache folder, and
/// llama-server's arguments beyond serve's.
struct Arm {
    name: &'static str,
    policy: &'static str,
    shared_cache: bool,
    llama_args: &'static [&'static str],
}

/// The second arm is the first with llama-server's `--no-cache-idle-slots`. By default
/// llama-server (with `-np auto`, one unified KV pool) moves an idle slot's tokens to its RAM
/// prompt cache and empties the slot when another request starts, so a worker serving
/// conversations in turn finds each one's slot empty at its next turn, and serve restores it
/// from the folder; with the flag an idle slot keeps its turn until a prompt needs the room.
static ARMS: [Arm; 3] = [
    Arm {
        name: "cache-aware, shared prompt cache",
        policy: "cache_aware",
        shared_cache: true,
        llama_args: &[],
    },
    Arm {
        name: "the same, --no-cache-idle-slots",
        policy: "cache_aware",
        shared_cache: true,
        llama_args: &["--no-cache-idle-slots"],
    },
    Arm {
        name: "round-robin, no prompt cache",
        policy: "round_robin",
        shared_cache: false,
        llama_args: &[],
    },
];

const WORKERS: usize = 2;
const MAX_TOKENS: u32 = 8;
/// Each worker's context (the model's own): llama-server's 4 slots share it (`-np auto`, one
/// unified pool), and a conversation's last turn takes about 2,000 tokens of it.
const CTX_SIZE: &str = "8192";
/// Rules in a system prompt: about 1,580 tokens of SmolLM2's.
const RULES: usize = 27;
/// A cold prefill of ~2,000 tokens can take a minute on a busy 2-core VM.
const READ_LIMIT: Duration = Duration::from_secs(300);

/// The conversations' subjects: (whose assistant, what it keeps records of, one of them).
/// Each system prompt begins with another word, so the gateway's tree (characters) sees no
/// shared prefix between conversations beyond the chat template's marks.
const SUBJECTS: [(&str, &str, &str); 5] = [
    ("Harbourmaster", "ships", "ship"),
    ("Librarian", "books", "book"),
    ("Gardener", "plants", "plant"),
    ("Quartermaster", "tents", "tent"),
    ("Baker", "breads", "loaf"),
];

/// How much a run sends: conversations (odd: see the module's comment), turns each, and how
/// long an arm's conversations may take (all arms: this times the arms).
struct Shape {
    conversations: usize,
    turns: usize,
    limit: Duration,
}

fn shape(quick: bool) -> Shape {
    if quick {
        Shape {
            conversations: 3,
            turns: 3,
            limit: Duration::from_secs(600),
        }
    } else {
        Shape {
            conversations: 5,
            turns: 4,
            limit: Duration::from_secs(1800),
        }
    }
}

/// Conversation `c`'s system prompt: an assistant's record-keeping rules.
fn system_prompt(c: usize) -> String {
    let (role, things, thing) = SUBJECTS[c % SUBJECTS.len()];
    let colours = ["red", "green", "blue", "amber", "white", "black", "grey"];
    let mut out = format!(
        "{role}'s assistant: you keep the records of the {things} of a small town and answer its staff's questions. Follow every rule below.\n"
    );
    for i in 0..RULES {
        out.push_str(&format!(
            "Rule {i}: when asked about {thing} number {i}, say that its colour is {}, that it weighs {} kilograms and that it is kept on shelf {}; answer in one short sentence, never guess, and say so when a record is missing.\n",
            colours[(i + c) % colours.len()],
            3 + (i * 7 + c * 5) % 40,
            1 + (i * 3 + c) % 12,
        ));
    }
    out
}

/// The question of conversation `c`'s turn `turn`.
fn question(c: usize, turn: usize) -> String {
    let (_, _, thing) = SUBJECTS[c % SUBJECTS.len()];
    let n = (3 + 7 * turn + 2 * c) % RULES;
    format!("What colour is {thing} number {n}? Answer in one sentence.")
}

/// One turn as measured.
pub struct Turn {
    conversation: usize,
    turn: usize,
    /// The worker the gateway sent it to (from its `smg_worker_requests_total`).
    worker: Option<usize>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// What the prompt adds to the conversation's previous prompt (the reply, the question,
    /// the template's marks): the least any cache leaves to prefill. A first turn's whole
    /// prompt.
    new_tokens: u64,
    ttft_ms: f64,
    /// Tokens serve restored from the prompt-cache folder (`timings.cache`, source `disk`).
    restored: u64,
}

impl Turn {
    fn prefilled(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.cached_tokens)
    }

    /// Prefilled tokens that an earlier turn of the conversation had prefilled already.
    fn again(&self) -> u64 {
        self.prefilled().saturating_sub(self.new_tokens)
    }
}

/// An arm's turns, and what the gateway sent to each worker.
pub struct ArmFigures {
    arm: &'static Arm,
    turns: Vec<Turn>,
    sent: Vec<u64>,
    seconds: f64,
}

/// The part's figures: its shape and each arm's.
pub struct Conversations {
    model_name: String,
    conversations: usize,
    turns: usize,
    arms: Vec<ArmFigures>,
}

/// Starts every arm's fleet, then sends the turns: turn by turn, conversation by conversation,
/// each arm in turn (the arms' order rotating), one request in flight in all, so the load of a
/// shared machine falls on every arm alike.
pub fn run(kit: &Kit, quick: bool) -> Result<Conversations, Failure> {
    let shape = shape(quick);
    let systems: Vec<String> = (0..shape.conversations).map(system_prompt).collect();
    println!(
        "==> conversations: {} arms side by side, {WORKERS} workers each (serve on llama-server, {}), {} conversations of {} turns, one request at a time in all",
        ARMS.len(),
        kit.model_name,
        shape.conversations,
        shape.turns
    );
    let mut fleets = Vec::new();
    for (index, arm) in ARMS.iter().enumerate() {
        fleets.push(start_arm(kit, index, arm)?);
    }
    let mut arms: Vec<Running> = ARMS
        .iter()
        .map(|arm| Running {
            arm,
            histories: systems
                .iter()
                .map(|s| vec![json!({"role": "system", "content": s})])
                .collect(),
            previous: vec![0; systems.len()],
            turns: Vec::new(),
            busy_s: 0.0,
        })
        .collect();
    let limit = shape.limit * ARMS.len() as u32;
    let started = Instant::now();
    let mut k = 0;
    for turn in 0..shape.turns {
        for c in 0..shape.conversations {
            for j in 0..ARMS.len() {
                let a = (j + k) % ARMS.len();
                if started.elapsed() > limit {
                    return Err(Failure::new(
                        format!("the conversations took more than {} s", limit.as_secs()),
                        format!(
                            "the machine is too busy, or a worker stalled: see the logs in {}",
                            kit.scratch.display()
                        ),
                    ));
                }
                arms[a].send(&fleets[a], c, turn)?;
            }
            k += 1;
        }
    }
    let mut figures = Vec::new();
    for (running, fleet) in arms.into_iter().zip(fleets) {
        let sent = fleet.sent();
        drop(fleet);
        figures.push(ArmFigures {
            arm: running.arm,
            turns: running.turns,
            sent,
            seconds: running.busy_s,
        });
    }
    Ok(Conversations {
        model_name: kit.model_name.clone(),
        conversations: shape.conversations,
        turns: shape.turns,
        arms: figures,
    })
}

/// One arm's fleet, its workers warmed up; its logs and state in a folder of its own.
fn start_arm(kit: &Kit, index: usize, arm: &Arm) -> Result<Fleet, Failure> {
    let scratch = kit.scratch.join(format!("arm-{index}"));
    std::fs::create_dir_all(&scratch).map_err(|e| Failure::new(e, "check /tmp"))?;
    let mut serve_args: Vec<String> = vec!["--ctx-size".into(), CTX_SIZE.into()];
    if arm.shared_cache {
        // A fresh folder, both serves' own.
        let cache = scratch.join("prompt-cache");
        let _ = std::fs::remove_dir_all(&cache);
        serve_args.push("--prompt-cache-dir".into());
        serve_args.push(cache.display().to_string());
    } else {
        serve_args.push("--no-prompt-cache".into());
    }
    if !arm.llama_args.is_empty() {
        serve_args.push("--".into());
        serve_args.extend(arm.llama_args.iter().map(|a| a.to_string()));
    }
    let spec = Spec {
        onebit: kit.onebit.clone(),
        smg: kit.smg.clone(),
        backend: Backend::Llama {
            server: kit.llama_server.clone(),
            model: kit.model.clone(),
        },
        workers: WORKERS,
        gateway: None,
        serve_args,
        scratch: scratch.clone(),
    };
    let began = Instant::now();
    let fleet = Fleet::start_with(&spec, arm.policy)?;
    // Each worker's first chat (the weights read in), sent to it directly: the gateway's tree
    // and counts stay as they were.
    for worker in &fleet.workers {
        warm_up(worker.addr).map_err(|what| worker.failure(what))?;
    }
    println!(
        "  {}: ready in {:.0} s (logs in {})",
        arm.name,
        began.elapsed().as_secs_f64(),
        scratch.display()
    );
    Ok(fleet)
}

/// An arm under way: its conversations so far and its turns measured.
struct Running {
    arm: &'static Arm,
    histories: Vec<Vec<Value>>,
    /// Each conversation's last prompt, in tokens.
    previous: Vec<u64>,
    turns: Vec<Turn>,
    /// Seconds its requests took, in all.
    busy_s: f64,
}

impl Running {
    /// Conversation `c`'s turn `turn` through `fleet`'s gateway, measured.
    fn send(&mut self, fleet: &Fleet, c: usize, turn: usize) -> Result<(), Failure> {
        let name = self.arm.name;
        let history = &mut self.histories[c];
        history.push(json!({"role": "user", "content": question(c, turn)}));
        let before = fleet.sent();
        let began = Instant::now();
        let answer = ask(fleet.gateway.addr, history).map_err(|what| {
            fleet.gateway.failure(format!(
                "{name}: conversation {c}, turn {}: {what}",
                turn + 1
            ))
        })?;
        self.busy_s += began.elapsed().as_secs_f64();
        let worker = which(&before, &fleet.sent());
        history.push(json!({"role": "assistant", "content": answer.text}));
        let measured = Turn {
            conversation: c,
            turn,
            worker,
            prompt_tokens: answer.prompt_tokens,
            cached_tokens: answer.cached_tokens,
            new_tokens: answer.prompt_tokens.saturating_sub(self.previous[c]),
            ttft_ms: answer.ttft_ms,
            restored: answer.restored,
        };
        self.previous[c] = answer.prompt_tokens;
        println!(
            "  {name}: conversation {c} turn {}: worker {}, {} prompt tokens, {} cached, {} prefilled ({} again), first text in {:.0} ms{}",
            turn + 1,
            worker.map_or("?".to_string(), |w| w.to_string()),
            measured.prompt_tokens,
            measured.cached_tokens,
            measured.prefilled(),
            measured.again(),
            measured.ttft_ms,
            if measured.restored > 0 {
                format!(" ({} restored from the folder)", measured.restored)
            } else {
                String::new()
            }
        );
        self.turns.push(measured);
        Ok(())
    }
}

/// The worker whose count of requests grew, when exactly one did.
fn which(before: &[u64], after: &[u64]) -> Option<usize> {
    let grew: Vec<usize> = (0..after.len())
        .filter(|&i| after[i] > before.get(i).copied().unwrap_or(0))
        .collect();
    match grew.as_slice() {
        [i] => Some(*i),
        _ => None,
    }
}

/// A short whole chat sent to a worker directly.
fn warm_up(worker: SocketAddr) -> Result<(), String> {
    let body = json!({
        "model": "fleet",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        "max_tokens": 4,
    });
    let mut conn = Conn::open(worker).map_err(|e| format!("cannot connect: {e}"))?;
    conn.set_read_timeout(READ_LIMIT)
        .map_err(|e| e.to_string())?;
    let request = client::post_json(worker, "/v1/chat/completions", &body.to_string(), true);
    let reply = conn
        .exchange(&request)
        .map_err(|e| format!("the warm-up chat failed: {e}"))?;
    if reply.status != 200 {
        return Err(format!("the warm-up chat answered {}", reply.status));
    }
    Ok(())
}

/// What one streamed reply said.
struct Answer {
    text: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    restored: u64,
    ttft_ms: f64,
}

/// Sends a conversation's turn through the gateway, greedy and streamed, and reads it event by
/// event: the time to the first event with text, the text, and the last events' `usage` and
/// `timings`.
fn ask(gateway: SocketAddr, messages: &[Value]) -> Result<Answer, String> {
    let body = json!({
        "model": "fleet",
        "messages": messages,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut conn = Conn::open(gateway).map_err(|e| format!("cannot connect: {e}"))?;
    conn.set_read_timeout(READ_LIMIT)
        .map_err(|e| e.to_string())?;
    let request = client::post_json(gateway, "/v1/chat/completions", &body.to_string(), true);
    let mut pending = Vec::new();
    let mut first_text: Option<SystemTime> = None;
    let mut first_event: Option<SystemTime> = None;
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut timings = Value::Null;
    let mut error = None;
    let mut done = false;
    let sent = SystemTime::now();
    let reply = conn
        .stream(&request, |piece, at| {
            pending.extend_from_slice(piece);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(event) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if !event["error"].is_null() {
                    error = Some(event["error"].to_string());
                }
                if event["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                    first_event.get_or_insert(at);
                }
                if let Some(delta) = event["choices"][0]["delta"]["content"].as_str()
                    && !delta.is_empty()
                {
                    first_text.get_or_insert(at);
                    text.push_str(delta);
                }
                if event["usage"].is_object() {
                    usage = event["usage"].clone();
                }
                if event["timings"].is_object() {
                    timings = event["timings"].clone();
                }
            }
        })
        .map_err(|e| format!("the stream broke: {e}"))?;
    if reply.status != 200 {
        return Err(format!("the chat answered {}", reply.status));
    }
    if let Some(error) = error {
        return Err(format!("the stream ended with an error: {error}"));
    }
    if !done {
        return Err("the stream ended without [DONE]".to_string());
    }
    let prompt_tokens = usage["prompt_tokens"]
        .as_u64()
        .ok_or_else(|| format!("the stream's usage has no prompt_tokens: {usage}"))?;
    let cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| timings["cache_n"].as_u64())
        .ok_or_else(|| format!("the stream says no cached tokens: {usage} {timings}"))?;
    let restored = if timings["cache"]["source"] == "disk" {
        timings["cache"]["n"].as_u64().unwrap_or(0)
    } else {
        0
    };
    let first = first_text
        .or(first_event)
        .ok_or("the stream carried no choices")?;
    let ttft_ms = first
        .duration_since(sent)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
    Ok(Answer {
        text,
        prompt_tokens,
        cached_tokens,
        restored,
        ttft_ms,
    })
}

/// An arm's figures, as the table and `results/fleet.json` give them.
struct Summary {
    first_prompt: u64,
    first_prefilled: u64,
    first_ttft_p50: f64,
    later_turns: usize,
    later_prompt: u64,
    later_cached: u64,
    later_prefilled: u64,
    later_again: u64,
    later_ttft_p50: f64,
    later_ttft_p90: f64,
    /// Later turns sent to another worker than the conversation's previous turn.
    moved: usize,
    restored_turns: usize,
    restored_tokens: u64,
}

impl ArmFigures {
    fn summary(&self) -> Summary {
        let (first, later): (Vec<&Turn>, Vec<&Turn>) = self.turns.iter().partition(|t| t.turn == 0);
        let ttfts = |turns: &[&Turn]| {
            let mut v: Vec<f64> = turns.iter().map(|t| t.ttft_ms).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let (first_ttft, later_ttft) = (ttfts(&first), ttfts(&later));
        let moved = later
            .iter()
            .filter(|t| {
                let before = self
                    .turns
                    .iter()
                    .find(|p| p.conversation == t.conversation && p.turn + 1 == t.turn);
                before.is_some_and(|p| p.worker != t.worker)
            })
            .count();
        Summary {
            first_prompt: first.iter().map(|t| t.prompt_tokens).sum(),
            first_prefilled: first.iter().map(|t| t.prefilled()).sum(),
            first_ttft_p50: percentile(&first_ttft, 0.5),
            later_turns: later.len(),
            later_prompt: later.iter().map(|t| t.prompt_tokens).sum(),
            later_cached: later.iter().map(|t| t.cached_tokens).sum(),
            later_prefilled: later.iter().map(|t| t.prefilled()).sum(),
            later_again: later.iter().map(|t| t.again()).sum(),
            later_ttft_p50: percentile(&later_ttft, 0.5),
            later_ttft_p90: percentile(&later_ttft, 0.9),
            moved,
            restored_turns: self.turns.iter().filter(|t| t.restored > 0).count(),
            restored_tokens: self.turns.iter().map(|t| t.restored).sum(),
        }
    }
}

impl Conversations {
    /// The table.
    pub fn print(&self) {
        println!(
            "conversations through the gateway ({WORKERS} workers: serve on llama-server, {}, cpu route; {} conversations x {} turns, ~1,580-token system prompts, greedy, {MAX_TOKENS} tokens, one request at a time):",
            self.model_name, self.conversations, self.turns
        );
        println!(
            "  {:<34} {:>11} | {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>10}",
            "", "turn 1", "turns 2+", "(tokens)", "prefilled", "(ms)", "", "", "restored"
        );
        println!(
            "  {:<34} {:>11} | {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>10}",
            "arm",
            "TTFT p50 ms",
            "prompt",
            "prefilled",
            "again",
            "TTFT p50",
            "TTFT p90",
            "moved",
            "from disk"
        );
        for figures in &self.arms {
            let s = figures.summary();
            println!(
                "  {:<34} {:>11.0} | {:>9} {:>9} {:>9} {:>9.0} {:>9.0} {:>6} {:>10}",
                figures.arm.name,
                s.first_ttft_p50,
                s.later_prompt,
                s.later_prefilled,
                s.later_again,
                s.later_ttft_p50,
                s.later_ttft_p90,
                format!("{}/{}", s.moved, s.later_turns),
                format!("{} ({})", s.restored_turns, s.restored_tokens),
            );
        }
        for figures in &self.arms {
            let s = figures.summary();
            println!(
                "  {}: its requests took {:.0} s; sent to each worker {:?}; turn 1: {} prompt tokens, {} prefilled",
                figures.arm.name, figures.seconds, figures.sent, s.first_prompt, s.first_prefilled
            );
        }
    }

    /// The figures for `results/fleet.json`.
    pub fn json(&self) -> Value {
        json!({
            "workers": WORKERS,
            "model": self.model_name,
            "conversations": self.conversations,
            "turns": self.turns,
            "max_tokens": MAX_TOKENS,
            "ctx_size": CTX_SIZE,
            "arms": self.arms.iter().map(|figures| {
                let s = figures.summary();
                json!({
                    "arm": figures.arm.name,
                    "policy": figures.arm.policy,
                    "shared_prompt_cache": figures.arm.shared_cache,
                    "llama_server_args": figures.arm.llama_args,
                    "requests_s": figures.seconds,
                    "sent": figures.sent,
                    "turn_1": {
                        "prompt_tokens": s.first_prompt,
                        "prefilled_tokens": s.first_prefilled,
                        "ttft_ms_p50": s.first_ttft_p50,
                    },
                    "later_turns": {
                        "turns": s.later_turns,
                        "prompt_tokens": s.later_prompt,
                        "cached_tokens": s.later_cached,
                        "prefilled_tokens": s.later_prefilled,
                        "prefilled_again_tokens": s.later_again,
                        "ttft_ms_p50": s.later_ttft_p50,
                        "ttft_ms_p90": s.later_ttft_p90,
                        "moved": s.moved,
                    },
                    "restored_from_disk": {"turns": s.restored_turns, "tokens": s.restored_tokens},
                    "per_turn": figures.turns.iter().map(|t| json!({
                        "conversation": t.conversation,
                        "turn": t.turn + 1,
                        "worker": t.worker,
                        "prompt_tokens": t.prompt_tokens,
                        "cached_tokens": t.cached_tokens,
                        "new_tokens": t.new_tokens,
                        "ttft_ms": t.ttft_ms,
                        "restored": t.restored,
                    })).collect::<Vec<_>>(),
                })
            }).collect::<Vec<_>>(),
        })
    }
}
