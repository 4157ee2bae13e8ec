//! The `rpc` arm: tokens per second and time to first token with the default model served
//! locally, split over one RPC worker and over two, side by side in one run. The workers are
//! `1bit rpc-worker` on this machine, reached over loopback: the figures are what llama.cpp's
//! RPC protocol costs per token on the fastest link there is, before any real network.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::arms::{self, Server};
use super::client::{self, Conn};
use super::rpc_link;
use super::{READY_LIMIT, loadavg, percentile};
use crate::{Failure, Workspace};

/// The arms, in table order: how many workers hold the layers.
const WORKERS: [usize; 3] = [0, 1, 2];
const NAMES: [&str; 3] = [
    "local (cpu route)",
    "split over 1 worker",
    "split over 2 workers",
];
/// Tokens generated per request (`ignore_eos`, so every request decodes as many).
const TOKENS: usize = 64;
const PROMPT: &str =
    "Write a short story about a lighthouse keeper who finds a message in a bottle.";

/// One arm's medians.
pub struct Row {
    pub name: &'static str,
    pub ttft_ms: f64,
    pub tokens_per_s: f64,
    /// Milliseconds per generated token more than the local arm.
    pub added_ms_per_token: f64,
}

/// A `1bit rpc-worker`, stopped (SIGTERM) when dropped.
struct Worker {
    child: Child,
    endpoint: String,
}

impl Worker {
    /// Started with its link's counts kept in `traffic` (`--traffic`).
    fn start(
        ws: &Workspace,
        onebit: &Path,
        threads: usize,
        traffic: &Path,
    ) -> Result<Worker, Failure> {
        let mut child = Command::new(onebit)
            .args([
                "rpc-worker",
                "--port",
                "0",
                "--threads",
                &threads.to_string(),
            ])
            .arg("--traffic")
            .arg(traffic)
            .env("ONEBIT_LLAMA_SERVER", ws.layout.llama_server())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                Failure::new(
                    format!("cannot start 1bit rpc-worker: {e}"),
                    "check the release build",
                )
            })?;
        let out = child.stdout.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            if let Some(out) = out {
                let mut reader = BufReader::new(out);
                let _ = reader.read_line(&mut line);
                let _ = tx.send(line);
                // Drain the rest so the worker never blocks on a full pipe.
                let mut sink = String::new();
                while reader.read_line(&mut sink).unwrap_or(0) > 0 {
                    sink.clear();
                }
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
        let endpoint = line
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string);
        match endpoint {
            Some(endpoint) => Ok(Worker { child, endpoint }),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                Err(Failure::new(
                    "1bit rpc-worker did not announce itself within 60 s",
                    "run it by hand to see why",
                ))
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

/// One streamed, greedy request of [`TOKENS`] tokens: (time to first token, decode tokens/s),
/// both from the client's clock.
fn one_request(addr: SocketAddr) -> Result<(f64, f64), String> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": TOKENS,
        "ignore_eos": true,
        // Every request prefills the whole prompt: time to first token includes its prefill.
        "cache_prompt": false,
        "stream": true,
    })
    .to_string();
    let request = client::post_json(addr, "/v1/chat/completions", &body, true);
    let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
    let mut pending = Vec::new();
    let mut times: Vec<SystemTime> = Vec::new();
    let sent = SystemTime::now();
    let reply = conn
        .stream(&request, |bytes, at| {
            pending.extend_from_slice(bytes);
            while let Some(end) = client::find(&pending, b"\n\n") {
                if client::find(&pending[..end], b"\"content\":\"").is_some() {
                    times.push(at);
                }
                pending.drain(..end + 2);
            }
        })
        .map_err(|e| e.to_string())?;
    if reply.status != 200 {
        return Err(format!("status {}", reply.status));
    }
    let (Some(first), Some(last)) = (times.first(), times.last()) else {
        return Err("the stream carried no tokens".to_string());
    };
    let secs =
        |a: SystemTime, b: SystemTime| b.duration_since(a).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let decode = secs(*first, *last);
    if times.len() < 2 || decode <= 0.0 {
        return Err(format!("{} token events: too few to time", times.len()));
    }
    Ok((secs(sent, *first) * 1e3, (times.len() - 1) as f64 / decode))
}

/// Start the three arms (serve alone, serve with one worker, with two), then time requests to
/// each in turn, rotating the order every round so drift falls on every arm alike.
pub fn measure(
    ws: &Workspace,
    onebit: &Path,
    quick: bool,
    scratch: &Path,
) -> Result<Vec<Row>, Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let rounds = if quick { 3 } else { 15 };
    println!(
        "rpc: {TOKENS}-token greedy streams, local against split over 1 and 2 loopback RPC workers ({threads} threads each), {rounds} rounds"
    );
    let mut workers: Vec<Worker> = Vec::new();
    let mut servers: Vec<Server> = Vec::new();
    let mut traffic: Vec<Vec<PathBuf>> = Vec::new();
    for n in WORKERS {
        let mut list = Vec::new();
        let mut files = Vec::new();
        for w in 0..n {
            let file = scratch.join(format!("traffic-{n}-{w}.json"));
            let worker = Worker::start(ws, onebit, threads, &file)?;
            list.push(worker.endpoint.clone());
            workers.push(worker);
            files.push(file);
        }
        traffic.push(files);
        let addr = arms::free_addr()?;
        let mut command = arms::serve(onebit, &model, addr, None);
        command.args(["--ctx-size", "1024"]);
        if n > 0 {
            command.args(["--rpc", &list.join(",")]);
        }
        let mut server = Server::spawn("serve", addr, &mut command, scratch)?;
        server.wait_healthy(Instant::now(), READY_LIMIT)?;
        servers.push(server);
    }
    // One unmeasured request each: the first builds llama-server's graphs.
    for s in &servers {
        one_request(s.addr)
            .map_err(|e| Failure::new(format!("rpc warm-up: {e}"), "see the serve log"))?;
    }
    let load_before = loadavg();
    let mut ttft = [Vec::new(), Vec::new(), Vec::new()];
    let mut tps = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..rounds {
        for k in 0..WORKERS.len() {
            let arm = (round + k) % WORKERS.len();
            let (t, r) = one_request(servers[arm].addr).map_err(|e| {
                Failure::new(format!("rpc, {}: {e}", NAMES[arm]), "see the serve log")
            })?;
            ttft[arm].push(t);
            tps[arm].push(r);
        }
    }
    println!("load average before: {load_before}; after: {}", loadavg());
    println!("\nWhat a token costs each link (the workers' --traffic counts):");
    let one = rpc_link::measure(servers[1].addr, &traffic[1])?;
    rpc_link::print_costs(&one);
    let two = rpc_link::measure(servers[2].addr, &traffic[2])?;
    rpc_link::print_costs(&two);
    drop(servers);
    drop(workers);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        percentile(v, 0.5)
    };
    let medians: Vec<(f64, f64)> = (0..WORKERS.len())
        .map(|a| (median(&mut ttft[a]), median(&mut tps[a])))
        .collect();
    let local_ms = 1e3 / medians[0].1;
    let rows: Vec<Row> = medians
        .iter()
        .enumerate()
        .map(|(a, (t, r))| Row {
            name: NAMES[a],
            ttft_ms: *t,
            tokens_per_s: *r,
            added_ms_per_token: 1e3 / r - local_ms,
        })
        .collect();
    println!(
        "| arm (loopback links) | time to first token (ms) | tokens/s | ms/token over local |"
    );
    println!("|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.1} | {:.1} | {:+.2} |",
            r.name, r.ttft_ms, r.tokens_per_s, r.added_ms_per_token
        );
    }
    // The link's share on loopback, and what one worker costs beyond it (fitted on the
    // one-worker run; the two-worker run shares this machine's cores, so it checks nothing).
    let rtt_us = rpc_link::loopback_rtt_us();
    let link = |cost: &rpc_link::LinkCost| rpc_link::added_ms(&cost.generated, rtt_us / 1e3, 40.0);
    let per_worker_ms = (rows[1].added_ms_per_token - link(&one)).max(0.0);
    for (cost, row) in [(&one, &rows[1]), (&two, &rows[2])] {
        println!(
            "on loopback ({rtt_us:.1} µs round trip, taken as 40 Gbit/s), {} worker(s): the link +{:.2} ms/token, with {per_worker_ms:.2} ms per worker +{:.2}; measured {:+.2}",
            cost.workers,
            link(cost),
            link(cost) + per_worker_ms * cost.workers as f64,
            row.added_ms_per_token
        );
    }
    rpc_link::print_projection(local_ms, per_worker_ms, &one, &two);
    Ok(rows)
}

/// `results/rpc.json`: the rows, for docs/performance.md.
pub fn write(out_dir: &Path, rows: &[Row]) -> Result<(), Failure> {
    let json = serde_json::json!({
        "link": "loopback",
        "tokens": TOKENS,
        "rows": rows.iter().map(|r| serde_json::json!({
            "arm": r.name,
            "ttft_ms": r.ttft_ms,
            "tokens_per_s": r.tokens_per_s,
            "added_ms_per_token": r.added_ms_per_token,
        })).collect::<Vec<_>>(),
    });
    std::fs::create_dir_all(out_dir)
        .and_then(|_| std::fs::write(out_dir.join("rpc.json"), format!("{json:#}\n")))
        .map_err(|e| {
            Failure::new(
                format!("cannot write {}/rpc.json: {e}", out_dir.display()),
                "check the folder",
            )
        })
}
