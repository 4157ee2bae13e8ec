//! The cpu device route: the model in llama-server on the CPU, with no GPU layers.
#![deny(unsafe_code)]

use llama_server::log::{LogSeries, lost_device};
use llama_server::{options, plan};
use onebit_plugin_api::{
    BackendLine, Claim, DeviceRoute, LineVerdict, Plan, PlanRequest, Refusal, RouteInfo,
    export_route,
};

/// llama-server's own default context is the model's training context, which on a CPU
/// allocates the whole KV cache; serve asks for this much instead unless told otherwise.
pub const DEFAULT_CTX: u64 = 4096;

/// The micro-batch (`-ub`) the cpu route runs llama-server with unless an option, a recipe or
/// the user sets one.
pub const UBATCH: u32 = 256;

/// One per process: it keeps the series it derives from its backend's stderr.
#[derive(Default)]
pub struct CpuRoute {
    log: LogSeries,
}

impl DeviceRoute for CpuRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: "cpu".to_string(),
            summary: "llama-server on the CPU (-ngl 0)".to_string(),
        }
    }

    fn claim(&self, request: &PlanRequest) -> Claim {
        if request.model.is_dir {
            Claim::none()
        } else {
            Claim {
                strength: 10,
                reason: "any GGUF runs on the CPU".to_string(),
            }
        }
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        request.options.checked_route_options("cpu", &[])?;
        if request.options.model.is_empty() {
            // The drop-in's router mode: llama-server loads the models itself.
            let built = plan::router(request, &["-ngl", "0"])?;
            return Ok(Plan {
                device: "cpu".to_string(),
                backends: built.backends,
                rules: built.rules,
                ..Default::default()
            });
        }
        llama_server::refuse_h32(request)?;
        if request.model.is_dir {
            return Err(Refusal::usage(format!(
                "{} is a directory; --device cpu serves a .gguf file",
                request.options.model
            )));
        }
        if request.options.strict_device {
            return Err(Refusal::usage(
                "--strict-device needs the hrx route (--device hrx, or auto on a machine with HRX): the cpu route runs every node on the CPU; remove --strict-device",
            ));
        }
        let ctx = options::context(request, Some(DEFAULT_CTX)).unwrap_or(DEFAULT_CTX);
        let ctx_source = match (request.options.ctx_size, options::role(request)) {
            (Some(n), _) => format!("ctx {n} (--ctx-size)"),
            (None, Some(role)) => {
                format!("ctx {ctx} (serve's default for --{role}; no --ctx-size)")
            }
            (None, None) => format!("ctx {DEFAULT_CTX} (serve's CPU default; no --ctx-size)"),
        };
        let built = plan::build(
            request,
            plan::Main {
                route: "cpu".to_string(),
                device_argv: vec!["-ngl".to_string(), "0".to_string()],
                ctx: Some(ctx),
                ctx_source,
                pool: "ram".to_string(),
                full: true,
                // A 256-token micro-batch prefills as fast as llama-server's 512 on the CPU
                // (docs/performance.md), and the prompt cache restores a prefix cut at a
                // multiple of it: half the prompt left to prefill again at worst.
                defaults: vec![vec!["-ub".to_string(), UBATCH.to_string()]],
                ..Default::default()
            },
        )?;
        Ok(Plan {
            device: "cpu".to_string(),
            backends: built.backends,
            rules: built.rules,
            side_models: built.side_models,
            one_hop: true,
            warmups: Vec::new(),
            memory: built.memory.need,
            memory_unknown: built.memory.unknown,
            notes: built.notes,
            ..Default::default()
        })
    }

    /// A lost GPU stops serve; every line feeds the log-derived series.
    fn on_backend_line(&self, line: &BackendLine) -> LineVerdict {
        self.log.observe(&line.line);
        LineVerdict {
            say: Vec::new(),
            stop: lost_device(&line.line).or_else(|| llama_server::rpc::lost_worker(&line.line)),
        }
    }

    fn metrics(&self) -> String {
        self.log.render()
    }
}

export_route!(CpuRoute);

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::ServeOptions;

    fn request(ctx: Option<u64>) -> PlanRequest {
        PlanRequest {
            options: ServeOptions {
                model: "/m/SmolLM2.gguf".into(),
                served_name: "smol".into(),
                llama_server: Some("/bin/sh".into()),
                ctx_size: ctx,
                ..Default::default()
            },
            ports: vec![34567],
            ..Default::default()
        }
    }

    #[test]
    fn plan_runs_llama_server_on_the_cpu_with_a_bounded_context() {
        let plan = CpuRoute::default().plan(&request(None)).unwrap();
        let argv = &plan.backends[0].argv;
        let joined = argv.join(" ");
        assert_eq!(argv[0], "/bin/sh");
        assert!(joined.contains("-m /m/SmolLM2.gguf --host 127.0.0.1 --port 34567"));
        assert!(joined.contains("-ngl 0"));
        assert!(joined.contains("--jinja") && joined.contains("--metrics"));
        assert!(joined.contains("--alias smol"));
        assert!(joined.ends_with("-c 4096 -ub 256"), "{joined}");
        assert!(plan.one_hop);
        let plan = CpuRoute::default().plan(&request(Some(512))).unwrap();
        assert!(plan.backends[0].argv.join(" ").ends_with("-c 512 -ub 256"));
    }

    #[test]
    fn strict_device_and_an_unbuilt_architecture_are_refused() {
        let mut r = request(None);
        r.options.strict_device = true;
        assert!(
            CpuRoute::default()
                .plan(&r)
                .unwrap_err()
                .message
                .contains("--strict-device needs")
        );
        let mut r = request(None);
        r.model.architecture = Some("zamba2".into());
        assert_eq!(CpuRoute::default().plan(&r).unwrap_err().exit_code, 2);
        r.model.architecture = Some("llama".into());
        assert!(CpuRoute::default().plan(&r).is_ok());
        r.options.ssd_streaming = true;
        assert!(
            CpuRoute::default()
                .plan(&r)
                .unwrap_err()
                .message
                .contains("needs --device ds4")
        );
    }

    #[test]
    fn a_model_directory_is_not_claimed_and_not_planned() {
        let mut r = request(None);
        r.model.is_dir = true;
        assert_eq!(CpuRoute::default().claim(&r).strength, 0);
        assert_eq!(CpuRoute::default().plan(&r).unwrap_err().exit_code, 2);
    }

    #[test]
    fn a_lost_gpu_line_stops_serve_and_report_lines_become_series() {
        let route = CpuRoute::default();
        let line = |l: &str| BackendLine {
            backend: 0,
            line: l.into(),
        };
        assert_eq!(
            route.on_backend_line(&line("srv  all slots are idle")).stop,
            None
        );
        let verdict = route.on_backend_line(&line("ggml_hrx: AMDGPU hardware exception"));
        assert!(verdict.stop.unwrap().contains("AMDGPU hardware exception"));
        route.on_backend_line(&line("W hrx: CPU fallback: MUL_MAT=2"));
        assert!(
            route
                .metrics()
                .contains("onebit_cpu_fallback_ops{op=\"MUL_MAT\"} 2")
        );
    }
}
