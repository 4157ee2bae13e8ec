//! A loaded model and its context: the safe methods the engine calls on llama.cpp.
// Every method calls llama.cpp through its function pointers on the live model and context.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

use super::abi::{Context, Functions, Model, Vocab};
use super::batch::{SamplerChain, TokenBatch};
use super::log::BUFFERS;
use super::{Llama, Token};
use crate::error::InprocError;
use crate::state_buffer::StateBuffer;

/// llama.cpp's micro-batch: the cpu route's (`-ub 256`), so a prompt is decoded in the runs
/// the cpu route's llama-server decodes it in and the greedy replies agree token for token.
pub const UBATCH: u32 = 256;

impl Llama {
    /// Load a GGUF and make a context of `n_ctx` tokens with `threads` threads. Blocks for
    /// the loading (a second for a small model).
    pub fn open(
        &self,
        path: &Path,
        n_ctx: u32,
        threads: i32,
        slots: u32,
    ) -> Result<Session<'_>, InprocError> {
        let f = &self.functions;
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            InprocError::Engine(format!("{}: the path holds a NUL byte", path.display()))
        })?;
        // SAFETY: the default-params functions take nothing and return the structs by value,
        // with the layouts declared in abi.rs.
        let (mut model_params, mut context_params) =
            unsafe { ((f.model_default_params)(), (f.context_default_params)()) };
        model_params.n_gpu_layers = 0;
        context_params.n_ctx = n_ctx;
        context_params.n_ubatch = UBATCH;
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
        let model = NonNull::new(model).ok_or_else(|| {
            InprocError::Engine(format!("llama.cpp could not load {}", path.display()))
        })?;
        // SAFETY: `model` is a live model from llama_model_load_from_file.
        let context = unsafe { (f.init_from_model)(model.as_ptr(), context_params) };
        let Some(context) = NonNull::new(context) else {
            // SAFETY: the model is live and owned here alone.
            unsafe { (f.model_free)(model.as_ptr()) };
            return Err(InprocError::Engine(format!(
                "llama.cpp could not make a context of {n_ctx} tokens for {}",
                path.display()
            )));
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
    pub fn decode_batch(&self, batch: &TokenBatch) -> Result<(), InprocError> {
        // SAFETY: the context is live; the batch's arrays hold `n_tokens` filled entries.
        let status = unsafe { (self.f().decode)(self.context.as_ptr(), batch.raw) };
        if status != 0 {
            return Err(InprocError::Engine(format!(
                "llama_decode failed with status {status}"
            )));
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
    pub fn warm_up(&self) -> Result<(), InprocError> {
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
    pub fn tokenize(&self, text: &str) -> Result<Vec<Token>, InprocError> {
        self.tokenize_with(text, true)
    }

    /// Tokenize `text` with special tokens parsed, and added only when `add_special` (a piece
    /// of a prompt, such as a message delimiter, gets none).
    pub fn tokenize_with(&self, text: &str, add_special: bool) -> Result<Vec<Token>, InprocError> {
        let len = i32::try_from(text.len())
            .map_err(|_| InprocError::Engine("the prompt is too long".to_string()))?;
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
                return Err(InprocError::Engine(
                    "llama.cpp could not tokenize the prompt".to_string(),
                ));
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
