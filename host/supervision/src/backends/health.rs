//! Whether the backends answer: serve's own client toward them (never busy-polling), the wait
//! for a loading backend, the health monitor once ready, and the `Status` `/health` reports.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use onebit_plugin_api::loader::LoadedRoute;
use onebit_plugin_api::{BackendHealth, HealthProbe};

use crate::backends::supervisor::Backend;

/// A backend that does not answer its health route within this long is reported down.
const HEALTH_TIMEOUT: Duration = Duration::from_millis(1500);
/// How often serve asks a loading backend's health route (see `wait_ready`).
const READY_POLL: Duration = Duration::from_millis(5);
/// The pause between two rounds of health questions once ready. With the timeout this puts a
/// backend that stops answering in `/health` within 1.75 s (Lemonade's probe gives up at 2 s).
const HEALTH_EVERY: Duration = Duration::from_millis(250);

/// How long a backend connection may sit idle and still be reused. llama-server (its
/// cpp-httplib, CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND) closes a keep-alive connection idle for
/// 5 s: a request written as that close happens meets a clean close before any reply, which
/// serve cannot tell from a request the backend took, so it must answer 502 rather than send
/// it again. Connections older than this are closed by serve first: both engines' pools
/// (`relay::pool`) and the probe client.
pub const IDLE_LIMIT: Duration = Duration::from_secs(3);

/// The client of serve's own calls to its backends (health, metrics, the watchdog's
/// questions, the route's host services): these are not relayed requests, and never busy-poll.
pub type ProbeClient = Client<HttpConnector, Full<Bytes>>;

/// Build the [`ProbeClient`]; `serve` does, once, on the runtime.
pub fn probe_client() -> ProbeClient {
    pooled_client(|tcp| tcp)
}

/// A pooled hyper client toward the backends on loopback (TCP_NODELAY, idle connections kept
/// for [`IDLE_LIMIT`]), its connector made from the TCP one by `wrap`: the probe client's as is, the
/// general engine's busy-polling (`relay::pool`).
pub fn pooled_client<C>(wrap: impl FnOnce(HttpConnector) -> C) -> Client<C, Full<Bytes>>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
{
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(IDLE_LIMIT)
        .build(wrap(connector))
}

/// Whether the model can take requests, as `/health` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The backends are starting.
    Loading,
    /// Every backend answers its own health route.
    Ready,
    /// A backend is down, hung or gone; the reason says which.
    Down(String),
    /// serve is stopping for this reason (a backend exited, the watchdog fired, a lost GPU);
    /// unlike `Down`, the health monitor never clears it.
    Failed(String),
}

/// The shared [`Status`]: read by every request, written by `serve` and the health monitor.
pub struct StatusCell(RwLock<Status>);

impl StatusCell {
    pub fn new(status: Status) -> Self {
        StatusCell(RwLock::new(status))
    }

    pub fn get(&self) -> Status {
        self.0.read().map(|s| s.clone()).unwrap_or(Status::Loading)
    }

    pub fn set(&self, status: Status) {
        if let Ok(mut s) = self.0.write() {
            *s = status;
        }
    }
}

/// Poll a backend's health route until it answers 200. Connection refused means it has not
/// bound yet, 503 that it is loading.
///
/// Asked every `READY_POLL`: a backoff up to 250 ms made serve ready up to 250 ms after its
/// backend was, and an answer from llama-server's HTTP thread while it loads costs it nothing.
pub async fn wait_ready(client: &ProbeClient, backend: &Backend) {
    loop {
        if let Ok(200) = backend_status(client, backend.spec.port, &backend.spec.health_path).await
        {
            return;
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

async fn backend_status(client: &ProbeClient, port: u16, path: &str) -> Result<u16, String> {
    let request = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let call = async {
        let reply = client.request(request).await.map_err(|e| e.to_string())?;
        let status = reply.status().as_u16();
        let _ = reply.into_body().collect().await;
        Ok(status)
    };
    tokio::time::timeout(HEALTH_TIMEOUT, call)
        .await
        .map_err(|_| format!("did not answer within {} s", HEALTH_TIMEOUT.as_secs_f64()))?
}

pub async fn backend_post(
    client: &ProbeClient,
    backend: &Backend,
    path: &str,
    body: &serde_json::Value,
) -> Result<(), String> {
    let request = hyper::Request::post(format!("http://127.0.0.1:{}{path}", backend.spec.port))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let reply = client.request(request).await.map_err(|e| e.to_string())?;
    let status = reply.status();
    let _ = reply.into_body().collect().await;
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("status {status}"))
    }
}

/// Once ready, ask every backend's health route (each within 1.5 s) a quarter
/// second after the last round ended; `/health` reports what the routes make of the answers,
/// so it never waits on a backend itself. `routes` holds each running route with its
/// backends' (port, health path): one route, or with `--laya` one per device, and serve is
/// down while any route says so (the first one's reason). An exit is reported by the
/// supervisor, not here. `also_down` names anything else the backend depends on that is gone
/// (an RPC worker), asked each round; it must not block. Spawned once by `serve` when ready;
/// runs until aborted.
pub async fn monitor_health(
    status: Arc<StatusCell>,
    client: ProbeClient,
    routes: Vec<(LoadedRoute, Vec<(u16, String)>)>,
    also_down: impl Fn() -> Option<String> + Send + 'static,
) {
    loop {
        tokio::time::sleep(HEALTH_EVERY).await;
        let mut health = onebit_plugin_api::Health {
            ok: true,
            reason: String::new(),
        };
        for (route, backends) in &routes {
            let verdict = route_health(&client, route, backends).await;
            if !verdict.ok {
                health = verdict;
                break;
            }
        }
        let elsewhere = also_down();
        if matches!(status.get(), Status::Down(_) | Status::Ready) {
            status.set(if let Some(why) = elsewhere {
                Status::Down(why)
            } else if health.ok {
                Status::Ready
            } else {
                Status::Down(health.reason)
            });
        }
    }
}

/// One route's verdict on its backends' health answers (the route judges on a blocking
/// thread).
async fn route_health(
    client: &ProbeClient,
    route: &LoadedRoute,
    backends: &[(u16, String)],
) -> onebit_plugin_api::Health {
    let mut probe = HealthProbe::default();
    for (port, path) in backends {
        probe
            .backends
            .push(match backend_status(client, *port, path).await {
                Ok(200) => BackendHealth {
                    ok: true,
                    reason: String::new(),
                },
                Ok(status) => BackendHealth {
                    ok: false,
                    reason: format!("the backend on port {port} answered {path} with {status}"),
                },
                Err(e) => BackendHealth {
                    ok: false,
                    reason: format!("the backend on port {port} {e} on {path}"),
                },
            });
    }
    let verdict = {
        let route = route.clone();
        tokio::task::spawn_blocking(move || route.health(&probe)).await
    };
    match verdict {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => onebit_plugin_api::Health {
            ok: false,
            reason: format!("the route's health check failed: {e}"),
        },
        Err(e) => onebit_plugin_api::Health {
            ok: false,
            reason: format!("the route's health check failed: {e}"),
        },
    }
}
