//! The batch a decode reads and the sampler chain a request draws with, owned by Rust.
// Both are llama.cpp's allocations, written through raw pointers and freed through C.
#![allow(unsafe_code)]

use super::Token;
use super::abi::{Batch, Sampler};

/// A batch of tokens for one decode, allocated by llama.cpp once and refilled for each decode.
pub struct TokenBatch {
    pub(super) raw: Batch,
    pub(super) capacity: usize,
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
    /// index (what [`super::Session::sample_at`] takes). Panics when full (callers check `is_full`).
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
    pub(super) chain: *mut Sampler,
    pub(super) free: unsafe extern "C" fn(*mut Sampler),
}

impl Drop for SamplerChain {
    fn drop(&mut self) {
        // SAFETY: the chain is owned here alone; freeing it frees the samplers it holds.
        unsafe { (self.free)(self.chain) }
    }
}
