//! llama.cpp's sequence memory for a plan that asks the host to size it
//! ([`MemoryNeed::llama_kv`]): a route running llama.cpp's kernels in process names its
//! context's settings, and the host sizes the KV cache and recurrent state from the model's
//! GGUF header with the formulas the llama-server routes use (`gguf::memory`).

use std::path::Path;

use gguf::memory::{CacheType, KvSettings};
use onebit_plugin_api::{LlamaKv, Plan};

/// Fill in what the plan asked for: the estimate added to its KV bytes and the padded context
/// as the one judged. A header that cannot be read or says too little makes the memory
/// unknown (a warning, not a refusal), as for the llama-server routes.
pub fn size(plan: &mut Plan, model: &Path) {
    let Some(need) = plan.memory.as_mut() else {
        return;
    };
    let Some(asked) = need.llama_kv.take() else {
        return;
    };
    match estimate(&asked, model) {
        Ok((bytes, n_ctx)) => {
            need.kv_bytes = need.kv_bytes.saturating_add(bytes);
            need.ctx = n_ctx;
        }
        Err(why) => {
            plan.memory = None;
            plan.memory_unknown = Some(why);
        }
    }
}

/// The bytes llama.cpp allocates for the model's sequence memory at `asked`, and its padded
/// context.
fn estimate(asked: &LlamaKv, model: &Path) -> Result<(u64, u64), String> {
    let cache = |name: &str| name.parse::<CacheType>().map_err(|e| e.to_string());
    let settings = KvSettings {
        ctx: asked.ctx,
        n_parallel: asked.n_parallel.max(1),
        unified: asked.unified,
        type_k: cache(&asked.type_k)?,
        type_v: cache(&asked.type_v)?,
        flash_attn: asked.flash_attn,
        n_ubatch: asked.n_ubatch.max(1),
        swa_full: asked.swa_full,
    };
    let header = gguf::read_header_lean(model)
        .map_err(|e| format!("its GGUF header cannot be read: {e}"))?;
    let estimate = gguf::memory::kv_estimate(&header, &settings).map_err(|e| e.to_string())?;
    Ok((estimate.total_bytes(), estimate.n_ctx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::writer::Builder;
    use onebit_plugin_api::MemoryNeed;

    /// A header of SmolLM2-135M's shape (30 layers, 3 KV heads of 64): 22.5 KiB of f16 KV
    /// per cell.
    fn smollm2_like(dir: &Path) -> std::path::PathBuf {
        let path = dir.join("s.gguf");
        Builder::smollm2_shaped().write(&path).unwrap();
        path
    }

    fn plan_asking(kv: LlamaKv) -> Plan {
        Plan {
            memory: Some(MemoryNeed {
                weights_bytes: 1000,
                compute_bytes: 7,
                llama_kv: Some(kv),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_asked_kv_is_added_and_the_padded_context_judged() {
        let dir = std::env::temp_dir().join(format!("onebit-llama-kv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = smollm2_like(&dir);
        let mut plan = plan_asking(LlamaKv::new(4000, 1));
        size(&mut plan, &model);
        let need = plan.memory.unwrap();
        // 4000 cells padded to 4096; 30 layers x (K + V) x 3 heads x 64 x 2 bytes per cell.
        assert_eq!(need.ctx, 4096);
        assert_eq!(need.kv_bytes, 4096 * 30 * 2 * 3 * 64 * 2);
        assert_eq!((need.weights_bytes, need.compute_bytes), (1000, 7));
        assert!(need.llama_kv.is_none());
        assert!(plan.memory_unknown.is_none());
    }

    #[test]
    fn an_unreadable_header_or_cache_type_makes_the_memory_unknown() {
        let dir = std::env::temp_dir().join(format!("onebit-llama-kv-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.gguf");
        std::fs::write(&junk, b"not a gguf").unwrap();
        let mut plan = plan_asking(LlamaKv::new(4096, 1));
        size(&mut plan, &junk);
        assert!(plan.memory.is_none());
        assert!(
            plan.memory_unknown
                .as_deref()
                .is_some_and(|w| w.starts_with("its GGUF header cannot be read")),
            "{:?}",
            plan.memory_unknown
        );
        let model = smollm2_like(&dir);
        let mut plan = plan_asking(LlamaKv {
            type_k: "f17".to_string(),
            ..LlamaKv::new(4096, 1)
        });
        size(&mut plan, &model);
        assert!(
            plan.memory_unknown
                .as_deref()
                .is_some_and(|w| w.contains("unsupported KV cache type 'f17'")),
            "{:?}",
            plan.memory_unknown
        );
    }

    #[test]
    fn a_plan_that_asks_nothing_is_left_as_it_is() {
        let mut plan = Plan {
            memory: Some(MemoryNeed {
                kv_bytes: 5,
                ..Default::default()
            }),
            ..Default::default()
        };
        let before = plan.clone();
        size(&mut plan, Path::new("/nonexistent.gguf"));
        assert_eq!(plan, before);
    }
}
