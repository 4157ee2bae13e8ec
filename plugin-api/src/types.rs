//! The values that cross the route boundary, as serde types carried in JSON.
//!
//! Compatibility rule: a field added in a later minor version carries `#[serde(default)]`, and
//! readers ignore fields they do not know, so routes and hosts of different minors understand
//! each other.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
    pub purpose: Purpose,
    pub options: ServeOptions,
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
    pub key: String,
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
    Plan(Plan),
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
    pub message: String,
}

impl RouteError {
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

/// How one method and path is handled.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Rule {
    /// `GET`, `POST`, `DELETE`, ...
    pub method: String,
    /// An exact path, or a prefix ending in `*` (`/slots/*`).
    pub path: String,
    pub action: Action,
    /// A chat, completion or Responses request: the watchdog tracks it, and a non-streamed
    /// JSON reply gets the served model name.
    pub inference: bool,
    /// 1.4: what the request's body is, and so what the host checks before it relays it; by
    /// default, as 1.3 and older: none for `GET` and `HEAD`, a JSON object for any other
    /// method.
    pub body: BodyKind,
    /// 1.4: where an inference reply names its model, for the served-name rewrite; by
    /// default OpenAI's shape.
    pub reply: ReplyShape,
}

/// What a request's body is (ABI 1.4), and what the host checks before relaying it. Whatever
/// the kind, a body is relayed byte for byte (`--precise` aside) and held to the body limit
/// and time limit; only [`BodyKind::Json`] is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyKind {
    /// The rule of 1.3 and older routes: [`BodyKind::None`] for `GET` and `HEAD`,
    /// [`BodyKind::Json`] for any other method ([`BodyKind::for_method`]).
    #[default]
    ByMethod,
    /// One JSON object, sent with a JSON Content-Type (or none): its `stream` flag says whether
    /// the reply is streamed. Anything else is refused with 400.
    Json,
    /// A `multipart/form-data` upload (a file, say: `/v1/audio/transcriptions`), with its
    /// boundary: relayed as it came, never parsed. Another Content-Type is refused with 400.
    Multipart,
    /// No body: none is read or relayed (`GET /slots`, `DELETE /v1/stream`).
    None,
    /// Any bytes, any Content-Type, relayed unchecked: for a body the backend alone can judge
    /// (llama-server's `/cors-proxy`, whose body is the proxied request's, or a JSON array).
    Raw,
}

impl BodyKind {
    /// The kind for a request of `method`: [`BodyKind::ByMethod`] resolved, any other kind as
    /// it is. Pure.
    pub fn for_method(self, method: &str) -> BodyKind {
        match self {
            BodyKind::ByMethod if method == "GET" || method == "HEAD" => BodyKind::None,
            BodyKind::ByMethod => BodyKind::Json,
            kind => kind,
        }
    }
}

/// Where an inference reply names its model (ABI 1.4), so the host puts the served name there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplyShape {
    /// OpenAI's (and llama-server's own): `model` at the top of a whole reply and of each
    /// streamed event.
    #[default]
    OpenAi,
    /// Anthropic's Messages API: `model` at the top of a whole reply; in a stream, only the
    /// `message_start` event names it, inside its `message`.
    Anthropic,
}

/// What the host does with a request that matches a rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Relay it unchanged to `backends[backend]`, same method, path and query.
    Proxy { backend: usize },
    /// Answer it directly.
    Answer {
        status: u16,
        content_type: String,
        body: String,
    },
    /// Ask the route ([`crate::DeviceRoute::forward`]) on a blocking thread.
    AskRoute,
    /// 1.2: the route answers it itself, streaming ([`crate::DeviceRoute::respond`], on a
    /// blocking thread the host owns for the request).
    InProcess,
}

/// The request table of a route whose backend is a llama-server: every route the pinned
/// llama-server registers, relayed unchanged to `backends[backend]`, except those serve
/// answers itself (`/health`, `/v1/health`, `/v1/models`, `/models`, `/metrics`) and slot save
/// and restore (`POST /slots/*`), which each route decides. Inference routes (chats,
/// completions, Responses, Anthropic's Messages, `/infill`, transcriptions) are marked; each
/// rule says its body's kind and, for inference, its reply's shape. A route adds its own rules
/// before or after (the first match wins): the public llama-server routes answer
/// `POST /slots/*` with 501, say. Called by a route's `plan`.
///
/// The routes of llama-server's router mode (`POST /models`, `/models/load`, ...) are relayed
/// too: a llama-server that is no router answers them 404 itself, as it would directly.
pub fn llama_server_rules(backend: usize) -> Vec<Rule> {
    use BodyKind::{Json, Multipart, None as NoBody, Raw};
    let rule =
        |method: &str, path: &str, inference: bool, body: BodyKind, reply: ReplyShape| Rule {
            method: method.to_string(),
            path: path.to_string(),
            action: Action::Proxy { backend },
            inference,
            body,
            reply,
        };
    let openai = ReplyShape::OpenAi;
    let generation = |path: &str| rule("POST", path, true, Json, openai);
    let post = |path: &str| rule("POST", path, false, Json, openai);
    let get = |path: &str| rule("GET", path, false, NoBody, openai);
    vec![
        // Generation: OpenAI's, llama.cpp's own, Anthropic's.
        generation("/v1/chat/completions"),
        generation("/chat/completions"),
        generation("/v1/completions"),
        generation("/completions"),
        generation("/completion"),
        generation("/v1/responses"),
        generation("/responses"),
        generation("/infill"),
        rule("POST", "/v1/messages", true, Json, ReplyShape::Anthropic),
        rule("POST", "/v1/audio/transcriptions", true, Multipart, openai),
        rule("POST", "/audio/transcriptions", true, Multipart, openai),
        // A control action on a generation in flight (`reasoning_end`): no generation itself.
        post("/v1/chat/completions/control"),
        // Token counts, templates, tokens.
        post("/v1/chat/completions/input_tokens"),
        post("/chat/completions/input_tokens"),
        post("/v1/responses/input_tokens"),
        post("/responses/input_tokens"),
        post("/v1/messages/count_tokens"),
        post("/tokenize"),
        post("/detokenize"),
        post("/apply-template"),
        // Embeddings, reranking, decisions.
        post("/v1/embeddings"),
        post("/embeddings"),
        post("/embedding"),
        post("/v1/rerank"),
        post("/rerank"),
        post("/v1/reranking"),
        post("/reranking"),
        post("/v1/systemone"),
        // The server's state.
        get("/slots"),
        get("/props"),
        post("/props"),
        get("/lora-adapters"),
        // Its body is a JSON array, which llama-server checks.
        rule("POST", "/lora-adapters", false, Raw, openai),
        // Resumable streams (a replay of a generation another request runs).
        get("/v1/stream"),
        rule("DELETE", "/v1/stream", false, NoBody, openai),
        post("/v1/streams/lookup"),
        // The Web UI's helpers: 403 unless llama-server was started with them.
        get("/tools"),
        post("/tools"),
        get("/cors-proxy"),
        rule("POST", "/cors-proxy", false, Raw, openai),
        // Router mode.
        post("/models"),
        post("/models/load"),
        post("/models/unload"),
        get("/models/sse"),
        rule("DELETE", "/models", false, NoBody, openai),
    ]
}

impl Default for Action {
    fn default() -> Self {
        Action::Proxy { backend: 0 }
    }
}

/// A request sent to a backend after it is ready.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Warmup {
    pub path: String,
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
    /// Which memory the backend allocates from: `ram` or `gtt`.
    pub pool: String,
    /// For a route that runs the model with llama.cpp's own kernels (in process, say): the
    /// settings of its context, for the host to size llama.cpp's KV cache and recurrent state
    /// from the GGUF header it read, with the formulas the llama-server routes use. The host
    /// adds the estimate to `kv_bytes` and sets `ctx` to the padded context (ABI 1.3).
    pub llama_kv: Option<LlamaKv>,
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
    pub type_v: String,
    /// Flash attention on (or auto) when the cache is made; off stores V transposed.
    pub flash_attn: bool,
    /// `n_ubatch`.
    pub n_ubatch: u64,
    /// Sliding-window layers keep the whole context (`swa_full`) instead of the window.
    pub swa_full: bool,
}

impl LlamaKv {
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

/// What the host passes to [`crate::DeviceRoute::start`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Started {
    pub plan: Plan,
    /// The process id of each backend, in the plan's order.
    pub pids: Vec<u32>,
}

/// What the host's probes of the backends found, for [`crate::DeviceRoute::health`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HealthProbe {
    /// One entry per backend, in the plan's order.
    pub backends: Vec<BackendHealth>,
}

/// One backend's state as the host sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendHealth {
    pub ok: bool,
    /// Why not, when not ok.
    pub reason: String,
}

/// The route's verdict on health.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Health {
    pub ok: bool,
    /// Why not, when not ok; shown in `/health`'s body.
    pub reason: String,
}

impl Health {
    /// Healthy when every backend is; else the first backend's reason.
    pub fn from_probe(probe: &HealthProbe) -> Self {
        match probe.backends.iter().find(|b| !b.ok) {
            None => Health {
                ok: true,
                reason: String::new(),
            },
            Some(bad) => Health {
                ok: false,
                reason: bad.reason.clone(),
            },
        }
    }
}

/// One line a backend printed on stderr.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendLine {
    /// Which backend, by its index in the plan.
    pub backend: usize,
    pub line: String,
}

/// What the host should do about a backend's line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LineVerdict {
    /// Lines serve prints on its stderr (without the `1bit serve: ` prefix).
    pub say: Vec<String>,
    /// Stop serve with status 1 for this reason (a lost GPU, a strict-placement abort).
    pub stop: Option<String>,
}

/// One request, as the route sees it in [`crate::DeviceRoute::forward`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ForwardRequest {
    pub method: String,
    pub path: String,
    pub query: String,
    /// The JSON body as text.
    pub body: String,
}

/// The route's decision for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Forward {
    /// Relay it to a backend, with this body instead of the client's when given.
    Proxy {
        backend: usize,
        #[serde(default)]
        body: Option<String>,
        /// A line serve prints on stderr when the reply's first byte arrives, with
        /// `{first_byte_ms}` replaced by the milliseconds since serve asked the route.
        #[serde(default)]
        first_byte_line: Option<String>,
    },
    /// Answer it directly.
    Answer {
        status: u16,
        content_type: String,
        body: String,
    },
}

/// A request the route asks the host to send to a backend (during `forward`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendRequest {
    pub backend: usize,
    pub method: String,
    /// Path and query.
    pub path: String,
    pub body: Option<String>,
    /// Give up after this long; 0 means the host's default (30 s).
    pub timeout_ms: u64,
}

/// A backend's whole reply.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendReply {
    pub status: u16,
    pub body: String,
}
