//! `zeta-engine`: the stand-in for the Zeta NPU's closed engine program. A vendor ships its own
//! binary instead; what serve needs of it is what this one does:
//!
//! - listen on `--host H --port N` (serve gives a free loopback port);
//! - answer llama-server's health route: `GET /health` 503 while the model loads, then 200
//!   `{"status":"ok"}`;
//! - answer `POST /v1/chat/completions` whole and streamed (`chat.completion.chunk` events,
//!   `data: [DONE]`), here with a deterministic generator: the prompt's words in reverse;
//! - answer `GET /metrics` with its own Prometheus counters (serve appends them to its own);
//! - take what the route passes on its command line (`--model`, `--device`, `--alias`,
//!   `--max-tokens-cap N` from `--route-opt max_tokens_cap=N`).
//!
//! Like many closed engines it forks a helper of its own, a device monitor, with a plain
//! `std::process::Command`: no parent-death signal, in the engine's process group. It dies
//! with the engine because serve's spawner kills the engine's whole group, on a stop and, by
//! its keeper, on a `kill -9` of serve (README.md). SIGTERM ends the engine at once (its
//! default action).

mod chat;
mod http;

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What the engine prints when its device is gone (the route stops serve on it).
const DEVICE_LOST_LINE: &str = "zeta-engine: device lost";

/// The most tokens a reply may have without `--max-tokens-cap`.
const DEFAULT_MAX_TOKENS_CAP: u32 = 1024;

/// How long the model takes to load onto the device unless `ZETA_LOAD_MS` says otherwise:
/// long enough that serve meets the 503 of a loading engine.
const DEFAULT_LOAD_MS: u64 = 300;

/// How often the device monitor looks at the device.
const MONITOR_EVERY: Duration = Duration::from_millis(500);

const USAGE: &str = "usage: zeta-engine --port N --model FILE --device NODE [--host H] [--alias NAME] [--max-tokens-cap N]\n       zeta-engine --device-monitor --device NODE";

/// The command line.
struct Args {
    host: String,
    port: u16,
    model: String,
    device: String,
    alias: String,
    max_tokens_cap: u32,
    /// Run as the device monitor (the engine starts itself so).
    monitor: bool,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        host: "127.0.0.1".to_string(),
        port: 0,
        model: String::new(),
        device: String::new(),
        alias: "zeta".to_string(),
        max_tokens_cap: DEFAULT_MAX_TOKENS_CAP,
        monitor: false,
    };
    while let Some(flag) = args.next() {
        if flag == "--device-monitor" {
            parsed.monitor = true;
            continue;
        }
        let value = args
            .next()
            .ok_or_else(|| format!("zeta-engine: {flag} needs a value\n{USAGE}"))?;
        let number = |what: &str| format!("zeta-engine: {flag} {value}: not {what}\n{USAGE}");
        match flag.as_str() {
            "--host" => parsed.host = value,
            "--port" => parsed.port = value.parse().map_err(|_| number("a port"))?,
            "--model" => parsed.model = value,
            "--device" => parsed.device = value,
            "--alias" => parsed.alias = value,
            "--max-tokens-cap" => {
                parsed.max_tokens_cap = value
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| number("a number of tokens from 1"))?;
            }
            _ => return Err(format!("zeta-engine: unknown flag {flag}\n{USAGE}")),
        }
    }
    if parsed.device.is_empty()
        || (!parsed.monitor && (parsed.port == 0 || parsed.model.is_empty()))
    {
        return Err(USAGE.to_string());
    }
    Ok(parsed)
}

/// The engine, shared by the connections' threads.
struct Engine {
    /// The model is loaded: `/health` says 200.
    ready: AtomicBool,
    alias: String,
    max_tokens_cap: u32,
    requests: AtomicU64,
    generations: AtomicU64,
    tokens: AtomicU64,
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    if args.monitor {
        return monitor(Path::new(&args.device));
    }
    if !Path::new(&args.device).exists() {
        eprintln!("zeta-engine: no Zeta device at {}", args.device);
        return ExitCode::FAILURE;
    }
    let listener = match TcpListener::bind((args.host.as_str(), args.port)) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!(
                "zeta-engine: cannot listen on {}:{}: {e}",
                args.host, args.port
            );
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "zeta-engine: listening on http://{}:{}",
        args.host, args.port
    );
    if let Err(e) = start_monitor(&args.device) {
        eprintln!("zeta-engine: cannot start the device monitor: {e}");
        return ExitCode::FAILURE;
    }
    let engine = Arc::new(Engine {
        ready: AtomicBool::new(false),
        alias: args.alias,
        max_tokens_cap: args.max_tokens_cap,
        requests: AtomicU64::new(0),
        generations: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
    });
    let loading = Arc::clone(&engine);
    let model = args.model;
    std::thread::spawn(move || {
        let load_ms = std::env::var("ZETA_LOAD_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_LOAD_MS);
        std::thread::sleep(Duration::from_millis(load_ms));
        loading.ready.store(true, Ordering::Release);
        eprintln!("zeta-engine: model {model} loaded");
    });
    for stream in listener.incoming().flatten() {
        let engine = Arc::clone(&engine);
        std::thread::spawn(move || serve_connection(&engine, stream));
    }
    ExitCode::SUCCESS
}

/// Start the device monitor: this program again, as a plain child (see the crate doc), its
/// stderr the engine's (so its lines reach serve's log).
// On purpose a bare spawn, as a closed engine's own: no parent-death signal, in the engine's
// group. It is what serve's keeper must reach (README.md), so it does not use onebit-process.
#[allow(clippy::disallowed_methods)]
fn start_monitor(device: &str) -> std::io::Result<()> {
    let mut monitor = Command::new(std::env::current_exe()?)
        .args(["--device-monitor", "--device", device])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?;
    eprintln!("zeta-engine: device monitor started (pid {})", monitor.id());
    std::thread::spawn(move || {
        if let Ok(status) = monitor.wait() {
            eprintln!("zeta-engine: the device monitor exited ({status})");
        }
    });
    Ok(())
}

/// The device monitor's life: look at the device until it is gone, then say so and exit. It
/// never looks at its parent: were the engine killed, it would run on, as closed engines'
/// helpers do, until something kills its process group.
fn monitor(device: &Path) -> ExitCode {
    loop {
        if !device.exists() {
            eprintln!("{DEVICE_LOST_LINE}: {} is gone", device.display());
            return ExitCode::FAILURE;
        }
        std::thread::sleep(MONITOR_EVERY);
    }
}

/// Answer the requests of one connection until the client closes it (or asks to).
fn serve_connection(engine: &Engine, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut out = BufWriter::new(write_half);
    while let Ok(Some(request)) = http::read_request(&mut reader) {
        engine.requests.fetch_add(1, Ordering::Relaxed);
        let close = request.close;
        if answer(engine, &request, &mut out).is_err() || close {
            return;
        }
    }
}

/// One request's reply.
fn answer(
    engine: &Engine,
    request: &http::Request,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let json = "application/json";
    let loaded = engine.ready.load(Ordering::Acquire);
    match (request.method.as_str(), request.path.as_str()) {
        ("GET", "/health") if loaded => {
            http::write_whole(out, 200, json, br#"{"status":"ok"}"#, request.close)
        }
        ("GET", "/metrics") => http::write_whole(
            out,
            200,
            "text/plain; version=0.0.4",
            metrics(engine).as_bytes(),
            request.close,
        ),
        _ if !loaded => {
            let body = chat::error(503, "unavailable_error", "Loading model");
            http::write_whole(out, 503, json, body.as_bytes(), request.close)
        }
        ("POST", "/v1/chat/completions" | "/chat/completions") => chat_reply(engine, request, out),
        _ => {
            let body = chat::error(404, "not_found_error", "File Not Found");
            http::write_whole(out, 404, json, body.as_bytes(), request.close)
        }
    }
}

/// A chat completion, whole or streamed; a client that leaves mid-stream stops it.
fn chat_reply(
    engine: &Engine,
    request: &http::Request,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let chat = match chat::parse(&request.body) {
        Ok(chat) => chat,
        Err(message) => {
            let body = chat::error(400, "invalid_request_error", &message);
            return http::write_whole(out, 400, "application/json", body.as_bytes(), request.close);
        }
    };
    let n = engine.generations.fetch_add(1, Ordering::Relaxed) + 1;
    let limit = chat
        .max_tokens
        .map_or(engine.max_tokens_cap, |m| m.min(engine.max_tokens_cap));
    let (tokens, finish) = chat::generate(&chat.prompt, limit);
    let completion = chat::Completion {
        id: format!("chatcmpl-zeta-{n}"),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: engine.alias.clone(),
    };
    if !chat.stream {
        engine
            .tokens
            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        let prompt_tokens = chat.prompt.split_whitespace().count() as u64;
        let body = chat::whole(
            &completion,
            &tokens.concat(),
            finish,
            prompt_tokens,
            tokens.len() as u64,
        );
        return http::write_whole(out, 200, "application/json", body.as_bytes(), request.close);
    }
    http::start_events(out)?;
    http::event(
        out,
        &chat::chunk(
            &completion,
            serde_json::json!({"role": "assistant", "content": ""}),
            None,
        ),
    )?;
    for token in &tokens {
        http::event(
            out,
            &chat::chunk(&completion, serde_json::json!({"content": token}), None),
        )?;
        engine.tokens.fetch_add(1, Ordering::Relaxed);
    }
    http::event(
        out,
        &chat::chunk(&completion, serde_json::json!({}), Some(finish)),
    )?;
    http::event(out, "[DONE]")?;
    http::end_events(out)
}

/// The engine's own Prometheus series.
fn metrics(engine: &Engine) -> String {
    format!(
        "# HELP zeta_engine_requests_total Requests the Zeta engine received.\n\
         # TYPE zeta_engine_requests_total counter\n\
         zeta_engine_requests_total {}\n\
         # HELP zeta_engine_generations_total Chat completions the Zeta engine began.\n\
         # TYPE zeta_engine_generations_total counter\n\
         zeta_engine_generations_total {}\n\
         # HELP zeta_engine_tokens_total Tokens the Zeta engine generated.\n\
         # TYPE zeta_engine_tokens_total counter\n\
         zeta_engine_tokens_total {}\n",
        engine.requests.load(Ordering::Relaxed),
        engine.generations.load(Ordering::Relaxed),
        engine.tokens.load(Ordering::Relaxed),
    )
}
