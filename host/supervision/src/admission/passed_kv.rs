//! The KV flags a user passes to llama-server after `--` (`-ctk`/`-ctv`, `-fa`, `-ub`, `-np`,
//! `--kv-unified`, `--swa-full`): a llama-server route sizes the cache for its own command line,
//! and llama-server takes the later flags, so the difference they make is counted here (a
//! quantized cache halves the need; `--swa-full` can multiply it).

use std::path::Path;

use gguf::memory::{CacheType, KvSettings};
use onebit_plugin_api::Plan;

use onebit_command::llama_server_cli::{LLAMA_SERVER, flag_and_inline_value};

/// The flags that change the cache's size, as llama-server names them.
const KV_FLAGS: &[&str] = &[
    "-ctk",
    "--cache-type-k",
    "-ctv",
    "--cache-type-v",
    "-fa",
    "--flash-attn",
    "-ub",
    "--ubatch-size",
    "-np",
    "--parallel",
    "-kvu",
    "--kv-unified",
    "-no-kvu",
    "--no-kv-unified",
    "--swa-full",
];

/// Count the difference `passed` (the arguments after `--`) makes to the llama-server backend's
/// cache: the cache at the backend's command line with them, less the cache without. Called by
/// `prepare` before the arguments are appended; a plan with no known need, no llama-server
/// backend, or no KV flag among `passed` is left as it is, and so is one whose flags do not
/// parse (llama-server refuses those itself, with its own line).
pub fn count(plan: &mut Plan, model: &Path, passed: &[String]) {
    if !passed
        .iter()
        .any(|a| KV_FLAGS.contains(&flag_and_inline_value(a).0))
    {
        return;
    }
    let Some(own) = plan.backends.first().filter(|b| b.engine == LLAMA_SERVER) else {
        return;
    };
    let with_passed: Vec<String> = own.argv.iter().chain(passed).cloned().collect();
    let (Some(before), Some(after)) = (settings(&own.argv), settings(&with_passed)) else {
        return;
    };
    let Some(need) = plan.memory.as_mut().filter(|n| n.llama_kv.is_none()) else {
        return;
    };
    let Ok(header) = gguf::read_header_lean(model) else {
        return;
    };
    let bytes = |s: &KvSettings| gguf::memory::kv_estimate(&header, s).map(|e| e.total_bytes());
    if let (Ok(before), Ok(after)) = (bytes(&before), bytes(&after)) {
        need.kv_bytes = need.kv_bytes.saturating_sub(before).saturating_add(after);
    }
}

/// The cache settings of a llama-server command line, the last of each flag winning, with
/// llama-server's defaults and the llama-server routes' (4 slots sharing one cache when `-np`
/// is not given or is -1); None when a value does not parse.
fn settings(argv: &[String]) -> Option<KvSettings> {
    let mut s = KvSettings::new(0);
    s.n_parallel = 4;
    let mut parallel_given = false;
    let mut unified: Option<bool> = None;
    let mut i = 0;
    while i < argv.len() {
        let arg = &argv[i];
        i += 1;
        let (flag, inline) = flag_and_inline_value(arg);
        let mut value = || {
            inline.clone().or_else(|| {
                i += 1;
                argv.get(i - 1).cloned()
            })
        };
        match flag {
            "-c" | "--ctx-size" => s.ctx = value()?.parse().ok()?,
            "-ctk" | "--cache-type-k" => s.type_k = value()?.parse::<CacheType>().ok()?,
            "-ctv" | "--cache-type-v" => s.type_v = value()?.parse::<CacheType>().ok()?,
            "-fa" | "--flash-attn" => s.flash_attn = value()? != "off",
            "-ub" | "--ubatch-size" => s.n_ubatch = value()?.parse::<u64>().ok()?.max(1),
            "-np" | "--parallel" => {
                let v = value()?;
                // `auto` (and -1) is llama-server's default: the routes' 4 shared slots.
                let n: i64 = if v == "auto" { -1 } else { v.parse().ok()? };
                parallel_given = n > 0;
                s.n_parallel = if n > 0 { u32::try_from(n).ok()? } else { 4 };
            }
            "-kvu" | "--kv-unified" => unified = Some(true),
            "-no-kvu" | "--no-kv-unified" => unified = Some(false),
            "--swa-full" => s.swa_full = true,
            _ => {}
        }
    }
    s.unified = unified.unwrap_or(!parallel_given);
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::writer::Builder;
    use onebit_plugin_api::{BackendSpec, MemoryNeed};

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    fn plan(kv_bytes: u64) -> Plan {
        Plan {
            backends: vec![BackendSpec {
                engine: "llama-server".into(),
                argv: words("llama-server -m s.gguf -c 4096"),
                ..Default::default()
            }],
            memory: Some(MemoryNeed {
                kv_bytes,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// SmolLM2's shape (30 layers, 3 KV heads of 64): 4096 cells of f16 K and V are 90 MiB;
    /// a q8_0 cache is 34/64 of that.
    #[test]
    fn a_quantized_cache_passed_after_the_separator_is_counted() {
        let dir = std::env::temp_dir().join(format!("onebit-passed-kv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("s.gguf");
        Builder::smollm2_shaped().write(&model).unwrap();
        let f16 = 4096 * 30 * 2 * 3 * 64 * 2;
        let other = 1000;

        // (what is passed, the backend's engine, the KV counted, why)
        let cases = [
            (
                "-ctk q8_0 --cache-type-v=q8_0",
                "llama-server",
                f16 * 34 / 64,
                "a q8_0 cache",
            ),
            ("--temp 0.6", "llama-server", f16, "no KV flag, no change"),
            ("-ctk f17", "llama-server", f16, "llama-server refuses it"),
            ("-ctk q8_0", "ds4-server", f16, "not llama-server"),
        ];
        for (passed, engine, kv, why) in cases {
            let mut p = plan(f16 + other);
            p.backends[0].engine = engine.to_string();
            count(&mut p, &model, &words(passed));
            assert_eq!(p.memory.unwrap().kv_bytes, kv + other, "{why}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_last_flag_wins_and_slots_unshare_the_cache() {
        let s = settings(&words("llama-server -ub 256 -np 2 -ub 1024 -fa off")).unwrap();
        assert_eq!(
            (s.n_ubatch, s.n_parallel, s.unified, s.flash_attn),
            (1024, 2, false, false)
        );
        let s = settings(&words("llama-server -np -1 --swa-full")).unwrap();
        assert_eq!((s.n_parallel, s.unified, s.swa_full), (4, true, true));
        let s = settings(&words("llama-server -np 2 -kvu")).unwrap();
        assert!(s.unified);
        assert!(settings(&words("llama-server -ub lots")).is_none());
    }
}
