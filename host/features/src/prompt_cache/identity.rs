//! What made a KV state: the model file, the llama.cpp build and the context settings. A state
//! is restored only into a backend whose identity is equal, field for field; the one check a
//! state file passes before any restore (docs/serve.md, Prompt cache).

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The identity of a backend's KV states. Made once per serve, when the backend is ready (its
/// `/props` says the build and the context per slot); compared with each state file's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The model file, canonical.
    pub model_path: String,
    pub model_bytes: u64,
    /// sha256 of the GGUF header (every byte before the tensor data), hex.
    pub model_header_sha256: String,
    /// llama-server's own `build_info` and the sha256 of its executable, hex.
    pub llama_build: String,
    pub llama_sha256: String,
    /// The context of one slot (`/props`' `default_generation_settings.n_ctx`) and the slots.
    pub n_ctx_slot: u64,
    pub total_slots: u64,
    /// The KV flags of the backend's command line (cache types, flash attention, unified KV,
    /// full SWA), each `flag=value`, llama.cpp's default where the line names none.
    pub kv_settings: Vec<String>,
}

impl Identity {
    /// Why `other` (a state file's) is not this identity, or None when it is: the first field
    /// that differs, as the discard line says it.
    pub fn mismatch(&self, other: &Identity) -> Option<String> {
        if self.model_path != other.model_path
            || self.model_bytes != other.model_bytes
            || self.model_header_sha256 != other.model_header_sha256
        {
            return Some(format!(
                "made by another model file ({}, {} bytes), not {} ({} bytes)",
                other.model_path, other.model_bytes, self.model_path, self.model_bytes
            ));
        }
        if self.llama_build != other.llama_build || self.llama_sha256 != other.llama_sha256 {
            return Some(format!(
                "made by another llama.cpp build ({} {}), not this one ({} {})",
                other.llama_build,
                short(&other.llama_sha256),
                self.llama_build,
                short(&self.llama_sha256)
            ));
        }
        if self.n_ctx_slot != other.n_ctx_slot
            || self.total_slots != other.total_slots
            || self.kv_settings != other.kv_settings
        {
            return Some(format!(
                "made with other context settings (ctx per slot {}, {} slots, {}), not these (ctx per slot {}, {} slots, {})",
                other.n_ctx_slot,
                other.total_slots,
                other.kv_settings.join(" "),
                self.n_ctx_slot,
                self.total_slots,
                self.kv_settings.join(" ")
            ));
        }
        None
    }

    /// A short key of the identity, for file names and the log.
    pub fn key(&self) -> String {
        let text = serde_json::to_string(self).unwrap_or_default();
        short(&hex(&Sha256::digest(text.as_bytes()))).to_string()
    }
}

fn short(hex: &str) -> &str {
    hex.get(..12).unwrap_or(hex)
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The model file's part of the identity: its canonical path, size and the sha256 of its
/// header. Blocks (reads the header: a few MB); called once, on a blocking thread.
pub fn model_part(path: &Path) -> std::io::Result<(String, u64, String)> {
    let canonical = std::fs::canonicalize(path)?;
    let bytes = std::fs::metadata(&canonical)?.len();
    let header_len = gguf::read_header_lean(&canonical)
        .map(|h| h.data_offset)
        .unwrap_or(bytes.min(1 << 20));
    let mut hasher = Sha256::new();
    let mut file = std::fs::File::open(&canonical)?.take(header_len);
    std::io::copy(&mut file, &mut hasher)?;
    Ok((
        canonical.to_string_lossy().into_owned(),
        bytes,
        hex(&hasher.finalize()),
    ))
}

/// The sha256 of a file (the llama-server executable), hex. Blocks.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

/// Whether the slots of a llama-server with this command line share one KV: `-kvu`, or no
/// `-np` (its auto parallel turns unified KV on), and not `-no-kvu`.
pub fn kv_unified(argv: &[String]) -> bool {
    kv_settings(argv)
        .last()
        .is_some_and(|s| s != "--kv-unified=off")
}

/// The KV flags of a llama-server command line, each `flag=value` under its long name, with
/// llama.cpp's defaults for those it does not name (common/arg.cpp): what decides the layout
/// of a slot's state besides the model and the context.
pub fn kv_settings(argv: &[String]) -> Vec<String> {
    // (long name, its aliases, llama.cpp's default, whether it takes a value)
    const FLAGS: [(&str, &[&str], &str, bool); 4] = [
        ("--cache-type-k", &["-ctk"], "f16", true),
        ("--cache-type-v", &["-ctv"], "f16", true),
        ("--flash-attn", &["-fa"], "auto", true),
        ("--swa-full", &[], "off", false),
    ];
    let mut out = Vec::new();
    for (long, aliases, default, takes_value) in FLAGS {
        let named = |a: &str| a == long || aliases.contains(&a);
        let mut value = default.to_string();
        for (i, arg) in argv.iter().enumerate() {
            if let Some(v) = arg.strip_prefix(long).and_then(|r| r.strip_prefix('=')) {
                value = v.to_string();
            } else if named(arg) {
                value = if takes_value {
                    argv.get(i + 1).cloned().unwrap_or_default()
                } else {
                    "on".to_string()
                };
            }
        }
        out.push(format!("{long}={value}"));
    }
    let unified = argv
        .iter()
        .rev()
        .find_map(|a| match a.as_str() {
            "-kvu" | "--kv-unified" => Some("on"),
            "-no-kvu" | "--no-kv-unified" => Some("off"),
            _ => None,
        })
        .unwrap_or(if argv.iter().any(|a| a == "-np" || a == "--parallel") {
            "off"
        } else {
            "auto"
        });
    out.push(format!("--kv-unified={unified}"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            model_path: "/m/a.gguf".into(),
            model_bytes: 10,
            model_header_sha256: "aa".into(),
            llama_build: "b1".into(),
            llama_sha256: "bb".into(),
            n_ctx_slot: 2048,
            total_slots: 4,
            kv_settings: vec!["--cache-type-k=f16".into()],
        }
    }

    #[test]
    fn each_part_of_the_identity_is_checked_and_said() {
        let me = identity();
        assert_eq!(me.mismatch(&identity()), None);
        let mut other = identity();
        other.model_header_sha256 = "ab".into();
        assert!(me.mismatch(&other).unwrap().contains("another model file"));
        let mut other = identity();
        other.llama_sha256 = "bc".into();
        assert!(
            me.mismatch(&other)
                .unwrap()
                .contains("another llama.cpp build")
        );
        let mut other = identity();
        other.n_ctx_slot = 4096;
        let why = me.mismatch(&other).unwrap();
        assert!(why.contains("ctx per slot 4096"), "{why}");
        assert_ne!(me.key(), other.key());
    }

    #[test]
    fn kv_flags_are_read_under_any_name_with_llama_cpp_defaults() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            kv_settings(&argv(&["llama-server", "-m", "x"])),
            [
                "--cache-type-k=f16",
                "--cache-type-v=f16",
                "--flash-attn=auto",
                "--swa-full=off",
                "--kv-unified=auto"
            ]
        );
        let s = kv_settings(&argv(&["-ctk", "q8_0", "--flash-attn=on", "-np", "2"]));
        assert_eq!(s[0], "--cache-type-k=q8_0");
        assert_eq!(s[2], "--flash-attn=on");
        assert_eq!(s[4], "--kv-unified=off");
    }
}
