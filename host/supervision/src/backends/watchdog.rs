//! The progress watchdog: notices a backend whose main loop stopped (a hung GPU dispatch) while
//! its HTTP thread still answers `/health`, so serve can kill it and exit.
//!
//! Every forwarded inference request holds a [`Ticket`]. Progress is a byte from the backend on
//! that request (the relayed body stamps the ticket's clock: one atomic store per frame) or the
//! backend's main loop answering its progress route (`/slots`), asked only while requests are
//! in flight. A request with no progress for the limit (plus, before its first byte, its
//! prompt's allowance) means the backend is hung.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio::sync::mpsc::UnboundedSender;

use crate::backends::health::ProbeClient as BackendClient;
use crate::backends::supervisor::Event;

/// The default limit, when neither `--watchdog` nor `ONEBIT_WATCHDOG_SECS` says otherwise.
pub const DEFAULT_LIMIT_SECS: u64 = 120;
/// The default prompt pace allowed before a request's first byte, in tokens per second.
pub const DEFAULT_PROMPT_TPS: f64 = 50.0;
/// How often in-flight requests are judged.
const JUDGE_EVERY: Duration = Duration::from_millis(250);

/// `--watchdog`, else `ONEBIT_WATCHDOG_SECS`, else 120; 0 turns the watchdog off.
pub fn limit_secs(flag: Option<u64>, env: Option<&str>) -> u64 {
    flag.or_else(|| env.and_then(|v| v.trim().parse().ok()))
        .unwrap_or(DEFAULT_LIMIT_SECS)
}

/// One backend as the watchdog reports and polls it.
#[derive(Clone, Debug)]
pub struct Watched {
    pub port: u16,
    pub pid: u32,
    /// Its progress route (`/slots`), None when it has none: then only streamed requests on it
    /// are judged.
    pub progress_path: Option<String>,
}

/// The watchdog of one serve: shared by the relay (tickets) and its own tasks.
pub struct Watchdog {
    limit: Duration,
    prompt_tps: f64,
    device: String,
    backends: Vec<Watched>,
    epoch: Instant,
    /// Per backend: when its progress route last answered (ms since `epoch`; 0 never).
    loop_alive_ms: Vec<AtomicU64>,
    /// Per backend: its progress route answered 404 or 501 (llama-server `--no-slots`), so
    /// it is judged as a backend without one.
    loop_missing: Vec<AtomicBool>,
    next_id: AtomicU64,
    in_flight: Mutex<HashMap<u64, Arc<Tracked>>>,
}

/// One tracked request.
struct Tracked {
    method: String,
    path: String,
    streamed: bool,
    backend: usize,
    started_ms: u64,
    /// Extra time before the first byte: prompt tokens / prompt tps.
    allowance: Duration,
    /// When the backend last sent something on it, the reply's head included (ms since
    /// `epoch`; 0 nothing yet).
    last_byte_ms: AtomicU64,
    bytes: AtomicU64,
}

/// A request's place in the watchdog; dropping it (the reply is over, or the client left)
/// stops tracking it.
pub struct Ticket {
    id: u64,
    tracked: Arc<Tracked>,
    dog: Arc<Watchdog>,
}

impl Ticket {
    /// Bytes arrived from the backend (0 for the reply's head): the request made progress.
    /// Called by the relayed body per frame on the hot path: two relaxed atomics, no lock.
    /// The prompt allowance lasts until the first body byte.
    pub fn progress(&self, bytes: usize) {
        self.tracked
            .last_byte_ms
            .store(self.dog.now_ms().max(1), Ordering::Relaxed);
        self.tracked
            .bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Ok(mut map) = self.dog.in_flight.lock() {
            map.remove(&self.id);
        }
    }
}

/// What the watchdog found: the first line of its report.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub backend: usize,
    pub line: String,
}

impl Watchdog {
    /// A watchdog with this limit (non-zero) over these backends.
    pub fn new(limit: Duration, prompt_tps: f64, device: &str, backends: Vec<Watched>) -> Self {
        Watchdog {
            limit,
            prompt_tps: if prompt_tps > 0.0 {
                prompt_tps
            } else {
                DEFAULT_PROMPT_TPS
            },
            device: device.to_string(),
            loop_alive_ms: backends.iter().map(|_| AtomicU64::new(0)).collect(),
            loop_missing: backends.iter().map(|_| AtomicBool::new(false)).collect(),
            backends,
            epoch: Instant::now(),
            next_id: AtomicU64::new(1),
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Start tracking an inference request about to be sent to `backend`. Called by the relay
    /// on an async thread, once per request (one short lock).
    pub fn track(
        self: &Arc<Self>,
        method: &str,
        path: &str,
        streamed: bool,
        backend: usize,
        request_bytes: usize,
    ) -> Ticket {
        let tokens = request_bytes as f64 / 4.0;
        let tracked = Arc::new(Tracked {
            method: method.to_string(),
            path: path.to_string(),
            streamed,
            backend,
            started_ms: self.now_ms(),
            allowance: Duration::from_secs_f64(tokens / self.prompt_tps),
            last_byte_ms: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = self.in_flight.lock() {
            map.insert(id, tracked.clone());
        }
        Ticket {
            id,
            tracked,
            dog: self.clone(),
        }
    }

    fn busy(&self, backend: usize) -> bool {
        self.in_flight
            .lock()
            .map(|m| m.values().any(|t| t.backend == backend))
            .unwrap_or(false)
    }

    /// The first hung request at `now_ms`, if any.
    fn judge(&self, now_ms: u64) -> Option<Verdict> {
        let map = self.in_flight.lock().ok()?;
        for t in map.values() {
            let watched = &self.backends.get(t.backend)?;
            let has_loop = watched.progress_path.is_some()
                && !self.loop_missing[t.backend].load(Ordering::Relaxed);
            if !has_loop && !t.streamed {
                // Without a progress route, a long non-streamed answer and a hang look alike.
                continue;
            }
            let last_byte = t.last_byte_ms.load(Ordering::Relaxed);
            let mut last = t.started_ms.max(last_byte);
            if has_loop {
                last = last.max(self.loop_alive_ms[t.backend].load(Ordering::Relaxed));
            }
            let limit = if t.bytes.load(Ordering::Relaxed) == 0 {
                self.limit + t.allowance
            } else {
                self.limit
            };
            let quiet = Duration::from_millis(now_ms.saturating_sub(last));
            if quiet > limit {
                let age = Duration::from_millis(now_ms.saturating_sub(t.started_ms));
                let line = format!(
                    "{} {} ({}) on the {} backend (port {}, pid {}) made no progress for {:.0} s (limit {:.0} s; {} bytes received in {:.0} s); killing it and exiting so Lemonade reloads it",
                    t.method,
                    t.path,
                    if t.streamed {
                        "streamed"
                    } else {
                        "not streamed"
                    },
                    self.device,
                    watched.port,
                    watched.pid,
                    quiet.as_secs_f64(),
                    limit.as_secs_f64(),
                    t.bytes.load(Ordering::Relaxed),
                    age.as_secs_f64(),
                );
                return Some(Verdict {
                    backend: t.backend,
                    line,
                });
            }
        }
        None
    }

    /// Run the watchdog until it fires, then send [`Event::Hung`] once. Spawned by serve once
    /// the backends are ready; it polls each backend's progress route only while requests
    /// are in flight on it.
    pub async fn run(self: Arc<Self>, client: BackendClient, events: UnboundedSender<Event>) {
        let mut pollers = Vec::new();
        for (index, b) in self.backends.iter().enumerate() {
            if let Some(path) = b.progress_path.clone() {
                pollers.push(tokio::spawn(self.clone().poll_loop(
                    index,
                    b.port,
                    path,
                    client.clone(),
                )));
            }
        }
        let mut tick = tokio::time::interval(JUDGE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            if let Some(verdict) = self.judge(self.now_ms()) {
                let _ = events.send(Event::Hung {
                    index: verdict.backend,
                    line: verdict.line,
                });
                break;
            }
        }
        for p in pollers {
            p.abort();
        }
    }

    /// Ask `path` every few seconds while requests are in flight on `index`; an answer means
    /// the main loop is turning. One request at a time: a wedged backend is not asked again
    /// until the previous question gives up.
    async fn poll_loop(
        self: Arc<Self>,
        index: usize,
        port: u16,
        path: String,
        client: BackendClient,
    ) {
        let every = (self.limit / 4).clamp(Duration::from_millis(250), Duration::from_secs(3));
        let uri = format!("http://127.0.0.1:{port}{path}");
        loop {
            tokio::time::sleep(every).await;
            if !self.busy(index) {
                continue;
            }
            let Ok(request) = hyper::Request::get(&uri).body(Full::new(Bytes::new())) else {
                return;
            };
            let ask = async {
                let reply = client.request(request).await.ok()?;
                let status = reply.status();
                reply.into_body().collect().await.ok()?;
                Some(status)
            };
            match tokio::time::timeout(self.limit.max(every), ask).await {
                Ok(Some(status)) if status.is_success() => {
                    self.loop_alive_ms[index].store(self.now_ms().max(1), Ordering::Relaxed);
                }
                Ok(Some(status)) if status.as_u16() == 404 || status.as_u16() == 501 => {
                    self.loop_missing[index].store(true, Ordering::Relaxed);
                    return;
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dog(progress: Option<&str>) -> Arc<Watchdog> {
        Arc::new(Watchdog::new(
            Duration::from_secs(2),
            50.0,
            "cpu",
            vec![Watched {
                port: 4000,
                pid: 42,
                progress_path: progress.map(str::to_string),
            }],
        ))
    }

    #[test]
    fn the_limit_comes_from_the_flag_then_the_environment_then_120() {
        assert_eq!(limit_secs(Some(5), Some("9")), 5);
        assert_eq!(limit_secs(None, Some("9")), 9);
        assert_eq!(limit_secs(None, Some("junk")), 120);
        assert_eq!(limit_secs(None, None), 120);
        assert_eq!(limit_secs(Some(0), None), 0);
    }

    #[test]
    fn a_quiet_request_is_hung_after_the_limit_and_bytes_reset_its_clock() {
        let dog = dog(Some("/slots"));
        let ticket = dog.track("POST", "/v1/chat/completions", true, 0, 40);
        let start = ticket.tracked.started_ms;
        assert_eq!(dog.judge(start + 2000), None);
        let v = dog.judge(start + 2300).expect("hung");
        assert!(
            v.line.starts_with("POST /v1/chat/completions (streamed) on the cpu backend (port 4000, pid 42) made no progress for 2 s (limit 2 s; 0 bytes"),
            "{}",
            v.line
        );
        ticket
            .tracked
            .last_byte_ms
            .store(start + 2200, Ordering::Relaxed);
        assert_eq!(dog.judge(start + 4000), None);
        drop(ticket);
        assert_eq!(
            dog.judge(start + 100_000),
            None,
            "a finished request is not judged"
        );
    }

    #[test]
    fn the_main_loop_answering_is_progress_for_a_non_streamed_request() {
        let dog = dog(Some("/slots"));
        let ticket = dog.track("POST", "/v1/completions", false, 0, 40);
        let start = ticket.tracked.started_ms;
        dog.loop_alive_ms[0].store(start + 1500, Ordering::Relaxed);
        assert_eq!(dog.judge(start + 3000), None);
        assert!(
            dog.judge(start + 3800).is_some(),
            "2 s plus 0.2 s for 10 tokens"
        );
    }

    #[test]
    fn without_a_progress_route_only_streamed_requests_are_judged() {
        let dog = dog(None);
        let quiet = dog.track("POST", "/v1/completions", false, 0, 40);
        let start = quiet.tracked.started_ms;
        assert_eq!(dog.judge(start + 60_000), None);
        let streamed = dog.track("POST", "/v1/completions", true, 0, 40);
        assert!(dog.judge(streamed.tracked.started_ms + 2500).is_some());
    }

    #[test]
    fn a_progress_route_that_answers_501_counts_as_none() {
        let dog = dog(Some("/slots"));
        let quiet = dog.track("POST", "/v1/completions", false, 0, 40);
        let start = quiet.tracked.started_ms;
        assert!(dog.judge(start + 2500).is_some());
        dog.loop_missing[0].store(true, Ordering::Relaxed);
        assert_eq!(dog.judge(start + 60_000), None);
    }

    #[test]
    fn a_long_prompt_gets_its_allowance_before_the_first_byte_only() {
        let dog = dog(Some("/slots"));
        // 400 000 bytes ≈ 100 000 tokens at 50 tok/s: 2000 s more.
        let ticket = dog.track("POST", "/v1/chat/completions", false, 0, 400_000);
        let start = ticket.tracked.started_ms;
        assert_eq!(dog.judge(start + 2_000_000), None);
        assert!(dog.judge(start + 2_002_500).is_some());
        ticket.progress(0);
        let head = ticket.tracked.last_byte_ms.load(Ordering::Relaxed);
        assert_eq!(
            dog.judge(head + 2500),
            None,
            "the reply's head keeps the allowance"
        );
        ticket.progress(10);
        let first = ticket.tracked.last_byte_ms.load(Ordering::Relaxed);
        assert!(
            dog.judge(first + 2500).is_some(),
            "after the first byte, the plain limit"
        );
    }
}
