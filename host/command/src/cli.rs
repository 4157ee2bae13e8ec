//! The command line: `1bit serve` with every flag of the specification's synopsis, `1bit plugins`,
//! and `1bit gguf`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// `1bit rpc-worker --port`'s default: ggml-rpc-server's own.
pub const RPC_WORKER_DEFAULT_PORT: u16 = 50052;
/// `--sse-keepalive-s`'s default: well under the stall window of Lemonade 11.8 and later.
pub const SSE_KEEPALIVE_DEFAULT_S: u64 = 15;
/// `--drain-s`'s default: with llama-server's own stop (well under a second) it fits the 5 s
/// Lemonade leaves between SIGTERM and SIGKILL.
pub const DRAIN_DEFAULT_S: f64 = 3.0;
/// The persistent prompt cache's disk budget, GiB (`--prompt-cache-gib`).
pub const PROMPT_CACHE_GIB_DEFAULT: f64 = 8.0;
/// The shortest prefix the prompt cache keeps, tokens (`--prompt-cache-min-tokens`).
pub const PROMPT_CACHE_MIN_TOKENS_DEFAULT: u64 = 1024;
/// llama-server's defaults for `--cors-methods` and `--cors-headers` (common/common.h).
pub const CORS_METHODS_DEFAULT: &str = "GET, POST, DELETE, OPTIONS";
pub const CORS_HEADERS_DEFAULT: &str = "*";

#[derive(Parser, Debug)]
#[command(
    name = "1bit",
    version,
    about = "Serve one local model behind an OpenAI-compatible API"
)]
pub struct Cli {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// How serve's lines are written (`log` sets it up before anything is said). Global: before
/// or after the subcommand; the drop-in (`1bit llama-server`) takes them from the environment.
#[derive(Args, Debug, Clone)]
pub struct LogArgs {
    /// Which lines are written: a `tracing` filter (`info`; `debug` adds one line per request;
    /// `warn`; `info,onebit::request=debug`).
    #[arg(
        long = "log",
        value_name = "FILTER",
        env = "ONEBIT_LOG",
        default_value = "info",
        global = true
    )]
    pub filter: String,
    /// `text`: each line as it always was; `json`: one JSON object per line (time, level,
    /// target, message, fields), the backends' lines too.
    #[arg(
        long,
        value_name = "FORMAT",
        env = "ONEBIT_LOG_FORMAT",
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
}

/// `--log-format`'s values.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// The log settings from the environment alone (`ONEBIT_LOG`, `ONEBIT_LOG_FORMAT`), for a
/// command line that is not serve's own (the drop-in's). A value clap refuses is the error.
#[derive(Parser, Debug)]
#[command(name = "1bit")]
pub struct LogFromEnv {
    #[command(flatten)]
    pub log: LogArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve one model on a loopback port.
    Serve(Box<ServeArgs>),
    /// List the device routes found, with their files, ABI versions, and whether they loaded.
    Plugins(PluginArgs),
    /// Run a llama.cpp RPC worker (ggml-rpc-server) that holds layers for `serve --rpc`.
    RpcWorker(WorkerArgs),
    /// Header-only GGUF models for tests, and a model's facts as serve reads them.
    Gguf {
        #[command(subcommand)]
        action: GgufAction,
    },
    /// llama-server's own command line (as Lemonade's llamacpp backend builds it), served by
    /// `1bit serve`; also what `1bit` does when run under the name `llama-server`.
    #[command(name = "llama-server", disable_help_flag = true)]
    LlamaServer {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<String>,
    },
}

#[derive(Args, Debug, Default)]
pub struct PluginArgs {
    /// Also look for route files in DIR (before the plugins folder beside the binary).
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Vec<PathBuf>,
    /// Also list the packages installed with `1bit plugins install --prefix DIR` (first).
    #[arg(long, value_name = "DIR")]
    pub prefix: Option<PathBuf>,
    #[command(subcommand)]
    pub action: Option<PluginAction>,
}

#[derive(Subcommand, Debug)]
pub enum PluginAction {
    /// Check a route library, a package folder or a package archive as serve would use it;
    /// one line per check, exit 1 on a failure.
    ///
    /// A package is checked as install checks it (the archive whole, the manifest, every
    /// file's sha256 and executable bit, the platform against this machine, the signature),
    /// installed into a scratch folder, and its route loaded from there as serve loads it.
    /// Then every route: info, claim and plan on the model. A route that answers in process:
    /// start, health, a whole and a streamed answer, a slow reader, a client that leaves, bad
    /// input, a panic contained, metrics. A route that runs its own engine programs: each
    /// program a file of the package (or an absolute system path) and executable, then serve
    /// itself runs the route with the fake backend standing in for each program (or, with
    /// --real-backends, the programs themselves), relays a whole and a streamed chat, reads
    /// /health and /metrics, and stops leaving no process.
    #[command(verbatim_doc_comment)]
    Check {
        /// The route library (`libonebit_route_NAME.so`), a package folder, or a `.tar.gz`.
        file: PathBuf,
        /// The model to claim and plan (default: a fixture file that is not a GGUF).
        #[arg(short = 'm', long, value_name = "MODEL")]
        model: Option<PathBuf>,
        /// An option for the route, KEY=VALUE; repeatable. Passed to the route as `1bit serve
        /// --route-opt` passes it; the route refuses a key it does not know.
        #[arg(long, value_name = "KEY=VALUE")]
        route_opt: Vec<String>,
        /// Run the plan's real engine programs instead of the fake backend: each must start,
        /// bind its port, answer health, relay a whole and a streamed chat, give its metrics,
        /// and leave no process (its own children included) after the stop.
        #[arg(long)]
        real_backends: bool,
        /// Seconds serve has to say ready (its backends healthy) before the check fails.
        #[arg(long, value_name = "SECS", default_value_t = 60)]
        ready_s: u64,
    },
    /// Check a route package (folder or .tar.gz: manifest, checksums and executable bits, the
    /// platform, the signature and the key the route's name belongs to, ABI, the route's own
    /// name) and install it atomically into the user's route folder; a newer version replaces
    /// an older one.
    Install {
        /// The package: a folder, or a `.tar.gz` of one.
        package: PathBuf,
        /// Install into `DIR/lib/1bit/plugins` instead of `~/.local/lib/1bit/plugins`.
        #[arg(long, value_name = "DIR")]
        prefix: Option<PathBuf>,
        /// Install a package that is unsigned, or signed by a key you have not trusted.
        #[arg(long)]
        allow_unsigned: bool,
        /// Install a package signed by another key than the one that signed the installed
        /// version (the route's name belongs to that key until you say so).
        #[arg(long)]
        new_signer: bool,
    },
    /// Remove an installed package by its route's name.
    Remove {
        /// The route's name (`1bit plugins` lists them).
        name: String,
        /// The prefix it was installed under.
        #[arg(long, value_name = "DIR")]
        prefix: Option<PathBuf>,
    },
    /// Trust a vendor's public key: packages it signed install and load without
    /// --allow-unsigned. The trust store is `$ONEBIT_TRUST_DIR`, else
    /// `$XDG_CONFIG_HOME/1bit/trusted-keys`, else `~/.config/1bit/trusted-keys`.
    Trust {
        /// The vendor's `.pub` file.
        key: PathBuf,
    },
    /// Stop trusting a key: every package it signed stops loading at serve's next start.
    Distrust {
        /// The key's fingerprint (`ed25519:...`, as `1bit plugins` shows it) or its `.pub` file.
        key: String,
    },
    /// Make a signing key pair for your packages: NAME.key (secret) and NAME.pub (give it to
    /// your users).
    Keygen {
        /// The key files' path without extension.
        name: PathBuf,
        /// Who the key is (your company's name), written in the .pub file.
        #[arg(long, default_value = "")]
        comment: String,
    },
    /// Build a package from a built route library and the files it carries: writes
    /// OUT/NAME-VERSION/ and OUT/NAME-VERSION.tar.gz, and prints the archive's path last.
    Package(PackageArgs),
}

/// `1bit plugins package`'s flags.
#[derive(Args, Debug)]
pub struct PackageArgs {
    /// The built route library (`libonebit_route_NAME.so`).
    pub route: PathBuf,
    /// The package's version (semver).
    #[arg(long = "version", value_name = "VERSION")]
    pub package_version: String,
    /// Who ships it.
    #[arg(long)]
    pub vendor: String,
    /// Its license: an SPDX expression, or `LicenseRef-...` for your own terms.
    #[arg(long)]
    pub license: String,
    /// One line on what the route runs (default: the route's own summary).
    #[arg(long)]
    pub summary: Option<String>,
    /// A file the route carries, with its version: FILE=VERSION; repeatable. Its executable
    /// bit is recorded (a program the route runs keeps it through install).
    #[arg(long, value_name = "FILE=VERSION")]
    pub carry: Vec<String>,
    /// A build of a carried file for CPUs with more features: FILE=OF:FEATURE,FEATURE (OF the
    /// carried file's name, the features as /proc/cpuinfo names them, or `native`: every
    /// feature of this machine's CPU, for a `-march=native` build); repeatable. serve uses the
    /// variant needing the most features this CPU has, else OF itself.
    #[arg(long, value_name = "FILE=OF:FEATURES")]
    pub variant: Vec<String>,
    /// The CPU features every file of the package needs (comma-separated, as /proc/cpuinfo
    /// names them: avx2,fma; `native`: every feature of this machine's CPU); recorded with the
    /// architecture and glibc read from the files.
    /// A package this machine cannot run is refused at install and at start.
    #[arg(long, value_name = "FEATURES", value_delimiter = ',')]
    pub cpu_features: Vec<String>,
    /// Sign the manifest with this secret key (`1bit plugins keygen`).
    #[arg(long, value_name = "KEYFILE")]
    pub sign: Option<PathBuf>,
    /// Where to write the package.
    #[arg(long, value_name = "DIR", default_value = "dist")]
    pub out: PathBuf,
}

#[derive(Subcommand, Debug)]
pub enum GgufAction {
    /// Write a header-only GGUF (v3) with a model's shape, no tensors: a test model the memory
    /// check and the routes read as they would a real one.
    Stub(StubArgs),
    /// Print a model's facts as serve reads them, one `key: value` a line, with the memory
    /// check's estimate at the model's own context.
    Inspect {
        /// The model (a .gguf file, the first shard of a sharded one).
        file: PathBuf,
    },
}

/// `1bit gguf stub`'s flags: the defaults are a small llama.
#[derive(Args, Debug, Clone)]
pub struct StubArgs {
    /// The file to write.
    pub out: PathBuf,
    /// `general.architecture`, the prefix of the model's own keys.
    #[arg(long, default_value = "llama", value_name = "ARCH")]
    pub arch: String,
    /// `<arch>.block_count`.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub layers: u32,
    /// `<arch>.attention.head_count`.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub heads: u32,
    /// `<arch>.attention.head_count_kv` (default: --heads).
    #[arg(long, value_name = "N")]
    pub kv_heads: Option<u32>,
    /// `<arch>.embedding_length`.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub embd: u32,
    /// `<arch>.context_length`, the model's training context.
    #[arg(long, default_value_t = 2048, value_name = "N")]
    pub ctx: u32,
    /// `general.file_type` (llama.cpp's ftype: 1 F16, 2 Q4_0, 7 Q8_0, 15 Q4_K_M, ...).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub file_type: u32,
    /// Make the file this many bytes, sparsely past the header, so the weights look this large.
    #[arg(long, value_name = "BYTES")]
    pub size: Option<u64>,
    /// `general.name` (default: OUT's file stem).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Replace OUT if it exists.
    #[arg(long)]
    pub force: bool,
}

/// serve's settings that come from the environment alone (docs/serve.md, Environment), read
/// here by clap with the flags and not by hand. Each is the text given (empty is unset) and is
/// judged where it is used, as it always was: a value that is not a number leaves the default.
/// The flags are hidden; the variables are the interface.
#[derive(Args, Debug, Default, Clone)]
pub struct EnvSettings {
    /// The largest request body, in bytes.
    #[arg(long, hide = true, env = "ONEBIT_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<String>,
    /// Seconds a client has to send a request's body.
    #[arg(long, hide = true, env = "ONEBIT_BODY_READ_TIMEOUT_S")]
    pub body_read_timeout_s: Option<String>,
    /// Seconds a client has to send a request's headers.
    #[arg(long, hide = true, env = "ONEBIT_HEADER_READ_TIMEOUT_S")]
    pub header_read_timeout_s: Option<String>,
    /// Seconds a backend gets after SIGTERM.
    #[arg(long, hide = true, env = "ONEBIT_BACKEND_STOP_GRACE_S")]
    pub backend_stop_grace_s: Option<String>,
    /// Microseconds a socket owed an answer asks for it before the thread sleeps.
    #[arg(long, hide = true, env = "ONEBIT_BUSY_POLL_US")]
    pub busy_poll_us: Option<String>,
    /// `0`: every request on the general engine (the fast engine hands each connection over
    /// unread); the engines' comparison, and a way around a fault in the fast one.
    #[arg(long, hide = true, env = "ONEBIT_FAST_ENGINE")]
    pub fast_engine: Option<String>,
    /// `--watchdog`'s default.
    #[arg(long, hide = true, env = "ONEBIT_WATCHDOG_SECS")]
    pub watchdog_secs: Option<String>,
    /// `1`: as `--precise`.
    #[arg(long, hide = true, env = "ONEBIT_PRECISE")]
    pub precise_env: Option<String>,
    /// `0`: as `--no-mem-check`.
    #[arg(long, hide = true, env = "ONEBIT_MEM_CHECK")]
    pub mem_check_env: Option<String>,
    /// `--laya-model`'s runtime, ggmlc's `laya` (else `laya` on PATH).
    #[arg(long, hide = true, env = "ONEBIT_LAYA_GGML")]
    pub laya_ggml: Option<String>,
    /// The device the Laya daemon runs on (`hrx`).
    #[arg(long, hide = true, env = "ONEBIT_LAYA_DEVICE")]
    pub laya_device: Option<String>,
    /// Seconds the Laya daemon has to say it is ready.
    #[arg(long, hide = true, env = "ONEBIT_LAYA_READY_S")]
    pub laya_ready_s: Option<String>,
    /// Milliseconds the Laya daemon has to answer one question.
    #[arg(long, hide = true, env = "ONEBIT_LAYA_ANSWER_MS")]
    pub laya_answer_ms: Option<String>,
}

impl EnvSettings {
    /// `ONEBIT_PRECISE=1`.
    pub fn precise(&self) -> bool {
        self.precise_env.as_deref().is_some_and(|v| v.trim() == "1")
    }

    /// `ONEBIT_MEM_CHECK=0`.
    pub fn no_mem_check(&self) -> bool {
        self.mem_check_env
            .as_deref()
            .is_some_and(|v| v.trim() == "0")
    }
}

#[derive(Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// The model: a .gguf file (the first shard of a sharded one) or an NPU model directory.
    #[arg(
        short = 'm',
        long,
        value_name = "MODEL",
        required_unless_present = "llama_router"
    )]
    pub model: Option<PathBuf>,
    /// llama-server's router mode, which the drop-in asks for when its command line names no
    /// model: the real llama-server picks and loads models itself (`--models-dir`, `/models`),
    /// behind serve's guard, key, supervision and health (docs/lemonade.md).
    #[arg(long, hide = true, conflicts_with = "model")]
    pub llama_router: bool,
    /// serve's own port.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// serve's own address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The device route: auto, npu, hrx, hybrid, cpu, ds4, or a vendor's route name.
    #[arg(long, default_value = "auto", value_name = "ROUTE")]
    pub device: String,
    /// The context size (tokens) the backend allocates.
    #[arg(short = 'c', long, value_name = "N")]
    pub ctx_size: Option<u64>,
    /// The served model name (default: the model file's stem). A comma-separated list, as
    /// llama-server's `-a`: all are listed as the model's aliases, and the first in sorted
    /// order is the served name.
    #[arg(long, value_name = "NAME")]
    pub alias: Option<String>,
    /// Informational tags for `/v1/models`, comma-separated (llama-server's `--tags`).
    #[arg(long, value_name = "TAGS")]
    pub tags: Option<String>,
    /// The llama-server binary (default: $ONEBIT_LLAMA_SERVER, the installed one, PATH).
    #[arg(long, value_name = "PATH")]
    pub llama_server: Option<String>,
    /// DwarfStar's ds4-server binary.
    #[arg(long, value_name = "PATH")]
    pub ds4: Option<String>,
    /// Pass --ssd-streaming to ds4-server.
    #[arg(long)]
    pub ssd_streaming: bool,
    /// The libhsa-runtime64 the HRX backend loads.
    #[arg(long, value_name = "PATH")]
    pub hrx_libhsa: Option<String>,
    /// --device hybrid: the program that prefills the prompt.
    #[arg(long, value_name = "PATH")]
    pub prefill_provider: Option<String>,
    /// HRX compute-wave save/restore placement.
    #[arg(long, value_name = "auto|on|off")]
    pub hrx_cwsr_placement: Option<String>,
    /// Draft with this MTP head.
    #[arg(long, value_name = "HEAD.gguf")]
    pub mtp: Option<String>,
    /// Draft with this DFlash block-diffusion model.
    #[arg(long, value_name = "DRAFT.gguf")]
    pub dflash: Option<String>,
    /// Do not draft with the model's own MTP layers.
    #[arg(long)]
    pub no_mtp: bool,
    /// The draft length.
    #[arg(long, value_name = "N")]
    pub mtp_max: Option<u32>,
    /// The draft probability threshold.
    #[arg(long, value_name = "P")]
    pub mtp_p_min: Option<f64>,
    /// A multimodal projector.
    #[arg(long, value_name = "MMPROJ.gguf")]
    pub mmproj: Option<String>,
    /// Classify each conversation and run it on the device the route policy names for its
    /// class (docs/laya.md); needs --device auto.
    #[arg(
        long,
        default_value_if("laya_model", clap::builder::ArgPredicate::IsPresent, "true")
    )]
    pub laya: bool,
    /// Classify with the Laya model: its GGUF (or a Laya folder holding one in gguf/), run by
    /// the `laya` daemon (ggmlc) that serve starts; implies --laya (docs/laya.md).
    #[arg(long, value_name = "PATH")]
    pub laya_model: Option<String>,
    /// A route policy file (replaces the built-in config/route-policy.json).
    #[arg(long, value_name = "FILE")]
    pub route_policy: Option<String>,
    /// The served model is a Project Manager that delegates tasks to expert models through
    /// Lemonade (docs/pm.md).
    #[arg(long)]
    pub pm: bool,
    /// --pm's experts file (replaces the built-in config/pm-experts.json).
    #[arg(long, value_name = "FILE")]
    pub pm_experts: Option<String>,
    /// The Lemonade --pm delegates to (default http://127.0.0.1:8000).
    #[arg(long, value_name = "URL")]
    pub lemonade_url: Option<String>,
    /// Expert streaming (refused in this build).
    #[arg(long, value_name = "N|auto")]
    pub moe_slots: Option<String>,
    /// Expert substitution ratio (refused in this build).
    #[arg(long, value_name = "R")]
    pub moe_subst: Option<String>,
    /// Expert prefetch (refused in this build).
    #[arg(long, value_name = "N")]
    pub moe_prefetch: Option<String>,
    /// Request slots in the backend (-np N).
    #[arg(long, value_name = "N")]
    pub parallel: Option<u32>,
    /// Serve /v1/embeddings from this model beside the chat model.
    #[arg(long, value_name = "MODEL.gguf")]
    pub embed: Option<String>,
    /// Serve /v1/rerank from this model beside the chat model.
    #[arg(long, value_name = "MODEL.gguf")]
    pub rerank: Option<String>,
    /// The model itself is an embedding model.
    #[arg(long, conflicts_with = "reranking")]
    pub embedding: bool,
    /// The model itself is a reranking model.
    #[arg(long)]
    pub reranking: bool,
    /// An option for the NPU route (or an add-on's), KEY=VALUE; repeatable. Passed to the
    /// route as it is; the route refuses a key it does not know.
    #[arg(long, value_name = "KEY=VALUE")]
    pub npu_opt: Vec<String>,
    /// llama.cpp RPC workers that take layers (`1bit rpc-worker`), each HOST:PORT.
    #[arg(long, value_name = "HOST:PORT[,...]", value_delimiter = ',')]
    pub rpc: Vec<String>,
    /// An option for the chosen route, KEY=VALUE; repeatable. Passed to the route as it is;
    /// the route refuses a key it does not know.
    #[arg(long, value_name = "KEY=VALUE")]
    pub route_opt: Vec<String>,
    /// At most N generations (chats, completions: what the route marks as inference) in
    /// flight at once; one more is refused at once with 503 and Retry-After: 1, so a client or
    /// a gateway retries it later or on another server. Default: no limit (the backend queues).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_generations: Option<u64>,
    /// End a generation still running SECS seconds after it was admitted: a whole reply not
    /// yet begun gets 504, a stream under way one last error event, and the backend's
    /// connection is dropped, which stops the engine. Default: no deadline.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_generation_s: Option<u64>,
    /// Run each backend of the plan as PROGRAM (the fake backend) with the plan's own
    /// arguments and environment: how `1bit plugins check` tests a child-process route on a
    /// machine without its engine.
    #[arg(long, hide = true, value_name = "PROGRAM")]
    pub backend_standin: Option<PathBuf>,
    /// Skip the memory check.
    #[arg(long, conflicts_with = "mem_check")]
    pub no_mem_check: bool,
    /// Print the memory estimate and exit: 0 when it fits, 3 when it does not.
    #[arg(long)]
    pub mem_check: bool,
    /// Seconds without progress before a request's backend is judged hung (0: off).
    #[arg(long, value_name = "SECS")]
    pub watchdog: Option<u64>,
    /// Prompt tokens per second the watchdog allows before a request's first byte.
    #[arg(long, value_name = "N")]
    pub watchdog_prompt_tps: Option<f64>,
    /// Send an SSE comment (`: keep-alive`) on a stream whose backend has been silent this many
    /// seconds (a long prefill), between events; 0 turns it off.
    #[arg(long, value_name = "SECS", env = "ONEBIT_SSE_KEEPALIVE_S", default_value_t = SSE_KEEPALIVE_DEFAULT_S)]
    pub sse_keepalive_s: u64,
    /// On SIGTERM, let requests in flight finish for up to this many seconds before the
    /// backends stop (0: stop at once).
    #[arg(long, value_name = "SECS", env = "ONEBIT_DRAIN_S", default_value_t = DRAIN_DEFAULT_S)]
    pub drain_s: f64,
    /// On SIGTERM, go on answering for this many seconds (within `--drain-s`) while `/health`
    /// answers 503 draining, so a gateway's health check stops sending here before connects
    /// are refused (docs/fleet.md); 0: refuse at once.
    #[arg(
        long,
        value_name = "SECS",
        env = "ONEBIT_DRAIN_NOTICE_S",
        default_value_t = 0.0
    )]
    pub drain_notice_s: f64,
    /// Refuse a model with any node off the device.
    #[arg(long, conflicts_with = "no_strict_device")]
    pub strict_device: bool,
    /// Allow nodes off the device.
    #[arg(long)]
    pub no_strict_device: bool,
    /// Print the device placement report.
    #[arg(long)]
    pub placement_report: bool,
    /// Tuned settings from FILE instead of the built-in recipes.
    #[arg(long, value_name = "FILE", conflicts_with = "no_recipes")]
    pub recipes: Option<String>,
    /// No recipes.
    #[arg(long)]
    pub no_recipes: bool,
    /// Re-prefill the whole conversation on every request.
    #[arg(long)]
    pub precise: bool,
    /// Send Claude Code's attribution line (`x-anthropic-billing-header: ...`, first in the
    /// system prompt: a Messages request's `system`, a chat completion's first system message,
    /// a Responses request's `instructions`) to the engine; by default it is dropped, since it
    /// changes every turn and the engine's cached prefix would end at it.
    #[arg(long)]
    pub keep_attribution: bool,
    /// Keep the KV state of long prompts in DIR across serve's restarts (default: `prompt-cache/`
    /// under serve's state directory, one folder per model file; docs/serve.md).
    #[arg(long, value_name = "DIR")]
    pub prompt_cache_dir: Option<PathBuf>,
    /// No persistent prompt cache: nothing is saved or restored.
    #[arg(long)]
    pub no_prompt_cache: bool,
    /// The prompt cache's disk budget in GiB; the least recently used states go first.
    #[arg(long, value_name = "N", default_value_t = PROMPT_CACHE_GIB_DEFAULT)]
    pub prompt_cache_gib: f64,
    /// The shortest prompt prefix, in tokens, whose state is worth keeping on disk.
    #[arg(long, value_name = "N", default_value_t = PROMPT_CACHE_MIN_TOKENS_DEFAULT)]
    pub prompt_cache_min_tokens: u64,
    #[command(flatten)]
    pub env: EnvSettings,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(
        long,
        value_name = "KEY",
        env = "ONEBIT_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Read the API keys from FILE, one a line, `#` lines skipped (kept out of the process list).
    #[arg(long, value_name = "FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Origins a web page may call serve from and read its replies: `*`, `localhost` (loopback
    /// origins), or a comma list (llama-server's flag; docs/security.md).
    #[arg(long, value_name = "ORIGINS")]
    pub cors_origins: Option<String>,
    /// Methods a preflight allows under --cors-origins (llama-server's default).
    #[arg(long, value_name = "METHODS", default_value = CORS_METHODS_DEFAULT)]
    pub cors_methods: String,
    /// Headers a preflight allows under --cors-origins.
    #[arg(long, value_name = "HEADERS", default_value = CORS_HEADERS_DEFAULT)]
    pub cors_headers: String,
    /// Let pages send credentials under --cors-origins (llama-server's default: on).
    #[arg(long, overrides_with = "no_cors_credentials")]
    pub cors_credentials: bool,
    /// Do not let pages send credentials under --cors-origins.
    #[arg(long)]
    pub no_cors_credentials: bool,
    /// Answer GET /metrics 501, as llama-server does without its --metrics (the drop-in sets
    /// it when its command line lacks --metrics).
    #[arg(long)]
    pub no_metrics: bool,
    /// Print the backend serve would start as one JSON line, and exit.
    #[arg(long, conflicts_with = "print_backend_env")]
    pub print_backend: bool,
    /// Print only the backend's environment, one NAME=VALUE line each, and exit.
    #[arg(long)]
    pub print_backend_env: bool,
    /// Also look for route files in DIR.
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Vec<PathBuf>,
    /// Arguments after `--` go to the llama-server backend unchanged (`-- --temp 0.6`).
    #[arg(last = true, value_name = "LLAMA_SERVER_ARGS")]
    pub backend_args: Vec<String>,
    /// serve's whole command line after `serve` (for a route's private flags); set by `main`.
    #[arg(skip)]
    pub command_line: Vec<String>,
    /// serve runs as Lemonade's llama-server (`1bit llama-server`, the drop-in); set by
    /// `main`. Its supervisor is Lemonade: serve's route label on `onebit_up` is `route`, and
    /// it never notifies a service manager (`NOTIFY_SOCKET` would name Lemonade's own).
    #[arg(skip)]
    pub under_lemonade: bool,

    // Removed flags, parsed only to refuse them with their reason (`ServeArgs::removed`).
    #[arg(long, hide = true)]
    pub lean: bool,
    #[arg(long, hide = true, value_name = "DEVICE")]
    pub prefill_device: Option<String>,
    #[arg(long, hide = true, value_name = "N")]
    pub prefill_min_tokens: Option<String>,
    #[arg(long, hide = true)]
    pub adaptive: bool,
    #[arg(long, hide = true, value_name = "N")]
    pub adaptive_at: Option<String>,
    #[arg(long, hide = true, value_name = "MODEL")]
    pub long_model: Option<String>,
    #[arg(long, hide = true, value_name = "N")]
    pub long_from: Option<String>,
    #[arg(long, hide = true, value_name = "PATH")]
    pub zinc: Option<String>,
    #[arg(long, hide = true, value_name = "PATH")]
    pub mlx_server: Option<String>,
}

/// What a removed device ran, and what to use instead.
const REMOVED_DEVICES: [(&str, &str); 4] = [
    (
        "vulkan",
        "it ran upstream llama.cpp's release on Vulkan0, and this engine has no Vulkan build; use --device hrx (or cpu), or Lemonade's own llamacpp Vulkan backend",
    ),
    (
        "rocm",
        "it ran the ROCmFPX tree's ROCm build on ROCm0, and this engine has no ROCm backend; use --device hrx (or cpu), or Lemonade's own llamacpp ROCm backend",
    ),
    (
        "zinc",
        "ZINC (zolotukhin/zinc), a Zig GGUF engine on Vulkan, ROCm or CUDA, is not part of this engine; use --device hrx (or cpu)",
    ),
    (
        "mlx",
        "lemon-mlx-engine's server (MLX on Metal, Apple Silicon) is not part of this engine; use Lemonade's own MLX backend",
    ),
];

impl ServeArgs {
    /// The model's path: empty in router mode, the one case without `-m`.
    pub fn model(&self) -> &std::path::Path {
        self.model.as_deref().unwrap_or(std::path::Path::new(""))
    }

    /// Flags this build parses but whose behaviour is not here yet, by the name a user typed.
    /// Each is refused with one line (exit 2) rather than silently ignored.
    pub fn not_yet_available(&self) -> Vec<&'static str> {
        let mut flags = Vec::new();
        let mut check = |set: bool, name: &'static str| {
            if set {
                flags.push(name);
            }
        };
        check(self.hrx_cwsr_placement.is_some(), "--hrx-cwsr-placement");
        flags
    }

    /// A removed device or flag, as one line saying what it was and what to use instead
    /// (exit 2); None when none was asked for.
    pub fn removed(&self) -> Option<String> {
        if let Some((device, why)) = REMOVED_DEVICES.iter().find(|(d, _)| *d == self.device) {
            return Some(format!("--device {device} was removed: {why}"));
        }
        let device_flag = |flag: &str, device: &str| {
            let why = REMOVED_DEVICES
                .iter()
                .find(|(d, _)| *d == device)
                .map(|(_, why)| *why)
                .unwrap_or_default();
            format!("{flag} was removed with --device {device}: {why}")
        };
        let flags: [(bool, &str, &str); 7] = [
            (
                self.lean,
                "--lean",
                "ROCmFPX's ROCmFP4 / ROCmI4 formats went with the ROCm build; serve a standard GGUF on --device hrx",
            ),
            (
                self.prefill_device.is_some(),
                "--prefill-device",
                "Vulkan decode with the prompt prefilled on HRX0 went with the Vulkan build; --device hrx prefills and decodes on HRX0",
            ),
            (
                self.prefill_min_tokens.is_some(),
                "--prefill-min-tokens",
                "Vulkan decode with the prompt prefilled on HRX0 went with the Vulkan build; --device hrx prefills and decodes on HRX0",
            ),
            (
                self.adaptive,
                "--adaptive",
                "Vulkan for the first requests with ROCm batching the overflow went with those builds; use --device hrx, with --parallel N for concurrent requests",
            ),
            (
                self.adaptive_at.is_some(),
                "--adaptive-at",
                "Vulkan for the first requests with ROCm batching the overflow went with those builds; use --device hrx, with --parallel N for concurrent requests",
            ),
            (
                self.long_model.is_some(),
                "--long-model",
                "long conversations to a Hadamard-rotated Q4_0 on the ROCm W4A4 route went with the ROCm build and the H32 format; serve one standard GGUF on --device hrx",
            ),
            (
                self.long_from.is_some(),
                "--long-from",
                "long conversations to a Hadamard-rotated Q4_0 on the ROCm W4A4 route went with the ROCm build and the H32 format; serve one standard GGUF on --device hrx",
            ),
        ];
        if let Some((_, flag, why)) = flags.iter().find(|(set, _, _)| *set) {
            return Some(format!("{flag} was removed: {why}"));
        }
        if self.zinc.is_some() {
            return Some(device_flag("--zinc", "zinc"));
        }
        if self.mlx_server.is_some() {
            return Some(device_flag("--mlx-server", "mlx"));
        }
        None
    }

    /// Flags that need serve in the request path, so `--print-backend` exits 5 for them.
    pub fn needs_serve_in_path(&self) -> Option<&'static str> {
        [
            (self.pm, "--pm"),
            (self.laya, "--laya"),
            (self.laya_model.is_some(), "--laya-model"),
            (self.embed.is_some(), "--embed"),
            (self.rerank.is_some(), "--rerank"),
            (self.prompt_cache_dir.is_some(), "--prompt-cache-dir"),
        ]
        .into_iter()
        .find(|(set, _)| *set)
        .map(|(_, flag)| flag)
    }

    /// Flags the specification keeps but this build refuses for good.
    pub fn refused_in_this_build(&self) -> Option<&'static str> {
        if self.moe_slots.is_some() {
            Some("--moe-slots")
        } else if self.moe_subst.is_some() {
            Some("--moe-subst")
        } else if self.moe_prefetch.is_some() {
            Some("--moe-prefetch")
        } else {
            None
        }
    }
}

/// `1bit rpc-worker`'s flags (run by `rpc::worker`).
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The IPv4 address to listen on. Anything but loopback lets every machine that reaches
    /// the port use this one (the protocol has no authentication; docs/security.md).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port to listen on (0: a free port the kernel picks).
    #[arg(long, default_value_t = RPC_WORKER_DEFAULT_PORT)]
    pub port: u16,
    /// Offer at most this many GiB per device: a relay in front of the worker caps what it
    /// reports (the pinned ggml-rpc-server reports its devices' own memory).
    #[arg(long, value_name = "GiB")]
    pub mem: Option<f64>,
    /// Count what crosses the link, by RPC command, and keep the counts in FILE (JSON,
    /// rewritten while they change and at exit); the relay `--mem` uses carries the link.
    #[arg(long, value_name = "FILE")]
    pub traffic: Option<PathBuf>,
    /// CPU threads for the worker's CPU device (default: ggml-rpc-server's, half the cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<u32>,
    /// The ggml-rpc-server binary (default: $ONEBIT_RPC_SERVER, beside $ONEBIT_LLAMA_SERVER,
    /// the installed one, PATH).
    #[arg(long, value_name = "PATH")]
    pub rpc_server: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn the_command_line_is_well_formed() {
        // clap's own checks (unique ids, conflicts that name real arguments), which it runs
        // only when a debug build parses: a clash would panic every `1bit` command.
        Cli::command().debug_assert();
        LogFromEnv::command().debug_assert();
    }

    #[test]
    fn env_settings_are_judged_as_before() {
        let cli = Cli::try_parse_from([
            "1bit",
            "serve",
            "-m",
            "m.gguf",
            "--precise-env",
            " 1",
            "--mem-check-env",
            "1",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("serve");
        };
        assert!(args.env.precise());
        assert!(!args.env.no_mem_check());
        assert_eq!(cli.log.filter, "info");
        assert_eq!(cli.log.log_format, LogFormat::Text);
    }
}
