//! What a KV estimate is asked with (the cache types, context, sequences and the like, as
//! llama-server's flags set them) and what it answers.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// Bytes in a MiB, for callers printing "40 + 62.8 MiB".
pub const MIB: f64 = 1024.0 * 1024.0;

/// A KV cache element type, as llama-server's `-ctk` / `-ctv` name it (`kv_cache_types` in
/// `common/arg.cpp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Iq4Nl,
    Q5_0,
    Q5_1,
}

impl CacheType {
    /// Every type `-ctk` / `-ctv` accept, in llama-server's order.
    pub const ALL: [CacheType; 9] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::Bf16,
        CacheType::Q8_0,
        CacheType::Q4_0,
        CacheType::Q4_1,
        CacheType::Iq4Nl,
        CacheType::Q5_0,
        CacheType::Q5_1,
    ];

    /// The name llama-server takes and prints (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Bf16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
            CacheType::Q4_1 => "q4_1",
            CacheType::Iq4Nl => "iq4_nl",
            CacheType::Q5_0 => "q5_0",
            CacheType::Q5_1 => "q5_1",
        }
    }

    /// (elements per block, bytes per block), from ggml's type traits.
    fn block(self) -> (u64, u64) {
        match self {
            CacheType::F32 => (1, 4),
            CacheType::F16 | CacheType::Bf16 => (1, 2),
            CacheType::Q8_0 => (32, 34),
            CacheType::Q4_0 | CacheType::Iq4Nl => (32, 18),
            CacheType::Q4_1 => (32, 20),
            CacheType::Q5_0 => (32, 22),
            CacheType::Q5_1 => (32, 24),
        }
    }

    /// Bytes of one row of `n` elements (`ggml_row_size`). ggml requires `n` to be a
    /// multiple of the block size; a partial block is counted whole rather than refused.
    pub fn row_size(self, n: u64) -> u64 {
        let (elems, bytes) = self.block();
        n.div_ceil(elems).saturating_mul(bytes)
    }
}

impl fmt::Display for CacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CacheType {
    type Err = Error;

    /// An unknown name is an [`ErrorKind::Settings`](crate::ErrorKind::Settings) error
    /// naming the types `-ctk` / `-ctv` take.
    fn from_str(s: &str) -> Result<CacheType, Error> {
        CacheType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = CacheType::ALL.iter().map(|t| t.name()).collect();
                Error::settings(format!(
                    "unsupported KV cache type '{s}'; -ctk/-ctv take one of {}",
                    names.join(", ")
                ))
            })
    }
}

/// The context settings that size llama.cpp's memory, as llama-server would be started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSettings {
    /// `-c`: total cells across all sequences, before llama.cpp pads it to 256. 0 means the
    /// model's own `context_length`, as `-c 0` does.
    pub ctx: u64,
    /// `-np`: parallel sequences (slots); 0 counts as 1.
    pub n_parallel: u32,
    /// `--kv-unified`: one cache shared by all sequences rather than one stream each.
    pub unified: bool,
    /// `-ctk`.
    pub type_k: CacheType,
    /// `-ctv`.
    pub type_v: CacheType,
    /// Whether flash attention is on when the cache is created. `-fa auto` (the default)
    /// counts as on: llama.cpp resolves auto only after the memory exists. Off stores V
    /// transposed, padded to the widest layer.
    pub flash_attn: bool,
    /// `-ub`.
    pub n_ubatch: u64,
    /// `--swa-full`: SWA layers keep the whole context instead of a window.
    pub swa_full: bool,
}

impl KvSettings {
    /// llama-server's defaults for one slot at context `ctx` (0 = the model's own).
    pub fn new(ctx: u64) -> KvSettings {
        KvSettings {
            ctx,
            n_parallel: 1,
            unified: true,
            type_k: CacheType::F16,
            type_v: CacheType::F16,
            flash_attn: true,
            n_ubatch: 512,
            swa_full: false,
        }
    }
}

impl Default for KvSettings {
    fn default() -> KvSettings {
        KvSettings::new(0)
    }
}

/// What llama.cpp will allocate for a model's sequence memory, split the way a user reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvEstimate {
    /// KV of the full-attention layers (and, for DeepSeek-3.2-style models, the indexer keys).
    pub kv_bytes: u64,
    /// KV of the sliding-window layers.
    pub swa_bytes: u64,
    /// Recurrent (conv + SSM / delta-net / RWKV) state of all sequences.
    pub recurrent_bytes: u64,
    /// The padded context llama.cpp runs with (`n_ctx`).
    pub n_ctx: u64,
    /// Cells per stream of the full-attention cache.
    pub cells: u64,
    /// Cells per stream of the SWA cache (0 when the model has no windowed layers).
    pub swa_cells: u64,
    /// KV streams: 1 when unified, else one per parallel sequence.
    pub n_stream: u64,
    pub kv_layers: u32,
    pub swa_layers: u32,
    pub recurrent_layers: u32,
    /// False for architectures with a cache this estimate only approximates (indexer or
    /// compressed caches of DeepSeek-4, GLM-DSA, MiniMax-M3, ...): the figure is the plain
    /// attention part and may be off by the extra cache.
    pub exact: bool,
}

impl KvEstimate {
    /// KV and state together: what `mem_admit` adds to the weights.
    pub fn total_bytes(&self) -> u64 {
        self.kv_bytes
            .saturating_add(self.swa_bytes)
            .saturating_add(self.recurrent_bytes)
    }

    /// KV of both caches, without recurrent state.
    pub fn attention_bytes(&self) -> u64 {
        self.kv_bytes.saturating_add(self.swa_bytes)
    }
}
