//! What serve was asked to do, fixed before the first request: the served name, the route's
//! table, the backends' ports, the limits and the rewrites. Run-time state (status, pools,
//! the watchdog) lives in `relay::App`, beside these.

mod rule_table;

pub use rule_table::RuleTable;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use onebit_plugin_api::{Plan, Rule};

use onebit_command::cli::ServeArgs;
use onebit_features::guard::Guard;
use onebit_features::guard::key::ApiKey;

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
    /// The plan's request table (`rule_for` looks a request up in it).
    pub rules: RuleTable,
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
    /// `--keep-attribution`: Claude Code's attribution line reaches the engine
    /// (`relay::attribution`).
    pub keep_attribution: bool,
    /// The route asked that its forwards take turns (`Plan::serialize_forwards`).
    pub serialize_forwards: bool,
    /// The browser guard, applied before routing.
    pub guard: Guard,
    /// The API key every route but `/health` needs, when serve has one.
    pub api_key: Option<ApiKey>,
    /// `GET /metrics` answers 501, as llama-server without `--metrics` (`--no-metrics`).
    pub metrics_off: bool,
    /// `--max-generations N`: at most N generations in flight; one more is refused (503).
    pub max_generations: Option<usize>,
    /// `--max-generation-s SECS`: a generation still running this long after its admission is
    /// ended (`exchange::Deadline`); None without the flag.
    pub max_generation: Option<Duration>,
    /// `--sse-keepalive-s`: the silence after which a streamed generation gets a comment
    /// (`sse_keepalive`); None when it is 0 (off).
    pub sse_keepalive: Option<Duration>,
    /// `--cors-origins`' policy: the guard lets the origins it names write, and replies carry
    /// its `Access-Control-*` headers (`guard::cors`); None without the flag.
    pub cors: Option<std::sync::Arc<onebit_features::guard::cors::Cors>>,
    /// False with `ONEBIT_FAST_ENGINE=0`: the fast engine hands every connection to the
    /// general engine before reading it.
    pub fast_engine: bool,
}

impl Settings {
    /// The route's rule for a request, the first that matches in the plan's order. Called by
    /// both relay engines on the connection's task; never blocks.
    pub fn rule_for(&self, method: &str, path: &str) -> Option<&Rule> {
        self.rules.find(method, path)
    }

    /// The relay's settings for this command line and plan.
    pub fn new(
        args: &ServeArgs,
        plan: &Plan,
        served_name: &str,
        ports: Vec<u16>,
        guard: Guard,
        api_key: Option<ApiKey>,
    ) -> Settings {
        Settings {
            served_name: served_name.to_string(),
            aliases: onebit_command::model::names(args.alias.as_deref()),
            tags: onebit_command::model::names(args.tags.as_deref()),
            device: plan.device.clone(),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            rules: RuleTable::new(plan.rules.clone()),
            ports,
            body_limit: env_number(args.env.max_body_bytes.as_deref())
                .filter(|n| *n >= 1.0)
                .map(|n| n as usize)
                .unwrap_or(DEFAULT_BODY_LIMIT),
            body_timeout: env_secs(args.env.body_read_timeout_s.as_deref())
                .unwrap_or(DEFAULT_BODY_TIMEOUT),
            guard,
            api_key,
            metrics_off: args.no_metrics,
            sse_keepalive: Some(Duration::from_secs(args.sse_keepalive_s))
                .filter(|every| !every.is_zero()),
            cors: onebit_features::guard::cors::Cors::from_args(args).map(std::sync::Arc::new),
            fast_engine: args.env.fast_engine.as_deref().map(str::trim) != Some("0"),
            side_models: plan.side_models.clone(),
            rename_in_streams: plan.rename_in_streams,
            names_model: !args.llama_router,
            precise: args.precise || args.env.precise(),
            keep_attribution: args.keep_attribution,
            serialize_forwards: plan.serialize_forwards,
            max_generations: args.max_generations.map(|n| n as usize),
            max_generation: args.max_generation_s.map(Duration::from_secs),
        }
    }
}

/// A number from an environment setting's text; None when unset or not a finite number.
pub fn env_number(value: Option<&str>) -> Option<f64> {
    value
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|n| n.is_finite())
}

/// A positive number of seconds from the environment.
pub fn env_secs(value: Option<&str>) -> Option<Duration> {
    env_number(value)
        .filter(|s| *s > 0.0 && *s < 1e9)
        .map(Duration::from_secs_f64)
}
