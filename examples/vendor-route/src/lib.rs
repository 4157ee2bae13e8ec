//! `--device acme`: an example of a vendor's private route for 1bit serve, whose kernels are
//! closed and ship as a shared library of their own.
//!
//! The Acme NPU's kernels are `libacme_kernels.so.1` (here built from `kernels/` by build.rs, as
//! a stand-in for the binary a vendor ships). The route:
//!
//! - claims a GGUF model (strength 95) when the kernels lie in its package, or beside the route
//!   library for a loose build ([`plan::claim`]);
//! - plans without loading anything: its options, where the kernels are, the device memory the
//!   host's memory check judges, one rule answered in process ([`plan::plan`]);
//! - loads the kernels at `start` with `libloading` and checks their version ([`kernels`]);
//! - answers `POST /v1/chat/completions` in process, whole or streamed, stopping as soon as the
//!   client leaves (`respond`'s notes on cancellation);
//! - reports its health (the kernels loaded) and Prometheus counters.
//!
//! `unsafe` is denied in the crate (Cargo.toml's `[lints]`) and allowed in [`kernels`] alone,
//! where each block says why it is sound; `export_route!` allows its one exported static.

pub mod chat;
pub mod kernels;
pub mod plan;
mod respond;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use onebit_plugin_api::{
    Claim, DeviceRoute, ForwardRequest, Health, HealthProbe, Plan, PlanRequest, Refusal, ReplySink,
    RouteError, RouteInfo, Started,
};

use crate::kernels::Kernels;
use crate::plan::State;

/// The route's `--device` name, which is also the `<name>` of its file,
/// `libonebit_route_acme.so`.
pub const NAME: &str = "acme";

/// The acme route: one instance per process, made by the host with `Default`. `start` fills
/// it; `respond` calls run concurrently on it, sharing the kernels (which keep no state) and
/// the counters (atomics).
#[derive(Default)]
pub struct AcmeRoute {
    /// The kernels and the plan's state, once `start` loaded them.
    loaded: OnceLock<Loaded>,
    /// Why `start` failed, for `health`.
    failed: Mutex<Option<String>>,
    /// What the route generated, for `metrics`.
    counters: Counters,
}

/// What `start` loaded.
struct Loaded {
    /// The kernels library and its functions, kept loaded for the process's life.
    kernels: Kernels,
    /// What the plan decided.
    state: State,
}

/// The route's Prometheus counters.
#[derive(Default)]
struct Counters {
    /// Chat completions begun.
    generations: AtomicU64,
    /// Tokens generated.
    tokens: AtomicU64,
}

impl DeviceRoute for AcmeRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: NAME.to_string(),
            summary: "GGUF models on the Acme NPU, in process, with Acme's own kernels".to_string(),
        }
    }

    fn claim(&self, request: &PlanRequest) -> Claim {
        plan::claim(request)
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        plan::plan(request)
    }

    /// Load the kernels the plan found, once per process; a failure (a missing file or symbol,
    /// another version) is one line, and ends serve with status 1.
    fn start(&self, started: &Started) -> Result<(), RouteError> {
        let result = self.load(started);
        if let Err(e) = &result {
            *self.failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.message.clone());
        }
        result
    }

    /// Healthy once the kernels are loaded.
    fn health(&self, _probe: &HealthProbe) -> Health {
        if self.loaded.get().is_some() {
            return Health {
                ok: true,
                reason: String::new(),
            };
        }
        let failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
        Health {
            ok: false,
            reason: match failed.as_deref() {
                Some(why) => format!("the Acme kernels failed to load: {why}"),
                None => "the Acme kernels are not loaded yet".to_string(),
            },
        }
    }

    fn metrics(&self) -> String {
        let mut text = format!(
            "# HELP acme_generations_total Chat completions the Acme kernels began.\n\
             # TYPE acme_generations_total counter\n\
             acme_generations_total {}\n\
             # HELP acme_tokens_total Tokens the Acme kernels generated.\n\
             # TYPE acme_tokens_total counter\n\
             acme_tokens_total {}\n",
            self.counters.generations.load(Ordering::Relaxed),
            self.counters.tokens.load(Ordering::Relaxed),
        );
        if let Some(loaded) = self.loaded.get() {
            text.push_str(&format!(
                "# HELP acme_device_total_bytes The Acme device's own memory, as its kernels report it.\n\
                 # TYPE acme_device_total_bytes gauge\n\
                 acme_device_total_bytes {}\n",
                loaded.kernels.device_total_bytes()
            ));
        }
        text
    }

    fn respond(
        &self,
        request: &ForwardRequest,
        sink: &mut dyn ReplySink,
    ) -> Result<(), RouteError> {
        respond::respond(self.loaded.get(), &self.counters, request, sink)
    }
}

impl AcmeRoute {
    /// [`DeviceRoute::start`]'s work: the plan's state read, the kernels loaded and checked.
    fn load(&self, started: &Started) -> Result<(), RouteError> {
        if self.loaded.get().is_some() {
            return Ok(());
        }
        let state: State =
            serde_json::from_value(started.plan.route_state.clone()).map_err(|e| {
                RouteError::new(format!("the acme route cannot read its plan's state: {e}"))
            })?;
        if state.kernels.is_empty() {
            return Err(RouteError::new(
                "the acme route's plan names no kernels library; plan with the acme route itself",
            ));
        }
        let kernels = Kernels::load(Path::new(&state.kernels)).map_err(RouteError::new)?;
        // serve calls start once; should two race, the first one's kernels stay.
        let _ = self.loaded.set(Loaded { kernels, state });
        Ok(())
    }
}

// The library's export: the one header the host looks up in the file.
onebit_plugin_api::export_route!(AcmeRoute);

#[cfg(test)]
mod tests;
