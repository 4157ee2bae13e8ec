//! The hrx device route: the model in the HRX build's llama-server on HRX0, every layer on the
//! GPU, with strict placement by default and serve's placement lines.
#![deny(unsafe_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use llama_server::placement::{self, PlacementLine, Watch};
use llama_server::{options, plan};
use onebit_plugin_api::{
    BackendLine, Claim, DeviceRoute, LineVerdict, Plan, PlanRequest, Purpose, Refusal, RouteInfo,
    Warmup, export_route,
};

/// Where TheRock's HSA runtime is looked for when neither `--hrx-libhsa` nor the user's
/// `IREE_HAL_AMDGPU_LIBHSA_PATH` names one.
pub const THEROCK_DIR: &str = "/opt/rocm-therock";

/// `1` or `0` overrides the hardware check of `claim` (tests, or a machine whose sysfs is
/// unusual).
pub const PRESENT_ENV: &str = llama_server::HRX_PRESENT_ENV;

#[derive(Default)]
pub struct HrxRoute {
    /// The placement watch of the plan being served, set by `plan` for [`Purpose::Serve`] and read
    /// by `on_backend_line` (the same process, one plan per run).
    watch: Mutex<Option<Watch>>,
}

/// How strictly placement is held, from the flags and `ONEBIT_STRICT_DEVICE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strictness {
    /// `--no-strict-device`: GGML_HRX_STRICT is left unset.
    Off,
    /// The default: GGML_HRX_STRICT=1.
    On,
    /// `--strict-device`: the default, the report, and a refusal of any report naming nodes off
    /// HRX.
    Refusing,
}

fn strictness(request: &PlanRequest) -> Strictness {
    if !llama_server::hrx_strict(request) {
        return Strictness::Off;
    }
    let refusing = request.options.strict_device
        || request
            .env
            .get("ONEBIT_STRICT_DEVICE")
            .is_some_and(|v| v.trim() == "1");
    if refusing {
        Strictness::Refusing
    } else {
        Strictness::On
    }
}

/// Whether this machine has HRX (shared with the hybrid route's decoder).
pub use llama_server::hrx_present;

/// The first HSA runtime under a folder (shared with the Laya scorer daemon's start).
pub use llama_server::{LIBHSA, find_libhsa};

/// The two warm-up requests of an hrx chat plan: a 360-token chat prompt for 8 tokens (HRX's
/// one-time per-shape program build), then a 16-token `/completion` with nothing to predict
/// (the small-batch weight layout ggml-hrx builds on first use).
pub fn warmups() -> Vec<Warmup> {
    vec![
        Warmup {
            path: "/v1/chat/completions".to_string(),
            body: serde_json::json!({
                "messages": [{"role": "user", "content": vec!["a"; 360].join(" ")}],
                "max_tokens": 8,
                "temperature": 0,
                "cache_prompt": false,
            }),
        },
        Warmup {
            path: "/completion".to_string(),
            body: serde_json::json!({"prompt": " a".repeat(16), "n_predict": 0}),
        },
    ]
}

impl DeviceRoute for HrxRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: "hrx".to_string(),
            summary: "llama-server on HRX0 (-ngl 99), strict placement".to_string(),
        }
    }

    fn claim(&self, request: &PlanRequest) -> Claim {
        if request.model.is_dir || !hrx_present(request) {
            return Claim::none();
        }
        Claim {
            strength: 50,
            reason: "a GGUF on a machine with HRX".to_string(),
        }
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        let o = &request.options;
        o.checked_route_options("hrx", &[])?;
        llama_server::refuse_h32(request)?;
        if request.model.is_dir {
            return Err(Refusal::usage(format!(
                "{} is a directory; --device hrx serves a .gguf file",
                o.model
            )));
        }
        let strict = strictness(request);
        let report = o.placement_report || strict == Strictness::Refusing;
        let ctx = options::context(request, None);

        let mut env = BTreeMap::new();
        if strict != Strictness::Off {
            env.insert("GGML_HRX_STRICT".to_string(), "1".to_string());
        }
        env.insert(
            "GGML_HRX_REPORT".to_string(),
            if report { "2" } else { "1" }.to_string(),
        );
        let libhsa = o
            .hrx_libhsa
            .clone()
            .or_else(|| find_libhsa(Path::new(THEROCK_DIR)).map(|p| p.display().to_string()));
        if let Some(libhsa) = libhsa {
            env.insert("IREE_HAL_AMDGPU_LIBHSA_PATH".to_string(), libhsa);
        }
        // HRX reports its whole pool free, so llama.cpp's --fit shrinks nothing: without
        // --ctx-size the backend takes the model's own context, and that is what is judged.
        let ctx_source = match (request.options.ctx_size, ctx, options::role(request)) {
            (Some(n), _, _) => format!("ctx {n} (--ctx-size)"),
            (None, Some(n), Some(role)) => {
                format!("ctx {n} (serve's default for --{role}; no --ctx-size)")
            }
            _ => match request.model.context_length {
                Some(n) => format!("the model's own ctx {n} (no --ctx-size)"),
                None => "the model's own ctx (no --ctx-size)".to_string(),
            },
        };
        let built = plan::build(
            request,
            plan::Main {
                route: "hrx".to_string(),
                device_argv: ["--device", "HRX0", "-ngl", "99"].map(String::from).into(),
                ctx,
                ctx_source,
                pool: "gtt".to_string(),
                env,
                after_options: if report {
                    vec!["-lv".to_string(), "4".to_string()]
                } else {
                    Vec::new()
                },
                // After the recipes, so that a recipe's own --cache-reuse wins over serve's.
                defaults: vec![vec!["--cache-reuse".to_string(), "256".to_string()]],
                full: true,
                // Every hrx backend serve starts runs under the same placement rules.
                side_env: true,
                ..Default::default()
            },
        )?;

        let no_warmup = request
            .env
            .get("ONEBIT_NO_WARMUP")
            .is_some_and(|v| v.trim() == "1");
        if request.purpose == Purpose::Serve {
            let watch = Watch::new(report, strict == Strictness::Refusing);
            if let Ok(mut slot) = self.watch.lock() {
                *slot = Some(watch);
            }
        }
        Ok(Plan {
            device: "hrx".to_string(),
            backends: built.backends,
            rules: built.rules,
            side_models: built.side_models,
            one_hop: true,
            warmups: if no_warmup { Vec::new() } else { warmups() },
            memory: built.memory.need,
            memory_unknown: built.memory.unknown,
            notes: built.notes,
            ..Default::default()
        })
    }

    fn on_backend_line(&self, line: &BackendLine) -> LineVerdict {
        if let Some(stop) = llama_server::rpc::lost_worker(&line.line) {
            return LineVerdict {
                say: Vec::new(),
                stop: Some(stop),
            };
        }
        match placement::parse(&line.line) {
            None => LineVerdict::default(),
            Some(PlacementLine::StrictAbort(what)) => LineVerdict {
                say: vec![placement::strict_refusal(&what)],
                stop: Some("HRX strict placement refused the model".to_string()),
            },
            Some(PlacementLine::Report(graph)) => {
                let Ok(mut slot) = self.watch.lock() else {
                    return LineVerdict::default();
                };
                let Some(watch) = slot.as_mut() else {
                    return LineVerdict::default();
                };
                let verdict = watch.observe(graph);
                let mut say: Vec<String> = verdict.say.into_iter().collect();
                let stop = verdict.stop.map(|refusal| {
                    say.push(refusal);
                    "HRX strict placement refused the model (--strict-device)".to_string()
                });
                LineVerdict { say, stop }
            }
        }
    }
}

export_route!(HrxRoute);

#[cfg(test)]
mod tests;
