//! The `inproc` route of 1bit serve: a GGUF served by llama.cpp inside serve's own process.
//!
//! `--device inproc` is an add-on built outside the workspace that serves a GGUF inside serve's
//! own process with llama.cpp's shared libraries, loaded at run time (no child process, no HTTP
//! hop). The template a vendor copies: see docs/routes/inproc.md and docs/plugins.md.
//!
//! `unsafe` is denied in the crate (Cargo.toml's `[lints]`) and allowed only in the modules that
//! call C: ffi's parts that do and state_buffer, each saying why. The heap is trimmed with
//! the `onebit-heap` crate's `Trimmer`, as the host's is.

pub mod chat;
mod engine;
pub mod error;
pub mod ffi;
pub mod generate;
mod host;
mod libraries;
mod metrics;
pub mod openai;
mod plan;
mod respond;
pub mod state_buffer;

use std::sync::{Arc, Mutex, OnceLock};

use onebit_plugin_api::*;

pub use crate::error::InprocError;
pub use crate::host::default_threads;
pub use crate::libraries::{LIB_DIR_VAR, check_lib_dir, libraries};
pub use crate::plan::{CLAIMED_ARCHITECTURES, State};

use crate::engine::{Engine, load};
use crate::generate::Counters;
use crate::metrics::RequestCounters;

/// The route's `--device` name.
pub const NAME: &str = "inproc";

#[derive(Default)]
pub struct InprocRoute {
    engine: OnceLock<Engine>,
    /// Why `start` failed, for health.
    failed: Mutex<Option<String>>,
    /// The requests' counts (answered, tokens, time, clients gone).
    counters: RequestCounters,
    /// The engine thread's own counts (decodes, prompts decoded beside other slots).
    engine_counters: Arc<Counters>,
}

impl DeviceRoute for InprocRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: NAME.to_string(),
            summary: "a GGUF served in process by llama.cpp's shared libraries (an add-on)"
                .to_string(),
        }
    }

    /// Under `--device auto`: the GGUFs of [`CLAIMED_ARCHITECTURES`] (see [`plan::claim`]).
    fn claim(&self, request: &PlanRequest) -> Claim {
        plan::claim(request)
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        plan::plan(request)
    }

    fn start(&self, started: &Started) -> Result<(), RouteError> {
        let state: State = serde_json::from_value(started.plan.route_state.clone())
            .map_err(|e| RouteError::new(format!("the inproc route's plan is unreadable: {e}")))?;
        match load(&state, self.engine_counters.clone()) {
            Ok(engine) => {
                let _ = self.engine.set(engine);
                Ok(())
            }
            Err(error) => {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
                Err(error.into())
            }
        }
    }

    fn health(&self, _probe: &HealthProbe) -> Health {
        if self.engine.get().is_some() {
            return Health {
                ok: true,
                reason: String::new(),
            };
        }
        let reason = self
            .failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "the inproc route is loading its model".to_string());
        Health { ok: false, reason }
    }

    fn metrics(&self) -> String {
        let model = self.engine.get().map(|engine| &engine.model);
        self.counters.render(&self.engine_counters, model)
    }

    fn respond(
        &self,
        request: &ForwardRequest,
        sink: &mut dyn ReplySink,
    ) -> Result<(), RouteError> {
        respond::respond(self.engine.get(), &self.counters, request, sink)
    }
}

export_route!(InprocRoute);
