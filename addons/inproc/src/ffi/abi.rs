//! The pinned llama.h's structs, handles and function signatures, as Rust declares them.

use std::ffi::{c_char, c_int, c_void};

use super::Token;

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
    pub(super) n_outputs_max: u32,
    pub(super) n_outputs_max_per_seq: u32,
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
    pub(super) swa_full: bool,
    pub(super) kv_unified: bool,
    samplers: *mut c_void,
    n_samplers: usize,
    ctx_other: *mut c_void,
}

/// `struct llama_batch`, as `llama_batch_get_one` returns it (a view of the caller's tokens).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Batch {
    pub(super) n_tokens: i32,
    pub(super) token: *mut Token,
    pub(super) embd: *mut f32,
    pub(super) pos: *mut i32,
    pub(super) n_seq_id: *mut i32,
    pub(super) seq_id: *mut *mut i32,
    pub(super) logits: *mut i8,
}

/// `struct llama_sampler_chain_params`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct ChainParams {
    no_perf: bool,
}

/// `ggml_log_callback`.
pub(super) type LogCallback = unsafe extern "C" fn(c_int, *const c_char, *mut c_void);

/// Opaque handles.
pub(super) type Model = c_void;
pub(super) type Context = c_void;
pub(super) type Vocab = c_void;
pub(super) type Memory = c_void;
pub(super) type Sampler = c_void;

/// The functions of libllama the route calls, resolved once.
pub(super) struct Functions {
    pub(super) backend_init: unsafe extern "C" fn(),
    pub(super) model_default_params: unsafe extern "C" fn() -> ModelParams,
    pub(super) context_default_params: unsafe extern "C" fn() -> ContextParams,
    pub(super) model_load_from_file: unsafe extern "C" fn(*const c_char, ModelParams) -> *mut Model,
    pub(super) model_free: unsafe extern "C" fn(*mut Model),
    pub(super) init_from_model: unsafe extern "C" fn(*mut Model, ContextParams) -> *mut Context,
    pub(super) free: unsafe extern "C" fn(*mut Context),
    pub(super) n_batch: unsafe extern "C" fn(*const Context) -> u32,
    pub(super) n_ubatch: unsafe extern "C" fn(*const Context) -> u32,
    pub(super) n_ctx_seq: unsafe extern "C" fn(*const Context) -> u32,
    pub(super) batch_init: unsafe extern "C" fn(i32, i32, i32) -> Batch,
    pub(super) model_get_vocab: unsafe extern "C" fn(*const Model) -> *const Vocab,
    pub(super) model_chat_template:
        unsafe extern "C" fn(*const Model, *const c_char) -> *const c_char,
    pub(super) model_meta_val_str:
        unsafe extern "C" fn(*const Model, *const c_char, *mut c_char, usize) -> i32,
    pub(super) get_memory: unsafe extern "C" fn(*const Context) -> *mut Memory,
    pub(super) memory_seq_rm: unsafe extern "C" fn(*mut Memory, i32, i32, i32) -> bool,
    pub(super) memory_seq_pos_min: unsafe extern "C" fn(*mut Memory, i32) -> i32,
    pub(super) state_seq_get_size: unsafe extern "C" fn(*mut Context, i32) -> usize,
    pub(super) state_seq_get_data: unsafe extern "C" fn(*mut Context, *mut u8, usize, i32) -> usize,
    pub(super) state_seq_set_data:
        unsafe extern "C" fn(*mut Context, *const u8, usize, i32) -> usize,
    pub(super) model_n_swa: unsafe extern "C" fn(*const Model) -> i32,
    pub(super) tokenize:
        unsafe extern "C" fn(*const Vocab, *const c_char, i32, *mut Token, i32, bool, bool) -> i32,
    pub(super) token_to_piece:
        unsafe extern "C" fn(*const Vocab, Token, *mut c_char, i32, i32, bool) -> i32,
    pub(super) vocab_is_eog: unsafe extern "C" fn(*const Vocab, Token) -> bool,
    pub(super) vocab_bos: unsafe extern "C" fn(*const Vocab) -> Token,
    pub(super) vocab_eos: unsafe extern "C" fn(*const Vocab) -> Token,
    pub(super) decode: unsafe extern "C" fn(*mut Context, Batch) -> i32,
    pub(super) sampler_chain_default_params: unsafe extern "C" fn() -> ChainParams,
    pub(super) sampler_chain_init: unsafe extern "C" fn(ChainParams) -> *mut Sampler,
    pub(super) sampler_chain_add: unsafe extern "C" fn(*mut Sampler, *mut Sampler),
    pub(super) sampler_init_greedy: unsafe extern "C" fn() -> *mut Sampler,
    pub(super) sampler_init_dist: unsafe extern "C" fn(u32) -> *mut Sampler,
    pub(super) sampler_init_top_k: unsafe extern "C" fn(i32) -> *mut Sampler,
    pub(super) sampler_init_top_p: unsafe extern "C" fn(f32, usize) -> *mut Sampler,
    pub(super) sampler_init_min_p: unsafe extern "C" fn(f32, usize) -> *mut Sampler,
    pub(super) sampler_init_temp: unsafe extern "C" fn(f32) -> *mut Sampler,
    pub(super) sampler_sample: unsafe extern "C" fn(*mut Sampler, *mut Context, i32) -> Token,
    pub(super) sampler_free: unsafe extern "C" fn(*mut Sampler),
    pub(super) print_system_info: unsafe extern "C" fn() -> *const c_char,
    pub(super) log_set: unsafe extern "C" fn(Option<LogCallback>, *mut c_void),
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
}
