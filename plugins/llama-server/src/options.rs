//! What a model can ask of llama-server: slots (`--parallel`), drafting (`--mtp`, `--dflash`,
//! the model's own MTP layers), images (`--mmproj`), and the embedding and reranking roles;
//! the argv and environment each maps to per route, and the rules the routes enforce.

use std::collections::BTreeMap;
use std::path::Path;

use onebit_plugin_api::{PlanRequest, Refusal};

use crate::memory;

/// Architectures whose gated delta-net layers HRX runs one sequence at a time.
const GATED_DELTA_NET: [&str; 3] = ["qwen35", "qwen35moe", "qwen3next"];
/// The context (and batch) a role server takes without `--ctx-size`.
pub const ROLE_CTX: u64 = 8192;
/// A DFlash drafter that does not say its block size drafts this many tokens.
const DFLASH_DEFAULT_DRAFT: u64 = 16;
/// The HRX dispatch turned off when slots share the KV cache: AMD's Qwen attention path
/// ignores the other sequences.
const QWEN_ATTENTION_DISPATCH: &str = "qwen.attention";

/// What the options add to a llama-server plan.
#[derive(Debug, Default, PartialEq)]
pub struct ModelArgs {
    /// Arguments appended to the route's argv.
    pub argv: Vec<String>,
    /// Environment the plan adds (where the user has not set it: `plan::Env::resolve`).
    pub env: BTreeMap<String, String>,
    /// Environment built from the user's own values, set in any case.
    pub env_combined: BTreeMap<String, String>,
    /// Lines serve prints before starting.
    pub notes: Vec<String>,
    /// Files beyond the model that the backend loads (a drafter, a projector), for the memory
    /// check.
    pub extra_weights_bytes: u64,
    /// The drafter's own KV cache at the plan's context.
    pub extra_kv_bytes: u64,
    /// The drafter the backend runs (what a recipe's `match.drafter` is matched against).
    pub drafter: Drafter,
}

/// The drafter a llama-server plan runs beside the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Drafter {
    /// No speculative decoding.
    #[default]
    None,
    /// An MTP head: `--mtp HEAD.gguf`, or the model's own MTP layers.
    Mtp,
    /// A DFlash draft model: `--dflash DRAFT.gguf`.
    Dflash,
}

impl Drafter {
    /// The drafter as a recipe's `match.drafter` names it.
    pub fn word(self) -> &'static str {
        match self {
            Drafter::None => "none",
            Drafter::Mtp => "mtp",
            Drafter::Dflash => "dflash",
        }
    }
}

/// Which role the model serves: chat (none), embedding or reranking.
pub fn role(request: &PlanRequest) -> Option<&'static str> {
    if request.options.reranking {
        Some("reranking")
    } else if request.options.embedding {
        Some("embedding")
    } else {
        None
    }
}

/// The context a llama-server route gives the model: `--ctx-size`, else 8192 for a role, else
/// `default` (the route's own choice; None = the model's own).
pub fn context(request: &PlanRequest, default: Option<u64>) -> Option<u64> {
    request
        .options
        .ctx_size
        .or(role(request).map(|_| ROLE_CTX))
        .or(default)
}

/// The options' arguments for `route` (`cpu` or `hrx`) at context `ctx`.
pub fn model_args(
    request: &PlanRequest,
    route: &str,
    ctx: Option<u64>,
) -> Result<ModelArgs, Refusal> {
    let o = &request.options;
    let mut out = ModelArgs::default();
    let parallel = slots(request, route == "hrx", &mut out)?;
    let header = model_header(request);
    if let Some(role) = role(request) {
        let n = ctx.unwrap_or(ROLE_CTX).to_string();
        push(&mut out.argv, &[&format!("--{role}"), "-b", &n, "-ub", &n]);
        // A model that names no pooling of its own (a chat model asked for embeddings) would
        // get none, which the OpenAI embeddings route refuses: pool it by the mean.
        if role == "embedding" && !crate::rag::has_pooling(header.as_ref()) {
            push(&mut out.argv, &["--pooling", "mean"]);
        }
    }
    let own_heads = header.as_ref().map(nextn_layers).unwrap_or(0) > 0;
    let one_slot = parallel.unwrap_or(1) <= 1;
    drafting(
        request,
        ctx,
        route == "hrx" && own_heads && one_slot,
        &mut out,
    )?;
    // Images.
    if let Some(mmproj) = &o.mmproj {
        out.extra_weights_bytes += drafter_file(mmproj, "--mmproj")?;
        push(
            &mut out.argv,
            &["--mmproj", mmproj, "-b", "4096", "-ub", "4096"],
        );
    }
    Ok(out)
}

/// The slots (`-np`), one on HRX for a gated delta-net model, and HRX's unified KV for more
/// than one. Returns the slots asked for.
fn slots(request: &PlanRequest, on_hrx: bool, out: &mut ModelArgs) -> Result<Option<u32>, Refusal> {
    let o = &request.options;
    let arch = request.model.architecture.as_deref().unwrap_or("");
    let mut parallel = o.parallel;
    if on_hrx && GATED_DELTA_NET.contains(&arch) {
        match parallel {
            Some(n) if n > 1 && o.device == "hrx" => {
                return Err(Refusal::usage(format!(
                    "--parallel {n}: HRX runs one gated delta-net sequence at a time, and {arch} is such a model; drop --parallel, or use --device cpu"
                )));
            }
            Some(n) if n > 1 => {
                out.notes.push(format!(
                    "HRX runs one gated delta-net sequence at a time: {arch} gets one slot, not {n}"
                ));
                parallel = Some(1);
            }
            _ => parallel = Some(1),
        }
    }
    if let Some(n) = parallel {
        if n == 0 {
            return Err(Refusal::usage(
                "--parallel 0: give at least one slot, e.g. --parallel 2",
            ));
        }
        push(&mut out.argv, &["-np", &n.to_string()]);
        if on_hrx && n > 1 {
            out.argv.push("-kvu".to_string());
            // The user's own list (even an empty one) keeps its entries and gains this one.
            match request.env.get("GGML_HRX_DISABLE_DISPATCH") {
                Some(user) => {
                    let value = if user.is_empty() {
                        QWEN_ATTENTION_DISPATCH.to_string()
                    } else {
                        format!("{user},{QWEN_ATTENTION_DISPATCH}")
                    };
                    out.env_combined
                        .insert("GGML_HRX_DISABLE_DISPATCH".to_string(), value);
                }
                None => {
                    out.env.insert(
                        "GGML_HRX_DISABLE_DISPATCH".to_string(),
                        QWEN_ATTENTION_DISPATCH.to_string(),
                    );
                }
            }
        }
    }

    Ok(parallel)
}

/// A drafter: `--mtp HEAD`, `--dflash DRAFT`, or the model's own MTP layers where
/// `own_mtp_fits` (on HRX, one slot, heads of its own), and the draft's settings.
fn drafting(
    request: &PlanRequest,
    ctx: Option<u64>,
    own_mtp_fits: bool,
    out: &mut ModelArgs,
) -> Result<(), Refusal> {
    let o = &request.options;
    let no_mtp = o.no_mtp
        || request
            .env
            .get("ONEBIT_NO_MTP")
            .is_some_and(|v| v.trim() == "1");
    match (&o.mtp, &o.dflash) {
        (Some(_), Some(_)) => {
            return Err(Refusal::usage(
                "--mtp and --dflash are two drafters; pick one",
            ));
        }
        (Some(head), None) => {
            let head_bytes = drafter_file(head, "--mtp")?;
            push(
                &mut out.argv,
                &["--spec-type", "draft-mtp", "-md", head, "-ngld", "99"],
            );
            out.extra_weights_bytes += head_bytes;
            out.extra_kv_bytes += drafter_kv(head, request, ctx);
            out.drafter = Drafter::Mtp;
        }
        (None, Some(draft)) => {
            let draft_bytes = drafter_file(draft, "--dflash")?;
            let n_max = match o.mtp_max {
                Some(n) => u64::from(n),
                None => dflash_block(draft)
                    .map(|b| b.saturating_sub(1).max(1))
                    .unwrap_or(DFLASH_DEFAULT_DRAFT),
            };
            push(
                &mut out.argv,
                &["--spec-type", "draft-dflash", "-md", draft, "-ngld", "99"],
            );
            if o.mtp_max.is_none() {
                push(&mut out.argv, &["--spec-draft-n-max", &n_max.to_string()]);
            }
            out.extra_weights_bytes += draft_bytes;
            out.extra_kv_bytes += drafter_kv(draft, request, ctx);
            out.drafter = Drafter::Dflash;
        }
        (None, None) => {
            if own_mtp_fits && !no_mtp && role(request).is_none() {
                push(&mut out.argv, &["--spec-type", "draft-mtp"]);
                out.drafter = Drafter::Mtp;
                out.notes.push(
                    "drafting with the model's own MTP layers (--no-mtp turns it off)".to_string(),
                );
            }
        }
    }
    if out.drafter != Drafter::None {
        if let Some(n) = o.mtp_max {
            push(&mut out.argv, &["--spec-draft-n-max", &n.to_string()]);
        }
        if let Some(p) = o.mtp_p_min {
            if !(0.0..=1.0).contains(&p) {
                return Err(Refusal::usage(format!(
                    "--mtp-p-min {p}: a probability between 0 and 1, e.g. 0.5"
                )));
            }
            push(&mut out.argv, &["--spec-draft-p-min", &p.to_string()]);
        }
    } else if o.mtp_max.is_some() || o.mtp_p_min.is_some() {
        return Err(Refusal::usage(
            "--mtp-max and --mtp-p-min set a drafter's draft; add --mtp HEAD.gguf or --dflash DRAFT.gguf",
        ));
    }

    Ok(())
}

fn push(argv: &mut Vec<String>, items: &[&str]) {
    argv.extend(items.iter().map(|s| s.to_string()));
}

/// A drafter or projector file: it must exist; its size counts in the memory check.
fn drafter_file(path: &str, flag: &str) -> Result<u64, Refusal> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|e| Refusal::usage(format!("{flag} {path}: {e}; pass an existing .gguf file")))
}

/// The drafter's KV cache at the plan's context (0 when its header says too little).
fn drafter_kv(path: &str, request: &PlanRequest, ctx: Option<u64>) -> u64 {
    let Ok(header) = gguf::read_header_lean(Path::new(path)) else {
        return 0;
    };
    let settings = crate::kv_settings(ctx, request.options.parallel);
    memory::kv_estimate(&header, &settings)
        .map(|e| e.total_bytes())
        .unwrap_or(0)
}

/// `dflash.block_size` of a DFlash drafter, when the file says.
fn dflash_block(path: &str) -> Option<u64> {
    let header = gguf::read_header_lean(Path::new(path)).ok()?;
    header.get_u64("dflash.block_size").or_else(|| {
        header
            .arch_key("block_size")
            .and_then(|k| header.get_u64(&k))
    })
}

/// The model's GGUF header, when it has one.
fn model_header(request: &PlanRequest) -> Option<gguf::Header> {
    if request.model.gguf_error.is_some() || request.model.is_dir {
        return None;
    }
    gguf::read_header_lean(Path::new(&request.options.model)).ok()
}

/// `<arch>.nextn_predict_layers`: the model's own MTP layers.
fn nextn_layers(header: &gguf::Header) -> u64 {
    header
        .arch_key("nextn_predict_layers")
        .and_then(|k| header.get_u64(&k))
        .unwrap_or(0)
}
