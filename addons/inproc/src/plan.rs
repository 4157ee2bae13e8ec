//! What `--device inproc` decides before anything loads: the claim, the plan, the request table.

use onebit_plugin_api::{
    Action, Claim, LlamaKv, MemoryNeed, Plan, PlanRequest, Refusal, Rule, llama_server_rules,
};
use serde::{Deserialize, Serialize};

use crate::NAME;
use crate::error::InprocError;
use crate::ffi::UBATCH;
use crate::host::default_threads;
use crate::libraries::libraries;
use crate::openai::Kind;

/// The context when `--ctx-size` is not given.
const DEFAULT_CTX: u32 = 4096;

/// The prompt cache in RAM when `--route-opt cache_ram_mib` is not given, in MiB.
const DEFAULT_CACHE_RAM_MIB: u64 = 256;

/// What llama.cpp's compute buffers take beyond weights and KV, counted as the llama-server
/// routes count it (SmolLM2 at ctx 4096 takes about 100 MiB; larger vocabularies more).
const COMPUTE_BYTES: u64 = 512 * 1024 * 1024;

/// The `general.architecture` values this route claims under `--device auto`: the ones its
/// tests show answering token for token as `--device cpu` does (SmolLM2 is `llama`, Gemma 3
/// 270M is `gemma3`). Other GGUFs it serves when asked by name (`--device inproc`).
pub const CLAIMED_ARCHITECTURES: [&str; 2] = ["llama", "gemma3"];

/// The claim's strength: an add-on that serves a model better than the public route for its
/// format (plugin-api's convention), so it outranks cpu (10) and hrx (50).
const CLAIM_STRENGTH: u8 = 95;

/// What `plan` decided and `start` acts on (the plan's `route_state`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct State {
    pub lib_dir: String,
    /// The libraries to load, in order (a package's, the build for this CPU of each).
    pub lib_files: Vec<String>,
    pub model: String,
    pub ctx: u32,
    pub threads: i32,
    /// `--parallel`: slots, whose next tokens share one decode.
    pub slots: u32,
    pub served_name: String,
    /// The prompt cache's budget in RAM, in MiB (0: none).
    pub cache_ram_mib: u64,
}

/// The paths this route answers in process, and the reply shape of each.
pub const SERVED: [(&str, Kind); 4] = [
    ("/v1/completions", Kind::Completion),
    ("/completions", Kind::Completion),
    ("/v1/chat/completions", Kind::Chat),
    ("/chat/completions", Kind::Chat),
];

/// The request table: completions and chat in process; every other llama-server path
/// answered 501 with a line saying which device serves it.
fn rules() -> Vec<Rule> {
    let mut rules: Vec<Rule> = SERVED
        .iter()
        .map(|(path, _)| Rule {
            method: "POST".to_string(),
            path: path.to_string(),
            action: Action::InProcess,
            inference: true,
            ..Default::default()
        })
        .collect();
    for rule in llama_server_rules(0) {
        if SERVED.iter().any(|(path, _)| *path == rule.path) {
            continue;
        }
        let message = format!(
            "the inproc route does not serve {} {}; serve this model with --device cpu for it",
            rule.method, rule.path
        );
        rules.push(Rule {
            action: Action::Answer {
                status: 501,
                content_type: "application/json".to_string(),
                body: InprocError::NotServed(message).body(),
            },
            ..rule
        });
    }
    rules
}

/// Under `--device auto`: the GGUFs of [`CLAIMED_ARCHITECTURES`], when llama.cpp's pinned
/// libraries are in place and nothing is asked that only the llama-server routes serve
/// (embeddings, reranking, a projector, a drafter). Otherwise no claim, so auto picks the
/// public route rather than one that would refuse.
pub fn claim(request: &PlanRequest) -> Claim {
    let model = &request.model;
    let Some(arch) = model.architecture.as_deref().filter(|_| !model.is_dir) else {
        return Claim::none();
    };
    let o = &request.options;
    let other_role = o.embedding
        || o.reranking
        || o.embed.is_some()
        || o.rerank.is_some()
        || o.mmproj.is_some()
        || o.mtp.is_some()
        || o.dflash.is_some();
    let has_libraries = libraries(request).is_ok();
    if !CLAIMED_ARCHITECTURES.contains(&arch) || other_role || !has_libraries {
        return Claim::none();
    }
    Claim {
        strength: CLAIM_STRENGTH,
        reason: format!("the inproc add-on runs {arch} GGUFs in process, with no hop"),
    }
}

/// The plan for `request`: the libraries checked, the route options read, the memory it needs
/// and the request table; the state `start` acts on. Reads a few files; starts nothing.
pub fn plan(request: &PlanRequest) -> Result<Plan, Refusal> {
    let options = request
        .options
        .checked_route_options(NAME, &["threads", "cache_ram_mib"])?;
    let model = &request.model;
    if model.is_dir || model.architecture.is_none() {
        let why = model
            .gguf_error
            .clone()
            .unwrap_or_else(|| "it names no architecture".to_string());
        return Err(Refusal::usage(format!(
            "the inproc route serves one GGUF file, and {} is not one ({why}); pass a .gguf model",
            request.options.model
        )));
    }
    let dir = libraries(request).map_err(|e| Refusal::engine(e.to_string()))?;
    let threads = match options.get("threads") {
        Some(value) => match value.trim().parse::<i32>() {
            Ok(n) if (1..=512).contains(&n) => n,
            _ => {
                return Err(Refusal::usage(format!(
                    "--route-opt threads={value}: the inproc route runs 1 to 512 threads; pass a count such as 4"
                )));
            }
        },
        None => default_threads(request),
    };
    let ctx = request
        .options
        .ctx_size
        .map_or(DEFAULT_CTX, |c| c.min(u32::MAX as u64) as u32);
    let slots = request.options.parallel.unwrap_or(1);
    if !(1..=64).contains(&slots) {
        return Err(Refusal::usage(format!(
            "--parallel {slots}: the inproc route runs 1 to 64 slots; pass one such as 4"
        )));
    }
    let cache_ram_mib = match options.get("cache_ram_mib") {
        Some(value) => value.trim().parse::<u64>().ok().filter(|&n| n <= 1 << 20).ok_or_else(|| {
            Refusal::usage(format!(
                "--route-opt cache_ram_mib={value}: the prompt cache takes 0 (none) to 1048576 MiB; pass a size such as 256"
            ))
        })?,
        None => DEFAULT_CACHE_RAM_MIB,
    };
    let ctx_source = match request.options.ctx_size {
        Some(n) => format!("ctx {n} (--ctx-size)"),
        None => format!("ctx {DEFAULT_CTX} (the inproc route's default; no --ctx-size)"),
    };
    // The weights are the file (llama.cpp maps it); llama.cpp's KV cache is sized by the
    // host from the header it read, for the context `start` makes.
    let memory = MemoryNeed {
        weights_bytes: model.bytes,
        // The prompt cache fills up to its budget as prompts come and go.
        compute_bytes: COMPUTE_BYTES + (cache_ram_mib << 20),
        ctx: u64::from(ctx),
        ctx_source,
        pool: "ram".to_string(),
        llama_kv: Some(LlamaKv {
            n_ubatch: u64::from(UBATCH),
            ..LlamaKv::new(u64::from(ctx), slots)
        }),
        ..Default::default()
    };
    let state = State {
        slots,
        lib_dir: dir.display().to_string(),
        lib_files: crate::libraries::library_files(request, &dir)
            .iter()
            .map(|f| f.display().to_string())
            .collect(),
        model: request.options.model.clone(),
        ctx,
        threads,
        served_name: request.options.served_name.clone(),
        cache_ram_mib,
    };
    Ok(Plan {
        device: NAME.to_string(),
        rules: rules(),
        one_hop: false,
        serve_in_path: "--device inproc (the model runs inside serve)".to_string(),
        notes: vec![format!(
            "inproc: llama.cpp from {}, ctx {ctx}, {slots} slot{}, {threads} thread{}, prompt cache {cache_ram_mib} MiB",
            dir.display(),
            if slots == 1 { "" } else { "s" },
            if threads == 1 { "" } else { "s" }
        )],
        route_state: serde_json::to_value(&state).expect("the state serializes"),
        memory: Some(memory),
        ..Default::default()
    })
}
