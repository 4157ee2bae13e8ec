//! The values that cross the route boundary, as serde types carried in JSON.
//!
//! Compatibility rule: a field added in a later minor version carries `#[serde(default)]`, and
//! readers ignore fields they do not know, so routes and hosts of different minors understand
//! each other.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::rules::Rule;

/// Who a route is, for `1bit plugins` and `--device`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouteInfo {
    /// The `--device` name (`cpu`, `hrx`, ...). Unique among the loaded routes.
    pub name: String,
    /// One line on what the route runs.
    pub summary: String,
}

/// Why serve is asking for a plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// To serve: the plan's backends will be started now.
    #[default]
    Serve,
    /// `--print-backend` / `--print-backend-env`: Lemonade will start the backend itself, on
    /// `ports[0]`, which is the port it gave serve.
    PrintBackend,
    /// `--mem-check`: only the memory facts are needed.
    MemCheck,
}

/// Everything a route needs to plan. Built by the host from the command line, the model file
/// and the environment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanRequest {
    /// What the plan is for: serving, or printing the one-hop command.
    pub purpose: Purpose,
    /// The command line's options, as the host read them.
    pub options: ServeOptions,
    /// What the host read from the model file.
    pub model: ModelFacts,
    /// serve's whole environment. A route reads its variables from here, not from the process,
    /// so a plan depends only on its request.
    pub env: BTreeMap<String, String>,
    /// Loopback ports the host reserved for the plan's backends, in order: four for
    /// [`Purpose::Serve`] and [`Purpose::MemCheck`] (free when asked, outside Lemonade's
    /// 8001-9000; a plan with more backends than that needs a newer host). For
    /// [`Purpose::PrintBackend`] this is the one port the caller chose.
    pub ports: Vec<u16>,
    /// The directory serve may use for files that live as long as it does (slot files, say).
    pub run_dir: String,
    /// 1.8: the folder the route's library was loaded from (absolute), so a route finds the
    /// libraries and data it carries without `/proc/self/maps` or the environment. Empty from
    /// a host before 1.8.
    pub route_dir: String,
    /// 1.8: the route's package, when it was loaded from one: its manifest as installed, every
    /// carried file already checked against its sha256 by the host before `claim`. None for a
    /// loose route file (and from a host before 1.8).
    pub package: Option<PackageFacts>,
}

/// 1.8: a route package's manifest as the host read and checked it ([`PlanRequest::package`]).
/// A route carries what it needs from `plan` to `start` in [`Plan::route_state`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PackageFacts {
    /// The route's name (the manifest's, equal to the route's own).
    pub name: String,
    /// The package's version (semver).
    pub version: String,
    /// Who ships it.
    pub vendor: String,
    /// Its license: an SPDX expression, or `LicenseRef-...` for a vendor's own terms.
    pub license: String,
    /// The package folder, absolute (the route library's folder).
    pub dir: String,
    /// Every file the package carries besides the route library, as checked.
    pub files: Vec<PackageFile>,
    /// The vendor key that signed the manifest (its fingerprint), or None when unsigned.
    pub signed_by: Option<String>,
}

/// 1.8: one file a package carries (a kernels library, say).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PackageFile {
    /// Its path, absolute.
    pub path: String,
    /// Its path inside the package, as the manifest names it (`libacme_kernels.so.1`).
    pub name: String,
    /// The version the manifest gives it.
    pub version: String,
    /// Its sha256, lowercase hex, as checked.
    pub sha256: String,
}

impl PackageFacts {
    /// The carried file the manifest calls `name` (its path inside the package). Pure.
    pub fn file(&self, name: &str) -> Option<&PackageFile> {
        self.files.iter().find(|f| f.name == name)
    }
}

impl PlanRequest {
    /// The project's cache, where `cargo xtask setup` installs llama.cpp and the models:
    /// `$ONEBIT_CACHE_DIR`, else `$XDG_CACHE_HOME/onebit`, else `$HOME/.cache/onebit`, read
    /// from the request's environment. Pure; any thread. None without any of the three.
    pub fn cache_dir(&self) -> Option<std::path::PathBuf> {
        let env = |k: &str| self.env.get(k).filter(|v| !v.is_empty());
        if let Some(dir) = env("ONEBIT_CACHE_DIR") {
            return Some(std::path::PathBuf::from(dir));
        }
        if let Some(dir) = env("XDG_CACHE_HOME") {
            return Some(std::path::Path::new(dir).join("onebit"));
        }
        env("HOME").map(|home| std::path::Path::new(home).join(".cache").join("onebit"))
    }
}

/// The parsed `1bit serve` options a route may act on. Flags a later version adds arrive as new
/// fields here. A route's own options (a vendor's, say) come as `--route-opt KEY=VALUE` or
/// `--npu-opt KEY=VALUE` in [`ServeOptions::route_options`]: serve's command line parser
/// refuses flags it does not know, so a private `--my-flag` never reaches a route.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServeOptions {
    /// `-m`, as given.
    pub model: String,
    /// `--alias`, else the model file's stem (a directory's name for a directory).
    pub served_name: String,
    /// `--host` of serve itself.
    pub host: String,
    /// `--port` of serve itself.
    pub port: u16,
    /// `--device`, as given (`auto` included).
    pub device: String,
    /// `--ctx-size`.
    pub ctx_size: Option<u64>,
    /// `--llama-server`.
    pub llama_server: Option<String>,
    /// `--ds4`.
    pub ds4: Option<String>,
    /// `--parallel`.
    pub parallel: Option<u32>,
    /// `--ssd-streaming` (ds4).
    pub ssd_streaming: bool,
    /// `--hrx-libhsa`.
    pub hrx_libhsa: Option<String>,
    /// `--strict-device`: the default strict placement plus the report, refusing a report that
    /// names nodes off the device.
    pub strict_device: bool,
    /// `--no-strict-device`: nodes the device declines run on the CPU.
    pub no_strict_device: bool,
    /// `--placement-report`: the backend reports every graph's placement.
    pub placement_report: bool,
    /// `--recipes FILE`: this recipes file instead of the built-in set.
    pub recipes: Option<String>,
    /// `--no-recipes`.
    pub no_recipes: bool,
    /// `--mtp HEAD.gguf`: draft with this MTP head.
    pub mtp: Option<String>,
    /// `--dflash DRAFT.gguf`: draft with this DFlash model.
    pub dflash: Option<String>,
    /// `--no-mtp` (or `ONEBIT_NO_MTP=1`, which the route reads from `env`).
    pub no_mtp: bool,
    /// `--mtp-max N`: the draft length.
    pub mtp_max: Option<u32>,
    /// `--mtp-p-min P`: the draft probability threshold.
    pub mtp_p_min: Option<f64>,
    /// `--mmproj FILE`: a multimodal projector.
    pub mmproj: Option<String>,
    /// `--embedding`: the model itself serves embeddings.
    pub embedding: bool,
    /// `--reranking`: the model itself serves reranking.
    pub reranking: bool,
    /// `--embed MODEL.gguf`: an embedding model served beside the chat model.
    pub embed: Option<String>,
    /// `--rerank MODEL.gguf`: a reranking model served beside the chat model.
    pub rerank: Option<String>,
    /// serve's whole command line after `serve`, as given (every flag in it is one serve
    /// knows; see `route_options` for a route's own).
    pub args: Vec<String>,
    /// 1.2: `--route-opt KEY=VALUE` and `--npu-opt KEY=VALUE`, in the order given. Opaque to
    /// serve: the route checks them in `plan` ([`ServeOptions::checked_route_options`]) and
    /// refuses a key it does not know.
    pub route_options: Vec<RouteOption>,
}

/// One `--route-opt` / `--npu-opt` pair.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouteOption {
    /// The flag it came with: `--route-opt` or `--npu-opt`.
    pub flag: String,
    /// The part before `=`.
    pub key: String,
    /// The part after the first `=` (a value without one is refused before any route sees it).
    pub value: String,
}

impl ServeOptions {
    /// The route options as a map (a key given twice keeps its last value), after checking
    /// that every key is one of `known`; else the one-line refusal (exit 2) that names the
    /// keys the route knows. Called by a route at the start of `plan`; a route that takes no
    /// options passes `&[]`, so any option is refused rather than ignored.
    pub fn checked_route_options(
        &self,
        route: &str,
        known: &[&str],
    ) -> Result<BTreeMap<String, String>, Refusal> {
        let mut options = BTreeMap::new();
        for option in &self.route_options {
            if !known.contains(&option.key.as_str()) {
                let knows = if known.is_empty() {
                    "it takes no options".to_string()
                } else {
                    format!("it knows {}", known.join(", "))
                };
                return Err(Refusal::usage(format!(
                    "{} {}={}: the {route} route has no option {}; {knows}",
                    option.flag, option.key, option.value, option.key
                )));
            }
            options.insert(option.key.clone(), option.value.clone());
        }
        Ok(options)
    }
}

/// What the host read from the model before planning.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelFacts {
    /// The path as given.
    pub path: String,
    /// The model is a directory (an NPU model directory, say), not a file.
    pub is_dir: bool,
    /// Every file of the model (each shard of a sharded GGUF), in order.
    pub files: Vec<String>,
    /// Their total size in bytes.
    pub bytes: u64,
    /// `general.architecture`, when the file is a GGUF that names one.
    pub architecture: Option<String>,
    /// `<arch>.context_length`.
    pub context_length: Option<u64>,
    /// `<arch>.expert_count` (a mixture of experts when above 1).
    pub expert_count: Option<u64>,
    /// The file is stamped `onebit.hadamard_q4_0` (the dropped H32 format).
    pub hadamard_q4_0: bool,
    /// Why the GGUF header could not be read, when it could not (the file may still be served
    /// by a backend that understands it).
    pub gguf_error: Option<String>,
}

/// How strongly a route claims a model for `--device auto`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Claim {
    /// 0 means no claim; the strongest claim wins. Conventions: 10 a route that runs any GGUF
    /// (cpu), 50 a route that needs present hardware (hrx), 90 a route that owns the model's
    /// format (an NPU model directory), 95 an add-on that serves a model better than the
    /// public route for its format. Equal claims: the route found first wins (folders in
    /// search order, `--plugin-dir` first; within a folder, by file name).
    pub strength: u8,
    /// Why, in a few words, for the start-up line.
    pub reason: String,
}

impl Claim {
    /// No claim.
    pub fn none() -> Self {
        Self::default()
    }
}

/// A route's answer to [`PlanRequest`].
// Made once per process; boxing the plan would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanOutcome {
    /// The route serves this request with this plan.
    Plan(Plan),
    /// The route does not serve it, and says why.
    Refused(Refusal),
}

/// Why a route will not serve this request, and how serve should exit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Refusal {
    /// serve's exit status, one of a closed set: [`Refusal::ENGINE`] (1),
    /// [`Refusal::USAGE`] (2), [`Refusal::NO_FIT`] (3), [`Refusal::NEEDS_SERVE`] (5). serve
    /// exits 2 for any other value ([`Refusal::exit_status`]).
    pub exit_code: i32,
    /// One line: what was wrong and what to do instead.
    pub message: String,
}

impl Refusal {
    /// The engine the route needs cannot be found or started (no `llama-server`, say).
    pub const ENGINE: i32 = 1;
    /// Bad usage: a flag, an option or a model this route does not take.
    pub const USAGE: i32 = 2;
    /// The model does not fit in memory.
    pub const NO_FIT: i32 = 3;
    /// `--print-backend` on a plan that needs serve in the request path.
    pub const NEEDS_SERVE: i32 = 5;

    /// Exit 2.
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            exit_code: Self::USAGE,
            message: message.into(),
        }
    }

    /// Exit 1.
    pub fn engine(message: impl Into<String>) -> Self {
        Self {
            exit_code: Self::ENGINE,
            message: message.into(),
        }
    }

    /// Exit 5, with serve's line for it: `what` (`--device ds4`, `an NPU model directory`)
    /// needs serve in the request path.
    pub fn needs_serve(what: &str) -> Self {
        Self {
            exit_code: Self::NEEDS_SERVE,
            message: format!(
                "--print-backend: {what} needs 1bit serve in the request path; run 1bit serve itself"
            ),
        }
    }

    /// The exit status serve uses: `exit_code` when it is one of the set, else 2.
    pub fn exit_status(&self) -> i32 {
        match self.exit_code {
            Self::ENGINE | Self::USAGE | Self::NO_FIT | Self::NEEDS_SERVE => self.exit_code,
            _ => Self::USAGE,
        }
    }
}

/// An error a route reports from an operation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouteError {
    /// One line the host prints, saying what failed and what to do.
    pub message: String,
}

impl RouteError {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// What to run, how to route requests, and what the admission check needs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Plan {
    /// The route's name, for lines and `/v1/models`.
    pub device: String,
    /// Child processes to start, in order. Empty for an in-process route.
    pub backends: Vec<BackendSpec>,
    /// How requests are handled; a path no rule matches gets 404.
    pub rules: Vec<Rule>,
    /// Whether Lemonade may start `backends[0]` itself and forward to it (`--print-backend`);
    /// false means the route needs serve in the request path (exit 5).
    pub one_hop: bool,
    /// 1.2: when not `one_hop`, what needs serve in the request path, for `--print-backend`'s
    /// line (`--device ds4`, `--embed`); empty says `--device <device>`.
    pub serve_in_path: String,
    /// Requests the host sends to `backends[0]` after it is ready and before serve says
    /// ready, in order.
    pub warmups: Vec<Warmup>,
    /// What the memory check needs. None skips the check: serve starts the backends without
    /// judging whether the model fits, and `--mem-check` says there is nothing to check. Right
    /// for an in-process route (its engine judges itself); a child-process route should give
    /// its estimate, or serve admits a model that may not fit.
    pub memory: Option<MemoryNeed>,
    /// Why the route cannot estimate what the backend will need (`memory` is then None): the
    /// model's header lacks what the estimate is made from, say. Data, not a refusal: the host
    /// says it in one warning line and goes on, or says nothing under `--no-mem-check`; the
    /// backend then says for itself whether it can load the model.
    pub memory_unknown: Option<String>,
    /// Lines serve prints before starting (a recipe applied, a setting chosen).
    pub notes: Vec<String>,
    /// Run `AskRoute` requests one at a time: each holds the turn from the moment serve asks
    /// the route until the backend sends the first byte of its reply (the hybrid route's one
    /// slot).
    pub serialize_forwards: bool,
    /// The route's own data, opaque to the host and handed back in [`Started`] (paths,
    /// settings the route decided at plan time).
    pub route_state: serde_json::Value,
    /// Models served beside the main one (`--embed`, `--rerank`), listed by `/v1/models`.
    pub side_models: Vec<SideModel>,
    /// The engine cannot be told the served name: serve rewrites `model` in streamed events
    /// too (non-streamed replies always get it).
    pub rename_in_streams: bool,
}

/// A model served beside the main one by its own backend.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SideModel {
    /// Its name in `/v1/models`.
    pub id: String,
    /// `embedding` or `rerank`.
    pub role: String,
    /// Its backend, by index in the plan.
    pub backend: usize,
}

/// One child process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendSpec {
    /// What it is, for lines (`llama-server`, `ds4-server`).
    pub engine: String,
    /// The program, then its arguments.
    pub argv: Vec<String>,
    /// Variables to add to serve's environment. A variable the user already set wins.
    pub env: BTreeMap<String, String>,
    /// Variables whose value the route built from the user's own (appending to a list, say):
    /// set even when the user set them, and listed by `--print-backend` in any case.
    pub env_combined: BTreeMap<String, String>,
    /// The loopback port it listens on.
    pub port: u16,
    /// Its health route: 200 means ready (and, later, alive).
    pub health_path: String,
    /// A route its main loop answers only between steps (llama-server's `/slots`), which the
    /// watchdog asks while requests are in flight; None when the engine has none.
    pub progress_path: Option<String>,
    /// Its Prometheus route, appended to serve's `/metrics`; None when it has none.
    pub metrics_path: Option<String>,
}

/// A request sent to a backend after it is ready.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Warmup {
    /// The path it is POSTed to.
    pub path: String,
    /// Its JSON body.
    pub body: serde_json::Value,
}

/// What the route knows about memory; the host adds free memory and decides.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryNeed {
    /// The weights: every file of the model (and extras such as a draft head or mmproj).
    pub weights_bytes: u64,
    /// KV cache and recurrent state at `ctx`.
    pub kv_bytes: u64,
    /// Compute buffers.
    pub compute_bytes: u64,
    /// The context judged.
    pub ctx: u64,
    /// The context as the line names it, after "at ": `ctx 4096 (--ctx-size)`, `the model's
    /// own ctx 262144 (no --ctx-size)`.
    pub ctx_source: String,
    /// Which memory the backend allocates from: `ram`, `gtt`, or (1.8) `device`, the route's
    /// own memory as it reported it in [`MemoryNeed::device`].
    pub pool: String,
    /// For a route that runs the model with llama.cpp's own kernels (in process, say): the
    /// settings of its context, for the host to size llama.cpp's KV cache and recurrent state
    /// from the GGUF header it read, with the formulas the llama-server routes use. The host
    /// adds the estimate to `kv_bytes` and sets `ctx` to the padded context (ABI 1.3).
    pub llama_kv: Option<LlamaKv>,
    /// 1.8: the device's own memory (an NPU's), as the route read it, for `pool: "device"`:
    /// the host judges the need against `free_bytes` with the same rule and line as RAM.
    pub device: Option<DeviceMemory>,
}

/// 1.8: a memory pool only the route can read (an NPU's own memory), for [`MemoryNeed::device`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceMemory {
    /// What the line calls it (`NPU`, `acme0`).
    pub name: String,
    /// Its size in bytes.
    pub total_bytes: u64,
    /// What is free now, in bytes.
    pub free_bytes: u64,
}

/// The settings of a llama.cpp context that size its sequence memory ([`MemoryNeed::llama_kv`]).
/// `LlamaKv::new(ctx, slots)` is llama.cpp's context defaults with llama-server's SWA window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LlamaKv {
    /// Cells across all sequences (`n_ctx`), before llama.cpp pads it; 0 is the model's own
    /// training context.
    pub ctx: u64,
    /// Sequences (`n_seq_max`, slots).
    pub n_parallel: u32,
    /// One cache shared by all sequences (`kv_unified`) rather than one stream each.
    pub unified: bool,
    /// The K and V cache types, by llama.cpp's names (`f16`, `q8_0`, ...).
    pub type_k: String,
    /// The V cache type, as `type_k`.
    pub type_v: String,
    /// Flash attention on (or auto) when the cache is made; off stores V transposed.
    pub flash_attn: bool,
    /// `n_ubatch`.
    pub n_ubatch: u64,
    /// Sliding-window layers keep the whole context (`swa_full`) instead of the window.
    pub swa_full: bool,
}

impl LlamaKv {
    /// A context of `ctx` tokens over `n_parallel` sequences, with llama-server's defaults
    /// for the rest.
    pub fn new(ctx: u64, n_parallel: u32) -> LlamaKv {
        LlamaKv {
            ctx,
            n_parallel,
            unified: false,
            type_k: "f16".to_string(),
            type_v: "f16".to_string(),
            flash_attn: true,
            n_ubatch: 512,
            swa_full: false,
        }
    }
}

impl Default for LlamaKv {
    fn default() -> LlamaKv {
        LlamaKv::new(0, 1)
    }
}
