//! What serve was asked to do, fixed before the first request: the served name, the route's
//! table, the backends' ports, the limits and the rewrites. Run-time state (status, pools,
//! the watchdog) lives in `relay::App`, beside these.

use std::time::Duration;

use onebit_plugin_api::Rule;

use crate::guard::Guard;
use crate::guard::key::ApiKey;

/// A request body larger than this is refused with 413 (base64 images make chats large);
/// `ONEBIT_MAX_BODY_BYTES` changes it.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024 * 1024;
/// A request body must have arrived whole within this long; `ONEBIT_BODY_READ_TIMEOUT_S`
/// changes it. At the default limit this asks for about 0.5 MiB/s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(120);

/// The settings a request is relayed by. Built once by `serve` and never changed.
pub struct Settings {
    pub served_name: String,
    /// Every name of `--alias` (the served name among them) and `--tags`, for `/v1/models`.
    pub aliases: Vec<String>,
    pub tags: Vec<String>,
    pub device: String,
    /// Unix time serve started, for `/v1/models`.
    pub created: u64,
    pub rules: Vec<Rule>,
    /// The loopback port of each backend, in the plan's order.
    pub ports: Vec<u16>,
    pub body_limit: usize,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
    /// Models served beside the main one, for `/v1/models`.
    pub side_models: Vec<onebit_plugin_api::SideModel>,
    /// The plan asked that streamed events carry the served name (`Plan::rename_in_streams`).
    pub rename_in_streams: bool,
    /// serve names the model in whole inference replies (its served name); false in
    /// llama-server's router mode, where the backend names each model it loads.
    pub names_model: bool,
    /// `--precise` (or `ONEBIT_PRECISE=1`): chats and completions go with `cache_prompt` false.
    pub precise: bool,
    /// The route asked that its forwards take turns (`Plan::serialize_forwards`).
    pub serialize_forwards: bool,
    /// The browser guard, applied before routing.
    pub guard: Guard,
    /// The API key every route but `/health` needs, when serve has one.
    pub api_key: Option<ApiKey>,
    /// `GET /metrics` answers 501, as llama-server without `--metrics` (`--no-metrics`).
    pub metrics_off: bool,
}

impl Settings {
    /// The route's rule for a request, the first that matches in the plan's order. Called by
    /// both relay engines on the connection's task; never blocks.
    pub fn rule_for(&self, method: &str, path: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| {
            r.method.eq_ignore_ascii_case(method)
                && match r.path.strip_suffix('*') {
                    Some(prefix) => path.starts_with(prefix),
                    None => r.path == path,
                }
        })
    }
}
