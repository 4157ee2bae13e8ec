//! llama.cpp's KV-cache and recurrent-state sizes for a model, computed from its GGUF header alone.
//!
//! The memory check must refuse a load before llama-server starts, so it cannot ask llama.cpp.
//! These are the pinned llama.cpp's own allocation rules (`llama_kv_cache` ctor
//! `src/llama-kv-cache.cpp`, `llama_kv_cache_iswa`, `llama_memory_recurrent`, the per-arch
//! `load_arch_hparams` in `src/models/*.cpp` and `create_memory` in `src/llama-model.cpp`),
//! restated over header keys: what llama.cpp allocates, not what a paper says a model needs.
//! Pure functions; callable from any thread.

use crate::{Error, Header};

mod settings;
pub use settings::{CacheType, KvEstimate, KvSettings, MIB};

/// llama.cpp pads the context and the SWA cache to this many cells
/// (`llama-context.cpp`, `llama-kv-cache-iswa.cpp`).
const PAD: u64 = 256;

/// A product that saturates: header values are untrusted, and an absurd one should give an
/// absurd estimate (which the memory check then refuses), not an overflow panic.
fn prod(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |acc, &f| acc.saturating_mul(f))
}

fn pad(n: u64) -> u64 {
    n.div_ceil(PAD).saturating_mul(PAD)
}

/// Which llama.cpp memory module an architecture gets (`create_memory`), and how its
/// layers split between attention and recurrence.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Encoders and diffusion models: no sequence memory at all.
    None,
    /// `llama_kv_cache` (or its iswa pair) over the trunk layers.
    Attention,
    /// Mamba / RWKV: every trunk layer is recurrent.
    Recurrent,
    /// Qwen3.5-style: one attention layer per `full_attention_interval` (default given), or
    /// the `attention.recurrent_layers` flags; MTP layers in neither cache.
    Interval(u64),
    /// Jamba-style: a layer with 0 KV heads is recurrent. `trunk_only` excludes MTP layers
    /// from the attention cache (GLM5-Next's explicit filters); the others let them in.
    HeadlessRecurrent { trunk_only: bool },
    /// Falcon-H1: every layer has both attention and state.
    Both,
    /// Nemotron-H: attention layers have heads and no FFN, recurrent ones neither.
    Nemotron,
}

fn layout(arch: &str) -> Layout {
    match arch {
        "bert" | "jina-bert-v2" | "jina-bert-v3" | "nomic-bert" | "nomic-bert-moe" | "neo-bert"
        | "eurobert" | "wavtokenizer-dec" | "modern-bert" | "gemma-embedding" | "dream"
        | "llada" | "llada-moe" | "rnd1" | "clef" => Layout::None,
        "mamba" | "mamba2" | "rwkv6" | "rwkv6qwen2" | "rwkv7" | "arwkv7" => Layout::Recurrent,
        "qwen3next" | "qwen35" | "qwen35moe" | "qwen4exp" => Layout::Interval(4),
        "minimax-01" => Layout::Interval(8),
        "jamba" | "granitehybrid" | "lfm2" | "lfm2moe" | "plamo2" | "kimi-linear"
        | "bailingmoe3" | "kimi-k3" => Layout::HeadlessRecurrent { trunk_only: false },
        "glm5-next" => Layout::HeadlessRecurrent { trunk_only: true },
        "falcon-h1" => Layout::Both,
        "nemotron_h" | "nemotron_h_moe" => Layout::Nemotron,
        _ => Layout::Attention,
    }
}

/// Architectures whose llama.cpp cache has parts beyond plain K/V rows that this estimate
/// does not model (indexer, compressed or shared caches, looped layers).
fn approximated(arch: &str) -> bool {
    matches!(
        arch,
        "deepseek4"
            | "glm-dsa"
            | "glm5-next"
            | "minimax-m3"
            | "hy_v4"
            | "dots3note"
            | "dflash"
            | "qwen4exp"
            | "gemma4-assistant"
            | "nanbeige"
    )
}

/// Typed header lookups that turn a wrong type or a missing key into an [`Error`] naming it.
struct Keys<'h> {
    h: &'h Header,
    arch: &'h str,
}

impl Keys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn opt(&self, suffix: &str) -> Result<Option<u64>, Error> {
        self.h.u64_checked(&self.key(suffix))
    }

    fn or(&self, suffix: &str, default: u64) -> Result<u64, Error> {
        Ok(self.opt(suffix)?.unwrap_or(default))
    }

    /// A key llama.cpp requires: without it llama-server would not load the model either.
    fn req(&self, suffix: &str) -> Result<u64, Error> {
        self.opt(suffix)?.ok_or_else(|| self.missing(suffix))
    }

    /// The error for a key llama.cpp requires and the file lacks.
    fn missing(&self, suffix: &str) -> Error {
        self.h
            .missing_key(&self.key(suffix), "llama.cpp cannot load this model")
    }

    fn per_layer(&self, suffix: &str, n: usize) -> Result<Option<Vec<u64>>, Error> {
        self.h.per_layer(&self.key(suffix), n)
    }

    /// A per-layer flag array read as llama.cpp's `get_arr` does: bool, u32 or i32 elements,
    /// any length up to the layer count (missing entries are false).
    fn flags(&self, suffix: &str, n: usize) -> Result<Option<Vec<bool>>, Error> {
        let key = self.key(suffix);
        let Some(value) = self.h.get(&key) else {
            return Ok(None);
        };
        let values = value.as_array().and_then(|a| a.to_u64s()).ok_or_else(|| {
            self.h.metadata_error(
                &key,
                format!(
                    "is a {}, expected a per-layer array of bools",
                    value.value_type()
                ),
            )
        })?;
        if values.len() > n {
            return Err(self.h.metadata_error(
                &key,
                format!("has {} elements but the model has {n} layers", values.len()),
            ));
        }
        let mut flags = vec![false; n];
        for (f, v) in flags.iter_mut().zip(values) {
            *f = v != 0;
        }
        Ok(Some(flags))
    }
}

/// `llama_hparams::set_swa_pattern`: every `n`-th trunk layer is full attention (the first
/// of each group with `dense_first`, else the last); `n == 0` windows every layer.
fn swa_pattern(n: u64, dense_first: bool, n_layer: usize, n_all: usize) -> Vec<bool> {
    (0..n_all)
        .map(|il| {
            let il = il as u64;
            if il >= n_layer as u64 {
                false
            } else if n == 0 {
                true
            } else if dense_first {
                !il.is_multiple_of(n)
            } else {
                il % n < n - 1
            }
        })
        .collect()
}

/// The sliding window: `(n_swa, is_swa per layer)`, or `None` when llama.cpp runs the model
/// without one (`swa_type == NONE`). One arm per `load_arch_hparams` in `src/models/`.
fn window(
    k: &Keys,
    n_layer: usize,
    n_all: usize,
    is_recr: &[bool],
) -> Result<Option<(u64, Vec<bool>)>, Error> {
    const WINDOW: &str = "attention.sliding_window";
    const PATTERN: &str = "attention.sliding_window_pattern";
    // `load_swa_pattern`: a per-layer bool array wins, else a scalar N, else the arch default.
    let pattern = |default_n: u64, dense_first: bool| -> Result<Vec<bool>, Error> {
        if let Some(v) = k.h.get(&k.key(PATTERN))
            && v.as_array().is_some()
        {
            return Ok(k.flags(PATTERN, n_all)?.unwrap_or_default());
        }
        let n = k.or(PATTERN, default_n)?;
        Ok(swa_pattern(n, dense_first, n_layer, n_all))
    };
    let window_set = || -> Result<Option<u64>, Error> { Ok(k.opt(WINDOW)?.filter(|&w| w > 0)) };
    let some = |n_swa: u64, layers: Vec<bool>| Ok(Some((n_swa, layers)));

    match k.arch {
        "gemma2" => some(k.or(WINDOW, 4096)?, pattern(2, false)?),
        "gemma3" => match window_set()? {
            Some(w) => some(w, pattern(6, false)?),
            None => Ok(None),
        },
        "gemma3n" => some(k.req(WINDOW)?, pattern(5, false)?),
        "gpt-oss" => some(k.req(WINDOW)?, pattern(2, false)?),
        "cohere2" | "muse-glimmer" => some(k.req(WINDOW)?, pattern(4, false)?),
        "cohere2moe" => some(k.req(WINDOW)?, pattern(4, true)?),
        "exaone-moe" => some(k.req(WINDOW)?, pattern(4, false)?),
        "exaone4" if n_layer == 64 => some(k.or(WINDOW, 4096)?, pattern(4, false)?),
        "olmo2" | "mellum" | "afmoe" => match window_set()? {
            Some(w) => some(w, pattern(4, false)?),
            None => Ok(None),
        },
        "plamo3" => match window_set()? {
            Some(w) => some(w, pattern(8, false)?),
            None => Ok(None),
        },
        "laguna" => match window_set()? {
            Some(w) => some(w, pattern(4, true)?),
            None => Ok(None),
        },
        // A present window, whatever its size, means a fixed 4096.
        "smallthinker" => match window_set()? {
            Some(_) => some(4096, pattern(4, true)?),
            None => Ok(None),
        },
        // Chunked attention of 8192 unless the converter wrote a 0 window.
        "llama4" => {
            if k.opt(WINDOW)? == Some(0) {
                Ok(None)
            } else {
                some(8192, pattern(4, false)?)
            }
        }
        "gemma4" | "gemma4-assistant" | "step35" | "mimo2" | "granite_swa" | "maple"
        | "spark2_5" | "dots3note" => {
            let n_swa = k.req(WINDOW)?;
            let layers = k.flags(PATTERN, n_all)?.ok_or_else(|| k.missing(PATTERN))?;
            some(n_swa, layers)
        }
        // The attention layers are the windowed ones, when a window is set.
        "lfm2" => match window_set()? {
            Some(w) => some(
                w,
                (0..n_all).map(|il| il < n_layer && !is_recr[il]).collect(),
            ),
            None => Ok(None),
        },
        _ => Ok(None),
    }
}

/// `n_embd_r` and `n_embd_s` (`llama-hparams.cpp`): elements of one layer's rolling conv
/// state and recurrent state per sequence.
fn recurrent_widths(k: &Keys, n_embd: u64, n_head: u64, head_k: u64) -> Result<(u64, u64), Error> {
    let wkv_head_size = k.or("wkv.head_size", 0)?;
    let shortconv = k.or("shortconv.l_cache", 0)?;
    let kda = k.or("kda.head_dim", 0)?;
    let d_conv = k.or("ssm.conv_kernel", 0)?;
    let d_inner = k.or("ssm.inner_size", 0)?;
    let d_state = k.or("ssm.state_size", 0)?;
    let n_group = k.or("ssm.group_count", 0)?;
    // MiniMax-01's lightning attention keeps a head_dim x head_dim state per head.
    let la = if k.arch == "minimax-01" { head_k } else { 0 };

    let r = if wkv_head_size != 0 {
        prod(&[k.or("token_shift_count", 2)?, n_embd])
    } else if shortconv != 0 {
        prod(&[n_embd, shortconv - 1])
    } else if kda != 0 {
        let d_conv = if d_conv > 0 { d_conv - 1 } else { 3 };
        prod(&[3, d_conv, n_head, kda])
    } else {
        prod(&[
            d_conv.saturating_sub(1),
            d_inner.saturating_add(prod(&[2, n_group, d_state])),
        ])
    };
    let s = if wkv_head_size != 0 {
        prod(&[n_embd, wkv_head_size])
    } else if kda != 0 {
        prod(&[kda, kda, n_head])
    } else if la != 0 {
        prod(&[la, la, n_head])
    } else {
        prod(&[d_state, d_inner])
    };
    Ok((r, s))
}

/// The bytes llama.cpp will allocate for the KV cache(s) and recurrent state of the model
/// whose header is `h`, run with `s`. Errors name the file and the key that is missing or
/// malformed; a model llama.cpp could not load is refused rather than guessed at.
pub fn kv_estimate(h: &Header, s: &KvSettings) -> Result<KvEstimate, Error> {
    let arch = h
        .architecture()
        .ok_or_else(|| h.missing_key("general.architecture", "pass a llama.cpp GGUF model"))?;
    let k = Keys { h, arch };
    let layout = layout(arch);
    let n_par = u64::from(s.n_parallel.max(1));

    if layout == Layout::None {
        return Ok(KvEstimate {
            exact: true,
            ..KvEstimate::default()
        });
    }

    let (n_all, nextn) = layer_counts(&k)?;
    let n_layer = n_all - nextn;

    let (n_ctx, n_stream, cells) = context_cells(&k, s, n_par)?;

    // Heads and head sizes (`llama_model_base::load_hparams`).
    let n_head = k
        .per_layer("attention.head_count", n_all)?
        .unwrap_or_else(|| vec![0; n_all]);
    let n_head_kv = k
        .per_layer("attention.head_count_kv", n_all)?
        .unwrap_or_else(|| n_head.clone());
    let n_embd = k.req("embedding_length")?;
    // A model without attention heads (pure recurrent) has no head size at all.
    let (head_k_full, head_v_full) = match n_embd.checked_div(n_head[0]) {
        Some(per_head) => (
            k.or("attention.key_length", per_head)?,
            k.or("attention.value_length", per_head)?,
        ),
        None => (0, 0),
    };
    let head_k_swa = k.or("attention.key_length_swa", head_k_full)?;
    let head_v_swa = k.or("attention.value_length_swa", head_v_full)?;
    // MLA caches the compressed latent and the rope part as one K row; there is no V.
    let is_mla = k.opt("attention.key_length_mla")?.unwrap_or(0) != 0
        && k.opt("attention.value_length_mla")?.unwrap_or(0) != 0;

    let Roles {
        is_recr,
        attends,
        recurs,
    } = layer_roles(&k, layout, n_layer, n_all, nextn, &n_head_kv)?;

    let swa = window(&k, n_layer, n_all, &is_recr)?;
    let is_swa = |il: usize| swa.as_ref().is_some_and(|(_, layers)| layers[il]);
    let head_k = |il: usize| if is_swa(il) { head_k_swa } else { head_k_full };
    let head_v = |il: usize| if is_swa(il) { head_v_swa } else { head_v_full };

    // Flash attention off stores V transposed, every layer as wide as the widest
    // (`n_embd_v_gqa_max` over all layers, recurrent and MTP ones included).
    let v_width_max = (0..n_all)
        .map(|il| head_v(il).saturating_mul(n_head_kv[il]))
        .max()
        .unwrap_or(0);
    let row_bytes = |il: usize| -> u64 {
        let k_row = s.type_k.row_size(head_k(il).saturating_mul(n_head_kv[il]));
        let v_row = if is_mla {
            0
        } else if s.flash_attn {
            s.type_v.row_size(head_v(il).saturating_mul(n_head_kv[il]))
        } else {
            s.type_v.row_size(v_width_max)
        };
        k_row.saturating_add(v_row)
    };

    let swa_cells = match &swa {
        None => 0,
        Some(_) if s.swa_full => cells,
        Some((n_swa, _)) => {
            let seqs = if s.unified { n_par } else { 1 };
            pad(cells.min(n_swa.saturating_mul(seqs).saturating_add(s.n_ubatch)))
        }
    };

    let mut est = KvEstimate {
        n_ctx,
        cells,
        swa_cells,
        n_stream,
        exact: !approximated(arch),
        ..KvEstimate::default()
    };
    let mut base_rows: u64 = 0;
    let mut swa_rows: u64 = 0;
    for il in (0..n_all).filter(|&il| attends[il]) {
        if is_swa(il) {
            swa_rows = swa_rows.saturating_add(row_bytes(il));
            est.swa_layers += 1;
        } else {
            base_rows = base_rows.saturating_add(row_bytes(il));
            est.kv_layers += 1;
        }
    }
    // DeepSeek-3.2's lightning indexer caches one K head per trunk layer beside the MLA
    // cache (`llama_kv_cache_dsa`); GLM-DSA does so on its "full" layers, counted as all.
    if matches!(arch, "deepseek32" | "glm-dsa") {
        let indexer = k.req("attention.indexer.key_length")?;
        base_rows = base_rows.saturating_add(prod(&[n_layer as u64, s.type_k.row_size(indexer)]));
    }
    est.kv_bytes = n_stream.saturating_mul(cells).saturating_mul(base_rows);
    est.swa_bytes = n_stream.saturating_mul(swa_cells).saturating_mul(swa_rows);

    let recurrent_layers = recurs.iter().filter(|&&r| r).count() as u64;
    if recurrent_layers > 0 {
        let (r, st) = recurrent_widths(&k, n_embd, n_head[0], head_k_full)?;
        // F32 rows, one per sequence (`llama_memory_recurrent`, mem_size = max(1, n_seq_max)).
        est.recurrent_bytes = n_par
            .saturating_mul(recurrent_layers)
            .saturating_mul(prod(&[4, r.saturating_add(st)]));
        est.recurrent_layers = recurrent_layers as u32;
    }
    Ok(est)
}

/// The model's layers (`block_count`, 1 to 512 as llama.cpp's LLAMA_MAX_LAYERS; the cap also
/// bounds the loops here) and how many of them are its MTP head (`nextn_predict_layers`).
fn layer_counts(k: &Keys<'_>) -> Result<(usize, usize), Error> {
    let h = k.h;
    let n_all = k.req("block_count")?;
    if n_all == 0 || n_all > 512 {
        return Err(h.metadata_error(
            &k.key("block_count"),
            format!("is {n_all}; llama.cpp loads 1 to 512 layers"),
        ));
    }
    let n_all = n_all as usize;
    let nextn = k.or("nextn_predict_layers", 0)? as usize;
    if nextn > n_all {
        return Err(h.metadata_error(
            &k.key("nextn_predict_layers"),
            format!("is {nextn}, more than the {n_all} layers"),
        ));
    }
    Ok((n_all, nextn))
}

/// The context asked (`-c`, or the model's own) padded, its streams, and the cells of each:
/// one stream holding it all when unified, else one per sequence.
fn context_cells(k: &Keys<'_>, s: &KvSettings, n_par: u64) -> Result<(u64, u64, u64), Error> {
    let ctx = match s.ctx {
        0 => k.req("context_length")?,
        c => c,
    };
    let n_ctx = pad(ctx);
    let (n_stream, cells) = if s.unified {
        (1, n_ctx)
    } else {
        (n_par, pad(n_ctx / n_par))
    };
    if cells == 0 {
        return Err(Error::settings(format!(
            "a context of {ctx} is too small for {n_par} parallel sequences; raise --ctx-size"
        )));
    }

    Ok((n_ctx, n_stream, cells))
}

/// Each layer's part in the caches: `is_recr` is llama.cpp's per-layer recurrent flag;
/// `attends` and `recurs` are the filters its attention and recurrent caches apply, which
/// differ from the flag per architecture.
struct Roles {
    is_recr: Vec<bool>,
    attends: Vec<bool>,
    recurs: Vec<bool>,
}

/// Which of the `n_all` layers (`n_layer` of the trunk, then `nextn` MTP layers) recur, and
/// which of the rest the attention cache holds, by the architecture's layout.
fn layer_roles(
    k: &Keys<'_>,
    layout: Layout,
    n_layer: usize,
    n_all: usize,
    nextn: usize,
    n_head_kv: &[u64],
) -> Result<Roles, Error> {
    let (h, arch) = (k.h, k.arch);
    let mut is_recr = vec![false; n_all];
    let mut attends = vec![true; n_all];
    let mut recurs = vec![false; n_all];
    match layout {
        Layout::None => unreachable!("kv_estimate answers a layout without caches itself"),
        Layout::Attention => {
            // The trunk's cache skips the MTP head's layers.
            if nextn > 0 && n_layer > 0 {
                attends = (0..n_all).map(|il| il < n_layer).collect();
            }
        }
        Layout::Recurrent => {
            is_recr = (0..n_all).map(|il| il < n_layer).collect();
            attends = vec![false; n_all];
            recurs = is_recr.clone();
        }
        Layout::Interval(default_interval) => {
            is_recr = match k.per_layer("attention.recurrent_layers", n_all)? {
                Some(flags) => flags.iter().map(|&f| f != 0).collect(),
                None => {
                    let interval = k.or("full_attention_interval", default_interval)?;
                    if interval == 0 {
                        return Err(h.metadata_error(
                            &k.key("full_attention_interval"),
                            "is 0; llama.cpp needs at least 1",
                        ));
                    }
                    (0..n_all)
                        .map(|il| il < n_layer && !(il as u64 + 1).is_multiple_of(interval))
                        .collect()
                }
            };
            attends = (0..n_all).map(|il| il < n_layer && !is_recr[il]).collect();
            recurs = (0..n_all).map(|il| il < n_layer && is_recr[il]).collect();
        }
        Layout::HeadlessRecurrent { trunk_only } => {
            // GLM5-Next flags MTP layers too; the others only flag trunk layers.
            let flagged = if trunk_only { n_all } else { n_layer };
            is_recr = (0..n_all)
                .map(|il| il < flagged && n_head_kv[il] == 0)
                .collect();
            attends = (0..n_all)
                .map(|il| !is_recr[il] && (!trunk_only || il < n_layer))
                .collect();
            recurs = (0..n_all).map(|il| il < n_layer && is_recr[il]).collect();
        }
        Layout::Both => {
            is_recr = (0..n_all).map(|il| il < n_layer).collect();
            recurs = is_recr.clone();
        }
        Layout::Nemotron => {
            let n_ff = k
                .per_layer("feed_forward_length", n_all)?
                .unwrap_or_else(|| vec![0; n_all]);
            is_recr = (0..n_all)
                .map(|il| il < n_layer && n_head_kv[il] == 0 && n_ff[il] == 0)
                .collect();
            attends = (0..n_all).map(|il| !is_recr[il] && n_ff[il] == 0).collect();
            recurs = (0..n_all).map(|il| il < n_layer && is_recr[il]).collect();
        }
    }

    // Gemma-3n/4 share the KV of their last layers with earlier ones (`has_kv`).
    let kv_from_start = match arch {
        "gemma3n" => Some(20),
        "gemma4" => Some(n_all.saturating_sub(k.or("attention.shared_kv_layers", 0)? as usize)),
        _ => None,
    };
    if let Some(limit) = kv_from_start {
        for (il, a) in attends.iter_mut().enumerate() {
            *a = *a && il < limit;
        }
    }
    Ok(Roles {
        is_recr,
        attends,
        recurs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::Builder;

    const MIB_U: u64 = 1024 * 1024;

    fn header(b: Builder) -> Header {
        let bytes = b.to_bytes();
        crate::read_header_from(&bytes[..], bytes.len() as u64, "fixture.gguf").unwrap()
    }

    fn estimate(b: Builder, s: &KvSettings) -> KvEstimate {
        kv_estimate(&header(b), s).unwrap()
    }

    /// `base` with `key` set to `value` (replaced in place, or appended).
    fn set(base: Builder, key: &str, value: impl Into<crate::Value>) -> Builder {
        let value = value.into();
        let h = header(base);
        let mut b = Builder::new();
        for (k, v) in h.metadata.iter() {
            b = b.kv(k, if k == key { value.clone() } else { v.clone() });
        }
        if h.get(key).is_none() {
            b = b.kv(key, value);
        }
        b
    }

    /// `base` without `key`.
    fn remove(base: Builder, key: &str) -> Builder {
        let mut b = Builder::new();
        for (k, v) in header(base).metadata.iter().filter(|(k, _)| *k != key) {
            b = b.kv(k, v.clone());
        }
        b
    }

    fn mib(bytes: u64) -> f64 {
        bytes as f64 / MIB
    }

    /// Qwen3-0.6B: 28 layers, 16 heads, 8 KV heads of 128.
    fn qwen3_0_6b() -> Builder {
        Builder::new()
            .kv("general.architecture", "qwen3")
            .kv("qwen3.block_count", 28u32)
            .kv("qwen3.context_length", 40960u32)
            .kv("qwen3.embedding_length", 1024u32)
            .kv("qwen3.attention.head_count", 16u32)
            .kv("qwen3.attention.head_count_kv", 8u32)
            .kv("qwen3.attention.key_length", 128u32)
            .kv("qwen3.attention.value_length", 128u32)
    }

    /// GLM-4.7-Flash as convert_hf_to_gguf writes it: arch deepseek2, 47 layers plus one
    /// MTP layer, MLA with kv_lora_rank 512 and a 64-dim rope part, so
    /// key_length = 512 + 64 = 576 on a single KV head.
    fn glm_4_7_flash() -> Builder {
        Builder::new()
            .kv("general.architecture", "deepseek2")
            .kv("deepseek2.block_count", 48u32)
            .kv("deepseek2.nextn_predict_layers", 1u32)
            .kv("deepseek2.context_length", 202752u32)
            .kv("deepseek2.embedding_length", 2048u32)
            .kv("deepseek2.attention.head_count", 20u32)
            .kv("deepseek2.attention.head_count_kv", 1u32)
            .kv("deepseek2.attention.kv_lora_rank", 512u32)
            .kv("deepseek2.attention.key_length", 576u32)
            .kv("deepseek2.attention.value_length", 512u32)
            .kv("deepseek2.attention.key_length_mla", 256u32)
            .kv("deepseek2.attention.value_length_mla", 256u32)
            .kv("deepseek2.rope.dimension_count", 64u32)
    }

    /// Qwen3.6-35B-A3B: 40 layers, full attention every 4th (2 KV heads of 256), the other
    /// 30 gated delta-net layers (conv kernel 4, 32 value heads of 128 = inner 4096,
    /// 16 key groups of state 128).
    fn qwen3_6_35b_a3b() -> Builder {
        Builder::new()
            .kv("general.architecture", "qwen35moe")
            .kv("qwen35moe.block_count", 40u32)
            .kv("qwen35moe.context_length", 262144u32)
            .kv("qwen35moe.embedding_length", 2048u32)
            .kv("qwen35moe.attention.head_count", 16u32)
            .kv("qwen35moe.attention.head_count_kv", 2u32)
            .kv("qwen35moe.attention.key_length", 256u32)
            .kv("qwen35moe.attention.value_length", 256u32)
            .kv("qwen35moe.full_attention_interval", 4u32)
            .kv("qwen35moe.ssm.conv_kernel", 4u32)
            .kv("qwen35moe.ssm.inner_size", 4096u32)
            .kv("qwen35moe.ssm.state_size", 128u32)
            .kv("qwen35moe.ssm.group_count", 16u32)
            .kv("qwen35moe.ssm.time_step_rank", 32u32)
    }

    /// gpt-oss-20b: 24 layers alternating a 128-token window and full attention, 8 KV heads of 64.
    fn gpt_oss_20b() -> Builder {
        Builder::new()
            .kv("general.architecture", "gpt-oss")
            .kv("gpt-oss.block_count", 24u32)
            .kv("gpt-oss.context_length", 131072u32)
            .kv("gpt-oss.embedding_length", 2880u32)
            .kv("gpt-oss.attention.head_count", 64u32)
            .kv("gpt-oss.attention.head_count_kv", 8u32)
            .kv("gpt-oss.attention.key_length", 64u32)
            .kv("gpt-oss.attention.value_length", 64u32)
            .kv("gpt-oss.attention.sliding_window", 128u32)
    }

    /// Gemma-3-27B: 62 layers, 5 of every 6 windowed to 1024, 16 KV heads of 128.
    fn gemma3_27b(window: Option<u32>) -> Builder {
        let b = Builder::new()
            .kv("general.architecture", "gemma3")
            .kv("gemma3.block_count", 62u32)
            .kv("gemma3.context_length", 131072u32)
            .kv("gemma3.embedding_length", 5376u32)
            .kv("gemma3.attention.head_count", 32u32)
            .kv("gemma3.attention.head_count_kv", 16u32)
            .kv("gemma3.attention.key_length", 128u32)
            .kv("gemma3.attention.value_length", 128u32);
        match window {
            Some(w) => b.kv("gemma3.attention.sliding_window", w),
            None => b,
        }
    }

    #[test]
    fn qwen3_0_6b_at_4096_holds_448_mib() {
        let e = estimate(qwen3_0_6b(), &KvSettings::new(4096));
        // 28 layers x 8 heads x (128 + 128) x 4096 cells x 2 bytes
        assert_eq!(e.kv_bytes, 448 * MIB_U);
        assert_eq!((e.swa_bytes, e.recurrent_bytes), (0, 0));
        assert_eq!((e.kv_layers, e.cells, e.n_stream), (28, 4096, 1));
        assert!(e.exact);
    }

    #[test]
    fn glm_4_7_flash_mla_at_2048_holds_105_75_mib() {
        let e = estimate(glm_4_7_flash(), &KvSettings::new(2048));
        // 47 trunk layers (the MTP layer excluded) x one K row of 576 x 2048 x 2 bytes, no V
        assert_eq!(e.kv_layers, 47);
        assert_eq!(e.kv_bytes, 47 * 576 * 2048 * 2);
        assert_eq!(mib(e.kv_bytes), 105.75);
        // V is absent, so flash attention off changes nothing
        let off = KvSettings {
            flash_attn: false,
            ..KvSettings::new(2048)
        };
        assert_eq!(estimate(glm_4_7_flash(), &off).kv_bytes, e.kv_bytes);
    }

    #[test]
    fn deepseek_without_mla_keys_caches_k_and_v_per_head() {
        // An old DeepSeek-V2 GGUF without the *_mla keys runs as plain attention in llama.cpp.
        let b = Builder::new()
            .kv("general.architecture", "deepseek2")
            .kv("deepseek2.block_count", 2u32)
            .kv("deepseek2.embedding_length", 2048u32)
            .kv("deepseek2.attention.head_count", 16u32)
            .kv("deepseek2.attention.kv_lora_rank", 512u32)
            .kv("deepseek2.attention.key_length", 192u32)
            .kv("deepseek2.attention.value_length", 128u32);
        let e = estimate(b, &KvSettings::new(256));
        assert_eq!(e.kv_bytes, 2 * 16 * (192 + 128) * 256 * 2);
    }

    #[test]
    fn qwen3_6_35b_a3b_at_2048_holds_40_mib_kv_and_62_8_mib_state() {
        let e = estimate(qwen3_6_35b_a3b(), &KvSettings::new(2048));
        // 10 attention layers (3, 7, ..., 39) x 2 heads x (256 + 256) x 2048 x 2 bytes
        assert_eq!(e.kv_layers, 10);
        assert_eq!(e.kv_bytes, 40 * MIB_U);
        // 30 delta-net layers x 4 bytes x (n_embd_r + n_embd_s), one sequence:
        // n_embd_r = (4 - 1) * (4096 + 2 * 16 * 128) = 24576, n_embd_s = 128 * 4096 = 524288
        assert_eq!(e.recurrent_layers, 30);
        assert_eq!(e.recurrent_bytes, 30 * 4 * (24576 + 524288));
        assert_eq!(format!("{:.1}", mib(e.recurrent_bytes)), "62.8");
        // state is per sequence, KV is per cell
        let np4 = KvSettings {
            n_parallel: 4,
            ..KvSettings::new(2048)
        };
        let e4 = estimate(qwen3_6_35b_a3b(), &np4);
        assert_eq!(e4.recurrent_bytes, 4 * e.recurrent_bytes);
        assert_eq!(e4.kv_bytes, e.kv_bytes);
    }

    #[test]
    fn an_mtp_layer_is_in_neither_cache_of_a_hybrid() {
        let b = set(qwen3_6_35b_a3b(), "qwen35moe.block_count", 41u32)
            .kv("qwen35moe.nextn_predict_layers", 1u32);
        let e = estimate(b, &KvSettings::new(2048));
        assert_eq!((e.kv_layers, e.recurrent_layers), (10, 30));
        assert_eq!(e.kv_bytes, 40 * MIB_U);
    }

    #[test]
    fn recurrent_layer_flags_override_the_interval() {
        let flags: Vec<bool> = (0..40).map(|il| il % 2 == 0).collect();
        let b = qwen3_6_35b_a3b().kv("qwen35moe.attention.recurrent_layers", flags);
        let e = estimate(b, &KvSettings::new(2048));
        assert_eq!((e.kv_layers, e.recurrent_layers), (20, 20));
        assert_eq!(e.kv_bytes, 80 * MIB_U);
    }

    #[test]
    fn gpt_oss_windows_every_other_layer() {
        let e = estimate(gpt_oss_20b(), &KvSettings::new(4096));
        // Layers 0, 2, ... are windowed: 12 full and 12 SWA, each row 8 x (64 + 64) x 2 = 2048 B.
        assert_eq!((e.kv_layers, e.swa_layers), (12, 12));
        assert_eq!(e.kv_bytes, 12 * 2048 * 4096);
        assert_eq!(e.kv_bytes, 96 * MIB_U);
        // SWA cells = PAD(min(4096, 128 * 1 + 512), 256) = 768
        assert_eq!(e.swa_cells, 768);
        assert_eq!(e.swa_bytes, 18 * MIB_U);

        // Unified with 4 slots: the window covers each slot, PAD(128 * 4 + 512) = 1024.
        let unified4 = KvSettings {
            n_parallel: 4,
            ..KvSettings::new(4096)
        };
        let e = estimate(gpt_oss_20b(), &unified4);
        assert_eq!((e.swa_cells, e.swa_bytes), (1024, 24 * MIB_U));

        // One stream per slot: 1024 cells each, a 768-cell window each.
        let split4 = KvSettings {
            unified: false,
            ..unified4
        };
        let e = estimate(gpt_oss_20b(), &split4);
        assert_eq!((e.n_stream, e.cells, e.swa_cells), (4, 1024, 768));
        assert_eq!(e.kv_bytes, 96 * MIB_U);
        assert_eq!(e.swa_bytes, 72 * MIB_U);

        // --swa-full keeps the whole context on windowed layers too.
        let full = KvSettings {
            swa_full: true,
            ..KvSettings::new(4096)
        };
        let e = estimate(gpt_oss_20b(), &full);
        assert_eq!((e.swa_cells, e.swa_bytes), (4096, 96 * MIB_U));
    }

    #[test]
    fn gemma3_windows_five_of_six_layers_only_with_a_window() {
        let e = estimate(gemma3_27b(Some(1024)), &KvSettings::new(8192));
        // Full layers are 5, 11, ..., 59: 10 of them. Rows: 16 x (128 + 128) x 2 = 8192 B.
        assert_eq!((e.kv_layers, e.swa_layers), (10, 52));
        assert_eq!(e.kv_bytes, 10 * 8192 * 8192);
        assert_eq!(e.kv_bytes, 640 * MIB_U);
        // SWA cells = PAD(min(8192, 1024 + 512), 256) = 1536
        assert_eq!(e.swa_cells, 1536);
        assert_eq!(e.swa_bytes, 52 * 8192 * 1536);
        assert_eq!(e.swa_bytes, 624 * MIB_U);

        for no_window in [None, Some(0)] {
            let e = estimate(gemma3_27b(no_window), &KvSettings::new(8192));
            assert_eq!((e.kv_layers, e.swa_layers), (62, 0), "{no_window:?}");
            assert_eq!(e.kv_bytes, 3968 * MIB_U);
        }
    }

    #[test]
    fn a_per_layer_window_pattern_wins_over_the_default() {
        let flags: Vec<bool> = (0..62).map(|il| il < 31).collect();
        let b = gemma3_27b(Some(1024)).kv("gemma3.attention.sliding_window_pattern", flags);
        let e = estimate(b, &KvSettings::new(8192));
        assert_eq!((e.kv_layers, e.swa_layers), (31, 31));
        let b = gemma3_27b(Some(1024)).kv("gemma3.attention.sliding_window_pattern", 2u32);
        let e = estimate(b, &KvSettings::new(8192));
        assert_eq!((e.kv_layers, e.swa_layers), (31, 31));
    }

    #[test]
    fn swa_head_sizes_apply_to_windowed_layers() {
        let b = gpt_oss_20b()
            .kv("gpt-oss.attention.key_length_swa", 32u32)
            .kv("gpt-oss.attention.value_length_swa", 32u32);
        let e = estimate(b, &KvSettings::new(4096));
        assert_eq!(e.kv_bytes, 96 * MIB_U);
        assert_eq!(e.swa_bytes, 9 * MIB_U);
    }

    #[test]
    fn llama4_is_chunked_by_8192_unless_its_window_is_0() {
        let b = || {
            Builder::new()
                .kv("general.architecture", "llama4")
                .kv("llama4.block_count", 48u32)
                .kv("llama4.embedding_length", 5120u32)
                .kv("llama4.attention.head_count", 40u32)
                .kv("llama4.attention.head_count_kv", 8u32)
                .kv("llama4.attention.key_length", 128u32)
                .kv("llama4.attention.value_length", 128u32)
        };
        let e = estimate(b(), &KvSettings::new(32768));
        assert_eq!((e.kv_layers, e.swa_layers), (12, 36));
        assert_eq!(e.swa_cells, pad(8192 + 512));
        let e = estimate(
            b().kv("llama4.attention.sliding_window", 0u32),
            &KvSettings::new(32768),
        );
        assert_eq!((e.kv_layers, e.swa_layers), (48, 0));
    }

    #[test]
    fn per_layer_kv_heads_count_only_layers_with_heads() {
        // Jamba-style: one attention layer in eight, the rest Mamba (0 KV heads).
        let heads: Vec<i32> = (0..8).map(|il| if il == 4 { 8 } else { 0 }).collect();
        let b = Builder::new()
            .kv("general.architecture", "jamba")
            .kv("jamba.block_count", 8u32)
            .kv("jamba.embedding_length", 4096u32)
            .kv("jamba.attention.head_count", 32u32)
            .kv("jamba.attention.head_count_kv", heads)
            .kv("jamba.ssm.conv_kernel", 4u32)
            .kv("jamba.ssm.inner_size", 8192u32)
            .kv("jamba.ssm.state_size", 16u32)
            .kv("jamba.ssm.time_step_rank", 256u32);
        let e = estimate(b, &KvSettings::new(4096));
        assert_eq!(e.kv_layers, 1);
        assert_eq!(e.kv_bytes, 8 * (128 + 128) * 4096 * 2);
        // n_embd_r = 3 * 8192, n_embd_s = 16 * 8192
        assert_eq!(e.recurrent_layers, 7);
        assert_eq!(e.recurrent_bytes, 7 * 4 * (3 * 8192 + 16 * 8192));
    }

    #[test]
    fn a_pure_recurrent_model_has_state_and_no_kv() {
        let b = Builder::new()
            .kv("general.architecture", "mamba2")
            .kv("mamba2.block_count", 64u32)
            .kv("mamba2.embedding_length", 2560u32)
            .kv("mamba2.ssm.conv_kernel", 4u32)
            .kv("mamba2.ssm.inner_size", 5120u32)
            .kv("mamba2.ssm.state_size", 128u32)
            .kv("mamba2.ssm.group_count", 1u32);
        let s = KvSettings {
            n_parallel: 2,
            ..KvSettings::new(4096)
        };
        let e = estimate(b, &s);
        assert_eq!(e.attention_bytes(), 0);
        assert_eq!(
            e.recurrent_bytes,
            2 * 64 * 4 * (3 * (5120 + 2 * 128) + 128 * 5120)
        );
        assert_eq!(e.total_bytes(), e.recurrent_bytes);
    }

    #[test]
    fn quantized_caches_use_block_sizes() {
        let s = KvSettings {
            type_k: CacheType::Q8_0,
            type_v: CacheType::Q8_0,
            ..KvSettings::new(4096)
        };
        // A 1024-wide row of q8_0 is 32 blocks of 34 bytes.
        let e = estimate(qwen3_0_6b(), &s);
        assert_eq!(e.kv_bytes, 28 * 2 * 1088 * 4096);
        assert_eq!(e.kv_bytes, 238 * MIB_U);
        let mixed = KvSettings {
            type_k: CacheType::Q4_0,
            type_v: CacheType::F32,
            ..KvSettings::new(4096)
        };
        let e = estimate(qwen3_0_6b(), &mixed);
        assert_eq!(e.kv_bytes, 28 * (576 + 4096) * 4096);
    }

    #[test]
    fn cache_types_parse_from_llama_server_names() {
        let rows: Vec<(&str, u64)> = CacheType::ALL
            .iter()
            .map(|t| (t.name(), t.row_size(64)))
            .collect();
        assert_eq!(
            rows,
            [
                ("f32", 256),
                ("f16", 128),
                ("bf16", 128),
                ("q8_0", 68),
                ("q4_0", 36),
                ("q4_1", 40),
                ("iq4_nl", 36),
                ("q5_0", 44),
                ("q5_1", 48),
            ]
        );
        for t in CacheType::ALL {
            assert_eq!(t.name().parse::<CacheType>().ok(), Some(t));
            assert_eq!(t.to_string(), t.name());
        }
        assert_eq!(
            "q4_k".parse::<CacheType>().unwrap_err().to_string(),
            "unsupported KV cache type 'q4_k'; -ctk/-ctv take one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
        );
        assert!(
            "F16".parse::<CacheType>().is_err(),
            "names are case-sensitive, as in llama-server"
        );
    }

    #[test]
    fn context_is_padded_and_split_per_stream() {
        // -c 5000 -np 3 without --kv-unified: n_ctx 5120, 1792 cells in each of 3 streams.
        let s = KvSettings {
            ctx: 5000,
            n_parallel: 3,
            unified: false,
            ..KvSettings::default()
        };
        let e = estimate(qwen3_0_6b(), &s);
        assert_eq!((e.n_ctx, e.cells, e.n_stream), (5120, 1792, 3));
        assert_eq!(e.kv_bytes, 3 * 1792 * 28 * 8 * 256 * 2);
        // -c 0 is the model's own context
        let e = estimate(qwen3_0_6b(), &KvSettings::default());
        assert_eq!(e.n_ctx, 40960);
        let e = estimate(qwen3_0_6b(), &KvSettings::new(1000));
        assert_eq!(e.n_ctx, 1024);
    }

    #[test]
    fn flash_attention_off_pads_v_to_the_widest_layer() {
        let kv: Vec<i32> = (0..28).map(|il| if il % 2 == 0 { 8 } else { 2 }).collect();
        let b = || set(qwen3_0_6b(), "qwen3.attention.head_count_kv", kv.clone());
        let on = estimate(b(), &KvSettings::new(256));
        assert_eq!(on.kv_bytes, 256 * 2 * (14 * 8 * 256 + 14 * 2 * 256));
        let off = KvSettings {
            flash_attn: false,
            ..KvSettings::new(256)
        };
        let off = estimate(b(), &off);
        // K as before; every V row as wide as 8 heads
        assert_eq!(
            off.kv_bytes,
            256 * 2 * (14 * 8 * 128 + 14 * 2 * 128 + 28 * 8 * 128)
        );
    }

    #[test]
    fn encoders_have_no_sequence_memory() {
        let b = Builder::new()
            .kv("general.architecture", "bert")
            .kv("bert.block_count", 12u32);
        assert_eq!(estimate(b, &KvSettings::new(512)).total_bytes(), 0);
    }

    #[test]
    fn missing_or_malformed_keys_are_named() {
        let err = |b: Builder| {
            kv_estimate(&header(b), &KvSettings::new(4096))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(Builder::new().kv("general.name", "x")),
            "fixture.gguf: key 'general.architecture' is missing; pass a llama.cpp GGUF model"
        );
        assert_eq!(
            err(Builder::new().kv("general.architecture", "qwen3")),
            "fixture.gguf: key 'qwen3.block_count' is missing; llama.cpp cannot load this model"
        );
        assert_eq!(
            err(Builder::new()
                .kv("general.architecture", "qwen3")
                .kv("qwen3.block_count", "28")),
            "fixture.gguf: key 'qwen3.block_count' is a string, expected a non-negative integer"
        );
        assert_eq!(
            err(Builder::new()
                .kv("general.architecture", "qwen3")
                .kv("qwen3.block_count", 2u32)
                .kv("qwen3.attention.head_count", 16u32)
                .kv("qwen3.attention.head_count_kv", vec![8i32, 8, 8])),
            "fixture.gguf: key 'qwen3.attention.head_count_kv' has 3 elements but the model has 2 layers"
        );
        assert_eq!(
            err(remove(gpt_oss_20b(), "gpt-oss.attention.sliding_window")),
            "fixture.gguf: key 'gpt-oss.attention.sliding_window' is missing; llama.cpp cannot load this model"
        );
        let tiny = KvSettings {
            ctx: 256,
            n_parallel: 512,
            unified: false,
            ..KvSettings::default()
        };
        assert_eq!(
            kv_estimate(&header(qwen3_0_6b()), &tiny)
                .unwrap_err()
                .to_string(),
            "a context of 256 is too small for 512 parallel sequences; raise --ctx-size"
        );
        let kind = |b: Builder, s: &KvSettings| kv_estimate(&header(b), s).unwrap_err().kind();
        assert_eq!(
            kind(Builder::new().kv("general.name", "x"), &tiny),
            crate::ErrorKind::MissingKey
        );
        assert_eq!(kind(qwen3_0_6b(), &tiny), crate::ErrorKind::Settings);
    }

    #[test]
    fn absurd_values_in_any_key_give_an_answer_not_a_panic() {
        let fixtures = [
            qwen3_0_6b(),
            glm_4_7_flash(),
            qwen3_6_35b_a3b(),
            gpt_oss_20b(),
            gemma3_27b(Some(1024)),
        ];
        let settings = [
            KvSettings::new(4096),
            KvSettings {
                ctx: u64::MAX,
                n_parallel: u32::MAX,
                unified: false,
                flash_attn: false,
                n_ubatch: u64::MAX,
                ..KvSettings::default()
            },
        ];
        let absurd = [
            crate::Value::U64(u64::MAX),
            crate::Value::U32(0),
            crate::Value::I32(-1),
            crate::Value::U32(513),
            vec![u64::MAX; 3].into(),
        ];
        for fixture in fixtures {
            let h = header(fixture.clone());
            for (key, _) in h.metadata.iter() {
                for value in &absurd {
                    let h = header(set(fixture.clone(), key, value.clone()));
                    for s in &settings {
                        // Either an estimate or a message naming the file; never a panic.
                        if let Err(e) = kv_estimate(&h, s) {
                            let e = e.to_string();
                            assert!(
                                e.starts_with("fixture.gguf: ") || e.starts_with("a context"),
                                "{e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `<cache>/models/SmolLM2-135M-Instruct-Q4_1.gguf`, the cache found as `cargo xtask
    /// setup` finds it.
    fn smollm2_path() -> std::path::PathBuf {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let cache = if let Some(dir) = var("ONEBIT_CACHE_DIR") {
            std::path::PathBuf::from(dir)
        } else if let Some(xdg) = var("XDG_CACHE_HOME") {
            std::path::Path::new(&xdg).join("onebit")
        } else {
            let home = var("HOME").expect("HOME or ONEBIT_CACHE_DIR must be set");
            std::path::Path::new(&home).join(".cache").join("onebit")
        };
        cache.join("models").join("SmolLM2-135M-Instruct-Q4_1.gguf")
    }

    #[test]
    fn smollm2_real_header_at_4096_holds_90_mib() {
        let path = smollm2_path();
        assert!(
            path.is_file(),
            "{} is missing: run `cargo xtask setup` to download the default model",
            path.display()
        );
        let h = crate::read_header(&path).unwrap();
        assert_eq!(h.architecture(), Some("llama"));
        assert_eq!(h.get_u64("llama.block_count"), Some(30));
        assert_eq!(h.get_u64("llama.attention.head_count_kv"), Some(3));
        // 576 / 9 heads = 64 per head, no explicit key_length
        assert_eq!(h.get_u64("llama.embedding_length"), Some(576));
        assert_eq!(h.get_u64("llama.attention.head_count"), Some(9));
        let e = kv_estimate(&h, &KvSettings::new(4096)).unwrap();
        // 30 layers x 3 KV heads x (64 + 64) x 4096 cells x 2 bytes
        assert_eq!(e.kv_bytes, 30 * 3 * 128 * 4096 * 2);
        assert_eq!(e.kv_bytes, 90 * MIB_U);
        assert_eq!(e.total_bytes(), e.kv_bytes);
    }
}
