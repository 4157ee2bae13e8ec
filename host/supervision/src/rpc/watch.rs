//! Watching the RPC workers while serve runs: one held connection per worker tells when it
//! stops answering (for /health), the per-worker series of /metrics, and which worker a
//! backend that failed on an RPC call lost.
//!
//! Why a held connection and not a probe every quarter second: a worker serves one client at
//! a time and listens with a backlog of 1, so while llama-server holds it, each new probe
//! would wait in its accept queue and, once two waited, the next would time out on a healthy
//! worker. One connection that waits in that queue costs nothing; the worker's kernel resets
//! it when the worker dies, and TCP keep-alive notices a machine or link that vanishes.

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::rpc::probe::{self, Offer};

/// How long a held connection may go unacknowledged before TCP keep-alive declares the worker
/// gone: 1 s idle, then 2 probes 1 s apart.
const KEEPALIVE: Duration = Duration::from_secs(1);
const KEEPALIVE_PROBES: u32 = 2;
/// How often a watcher thread looks at its connection.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// One worker as serve last saw it.
#[derive(Clone, Debug)]
struct Worker {
    endpoint: String,
    offered: u64,
    /// None while it answers; why not, once it stopped.
    lost: Option<String>,
}

/// The workers serve was given, as last seen: made before anything starts (from what each
/// offered), shared by the watcher threads, the health monitor, `/metrics` and the stop. A
/// clone is the same board.
#[derive(Clone, Debug, Default)]
pub struct Workers(Arc<Board>);

#[derive(Debug, Default)]
struct Board {
    workers: Mutex<Vec<Worker>>,
    /// Woken when a worker is first seen lost ([`Workers::lost`]).
    changed: tokio::sync::Notify,
}

impl Workers {
    /// The board of the workers serve was given and what they offered; empty without `--rpc`.
    pub fn watching(offers: &[Offer]) -> Workers {
        Workers(Arc::new(Board {
            workers: Mutex::new(
                offers
                    .iter()
                    .map(|o| Worker {
                        endpoint: o.endpoint.clone(),
                        offered: o.free(),
                        lost: None,
                    })
                    .collect(),
            ),
            changed: tokio::sync::Notify::new(),
        }))
    }

    fn board(&self) -> &Mutex<Vec<Worker>> {
        &self.0.workers
    }

    fn mark_lost(&self, endpoint: &str, why: String) {
        if let Ok(mut b) = self.board().lock()
            && let Some(w) = b.iter_mut().find(|w| w.endpoint == endpoint)
            && w.lost.is_none()
        {
            w.lost = Some(why);
            self.0.changed.notify_waiters();
        }
    }

    /// Resolves with [`Workers::down`]'s line once a worker is seen lost (at once if one is);
    /// never without workers. Awaited by serve's main loop, which ends serve then (a lost
    /// worker's layers are gone for good: docs/rpc.md).
    pub async fn lost(&self) -> String {
        loop {
            let changed = self.0.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(why) = self.down() {
                return why;
            }
            changed.await;
        }
    }
}

impl Workers {
    /// Start one watcher thread per worker, once the backend is ready (it holds its own
    /// connections to the workers by then, so the held one waits in the accept queue and never
    /// delays the backend's). The threads live as long as serve; they only read their socket.
    pub fn spawn(&self) {
        let workers: Vec<String> = self
            .board()
            .lock()
            .map(|b| b.iter().map(|w| w.endpoint.clone()).collect())
            .unwrap_or_default();
        for endpoint in workers {
            let _ = std::thread::Builder::new().name("rpc-watch".into()).spawn({
                let workers = self.clone();
                move || watch_one(&endpoint, &workers)
            });
        }
    }
}

fn watch_one(endpoint: &str, workers: &Workers) {
    let stream = match probe::connect(endpoint, probe::ANSWER_WITHIN) {
        Ok(s) => s,
        Err(e) => return workers.mark_lost(endpoint, e),
    };
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE)
        .with_interval(KEEPALIVE)
        .with_retries(KEEPALIVE_PROBES);
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
    let _ = stream.set_read_timeout(Some(LOOK_EVERY));
    let mut byte = [0u8; 1];
    loop {
        match (&stream).read(&mut byte) {
            // The worker closed it: it exited, or took this connection after the backend's
            // closed (which only a dying backend does).
            Ok(0) => {
                return workers.mark_lost(
                    endpoint,
                    format!("RPC worker {endpoint} closed its connection"),
                );
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) && e.raw_os_error() != Some(libc::ETIMEDOUT) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return workers.mark_lost(
                    endpoint,
                    format!("RPC worker {endpoint} stopped answering ({e})"),
                );
            }
        }
    }
}

impl Workers {
    /// Why /health should answer 503: the first worker that stopped answering, or None. Called by
    /// serve's health monitor each round; takes a lock, never blocks on the network.
    pub fn down(&self) -> Option<String> {
        self.board()
            .lock()
            .ok()?
            .iter()
            .find_map(|w| w.lost.clone())
            .map(|why| format!("{why}; the backend cannot run the layers it held"))
    }
}

impl Workers {
    /// When a backend ended and serve was given workers: the line naming the worker it lost, or
    /// None when every worker still answers. A worker the watchers have not seen go is asked
    /// again (a connection), a few times over [`LOST_WITHIN`]: the backend may notice a dying
    /// worker's closed connection before the watcher thread has run or the worker's port has
    /// closed. Blocks the calling thread for up to that long (more for a worker that times out).
    pub fn name_lost(&self) -> Option<String> {
        let started = std::time::Instant::now();
        loop {
            let workers: Vec<Worker> = self.board().lock().ok()?.clone();
            if workers.is_empty() {
                return None;
            }
            let lost: Vec<String> = workers
                .iter()
                .filter_map(|w| {
                    w.lost.clone().or_else(|| {
                        probe::connect(&w.endpoint, probe::ANSWER_WITHIN)
                            .err()
                            .inspect(|e| self.mark_lost(&w.endpoint, e.clone()))
                    })
                })
                .collect();
            if !lost.is_empty() {
                return Some(lost.join("; "));
            }
            if started.elapsed() >= LOST_WITHIN {
                return None;
            }
            std::thread::sleep(LOOK_EVERY);
        }
    }
}

/// How long [`name_lost`] keeps asking before it says no worker was lost.
const LOST_WITHIN: Duration = Duration::from_millis(1500);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: String,
}

impl Workers {
    /// The per-worker series as Prometheus text; empty without workers. Called by `GET /metrics`
    /// on a runtime worker; takes a lock, never blocks on the network.
    pub fn render(&self) -> String {
        let workers = self.board().lock().map(|b| b.clone()).unwrap_or_default();
        if workers.is_empty() {
            return String::new();
        }
        let up = Family::<WorkerLabel, Gauge>::default();
        let offered = Family::<WorkerLabel, Gauge>::default();
        for w in &workers {
            let label = WorkerLabel {
                worker: w.endpoint.clone(),
            };
            up.get_or_create(&label).set(i64::from(w.lost.is_none()));
            offered
                .get_or_create(&label)
                .set(i64::try_from(w.offered).unwrap_or(i64::MAX));
        }
        let mut registry = Registry::default();
        registry.register(
            "onebit_rpc_worker_up",
            "1 while the RPC worker answers, 0 once it stopped",
            up,
        );
        registry.register(
            "onebit_rpc_worker_offered_bytes",
            "The memory the RPC worker offered (its devices' free memory) when serve started",
            offered,
        );
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
        out
    }
}
