//! `App`: what every request handler shares, the settings (fixed) beside the run-time state
//! (status, pools, the watchdog, the route).

use std::sync::{Arc, OnceLock};

use crate::pool::{BackendClient, BackendPool};
use crate::settings::Settings;
use onebit_metrics as metrics;
use onebit_supervision::backends::health::{Status, StatusCell};
use onebit_supervision::backends::route_calls::RouteCalls;
use onebit_supervision::backends::watchdog::Watchdog;

/// What the handlers share: the settings (fixed; `app.settings`) and the state that changes
/// while serve runs.
pub struct App {
    pub settings: Settings,
    /// What every reply's phases read (`reply_loop`), taken from the settings once.
    pub replies: Arc<crate::reply_loop::ReplySettings>,
    /// Whether the model can take requests; the health monitor and `serve` set it.
    pub status: Arc<StatusCell>,
    /// The general engine's client (busy-polling).
    pub client: BackendClient,
    /// serve's own calls to the backends: metrics scrapes (and, in `serve`, health and the
    /// route's host services).
    pub probes: onebit_supervision::backends::health::ProbeClient,
    /// The turn route forwards take, when the route asks (`Settings::serialize_forwards`).
    pub forward_turn: Arc<tokio::sync::Mutex<()>>,
    pub route: RouteCalls,
    /// The progress watchdog, set once the backends run (never, with `--watchdog 0`).
    pub watchdog: OnceLock<Arc<Watchdog>>,
    /// What `/metrics` reads besides the status.
    pub metrics: metrics::Sources,
    /// The fast engine's idle backend connections.
    pub pool: BackendPool,
    /// `onebit_requests_total` and the added-time histogram, recorded by both engines.
    pub requests: metrics::requests::RequestSeries,
    /// `--pm`: a chat's plan targets the Project Manager's tool loop (`Target::ToolLoop`).
    pub pm: Option<Arc<onebit_features::pm::Pm>>,
    /// `--laya`: an inference request's backend is its conversation's device's
    /// (`DeviceChoice::ByConversation`); holds the conversations decided.
    pub laya: Option<Arc<onebit_features::laya::Laya>>,
    /// The persistent prompt cache of backend 0 (`--prompt-cache-dir`): a chat or completion
    /// whose plan says so is prepared by it before it is forwarded.
    pub prompt_cache: Option<Arc<onebit_features::prompt_cache::PromptCache>>,
    /// The requests in flight, the drain, the stop, busy polling (`traffic`).
    pub traffic: Arc<crate::traffic::Traffic>,
    /// `--rpc`'s workers as last seen (`/metrics`, `/health`, the stop's line).
    pub rpc_workers: onebit_supervision::rpc::watch::Workers,
    /// Generations in flight (`relay::exchange`: taken at admission, released at the end),
    /// against `Settings::max_generations`.
    pub generations: std::sync::atomic::AtomicUsize,
}

impl App {
    /// The status now; a read lock held for a clone.
    pub fn status(&self) -> Status {
        self.status.get()
    }

    pub fn set_status(&self, status: Status) {
        self.status.set(status);
    }
}
