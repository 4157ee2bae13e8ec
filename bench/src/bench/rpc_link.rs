//! What a token costs each RPC worker's link, counted by the workers' own relays (`1bit
//! rpc-worker --traffic FILE`), and what those counts project for real links. Part of `bench
//! rpc`: after its timed rounds, each split arm answers three greedy requests whose counts are
//! read around each; the differences give the round trips and bytes per generated token and
//! per prompt token, for each worker. The model (docs/rpc.md, What a link costs):
//!
//! ```text
//! ms per token = local ms per token
//!              + Σ over workers (round trips × RTT + bytes × 8 / bandwidth + per-worker cost)
//! ```
//!
//! The per-worker cost (serialising, the worker's dispatch, the relay's hop) is what the
//! one-worker loopback run measures beyond its round trips and bytes.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::client::{self, Conn};
use crate::Failure;

/// Generated tokens of the long request (the short one generates one).
const GENERATED: u64 = 33;
const SHORT_PROMPT: &str = "Name three colours.";
/// The file is rewritten every 200 ms while it changes.
const SETTLE: Duration = Duration::from_millis(600);

/// Round trips and bytes (both ways) over one worker's link, per token.
#[derive(Clone, Copy, Debug, Default)]
pub struct PerToken {
    pub round_trips: f64,
    pub bytes: f64,
}

/// One split arm's costs: per generated token and per prompt token, for each worker.
#[derive(Debug)]
pub struct LinkCost {
    pub workers: usize,
    pub generated: Vec<PerToken>,
    pub prompt: Vec<PerToken>,
    /// The counts per generated token by command, for each worker (messages, bytes).
    pub by_command: Vec<Vec<(String, f64, f64)>>,
}

/// Counts read from one worker's file.
#[derive(Clone, Debug, Default)]
struct Counts(Value);

impl Counts {
    fn read(path: &Path) -> Result<Counts, Failure> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Failure::new(
                format!("cannot read the worker's --traffic {}: {e}", path.display()),
                "see whether 1bit rpc-worker is running",
            )
        })?;
        serde_json::from_str(&text).map(Counts).map_err(|e| {
            Failure::new(
                format!("{}: not the traffic JSON ({e})", path.display()),
                "check the release build of 1bit",
            )
        })
    }

    fn total(&self, key: &str) -> f64 {
        self.0[key].as_f64().unwrap_or(0.0)
    }

    /// (round trips, bytes) since `before`.
    fn since(&self, before: &Counts) -> PerToken {
        PerToken {
            round_trips: self.total("round_trips") - before.total("round_trips"),
            bytes: self.total("bytes_up") + self.total("bytes_down")
                - before.total("bytes_up")
                - before.total("bytes_down"),
        }
    }

    /// Each command's (requests, bytes) since `before`, by name.
    fn commands_since(&self, before: &Counts) -> Vec<(String, f64, f64)> {
        let mut out = Vec::new();
        let Some(now) = self.0["commands"].as_object() else {
            return out;
        };
        for (name, c) in now {
            let was = &before.0["commands"][name];
            let get = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
            let requests = get(c, "requests") - get(was, "requests");
            let bytes = get(c, "request_bytes") + get(c, "answer_bytes")
                - get(was, "request_bytes")
                - get(was, "answer_bytes");
            if requests > 0.0 {
                out.push((name.clone(), requests, bytes));
            }
        }
        out
    }
}

fn read_all(files: &[PathBuf]) -> Result<Vec<Counts>, Failure> {
    std::thread::sleep(SETTLE);
    files.iter().map(|f| Counts::read(f)).collect()
}

/// One whole greedy chat: its prompt tokens (the reply's usage).
fn ask(addr: SocketAddr, prompt: &str, max_tokens: u64) -> Result<u64, Failure> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "cache_prompt": false,
    })
    .to_string();
    let request = client::post_json(addr, "/v1/chat/completions", &body, true);
    let failed = |e: String| Failure::new(format!("rpc traffic: {e}"), "see the serve log");
    let mut conn = Conn::open(addr).map_err(|e| failed(e.to_string()))?;
    let mut reply = Vec::new();
    let head = conn
        .stream(&request, |bytes, _| reply.extend_from_slice(bytes))
        .map_err(|e| failed(e.to_string()))?;
    let value: Value = serde_json::from_slice(&reply).unwrap_or(Value::Null);
    let (Some(prompt_tokens), Some(completion)) = (
        value["usage"]["prompt_tokens"].as_u64(),
        value["usage"]["completion_tokens"].as_u64(),
    ) else {
        return Err(failed(format!(
            "status {}: no usage in the reply",
            head.status
        )));
    };
    if completion != max_tokens {
        return Err(failed(format!(
            "{completion} tokens generated, {max_tokens} asked"
        )));
    }
    Ok(prompt_tokens)
}

/// The costs of the arm served at `addr`, whose workers keep their counts in `files`.
pub fn measure(addr: SocketAddr, files: &[PathBuf]) -> Result<LinkCost, Failure> {
    let long_prompt = SHORT_PROMPT.repeat(24);
    let at_start = read_all(files)?;
    let short_tokens = ask(addr, SHORT_PROMPT, 1)?;
    let after_short = read_all(files)?;
    ask(addr, SHORT_PROMPT, 1 + GENERATED)?;
    let after_generated = read_all(files)?;
    let long_tokens = ask(addr, &long_prompt, 1)?;
    let after_long = read_all(files)?;
    let extra_prompt = long_tokens.saturating_sub(short_tokens).max(1) as f64;
    let per = |t: PerToken, n: f64| PerToken {
        round_trips: t.round_trips / n,
        bytes: t.bytes / n,
    };
    let mut cost = LinkCost {
        workers: files.len(),
        generated: Vec::new(),
        prompt: Vec::new(),
        by_command: Vec::new(),
    };
    for w in 0..files.len() {
        let short = after_short[w].since(&at_start[w]);
        let generated = after_generated[w].since(&after_short[w]);
        let long = after_long[w].since(&after_generated[w]);
        // The long request's one token is the short one's; the rest is its longer prompt.
        let more = PerToken {
            round_trips: generated.round_trips - short.round_trips,
            bytes: generated.bytes - short.bytes,
        };
        cost.generated.push(per(more, GENERATED as f64));
        let prompt = PerToken {
            round_trips: long.round_trips - short.round_trips,
            bytes: long.bytes - short.bytes,
        };
        cost.prompt.push(per(prompt, extra_prompt));
        // The long request's commands less the short one's, per extra token.
        let short_commands = after_short[w].commands_since(&at_start[w]);
        let by_command = after_generated[w]
            .commands_since(&after_short[w])
            .into_iter()
            .map(|(name, requests, bytes)| {
                let (r0, b0) = short_commands
                    .iter()
                    .find(|c| c.0 == name)
                    .map_or((0.0, 0.0), |c| (c.1, c.2));
                let per = GENERATED as f64;
                (name, (requests - r0) / per, (bytes - b0) / per)
            })
            .filter(|c| c.1.abs() > 0.01 || c.2.abs() > 1.0)
            .collect();
        cost.by_command.push(by_command);
    }
    Ok(cost)
}

/// The round trip of a one-byte TCP ping-pong over loopback, median of 2,000 (µs): what one
/// RPC round trip costs on the benchmark's links before any software.
pub fn loopback_rtt_us() -> f64 {
    let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
        return f64::NAN;
    };
    let Ok(addr) = listener.local_addr() else {
        return f64::NAN;
    };
    let echo = std::thread::spawn(move || {
        use std::io::{Read, Write};
        if let Ok((mut s, _)) = listener.accept() {
            let _ = s.set_nodelay(true);
            let mut b = [0u8; 1];
            while s.read_exact(&mut b).is_ok() && s.write_all(&b).is_ok() {}
        }
    });
    let mut times = Vec::new();
    if let Ok(mut s) = TcpStream::connect(addr) {
        use std::io::{Read, Write};
        let _ = s.set_nodelay(true);
        let mut b = [0u8; 1];
        for _ in 0..2_000 {
            let t = Instant::now();
            if s.write_all(&b).is_err() || s.read_exact(&mut b).is_err() {
                break;
            }
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let _ = echo.join();
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Milliseconds per token the link adds over local for `costs` (one entry per worker) on a
/// link of `rtt_ms` and `gbit_s`, before the per-worker cost.
pub fn added_ms(costs: &[PerToken], rtt_ms: f64, gbit_s: f64) -> f64 {
    costs
        .iter()
        .map(|c| c.round_trips * rtt_ms + c.bytes * 8.0 / (gbit_s * 1e9) * 1e3)
        .sum()
}

/// The projection table: tokens/s for 1, 2 and 4 workers on each link, from the local rate,
/// the measured costs (4 workers: the two-worker arm's mean worker, four times) and
/// `per_worker_ms` each.
pub fn print_projection(local_ms: f64, per_worker_ms: f64, one: &LinkCost, two: &LinkCost) {
    let mean = |c: &LinkCost| {
        let n = c.generated.len().max(1) as f64;
        PerToken {
            round_trips: c.generated.iter().map(|p| p.round_trips).sum::<f64>() / n,
            bytes: c.generated.iter().map(|p| p.bytes).sum::<f64>() / n,
        }
    };
    let four = vec![mean(two); 4];
    let arms: [(&str, &[PerToken]); 3] = [
        ("1 worker", &one.generated),
        ("2 workers", &two.generated),
        ("4 workers", &four),
    ];
    println!(
        "\nProjected decode tokens/s (local compute {local_ms:.2} ms/token, plus per worker its round trips and bytes on the link and {per_worker_ms:.2} ms):"
    );
    print!("| workers |");
    let links = [(1.0, "1 GbE"), (10.0, "10 GbE"), (25.0, "25 GbE")];
    let rtts = [0.1, 0.5];
    for (_, name) in links {
        for rtt in rtts {
            print!(" {name}, {rtt} ms |");
        }
    }
    println!();
    println!("|---|{}", "---:|".repeat(links.len() * rtts.len()));
    for (name, costs) in arms {
        print!("| {name} |");
        for (gbit, _) in links {
            for rtt in rtts {
                let ms = local_ms + added_ms(costs, rtt, gbit) + per_worker_ms * costs.len() as f64;
                print!(" {:.1} |", 1e3 / ms);
            }
        }
        println!();
    }
}

/// Print one arm's costs, per worker and by command.
pub fn print_costs(cost: &LinkCost) {
    for w in 0..cost.workers {
        let g = cost.generated[w];
        let p = cost.prompt[w];
        println!(
            "  {} worker(s), worker {}: per generated token {:.1} round trips, {:.0} bytes; per prompt token {:.2} round trips, {:.0} bytes",
            cost.workers,
            w + 1,
            g.round_trips,
            g.bytes,
            p.round_trips,
            p.bytes
        );
        let mut commands = cost.by_command[w].clone();
        commands.sort_by(|a, b| b.2.total_cmp(&a.2));
        let listed: Vec<String> = commands
            .iter()
            .map(|(name, n, b)| format!("{name} {n:.1}× {b:.0} B"))
            .collect();
        println!("    by command, per generated token: {}", listed.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_adds_round_trips_and_bytes_per_worker() {
        let w = PerToken {
            round_trips: 10.0,
            bytes: 125_000.0,
        };
        // 10 × 0.1 ms, plus 1 Mbit over 1 Gbit/s = 1 ms.
        assert!((added_ms(&[w], 0.1, 1.0) - 2.0).abs() < 1e-9);
        assert!((added_ms(&[w, w], 0.1, 1.0) - 4.0).abs() < 1e-9);
    }
}
