//! Helpers shared by the gguf integration tests: scratch directories and a typical header.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use gguf::writer::Builder;

/// A fresh, empty directory under the system temp dir, unique per process and call.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("gguf-test-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// A small llama-like header with every common shape of value: scalars, a string array,
/// an i32 array and a few tensors.
pub fn llama_like() -> Builder {
    Builder::new()
        .kv("general.architecture", "llama")
        .kv("general.name", "tiny")
        .kv("llama.block_count", 2u32)
        .kv("llama.context_length", 8192u32)
        .kv("llama.embedding_length", 64u32)
        .kv("llama.attention.head_count", 4u32)
        .kv("llama.attention.head_count_kv", vec![2i32, 1])
        .kv("llama.rope.freq_base", 10000.0f32)
        .kv("tokenizer.ggml.tokens", vec!["<s>", "</s>", "a", "b"])
        .kv("tokenizer.ggml.token_type", vec![3i32, 3, 1, 1])
        .kv("tokenizer.ggml.add_bos_token", true)
        .tensor("token_embd.weight", &[64, 4], 1, 0)
        .tensor("blk.0.attn_q.weight", &[64, 64], 8, 512)
        .tensor("output_norm.weight", &[64], 0, 4864)
}

pub fn parse(bytes: &[u8]) -> Result<gguf::Header, gguf::Error> {
    gguf::read_header_from(bytes, bytes.len() as u64, "t.gguf")
}

/// The error text for `bytes`, which must not parse.
pub fn error_text(bytes: &[u8]) -> String {
    match parse(bytes) {
        Ok(h) => panic!("expected an error, parsed {} keys", h.metadata.len()),
        Err(e) => e.to_string(),
    }
}
