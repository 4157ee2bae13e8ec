//! What `--device zeta` decides before anything starts: the claim, and the plan serve carries
//! out (the engine program to start, its port, health and metrics routes, the request table,
//! the device memory the host's memory check judges). Pure: these read the request and look at
//! files; they start nothing (serve starts the engine).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use onebit_plugin_api::{
    BackendSpec, Claim, DeviceMemory, MemoryNeed, Plan, PlanRequest, Refusal, Rule,
    llama_server_rules,
};

use crate::NAME;

/// The engine program's file name: in the package (`--carry target/release/zeta-engine=1.0.0`)
/// and, for a loose build, beside the route library.
pub const ENGINE_FILE: &str = "zeta-engine";

/// The claim's strength for a GGUF when the engine and a Zeta device are both present: a
/// vendor accelerator that serves the model better than the public routes (cpu 10, hrx 50),
/// so `--device auto` picks it on a machine that has one. Without the device it claims
/// nothing: auto then picks a public route rather than one whose engine cannot run.
pub const CLAIM_STRENGTH: u8 = 95;

/// The route options `--route-opt KEY=VALUE` this route knows.
pub const ROUTE_OPTIONS: [&str; 1] = ["max_tokens_cap"];

/// The variable, read from the request's environment, naming the Zeta device node when it is
/// not [`DEFAULT_DEVICE`] (the stand-in engine runs on any file named so; a test points it at
/// one).
pub const DEVICE_VAR: &str = "ZETA_DEVICE";

/// Where the Zeta driver puts its first device.
pub const DEFAULT_DEVICE: &str = "/dev/zeta0";

/// The Zeta device's name in serve's memory line.
pub const DEVICE_NAME: &str = "zeta0";

/// The Zeta device's own memory: 8 GiB.
pub const DEVICE_TOTAL_BYTES: u64 = 8 << 30;

/// Free device memory when [`FREE_BYTES_VAR`] is not set: 6 GiB. A real route asks its driver
/// in `plan` (a query, not a load).
pub const DEFAULT_FREE_BYTES: u64 = 6 << 30;

/// The variable, read from the request's environment, that sets the free device memory in
/// bytes, so a test can simulate a full device (serve then exits 3).
pub const FREE_BYTES_VAR: &str = "ZETA_DEVICE_FREE_BYTES";

/// What the engine takes on the device besides the weights (its compiled graph and buffers).
pub const ENGINE_SCRATCH_BYTES: u64 = 128 << 20;

/// The paths the engine answers besides its health and metrics routes: serve relays these to
/// it; any other path gets 404 from serve.
pub const ENGINE_PATHS: [&str; 2] = ["/v1/chat/completions", "/chat/completions"];

/// The context the memory line names when neither `--ctx-size` nor the model gives one.
const DEFAULT_CTX: u64 = 4096;

/// Whether the model is one GGUF file: the host read an architecture from its header, or its
/// name ends in `.gguf`.
fn is_gguf(request: &PlanRequest) -> bool {
    let model = &request.model;
    !model.is_dir
        && (model.architecture.is_some() || model.path.to_ascii_lowercase().ends_with(".gguf"))
}

/// The model as the user named it, for lines.
fn model_name(request: &PlanRequest) -> &str {
    if request.options.model.is_empty() {
        &request.model.path
    } else {
        &request.options.model
    }
}

/// Where the engine program is, or where the route looked and what to do, in one line.
///
/// From a package, it is the file the manifest names [`ENGINE_FILE`], which the host checked
/// against its sha256 before `claim`; a file of that name lying unlisted in the package is not
/// trusted. A loose route file (a build folder, `--plugin-dir target/release`) finds it beside
/// itself, in [`PlanRequest::route_dir`]. Either way it must be executable: serve runs it.
pub fn find_engine(request: &PlanRequest) -> Result<PathBuf, String> {
    let path = if let Some(package) = &request.package {
        match package.file(ENGINE_FILE) {
            Some(file) => PathBuf::from(&file.path),
            None => {
                return Err(format!(
                    "the zeta package in {} carries no {ENGINE_FILE}; rebuild it with 1bit plugins package --carry target/release/{ENGINE_FILE}=1.0.0 and reinstall it",
                    package.dir
                ));
            }
        }
    } else if request.route_dir.is_empty() {
        return Err(format!(
            "this 1bit tells routes no folder (a host before route ABI 1.8), so the zeta route cannot find {ENGINE_FILE}; upgrade 1bit"
        ));
    } else {
        Path::new(&request.route_dir).join(ENGINE_FILE)
    };
    let mode = match std::fs::metadata(&path) {
        Ok(meta) if meta.is_file() => meta.permissions().mode(),
        _ if request.package.is_some() => {
            return Err(format!(
                "the zeta package lists {ENGINE_FILE} but {} is missing; reinstall the package (1bit plugins install)",
                path.display()
            ));
        }
        _ => {
            return Err(format!(
                "the zeta route found no engine at {}; put {ENGINE_FILE} beside libonebit_route_zeta.so (cargo build --release builds both into target/release) or install the zeta package",
                path.display()
            ));
        }
    };
    if mode & 0o111 == 0 {
        return Err(format!(
            "the Zeta engine {} is not executable (mode {:o}); reinstall the package with a 1bit that keeps file modes, or chmod +x it",
            path.display(),
            mode & 0o7777
        ));
    }
    Ok(path)
}

/// The Zeta device node: [`DEVICE_VAR`]'s path, else [`DEFAULT_DEVICE`]; or why there is none,
/// in one line.
pub fn find_device(request: &PlanRequest) -> Result<PathBuf, String> {
    let named = request.env.get(DEVICE_VAR).filter(|v| !v.is_empty());
    let path = PathBuf::from(named.map_or(DEFAULT_DEVICE, String::as_str));
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "no Zeta device at {}; install the Zeta driver, or set {DEVICE_VAR} to the device node",
            path.display()
        ))
    }
}

/// Under `--device auto`: [`CLAIM_STRENGTH`] for a GGUF file when the engine and a device are
/// present, else no claim, each with its reason.
pub fn claim(request: &PlanRequest) -> Claim {
    let refused = |reason: String| Claim {
        strength: 0,
        reason,
    };
    if !is_gguf(request) {
        return refused(format!("{} is not a GGUF file", model_name(request)));
    }
    let engine = match find_engine(request) {
        Ok(path) => path,
        Err(_) => return refused(format!("the Zeta engine ({ENGINE_FILE}) is not installed")),
    };
    match find_device(request) {
        Ok(device) => Claim {
            strength: CLAIM_STRENGTH,
            reason: format!(
                "the Zeta NPU {} runs GGUF models with its engine {}",
                device.display(),
                engine.display()
            ),
        },
        Err(why) => refused(why),
    }
}

/// The plan for `request`: the route options checked, the engine and the device found, one
/// backend (the engine on the first reserved port), the request table relayed to it, and the
/// device memory the check judges.
pub fn plan(request: &PlanRequest) -> Result<Plan, Refusal> {
    let options = request
        .options
        .checked_route_options(NAME, &ROUTE_OPTIONS)?;
    let max_tokens_cap = match options.get("max_tokens_cap") {
        Some(value) => Some(value.trim().parse::<u32>().ok().filter(|n| *n >= 1).ok_or_else(
            || {
                Refusal::usage(format!(
                    "--route-opt max_tokens_cap={value}: the zeta route takes a whole number of tokens from 1; pass one such as 256"
                ))
            },
        )?),
        None => None,
    };
    if !is_gguf(request) {
        return Err(Refusal::usage(format!(
            "the zeta route serves one GGUF file, and {} is not one; pass a .gguf model",
            model_name(request)
        )));
    }
    let engine = find_engine(request).map_err(Refusal::engine)?;
    let device = find_device(request).map_err(Refusal::engine)?;
    let Some(&port) = request.ports.first() else {
        return Err(Refusal::engine(
            "this 1bit reserved no port for the Zeta engine; upgrade 1bit",
        ));
    };
    let served_name = if request.options.served_name.is_empty() {
        NAME.to_string()
    } else {
        request.options.served_name.clone()
    };
    let mut argv = vec![
        engine.display().to_string(),
        "--host".to_string(),
        "127.0.0.1".to_string(),
        "--port".to_string(),
        port.to_string(),
        "--model".to_string(),
        request.model.path.clone(),
        "--device".to_string(),
        device.display().to_string(),
        "--alias".to_string(),
        served_name,
    ];
    if let Some(cap) = max_tokens_cap {
        argv.extend(["--max-tokens-cap".to_string(), cap.to_string()]);
    }
    let backend = BackendSpec {
        engine: ENGINE_FILE.to_string(),
        argv,
        port,
        health_path: "/health".to_string(),
        metrics_path: Some("/metrics".to_string()),
        ..Default::default()
    };
    let from = match &request.package {
        Some(package) => format!("package {} {}", package.name, package.version),
        None => "a loose build".to_string(),
    };
    let mut notes = vec![format!(
        "zeta: engine {} ({from}) on device {}",
        engine.display(),
        device.display()
    )];
    if let Some(cap) = max_tokens_cap {
        notes.push(format!("zeta: at most {cap} tokens a reply"));
    }
    Ok(Plan {
        device: NAME.to_string(),
        backends: vec![backend],
        rules: rules(),
        // serve stays in the path: it supervises the engine and what the engine starts.
        one_hop: false,
        serve_in_path: "--device zeta (serve supervises the Zeta engine and its device monitor)"
            .to_string(),
        memory: Some(memory(request)?),
        notes,
        ..Default::default()
    })
}

/// The request table: the engine's chat paths, relayed to backend 0 as the llama-server routes
/// relay them (plugin-api's own rules for those paths: a JSON body, a generation, OpenAI's
/// reply shape). serve answers `/health`, `/v1/health`, `/v1/models` and `/metrics` itself
/// (from the engine's health and metrics routes), so they are never in the table.
pub fn rules() -> Vec<Rule> {
    llama_server_rules(0)
        .into_iter()
        .filter(|rule| ENGINE_PATHS.contains(&rule.path.as_str()))
        .collect()
}

/// What the memory check judges: the weights and the engine's buffers, against the device's
/// own memory (`pool: "device"`), whose free bytes come from [`FREE_BYTES_VAR`] when it is set.
fn memory(request: &PlanRequest) -> Result<MemoryNeed, Refusal> {
    let free_bytes = match request.env.get(FREE_BYTES_VAR) {
        Some(value) => value.trim().parse::<u64>().map_err(|_| {
            Refusal::usage(format!(
                "{FREE_BYTES_VAR}={value}: not a number of bytes; set a whole number such as 6442450944, or unset it"
            ))
        })?,
        None => DEFAULT_FREE_BYTES,
    };
    let (ctx, ctx_source) = match (request.options.ctx_size, request.model.context_length) {
        (Some(n), _) => (n, format!("ctx {n} (--ctx-size)")),
        (None, Some(n)) => (n, format!("the model's own ctx {n} (no --ctx-size)")),
        (None, None) => (
            DEFAULT_CTX,
            format!("ctx {DEFAULT_CTX} (the zeta route's default; no --ctx-size)"),
        ),
    };
    Ok(MemoryNeed {
        weights_bytes: request.model.bytes,
        compute_bytes: ENGINE_SCRATCH_BYTES,
        ctx,
        ctx_source,
        pool: "device".to_string(),
        device: Some(DeviceMemory {
            name: DEVICE_NAME.to_string(),
            total_bytes: DEVICE_TOTAL_BYTES,
            free_bytes,
        }),
        ..Default::default()
    })
}
