//! The client side of `cargo xtask bench`'s parts: the hop's latencies, throughput under 64
//! clients, the SSE events' delays and start-up, each measured against every arm.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::arms::{self, Server};
use super::client::{self, Conn};
use super::{
    ARMS, Binaries, CLIENTS, Options, READY_LIMIT, SSE_EVENTS, SSE_INTERVAL_MS, TOKENIZE,
    all_healthy, percentile,
};
use crate::{Failure, Workspace};

/// Per-request latencies (µs) of the hop, per arm: direct, serve, nginx, and the baseline
/// serve (empty without `--baseline`).
#[derive(Default)]
pub(super) struct Hop {
    pub(super) keep_alive: [Vec<f64>; 4],
    pub(super) new_connection: [Vec<f64>; 4],
    /// Keep-alive connections the server closed, per arm (the next request reconnects).
    pub(super) reconnects: [u64; 4],
}

impl Hop {
    pub(super) fn keep_alive_block(
        &mut self,
        arm: usize,
        addr: SocketAddr,
        conn: &mut Option<Conn>,
        n: usize,
    ) -> Result<(), String> {
        let request = client::post_json(addr, "/tokenize", TOKENIZE, false);
        for _ in 0..n {
            let began = Instant::now();
            let c = match conn {
                Some(c) => c,
                None => conn.insert(Conn::open(addr).map_err(|e| e.to_string())?),
            };
            let reply = c.exchange(&request).map_err(|e| e.to_string())?;
            let micros = began.elapsed().as_secs_f64() * 1e6;
            check_ok(reply.status)?;
            if reply.close {
                *conn = None;
                self.reconnects[arm] += 1;
            }
            self.keep_alive[arm].push(micros);
        }
        Ok(())
    }

    /// Connect, ask with `Connection: close`, read the reply: what a client without a pool pays.
    pub(super) fn new_connection_block(
        &mut self,
        arm: usize,
        addr: SocketAddr,
        n: usize,
    ) -> Result<(), String> {
        let request = client::post_json(addr, "/tokenize", TOKENIZE, true);
        for _ in 0..n {
            let began = Instant::now();
            let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
            let reply = conn.exchange(&request).map_err(|e| e.to_string())?;
            let micros = began.elapsed().as_secs_f64() * 1e6;
            check_ok(reply.status)?;
            self.new_connection[arm].push(micros);
        }
        Ok(())
    }
}

fn check_ok(status: u16) -> Result<(), String> {
    if status == 200 {
        Ok(())
    } else {
        Err(format!("/tokenize answered {status}"))
    }
}

pub(super) struct Load {
    pub(super) requests: u64,
    pub(super) seconds: f64,
    pub(super) peak_rss_kib: u64,
}

/// `CLIENTS` threads, each with its own keep-alive connection, asking /tokenize back to back
/// for `duration`; samples `watch`'s VmRSS every 50 ms meanwhile.
pub(super) fn throughput(
    addr: SocketAddr,
    duration: Duration,
    watch: Option<u32>,
) -> Result<Load, String> {
    let request = client::post_json(addr, "/tokenize", TOKENIZE, false);
    let done = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let start = Barrier::new(CLIENTS + 1);
    let peak = AtomicU64::new(0);
    let error = std::sync::Mutex::new(None::<String>);
    let seconds = std::thread::scope(|scope| {
        for _ in 0..CLIENTS {
            scope.spawn(|| {
                let conn = Conn::open(addr);
                start.wait();
                let mut conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                        return;
                    }
                };
                let mut n = 0;
                while !done.load(Ordering::Relaxed) {
                    match conn.exchange(&request) {
                        Ok(reply) if reply.status == 200 => {
                            n += 1;
                            if reply.close {
                                match Conn::open(addr) {
                                    Ok(c) => conn = c,
                                    Err(_) => break,
                                }
                            }
                        }
                        Ok(reply) => {
                            *error.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("/tokenize answered {} under load", reply.status));
                            break;
                        }
                        Err(e) => {
                            *error.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(format!("under load: {e}"));
                            break;
                        }
                    }
                }
                count.fetch_add(n, Ordering::Relaxed);
            });
        }
        start.wait();
        let began = Instant::now();
        while began.elapsed() < duration {
            if let Some(kib) = watch.and_then(arms::vm_rss_kib) {
                peak.fetch_max(kib, Ordering::Relaxed);
            }
            std::thread::sleep(
                Duration::from_millis(50).min(duration.saturating_sub(began.elapsed())),
            );
        }
        if let Some(kib) = watch.and_then(arms::vm_rss_kib) {
            peak.fetch_max(kib, Ordering::Relaxed);
        }
        done.store(true, Ordering::Relaxed);
        began.elapsed().as_secs_f64()
    });
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(Load {
        requests: count.into_inner(),
        seconds,
        peak_rss_kib: peak.into_inner(),
    })
}

/// Per-event delays (µs) at the client, and events that arrived only after the next was sent.
#[derive(Default)]
pub(super) struct Sse {
    pub(super) delays: [Vec<f64>; 3],
    pub(super) held: [u64; 3],
    /// How late each held-back event arrived (µs after it was sent), per arm.
    pub(super) held_late_us: [Vec<f64>; 3],
    /// Consecutive events the fake sent at least half an interval apart, per arm.
    pub(super) paced: [u64; 3],
    pub(super) streams: usize,
}

/// ", arriving 2.4, 4.0 ms late" for held-back events (µs given), or nothing.
pub(super) fn late_ms(late_us: &[f64]) -> String {
    if late_us.is_empty() {
        return String::new();
    }
    let list: Vec<String> = late_us
        .iter()
        .map(|us| format!("{:.1}", us / 1e3))
        .collect();
    format!(", arriving {} ms late", list.join(", "))
}

/// The SSE part: the fake backend alone, serve in front of another, nginx in front of the first.
pub(super) fn sse(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
) -> Result<Sse, Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    let nginx_bin = arms::nginx_binary()?;
    let pace = |command: &mut Command| {
        command
            .env("FAKE_SSE_EVENTS", SSE_EVENTS.to_string())
            .env("FAKE_SSE_INTERVAL_MS", SSE_INTERVAL_MS.to_string());
    };
    let began = Instant::now();
    let direct_addr = arms::free_addr()?;
    let mut command = Command::new(&bins.fake);
    command.arg("-m").arg(&model).args([
        "--host",
        "127.0.0.1",
        "--port",
        &direct_addr.port().to_string(),
    ]);
    pace(&mut command);
    let mut direct = Server::spawn("fake-backend", direct_addr, &mut command, scratch)?;
    let serve_addr = arms::free_addr()?;
    let mut command = arms::serve(&bins.onebit, &model, serve_addr, Some(&bins.fake));
    pace(&mut command);
    let mut serve = Server::spawn("1bit serve (fake)", serve_addr, &mut command, scratch)?;
    let nginx_addr = arms::free_addr()?;
    let mut nginx = Server::spawn(
        "nginx (fake)",
        nginx_addr,
        &mut arms::nginx(&nginx_bin, scratch, nginx_addr, direct_addr)?,
        scratch,
    )?;
    all_healthy(&mut [&mut direct, &mut serve, &mut nginx], began)?;
    let servers = [&direct, &serve, &nginx];
    let rounds = if options.quick { 2 } else { 6 };
    println!(
        "sse: {rounds} streams per arm of {SSE_EVENTS} events {SSE_INTERVAL_MS} ms apart (after one warm-up)"
    );
    let mut found = Sse {
        streams: rounds,
        ..Sse::default()
    };
    for round in 0..=rounds {
        for k in 0..3 {
            let arm = (round + k) % 3;
            let events = stream_events(servers[arm].addr).map_err(|e| servers[arm].failure(e))?;
            if round == 0 {
                continue;
            }
            for pair in events.windows(2) {
                // Only pairs the fake really sent apart: a fake that wakes late sends the
                // overdue chunks back to back, and those arrive together through any arm.
                if pair[1].sent_ns.saturating_sub(pair[0].sent_ns) < SSE_INTERVAL_MS * 500_000 {
                    continue;
                }
                found.paced[arm] += 1;
                // Received no earlier than the next one was sent: held back or coalesced.
                if pair[0].received_ns >= pair[1].sent_ns {
                    found.held[arm] += 1;
                    found.held_late_us[arm]
                        .push(pair[0].received_ns.saturating_sub(pair[0].sent_ns) as f64 / 1e3);
                }
            }
            found.delays[arm].extend(
                events
                    .iter()
                    .map(|e| (e.received_ns as f64 - e.sent_ns as f64) / 1e3),
            );
        }
    }
    for delays in &mut found.delays {
        delays.sort_by(f64::total_cmp);
    }
    Ok(found)
}

struct Event {
    pub(super) sent_ns: u64,
    pub(super) received_ns: u64,
}

/// One streamed chat completion: its content events (`fake_seq` below `SSE_EVENTS`), with
/// `fake_sent_ns` and the receipt time, in order of `fake_seq`.
fn stream_events(addr: SocketAddr) -> Result<Vec<Event>, String> {
    let body = r#"{"messages":[{"role":"user","content":"hello"}],"stream":true}"#;
    let request = client::post_json(addr, "/v1/chat/completions", body, true);
    let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
    let mut pending = Vec::new();
    let mut events = Vec::new();
    let reply = conn
        .stream(&request, |bytes, at: SystemTime| {
            pending.extend_from_slice(bytes);
            while let Some(end) = client::find(&pending, b"\n\n") {
                let event = &pending[..end];
                // The paced content chunks only: the closing events follow the last at once.
                if let (Some(seq), Some(sent_ns)) = (
                    number_after(event, b"\"fake_seq\":"),
                    number_after(event, b"\"fake_sent_ns\":"),
                ) && seq < SSE_EVENTS as u64
                {
                    events.push((
                        seq,
                        Event {
                            sent_ns,
                            received_ns: client::unix_ns(at),
                        },
                    ));
                }
                pending.drain(..end + 2);
            }
        })
        .map_err(|e| e.to_string())?;
    check_ok(reply.status)?;
    if events.len() != SSE_EVENTS {
        return Err(format!(
            "the stream carried {} timestamped content events, expected {SSE_EVENTS}",
            events.len()
        ));
    }
    events.sort_by_key(|(seq, _)| *seq);
    Ok(events.into_iter().map(|(_, e)| e).collect())
}

fn number_after(text: &[u8], key: &[u8]) -> Option<u64> {
    let at = client::find(text, key)? + key.len();
    let digits: &[u8] = &text[at..];
    let end = digits
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

/// Launch to `/health` 200: llama-server alone against serve (with its llama-server), same
/// model and flags, alternating, after one unmeasured start of each. Returns the median start
/// of each (ms) and the median of what serve added.
pub(super) fn startup(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
) -> Result<([f64; 2], f64), Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    // Eleven: llama-server's own start varies by ±50 ms on a busy 2-core VM.
    let rounds = if options.quick { 2 } else { 11 };
    println!("startup: launch to /health 200, {rounds} runs each (after one warm-up)");
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..=rounds {
        for k in 0..2 {
            let arm = (round + k) % 2;
            let addr = arms::free_addr()?;
            let mut command = if arm == 0 {
                arms::llama_server(&bins.llama_server, &model, addr)
            } else {
                arms::serve(&bins.onebit, &model, addr, None)
            };
            let began = Instant::now();
            let mut server = Server::spawn(ARMS[arm], addr, &mut command, scratch)?;
            let ready = server.wait_healthy(began, READY_LIMIT)?;
            drop(server);
            if round > 0 {
                times[arm].push(ready.as_secs_f64() * 1e3);
            }
        }
    }
    // What serve adds: the median of each round's two starts' difference, which drift between
    // rounds (llama-server's own start varies by ±50 ms here) cancels out of.
    let mut added: Vec<f64> = times[1].iter().zip(&times[0]).map(|(s, d)| s - d).collect();
    added.sort_by(f64::total_cmp);
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    Ok((
        [percentile(&times[0], 0.5), percentile(&times[1], 0.5)],
        percentile(&added, 0.5),
    ))
}
