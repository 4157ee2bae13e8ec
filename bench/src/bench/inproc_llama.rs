//! `cargo xtask bench inproc-llama [--quick]`: time to first token and decode tokens/s of the
//! default model through the inproc add-on (in process), through `--device cpu` (serve relaying
//! to llama-server) and on llama-server directly: the three run side by side and take turns
//! request by request; and serve's resident memory split into the model's and the rest.
//! Release builds.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use super::arms::vm_rss_kib;
use crate::{Failure, Prepare, Workspace, process};

/// The prompts, each completed greedily and streamed.
const PROMPTS: [&str; 5] = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
];

/// New tokens per request.
const MAX_TOKENS: u32 = 64;

/// A child killed when dropped.
pub(super) struct Running(pub(super) Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One arm's medians.
struct Figures {
    ttft_ms: f64,
    decode_tps: f64,
}

/// Run the three arms; `quick` makes one pass over the prompts, else five.
pub fn run(ws: &Workspace, prep: &dyn Prepare, quick: bool) -> Result<ExitCode, Failure> {
    let passes = if quick { 1 } else { 5 };
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
    let library = prep.addon(ws, true)?;
    let scratch =
        std::env::temp_dir().join(format!("onebit-bench-inproc-llama-{}", std::process::id()));
    let plugins = scratch.join("plugins");
    std::fs::create_dir_all(&plugins).map_err(|e| Failure::new(e, "check /tmp"))?;
    std::fs::copy(&library, plugins.join("libonebit_route_inproc.so"))
        .map_err(|e| Failure::new(e, "check /tmp"))?;
    let model = ws.layout.model(ws.pins.default_model());
    let onebit = ws.root.join("target/release/1bit");
    let llama_server = ws.layout.llama_server();

    let mut rows = Vec::new();
    let mut concurrent = Vec::new();
    let mut resident = Vec::new();
    let mut beyond = None;
    for parallel in [1, STREAMS] {
        // The three arms run side by side and take turns request by request (the order
        // rotating each round), so a slow spell of the shared VM falls on all three alike.
        let mut running = Vec::new();
        for arm in ARMS {
            let port = free_port()?;
            let mut command = arm_command(arm, parallel, port, &model, &onebit, &llama_server);
            if arm != ARMS[0] {
                command
                    .arg("--plugin-dir")
                    .arg(&plugins)
                    .env("ONEBIT_STATE_DIR", &scratch)
                    .env("ONEBIT_INPROC_LIB_DIR", ws.layout.lib_dir());
            }
            let child = command
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| Failure::new(format!("cannot start {arm}: {e}"), "run setup"))?;
            let pid = child.id();
            running.push((arm, port, pid, Running(child)));
        }
        for (arm, port, _, _) in &running {
            wait_ready(*port, arm)?;
            // Warm up: one request, not counted.
            stream(*port, PROMPTS[0], arm)?;
        }
        let turns = |round: usize| {
            let n = running.len();
            (0..n).map(move |i| (i + round) % n)
        };
        if parallel > 1 {
            let mut rates = vec![Vec::new(); running.len()];
            for round in 0..passes {
                for i in turns(round) {
                    let (arm, port, _, _) = running[i];
                    settle();
                    let timed: Vec<Result<Timed, Failure>> = std::thread::scope(|s| {
                        let streams: Vec<_> = PROMPTS[..STREAMS]
                            .iter()
                            .map(|p| s.spawn(move || stream(port, p, arm)))
                            .collect();
                        streams
                            .into_iter()
                            .map(|t| t.join().expect("a stream thread"))
                            .collect()
                    });
                    let timed = timed.into_iter().collect::<Result<Vec<_>, _>>()?;
                    let begin = timed.iter().map(|t| t.first).min().expect("streams ran");
                    let end = timed.iter().map(|t| t.last).max().expect("streams ran");
                    let tokens: u32 = timed.iter().map(|t| t.tokens).sum();
                    rates[i].push(f64::from(tokens) / end.duration_since(begin).as_secs_f64());
                }
            }
            for ((arm, _, _, _), mut rates) in running.iter().zip(rates) {
                concurrent.push((*arm, median(&mut rates)));
            }
            continue;
        }
        let mut ttft = vec![Vec::new(); running.len()];
        let mut tps = vec![Vec::new(); running.len()];
        let mut round = 0;
        for _ in 0..passes {
            for prompt in PROMPTS {
                for i in turns(round) {
                    let (arm, port, _, _) = running[i];
                    settle();
                    let timed = stream(port, prompt, arm)?;
                    ttft[i].push(timed.ttft_ms);
                    tps[i].push(timed.decode_tps);
                }
                round += 1;
            }
        }
        for (i, (arm, port, pid, _)) in running.iter().enumerate() {
            rows.push((
                *arm,
                Figures {
                    ttft_ms: median(&mut ttft[i]),
                    decode_tps: median(&mut tps[i]),
                },
            ));
            let rss = vm_rss_kib(*pid).unwrap_or(0);
            if *arm == "--device inproc" {
                beyond = Some(beyond_the_model(*port, rss)?);
            }
            resident.push((*arm, rss));
        }
    }
    let direct_tps = rows[0].1.decode_tps;
    let direct_ttft = rows[0].1.ttft_ms;
    println!(
        "\nSmolLM2-135M Q4_1, greedy, {MAX_TOKENS} new tokens, {} requests per arm (medians):",
        passes * PROMPTS.len()
    );
    println!("| arm | TTFT ms | decode tok/s | decode vs direct | TTFT vs direct |");
    println!("|---|---:|---:|---:|---:|");
    for (arm, f) in &rows {
        println!(
            "| {arm} | {:.1} | {:.1} | {:.3} | {:.2} |",
            f.ttft_ms,
            f.decode_tps,
            f.decode_tps / direct_tps,
            f.ttft_ms / direct_ttft
        );
    }
    let direct = concurrent[0].1;
    println!(
        "\n{STREAMS} concurrent streams ({STREAMS} slots: -np / --parallel {STREAMS}), aggregate decode tok/s = all streams' tokens over the time from the first token to the last (median of {passes}):"
    );
    println!("| arm | aggregate tok/s | vs direct |");
    println!("|---|---:|---:|");
    for (arm, rate) in &concurrent {
        println!("| {arm} | {rate:.1} | {:.3} |", rate / direct);
    }
    println!(
        "\nResident memory after the single-slot runs (VmRSS of the process the client talks to; for --device cpu that is serve alone, its llama-server apart):"
    );
    println!("| arm | VmRSS MiB |");
    println!("|---|---:|");
    for (arm, kib) in &resident {
        println!("| {arm} | {:.1} |", mib(*kib));
    }
    if let Some(b) = beyond {
        println!(
            "\nserve with the inproc route: VmRSS {:.1} MiB = the model's own allocations {:.1} MiB (the mapped GGUF's resident pages, and the anonymous memory that loading it, making its context and the warm-up decode added; llama.cpp's buffers: {}) + everything else {:.1} MiB (serve, the add-on, llama.cpp's code, and what the requests added; target: at most 20 MiB)",
            mib(b.rss_kib),
            mib(b.model_kib),
            b.buffers,
            mib(b.rss_kib.saturating_sub(b.model_kib))
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// serve's resident memory and the part of it that is the model's own.
struct Beyond {
    rss_kib: u64,
    /// `onebit_inproc_model_resident_bytes`: the mapped GGUF's resident pages and the anonymous
    /// memory the model's load, its context and the warm-up added, measured by the add-on.
    model_kib: u64,
    /// llama.cpp's buffers as it reported them: `model 92.1 MiB, kv 45.0 MiB, ...`.
    buffers: String,
}

/// Read the model's part from the inproc route's /metrics. Whatever the requests added later
/// (the compute buffer's pages a longer prompt first touched, say) counts as the rest, so the
/// rest may be overstated, never understated.
fn beyond_the_model(port: u16, rss_kib: u64) -> Result<Beyond, Failure> {
    let (status, metrics) = super::inproc::get(port, "/metrics");
    if status != 200 {
        return Err(Failure::new(
            format!("GET /metrics of the inproc arm answered {status}"),
            "run the arm by hand",
        ));
    }
    let gauge = |line: &str, name: &str| {
        line.strip_prefix(name)
            .and_then(|rest| rest.trim().parse::<u64>().ok())
    };
    let model = metrics
        .lines()
        .find_map(|l| gauge(l, "onebit_inproc_model_resident_bytes "))
        .ok_or_else(|| {
            Failure::new(
                "the inproc route reported no onebit_inproc_model_resident_bytes in /metrics",
                "rebuild the add-on (cargo xtask addon --release)",
            )
        })?;
    let buffers: Vec<String> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("onebit_inproc_model_buffer_bytes{buffer=\""))
        .filter_map(|l| {
            let (kind, value) = l.split_once("\"} ")?;
            let bytes: u64 = value.trim().parse().ok()?;
            Some(format!("{kind} {:.1} MiB", bytes as f64 / 1048576.0))
        })
        .collect();
    Ok(Beyond {
        rss_kib,
        model_kib: model / 1024,
        buffers: buffers.join(", "),
    })
}

/// Concurrent streams in the second part (and slots of every arm there).
const STREAMS: usize = 4;

/// The arms, llama-server direct first (the others are compared with it).
const ARMS: [&str; 3] = ["llama-server direct", "--device cpu", "--device inproc"];

/// How an arm starts, with `parallel` slots on `port`.
fn arm_command(
    arm: &str,
    parallel: usize,
    port: u16,
    model: &std::path::Path,
    onebit: &std::path::Path,
    llama_server: &std::path::Path,
) -> Command {
    let (port, slots) = (port.to_string(), parallel.to_string());
    if arm == ARMS[0] {
        let mut c = Command::new(llama_server);
        c.arg("-m").arg(model).args([
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--ctx-size",
            "2048",
            "-ngl",
            "0",
            "--jinja",
            "-np",
            &slots,
        ]);
        return c;
    }
    let mut c = Command::new(onebit);
    c.arg("serve").arg("-m").arg(model).args([
        "--port",
        &port,
        "--ctx-size",
        "2048",
        "--device",
        arm.trim_start_matches("--device "),
        "--parallel",
        &slots,
        "--llama-server",
    ]);
    c.arg(llama_server);
    c
}

/// A pause before each timed request, so the threads of the arm that ran last have stopped
/// spinning (ggml's workers poll for a while after a decode) and idle the cores.
pub(super) fn settle() {
    std::thread::sleep(Duration::from_millis(30));
}

/// One streamed completion's timings.
struct Timed {
    ttft_ms: f64,
    decode_tps: f64,
    tokens: u32,
    first: Instant,
    last: Instant,
}

pub(super) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub(super) fn free_port() -> Result<u16, Failure> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Failure::new(e, "no free loopback port"))
}

pub(super) fn wait_ready(port: u16, arm: &str) -> Result<(), Failure> {
    let began = Instant::now();
    loop {
        let ok = TcpStream::connect(("127.0.0.1", port)).and_then(|mut tcp| {
            tcp.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
            let mut head = [0u8; 12];
            tcp.read_exact(&mut head)?;
            Ok(&head[9..12] == b"200")
        });
        if ok.unwrap_or(false) {
            return Ok(());
        }
        if began.elapsed() > Duration::from_secs(120) {
            return Err(Failure::new(
                format!("{arm} did not become ready"),
                "run it by hand to see why",
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One streamed completion: time to the first event with text, tokens/s over the events after
/// it, and when the first and last came. Each SSE event with text counts as one token, as
/// llama-server sends one per token.
fn stream(port: u16, prompt: &str, arm: &str) -> Result<Timed, Failure> {
    let body = serde_json::json!({
        "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": true,
        // Every request decodes its whole prompt in every arm: llama-server and the add-on
        // would otherwise restore earlier requests' states from their prompt caches in RAM,
        // and TTFT would compare caches, not the hop.
        "cache_prompt": false,
    })
    .to_string();
    let broke = |e: std::io::Error| {
        Failure::new(
            format!("{arm}: a streamed request failed: {e}"),
            "run the arm by hand",
        )
    };
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).map_err(broke)?;
    tcp.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(broke)?;
    let sent = Instant::now();
    write!(
        tcp,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(broke)?;
    let mut reader = BufReader::new(tcp);
    let mut line = String::new();
    // The head.
    let mut status = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).map_err(broke)? == 0 || line == "\r\n" {
            break;
        }
        if status.is_empty() {
            status = line.trim().to_string();
        }
    }
    let mut first: Option<Instant> = None;
    let mut last = sent;
    let mut tokens = 0u32;
    let mut pending = Vec::new();
    // Chunked transfer: a size line, that many bytes, CRLF; events are split into lines here.
    loop {
        line.clear();
        if reader.read_line(&mut line).map_err(broke)? == 0 {
            break;
        }
        let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let mut chunk = vec![0u8; size + 2];
        reader.read_exact(&mut chunk).map_err(broke)?;
        pending.extend_from_slice(&chunk[..size]);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let event: Vec<u8> = pending.drain(..=end).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            let has_text = serde_json::from_str::<serde_json::Value>(data)
                .ok()
                .and_then(|v| v["choices"][0]["text"].as_str().map(|t| !t.is_empty()))
                .unwrap_or(false);
            if has_text {
                let now = Instant::now();
                first.get_or_insert(now);
                last = now;
                tokens += 1;
            }
        }
    }
    let first = first.ok_or_else(|| {
        Failure::new(
            format!("{arm}: a stream of {prompt:?} carried no text ({status}; {tokens} events with text)"),
            "run the arm by hand",
        )
    })?;
    let ttft = first.duration_since(sent).as_secs_f64() * 1000.0;
    let decode = last.duration_since(first).as_secs_f64();
    let rate = if decode > 0.0 {
        f64::from(tokens - 1) / decode
    } else {
        0.0
    };
    Ok(Timed {
        ttft_ms: ttft,
        decode_tps: rate,
        tokens,
        first,
        last,
    })
}
