//! The hybrid device route: a prefill provider computes each prompt's KV cache, and a one-slot
//! llama-server decodes from it after restoring it (docs/hybrid.md).
#![deny(unsafe_code)]

mod error;
mod handoff;
mod provider;

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use llama_server::log::lost_device;
use llama_server::plan;
use onebit_plugin_api::{
    Action, BackendLine, DeviceRoute, Forward, ForwardRequest, HostServices, LineVerdict, Plan,
    PlanRequest, Refusal, RouteInfo, Rule, Started, export_route,
};
use serde::{Deserialize, Serialize};

/// The decoder's context when `--ctx-size` is not given: the cpu route's default, for the same
/// reason (llama-server's own default allocates the model's whole training context).
pub const DEFAULT_CTX: u64 = 4096;

/// The provider's time limit when `ONEBIT_HYBRID_PREFILL_TIMEOUT_S` is not set.
pub const DEFAULT_PREFILL_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a provider has to exit after SIGTERM before it gets SIGKILL.
pub const PROVIDER_STOP_GRACE: Duration = Duration::from_secs(2);

/// Flags the route refuses, each with why, as the user typed it.
const REFUSED_FLAGS: [(&str, &str); 9] = [
    (
        "--mtp",
        "only the prompt's KV is handed over, and a drafter would draft over a cache it did not compute",
    ),
    (
        "--dflash",
        "only the prompt's KV is handed over, and a drafter would draft over a cache it did not compute",
    ),
    ("--mmproj", "the handoff carries text tokens only"),
    ("--moe-slots", "expert streaming is not part of the handoff"),
    ("--embedding", "it serves generation, not embeddings"),
    ("--reranking", "it serves generation, not reranking"),
    (
        "--pm",
        "per-request expert picking is not part of the handoff",
    ),
    (
        "--embed",
        "its one slot serves the chat model; run the embedder with --device cpu",
    ),
    (
        "--rerank",
        "its one slot serves the chat model; run the reranker with --device cpu",
    ),
];

/// What the route decided at plan time and needs per request; carried through
/// `Plan::route_state` into [`DeviceRoute::start`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// The provider program; None means the backend prefills every request itself.
    pub provider: Option<String>,
    /// `ONEBIT_HYBRID_ELFS`, passed on as `--elfs`.
    pub elfs: Option<String>,
    /// The backend's `--slot-save-path` (serve's run directory).
    pub slot_dir: String,
    /// `-m`, as given.
    pub model: String,
    /// The decoding llama-server's address, for `ONEBIT_HYBRID_BACKEND_URL`.
    pub backend_url: String,
    /// The provider's time limit in seconds.
    pub timeout_s: f64,
    /// The decoder's llama-server, for `ONEBIT_PREFILL_LLAMA_SERVER` (a provider that starts a
    /// server of its own starts the same one); None when the user's environment names one.
    pub prefill_server: Option<String>,
}

/// One per process: the settings from `start`, and a counter naming each handoff's files.
#[derive(Default)]
pub struct HybridRoute {
    settings: OnceLock<Settings>,
    handoffs: AtomicU64,
}

impl DeviceRoute for HybridRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: "hybrid".to_string(),
            summary: "a prefill provider computes the prompt, llama-server decodes from its KV"
                .to_string(),
        }
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        request.options.checked_route_options("hybrid", &[])?;
        llama_server::refuse_h32(request)?;
        if request.purpose == onebit_plugin_api::Purpose::PrintBackend {
            // The prefill handoff happens in serve, between the provider and llama-server.
            return Err(Refusal::needs_serve("--device hybrid"));
        }
        if request.model.is_dir {
            return Err(Refusal::usage(format!(
                "{} is a directory; --device hybrid serves a .gguf file",
                request.options.model
            )));
        }
        refuse_flags(request)?;
        let provider = provider_path(request)?;
        let port = *request
            .ports
            .first()
            .ok_or_else(|| Refusal::usage("the host reserved no port for the backend"))?;
        let ctx = request.options.ctx_size.unwrap_or(DEFAULT_CTX);
        let ctx_source = match request.options.ctx_size {
            Some(n) => format!("ctx {n} (--ctx-size)"),
            None => format!("ctx {DEFAULT_CTX} (serve's hybrid default; no --ctx-size)"),
        };
        // The decoder is the HRX llama-server where the machine has HRX, else the CPU one; one
        // slot, whose state serve saves and restores in the run directory.
        let on_hrx = llama_server::hrx_present(request);
        let mut env = BTreeMap::new();
        if on_hrx {
            // Every hrx backend serve starts runs under strict placement (unless opted out).
            if llama_server::hrx_strict(request) {
                env.insert("GGML_HRX_STRICT".to_string(), "1".to_string());
            }
            env.insert("GGML_HRX_REPORT".to_string(), "1".to_string());
        }
        let mut one_slot = request.clone();
        one_slot.options.parallel = Some(1);
        let built = plan::build(
            &one_slot,
            plan::Main {
                route: "hybrid".to_string(),
                device_argv: if on_hrx {
                    ["--device", "HRX0", "-ngl", "99"].map(String::from).into()
                } else {
                    ["-ngl", "0"].map(String::from).into()
                },
                ctx: Some(ctx),
                ctx_source,
                pool: if on_hrx { "gtt" } else { "ram" }.to_string(),
                env,
                fixed_argv: vec![
                    "-np".to_string(),
                    "1".to_string(),
                    "--slot-save-path".to_string(),
                    request.run_dir.clone(),
                ],
                full: false,
                ..Default::default()
            },
        )?;
        let memory = built.memory;
        let decoder = built
            .backends
            .into_iter()
            .next()
            .ok_or_else(|| Refusal::usage("the hybrid plan built no decoder"))?;
        let settings = Settings {
            provider: provider.clone(),
            elfs: request
                .env
                .get("ONEBIT_HYBRID_ELFS")
                .filter(|v| !v.is_empty())
                .cloned(),
            slot_dir: request.run_dir.clone(),
            model: request.options.model.clone(),
            backend_url: format!("http://127.0.0.1:{port}"),
            timeout_s: prefill_timeout(request)?.as_secs_f64(),
            prefill_server: decoder
                .argv
                .first()
                .filter(|_| !request.env.contains_key("ONEBIT_PREFILL_LLAMA_SERVER"))
                .cloned(),
        };
        let notes = match &provider {
            Some(p) => vec![format!(
                "hybrid: prefill provider {p} (time limit {} s); the decoder restores its KV into slot 0",
                settings.timeout_s
            )],
            None => vec![
                "hybrid: no prefill provider named (--prefill-provider PATH or ONEBIT_HYBRID_PREFILL): the backend prefills every request itself, on one slot".to_string(),
            ],
        };
        Ok(Plan {
            device: "hybrid".to_string(),
            backends: vec![decoder],
            rules: rules(provider.is_some()),
            // serve is in the request path: it hands each prompt over.
            one_hop: false,
            warmups: Vec::new(),
            memory: memory.need,
            memory_unknown: memory.unknown,
            notes,
            serialize_forwards: provider.is_some(),
            route_state: serde_json::to_value(&settings).unwrap_or_default(),
            ..Default::default()
        })
    }

    fn start(&self, started: &Started) -> Result<(), onebit_plugin_api::RouteError> {
        let settings: Settings = serde_json::from_value(started.plan.route_state.clone())
            .map_err(|e| onebit_plugin_api::RouteError::new(format!("bad route state: {e}")))?;
        let _ = self.settings.set(settings);
        Ok(())
    }

    fn on_backend_line(&self, line: &BackendLine) -> LineVerdict {
        LineVerdict {
            say: Vec::new(),
            stop: lost_device(&line.line),
        }
    }

    /// Runs the handoff; any failure is said and the request goes to the backend as it came.
    fn forward(&self, request: &ForwardRequest, host: &dyn HostServices) -> Forward {
        let as_it_came = Forward::Proxy {
            backend: 0,
            body: None,
            first_byte_line: None,
        };
        let Some(settings) = self.settings.get() else {
            return as_it_came;
        };
        let seq = self.handoffs.fetch_add(1, Ordering::Relaxed);
        match handoff::run(settings, request, host, seq) {
            Ok(done) => Forward::Proxy {
                backend: 0,
                body: Some(done.body),
                first_byte_line: Some(format!(
                    "hybrid: {} prompt tokens: prefill {:.1} ms, restore {:.1} ms, first byte {{first_byte_ms}} ms",
                    done.n_tokens, done.prefill_ms, done.restore_ms
                )),
            },
            Err(reason) => {
                eprintln!("hybrid: fallback: {reason}; the backend prefills this request itself");
                as_it_came
            }
        }
    }
}

export_route!(HybridRoute);

/// The request table: chats and completions ask the route (when a provider is named), the rest
/// is relayed; slot actions stay serve's own.
fn rules(handoff: bool) -> Vec<Rule> {
    const HANDED_OFF: [&str; 5] = [
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/completions",
        "/completions",
        "/completion",
    ];
    let mut rules = llama_server::rules();
    for rule in &mut rules {
        if handoff && rule.method == "POST" && HANDED_OFF.contains(&rule.path.as_str()) {
            rule.action = Action::AskRoute;
        }
        if rule.path == "/slots/*" {
            rule.action = Action::Answer {
                status: 501,
                content_type: "application/json".to_string(),
                body: onebit_plugin_api::error_body(
                    501,
                    "not_supported_error",
                    "slot save and restore are serve's own on --device hybrid (it hands prompts over through slot 0); use another --device to save slots",
                ),
            };
        }
    }
    rules
}

/// A flag of the command line, as `--flag`, `--flag VALUE` or `--flag=VALUE`.
fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter()
        .any(|a| a == flag || a.strip_prefix(flag).is_some_and(|r| r.starts_with('=')))
}

/// The value of `--flag VALUE` or `--flag=VALUE`, the last one given.
fn flag_value(args: &[String], flag: &str) -> Option<String> {
    let mut found = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == flag {
            found = it.next().cloned();
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            found = Some(v.to_string());
        }
    }
    found
}

/// `--parallel` > 1 and the flags that would hand over more than the prompt's KV.
fn refuse_flags(request: &PlanRequest) -> Result<(), Refusal> {
    if let Some(n) = request.options.parallel.filter(|n| *n > 1) {
        return Err(Refusal::usage(format!(
            "--parallel {n}: --device hybrid runs one slot and hands prompts over one at a time; remove --parallel"
        )));
    }
    for (flag, why) in REFUSED_FLAGS {
        if has_flag(&request.options.args, flag) {
            return Err(Refusal::usage(format!(
                "{flag} cannot be used with --device hybrid: {why}; remove {flag}"
            )));
        }
    }
    Ok(())
}

/// `--prefill-provider PATH`, else `ONEBIT_HYBRID_PREFILL`; a named program must be executable.
fn provider_path(request: &PlanRequest) -> Result<Option<String>, Refusal> {
    let (path, what) = match flag_value(&request.options.args, "--prefill-provider") {
        Some(p) => (p, "--prefill-provider"),
        None => match request
            .env
            .get("ONEBIT_HYBRID_PREFILL")
            .filter(|v| !v.is_empty())
        {
            Some(p) => (p.clone(), "ONEBIT_HYBRID_PREFILL"),
            None => return Ok(None),
        },
    };
    use std::os::unix::fs::PermissionsExt;
    let executable = std::path::Path::new(&path)
        .metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if !executable {
        return Err(Refusal::usage(format!(
            "{what} {path}: not an executable file; pass the prefill provider program, or name none to let the backend prefill"
        )));
    }
    Ok(Some(path))
}

/// `ONEBIT_HYBRID_PREFILL_TIMEOUT_S`, a positive number of seconds, default 600.
fn prefill_timeout(request: &PlanRequest) -> Result<Duration, Refusal> {
    match request
        .env
        .get("ONEBIT_HYBRID_PREFILL_TIMEOUT_S")
        .filter(|v| !v.trim().is_empty())
    {
        None => Ok(DEFAULT_PREFILL_TIMEOUT),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Refusal::usage(format!(
                    "ONEBIT_HYBRID_PREFILL_TIMEOUT_S={v}: not a positive number of seconds; set one such as 600"
                ))
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::ServeOptions;

    fn request(args: &[&str], env: &[(&str, &str)]) -> PlanRequest {
        PlanRequest {
            options: ServeOptions {
                model: "/m/SmolLM2.gguf".into(),
                served_name: "smol".into(),
                llama_server: Some("/bin/sh".into()),
                args: args.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ports: vec![34567],
            run_dir: "/tmp/run".into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_decoder_has_one_slot_and_the_run_dir_for_slot_files() {
        let plan = HybridRoute::default()
            .plan(&request(&["--prefill-provider", "/bin/true"], &[]))
            .unwrap();
        let argv = plan.backends[0].argv.join(" ");
        assert!(argv.contains("-np 1 --slot-save-path /tmp/run"), "{argv}");
        assert!(argv.contains("-c 4096"), "{argv}");
        assert!(!plan.one_hop);
        assert!(plan.serialize_forwards);
        let chat = plan
            .rules
            .iter()
            .find(|r| r.path == "/v1/chat/completions")
            .unwrap();
        assert_eq!(chat.action, Action::AskRoute);
        let settings: Settings = serde_json::from_value(plan.route_state).unwrap();
        assert_eq!(settings.provider.as_deref(), Some("/bin/true"));
        assert_eq!(settings.backend_url, "http://127.0.0.1:34567");
        assert_eq!(settings.timeout_s, 600.0);
    }

    #[test]
    fn without_a_provider_requests_are_relayed_and_a_note_says_so() {
        let plan = HybridRoute::default().plan(&request(&[], &[])).unwrap();
        assert!(plan.rules.iter().all(|r| r.action != Action::AskRoute));
        assert!(!plan.serialize_forwards);
        assert!(
            plan.notes[0].contains("no prefill provider"),
            "{:?}",
            plan.notes
        );
    }

    #[test]
    fn the_environment_names_the_provider_and_its_limit() {
        let r = request(
            &[],
            &[
                ("ONEBIT_HYBRID_PREFILL", "/bin/true"),
                ("ONEBIT_HYBRID_PREFILL_TIMEOUT_S", "1"),
                ("ONEBIT_HYBRID_ELFS", "/elfs"),
            ],
        );
        let plan = HybridRoute::default().plan(&r).unwrap();
        let settings: Settings = serde_json::from_value(plan.route_state).unwrap();
        assert_eq!(settings.provider.as_deref(), Some("/bin/true"));
        assert_eq!(settings.timeout_s, 1.0);
        assert_eq!(settings.elfs.as_deref(), Some("/elfs"));
        let r = request(&[], &[("ONEBIT_HYBRID_PREFILL_TIMEOUT_S", "soon")]);
        assert_eq!(HybridRoute::default().plan(&r).unwrap_err().exit_code, 2);
        let r = request(&["--prefill-provider=/nonexistent/p"], &[]);
        let refusal = HybridRoute::default().plan(&r).unwrap_err();
        assert!(refusal.message.contains("/nonexistent/p"), "{refusal:?}");
    }

    #[test]
    fn drafting_images_roles_and_more_slots_are_refused() {
        for flag in ["--mtp", "--dflash", "--mmproj", "--moe-slots", "--pm"] {
            let r = request(&[flag, "x"], &[]);
            let refusal = HybridRoute::default().plan(&r).unwrap_err();
            assert_eq!(refusal.exit_code, 2);
            assert!(refusal.message.starts_with(flag), "{refusal:?}");
        }
        for flag in ["--embedding", "--reranking"] {
            let refusal = HybridRoute::default()
                .plan(&request(&[flag], &[]))
                .unwrap_err();
            assert!(refusal.message.contains("--device hybrid"), "{refusal:?}");
        }
        assert!(
            HybridRoute::default()
                .plan(&request(&["--pm-experts", "f"], &[]))
                .is_ok()
        );
        let mut r = request(&[], &[]);
        r.options.parallel = Some(2);
        let refusal = HybridRoute::default().plan(&r).unwrap_err();
        assert!(refusal.message.starts_with("--parallel 2"), "{refusal:?}");
    }
}
