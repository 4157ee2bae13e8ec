//! `--device zeta`: an example of a vendor's private route for 1bit serve whose closed engine is
//! a **program** (a server of its own), not a library.
//!
//! The Zeta NPU's engine is `zeta-engine` (here built from `src/bin/zeta-engine/` as a stand-in
//! for the binary a vendor ships). It speaks what serve expects of a backend: llama-server's
//! health route, OpenAI's chat completions (whole and streamed) and Prometheus metrics, on the
//! loopback port serve gives it. The route:
//!
//! - claims a GGUF model (strength 95) when the engine is in its package (or beside the route
//!   library for a loose build) and a Zeta device is present ([`plan::claim`]);
//! - plans one backend, the engine, which serve starts, health-checks, supervises, relays
//!   requests to and stops ([`plan::plan`]); nothing runs inside serve.
//!
//! The engine forks a helper of its own (a device monitor) as closed engines do; serve's
//! spawner (onebit-process) kills it with the engine, on a stop and on a `kill -9` of serve
//! alike (README.md).

#![deny(unsafe_code)] // not forbid: export_route! places one #[unsafe(export_name)] static

pub mod plan;

use onebit_plugin_api::{
    BackendLine, Claim, DeviceRoute, LineVerdict, Plan, PlanRequest, Refusal, RouteInfo,
};

/// The route's `--device` name, which is also the `<name>` of its file,
/// `libonebit_route_zeta.so`.
pub const NAME: &str = "zeta";

/// What the engine prints on stderr when it lost its device: serve stops (exit 1) rather than
/// relay to an engine that can no longer answer.
pub const DEVICE_LOST_LINE: &str = "zeta-engine: device lost";

/// The zeta route: one instance per process, made by the host with `Default`. It keeps no
/// state: the engine is serve's child, and the engine keeps its own counters.
#[derive(Default)]
pub struct ZetaRoute;

impl DeviceRoute for ZetaRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: NAME.to_string(),
            summary: "GGUF models on the Zeta NPU, served by Zeta's own engine program".to_string(),
        }
    }

    fn claim(&self, request: &PlanRequest) -> Claim {
        plan::claim(request)
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        plan::plan(request)
    }

    /// The engine's stderr, line by line (serve passes each through already): a lost device
    /// stops serve with the engine's own words.
    fn on_backend_line(&self, line: &BackendLine) -> LineVerdict {
        LineVerdict {
            say: Vec::new(),
            stop: line
                .line
                .contains(DEVICE_LOST_LINE)
                .then(|| format!("the Zeta engine lost its device: {}", line.line.trim())),
        }
    }
}

// The library's export: the one header the host looks up in the file.
onebit_plugin_api::export_route!(ZetaRoute);

#[cfg(test)]
mod tests;
