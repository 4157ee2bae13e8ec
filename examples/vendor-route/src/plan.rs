//! What `--device acme` decides before anything loads: the claim, the plan, and the state the
//! plan hands to `start`. Pure: these read the request and look at files, and load nothing (the
//! kernels library is opened by `start` alone).

use std::path::{Path, PathBuf};

use onebit_plugin_api::{
    Action, BodyKind, Claim, DeviceMemory, MemoryNeed, Plan, PlanRequest, Refusal, Rule,
};
use serde::{Deserialize, Serialize};

use crate::NAME;
use crate::kernels::KERNELS_FILE;

/// The claim's strength for a GGUF when the kernels are in place: an add-on that serves a model
/// better than the public route for its format (plugin-api's convention), so it outranks cpu
/// (10), hrx (50) and npu (90).
pub const CLAIM_STRENGTH: u8 = 95;

/// The route options `--route-opt KEY=VALUE` this route knows.
pub const ROUTE_OPTIONS: [&str; 1] = ["max_tokens_cap"];

/// The most tokens one reply may have when `--route-opt max_tokens_cap` is not given; a
/// request's own `max_tokens` is held to the cap.
pub const DEFAULT_MAX_TOKENS_CAP: u32 = 1024;

/// The Acme device's name in serve's memory line.
pub const DEVICE_NAME: &str = "acme0";

/// The Acme device's own memory (what `acme_device_total_bytes` reports): 4 GiB.
pub const DEVICE_TOTAL_BYTES: u64 = 4 << 30;

/// Free device memory when [`FREE_BYTES_VAR`] is not set: 3 GiB. A real route reads it from
/// its driver in `plan` (a query, not a load).
pub const DEFAULT_FREE_BYTES: u64 = 3 << 30;

/// The variable, read from the request's environment, that sets the free device memory in
/// bytes, so a test can simulate a full device.
pub const FREE_BYTES_VAR: &str = "ACME_DEVICE_FREE_BYTES";

/// What the kernels take on the device besides the weights (their working buffers).
pub const KERNEL_SCRATCH_BYTES: u64 = 64 << 20;

/// The context the memory line names when neither `--ctx-size` nor the model gives one.
const DEFAULT_CTX: u64 = 4096;

/// What `plan` decided and `start` acts on, carried in [`Plan::route_state`] as a JSON object
/// with these keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct State {
    /// The kernels library's absolute path.
    pub kernels: String,
    /// The name replies give as their `model` (`--alias`, else the model file's stem).
    pub served_name: String,
    /// The most tokens one reply may have.
    pub max_tokens_cap: u32,
}

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

/// Where the kernels library is, or where the route looked for it and what to do, in one line.
///
/// From a package, it is the file the manifest names [`KERNELS_FILE`], which the host checked
/// against its sha256 before `claim`; a file of that name lying unlisted in the package is not
/// trusted. A loose route file (a build folder, `--plugin-dir target/release`) finds it beside
/// itself, in [`PlanRequest::route_dir`].
pub fn find_kernels(request: &PlanRequest) -> Result<PathBuf, String> {
    if let Some(package) = &request.package {
        return match package.file(KERNELS_FILE) {
            Some(file) if Path::new(&file.path).is_file() => Ok(PathBuf::from(&file.path)),
            Some(file) => Err(format!(
                "the acme package in {} lists {KERNELS_FILE} but {} is missing; reinstall the package (1bit plugins install)",
                package.dir, file.path
            )),
            None => Err(format!(
                "the acme package in {} carries no {KERNELS_FILE}; rebuild it with 1bit plugins package --carry target/release/{KERNELS_FILE}=1.0.3 and reinstall it",
                package.dir
            )),
        };
    }
    if request.route_dir.is_empty() {
        return Err(format!(
            "this 1bit tells routes no folder (a host before route ABI 1.8), so the acme route cannot find {KERNELS_FILE}; upgrade 1bit"
        ));
    }
    let path = Path::new(&request.route_dir).join(KERNELS_FILE);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the acme route found no kernels library at {}; put {KERNELS_FILE} beside libonebit_route_acme.so (cargo build --release builds both into target/release) or install the acme package",
            path.display()
        ))
    }
}

/// Under `--device auto`: [`CLAIM_STRENGTH`] for a GGUF file when the kernels library is in
/// place, else no claim (so auto picks a public route rather than one that would refuse), each
/// with its reason.
pub fn claim(request: &PlanRequest) -> Claim {
    if !is_gguf(request) {
        return Claim {
            strength: 0,
            reason: format!("{} is not a GGUF file", model_name(request)),
        };
    }
    match find_kernels(request) {
        Ok(path) => Claim {
            strength: CLAIM_STRENGTH,
            reason: format!(
                "the Acme NPU runs GGUF models; its kernels are {}",
                path.display()
            ),
        },
        Err(_) => Claim {
            strength: 0,
            reason: format!("the Acme kernels ({KERNELS_FILE}) are not installed"),
        },
    }
}

/// The plan for `request`: the route options checked, the kernels found (not loaded), the
/// device memory the check judges, one in-process rule, and the [`State`] `start` acts on.
/// Pure: it reads the request and looks at one file.
pub fn plan(request: &PlanRequest) -> Result<Plan, Refusal> {
    let options = request
        .options
        .checked_route_options(NAME, &ROUTE_OPTIONS)?;
    let max_tokens_cap = match options.get("max_tokens_cap") {
        Some(value) => value
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| {
                Refusal::usage(format!(
                    "--route-opt max_tokens_cap={value}: the acme route takes a whole number of tokens from 1; pass one such as 256"
                ))
            })?,
        None => DEFAULT_MAX_TOKENS_CAP,
    };
    if !is_gguf(request) {
        return Err(Refusal::usage(format!(
            "the acme route serves one GGUF file, and {} is not one; pass a .gguf model",
            model_name(request)
        )));
    }
    let kernels = find_kernels(request).map_err(Refusal::engine)?;
    let served_name = if request.options.served_name.is_empty() {
        NAME.to_string()
    } else {
        request.options.served_name.clone()
    };
    let state = State {
        kernels: kernels.display().to_string(),
        served_name,
        max_tokens_cap,
    };
    Ok(Plan {
        device: NAME.to_string(),
        backends: Vec::new(),
        rules: rules(),
        one_hop: false,
        serve_in_path: "--device acme (the model runs inside serve, on the Acme NPU)".to_string(),
        memory: Some(memory(request)?),
        notes: vec![format!(
            "acme: kernels {}, at most {max_tokens_cap} tokens a reply",
            kernels.display()
        )],
        route_state: serde_json::to_value(&state).expect("the state is plain data"),
        ..Default::default()
    })
}

/// The request table: chat completions answered in process. serve answers `/health`,
/// `/v1/health`, `/v1/models` and `/metrics` itself (from the route's `health` and `metrics`),
/// so they are never in the table; any other path gets 404.
fn rules() -> Vec<Rule> {
    vec![Rule {
        method: "POST".to_string(),
        path: "/v1/chat/completions".to_string(),
        action: Action::InProcess,
        inference: true,
        body: BodyKind::Json,
        ..Default::default()
    }]
}

/// What the memory check judges: the weights and the kernels' buffers, against the device's own
/// memory (`pool: "device"`), whose free bytes come from [`FREE_BYTES_VAR`] when it is set.
fn memory(request: &PlanRequest) -> Result<MemoryNeed, Refusal> {
    let free_bytes = match request.env.get(FREE_BYTES_VAR) {
        Some(value) => value.trim().parse::<u64>().map_err(|_| {
            Refusal::usage(format!(
                "{FREE_BYTES_VAR}={value}: not a number of bytes; set a whole number such as 3221225472, or unset it"
            ))
        })?,
        None => DEFAULT_FREE_BYTES,
    };
    let (ctx, ctx_source) = match (request.options.ctx_size, request.model.context_length) {
        (Some(n), _) => (n, format!("ctx {n} (--ctx-size)")),
        (None, Some(n)) => (n, format!("the model's own ctx {n} (no --ctx-size)")),
        (None, None) => (
            DEFAULT_CTX,
            format!("ctx {DEFAULT_CTX} (the acme route's default; no --ctx-size)"),
        ),
    };
    Ok(MemoryNeed {
        weights_bytes: request.model.bytes,
        compute_bytes: KERNEL_SCRATCH_BYTES,
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
