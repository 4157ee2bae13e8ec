//! The engine thread: loads llama.cpp and the model once, then runs every request's job.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, mpsc};

use crate::chat;
use crate::error::InprocError;
use crate::ffi::Llama;
use crate::generate::{Counters, Job, PromptCache, SlotEngine};
use crate::host::{mapped_bytes, status_bytes};
use crate::plan::State;

/// The loaded engine: a thread of its own holds llama.cpp's model and its one context and
/// runs one job at a time. One thread for every request, because ggml's OpenMP keeps a team
/// of threads per calling thread: decoding from whichever thread the host gives each request
/// left earlier teams competing for the cores and halved decode speed.
pub struct Engine {
    pub jobs: mpsc::Sender<Job>,
    pub served_name: String,
    pub model: Model,
}

/// Start the engine thread: it loads llama.cpp (once per process; it stays loaded) and the
/// model, then runs jobs for the life of the process. Blocks until the model is loaded.
pub fn load(state: &State, counters: Arc<Counters>) -> Result<Engine, InprocError> {
    let (jobs, queue) = mpsc::channel::<Job>();
    let (ready, loaded) = mpsc::channel();
    let served_name = state.served_name.clone();
    let state = state.clone();
    std::thread::Builder::new()
        .name("inproc-engine".to_string())
        .spawn(move || engine_thread(&state, ready, queue, counters))
        .map_err(|e| {
            InprocError::Engine(format!(
                "the inproc route could not start its engine thread: {e}"
            ))
        })?;
    let model = loaded.recv().map_err(|_| {
        InprocError::Engine("the inproc route's engine thread failed while loading".to_string())
    })??;
    Ok(Engine {
        jobs,
        served_name,
        model,
    })
}

/// What the engine thread hands back once the model is loaded.
pub struct Model {
    /// `tokenizer.chat_template` (ChatML when the GGUF has none, as llama-server falls back),
    /// and the texts of its begin and end tokens.
    pub template: String,
    pub bos: String,
    pub eos: String,
    /// What llama.cpp said it allocated for the model and its context, by kind.
    pub buffers: Vec<(String, u64)>,
    /// The model's own resident memory: what its load, its context and the warm-up added to
    /// the process's anonymous memory, and the mapped GGUF's resident pages.
    pub resident_bytes: u64,
}

type Loaded = Result<Model, InprocError>;

/// The engine thread: load, say so, then one job at a time until the route is gone.
fn engine_thread(
    state: &State,
    ready: mpsc::Sender<Loaded>,
    queue: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
) {
    static LLAMA: OnceLock<Result<Llama, InprocError>> = OnceLock::new();
    let llama = match LLAMA
        .get_or_init(|| {
            let files: Vec<PathBuf> = if state.lib_files.is_empty() {
                crate::ffi::LIBRARIES
                    .iter()
                    .map(|name| Path::new(&state.lib_dir).join(name))
                    .collect()
            } else {
                state.lib_files.iter().map(PathBuf::from).collect()
            };
            Llama::load(&files)
        })
        .as_ref()
    {
        Ok(llama) => llama,
        Err(e) => {
            let _ = ready.send(Err(InprocError::Engine(format!(
                "the inproc route could not load llama.cpp: {e}"
            ))));
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
        let _ = ready.send(Err(InprocError::Engine(format!(
            "the inproc route could not run {} once (warm-up): {e}",
            state.model
        ))));
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
