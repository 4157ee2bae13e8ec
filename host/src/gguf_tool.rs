//! `1bit gguf`: test models and a model's facts. `stub` writes a header-only GGUF (v3, no
//! tensors) with a model's shape, optionally grown sparsely to a size, through the gguf crate's
//! fixture writer; `inspect` prints what serve reads from a model: the facts the routes plan
//! from (`model::facts`), the header's shape, and the memory check's estimate (the weights'
//! bytes, and `gguf::memory::kv_estimate` with the llama-server routes' settings) at the model's
//! own context. A file that cannot be read is one line on stderr, exit 2.

use std::path::Path;

use gguf::memory::{KvSettings, MIB};
use gguf::writer::Builder;
use gguf::{ErrorKind, Header};

use onebit_command::cli::{GgufAction, StubArgs};
use onebit_command::{error, model};

/// llama.cpp's LLAMA_MAX_LAYERS: the memory check refuses more.
const MAX_LAYERS: u32 = 512;
/// Slots the llama-server routes run without `--parallel` (`-np auto`: 4 sharing one cache).
const SERVE_SLOTS: u32 = 4;

/// Run `1bit gguf ACTION`: its lines on stdout, exit 0; or its one line on stderr, exit 2.
pub fn run(action: GgufAction) -> i32 {
    let outcome = match action {
        GgufAction::Stub(args) => stub(&args).map(|line| vec![line]),
        GgufAction::Inspect { file } => inspect(&file),
    };
    match outcome {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            error::exit::OK
        }
        Err(line) => {
            eprintln!("{line}");
            error::exit::USAGE
        }
    }
}

/// `1bit gguf stub OUT`: the one line saying what was written, or why nothing was.
fn stub(args: &StubArgs) -> Result<String, String> {
    let refuse = |why: String| format!("1bit gguf stub: {why}");
    let kv_heads = checked_shape(args).map_err(refuse)?;
    let out = &args.out;
    if !args.force && std::fs::symlink_metadata(out).is_ok() {
        return Err(refuse(format!(
            "{} exists; pass --force to replace it, or another path",
            out.display()
        )));
    }
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| model::served_name(out, None));
    let arch = args.arch.trim();
    let key = |suffix: &str| format!("{arch}.{suffix}");
    let head_dim = args.embd / args.heads;
    let builder = Builder::new()
        .kv("general.architecture", arch)
        .kv("general.name", name.as_str())
        .kv("general.file_type", args.file_type)
        .kv(key("block_count"), args.layers)
        .kv(key("context_length"), args.ctx)
        .kv(key("embedding_length"), args.embd)
        .kv(key("feed_forward_length"), args.embd.saturating_mul(4))
        .kv(key("attention.head_count"), args.heads)
        .kv(key("attention.head_count_kv"), kv_heads)
        .kv(key("attention.key_length"), head_dim)
        .kv(key("attention.value_length"), head_dim);
    let header_bytes = builder.to_bytes().len() as u64;
    let bytes = match args.size {
        Some(size) if size < header_bytes => {
            return Err(refuse(format!(
                "--size {size}: smaller than the {header_bytes}-byte header; pass {header_bytes} or more, or leave --size out"
            )));
        }
        Some(size) => size,
        None => header_bytes,
    };
    builder.total_size(bytes).write(out).map_err(|e| {
        refuse(format!(
            "{}: cannot write it: {e}; pass a path in a folder you can write",
            out.display()
        ))
    })?;
    let tail = if bytes > header_bytes {
        format!("{bytes} bytes, sparse past the {header_bytes}-byte header")
    } else {
        format!("{bytes} bytes, the header alone")
    };
    Ok(format!(
        "wrote {}: a header-only GGUF v3 ({arch} \"{name}\": {} layers, {} heads, {kv_heads} KV heads, embd {}, ctx {}, file type {}), {tail}",
        out.display(),
        args.layers,
        args.heads,
        args.embd,
        args.ctx,
        args.file_type
    ))
}

/// The stub's shape checked as llama.cpp would load it: the KV heads (default: the heads), or
/// what is wrong, in words.
fn checked_shape(args: &StubArgs) -> Result<u32, String> {
    if args.arch.trim().is_empty() {
        return Err("--arch is empty; pass an architecture such as --arch llama".to_string());
    }
    if args.layers == 0 || args.layers > MAX_LAYERS {
        return Err(format!(
            "--layers {}: llama.cpp loads 1 to {MAX_LAYERS} layers; pass one of those",
            args.layers
        ));
    }
    if args.heads == 0 {
        return Err("--heads 0: a model has at least one head; pass --heads 1 or more".to_string());
    }
    let kv_heads = args.kv_heads.unwrap_or(args.heads);
    if kv_heads == 0 || !args.heads.is_multiple_of(kv_heads) {
        return Err(format!(
            "--kv-heads {kv_heads}: must divide --heads {} (grouped-query attention); pass a divisor of it",
            args.heads
        ));
    }
    if args.embd == 0 || !args.embd.is_multiple_of(args.heads) {
        return Err(format!(
            "--embd {}: must be a multiple of --heads {} (each head as wide); pass such a width",
            args.embd, args.heads
        ));
    }
    if args.ctx == 0 {
        return Err(
            "--ctx 0: a model has a context of at least one token; pass --ctx 1 or more"
                .to_string(),
        );
    }
    Ok(kv_heads)
}

/// `1bit gguf inspect FILE`: one `key: value` line per fact, or the one line saying what is
/// wrong with the file and what to do.
fn inspect(file: &Path) -> Result<Vec<String>, String> {
    let refuse = |why: String| format!("1bit gguf inspect: {why}");
    let shown = file.display();
    match std::fs::metadata(file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(refuse(format!(
                "{shown}: no such file; pass the path of a .gguf model (1bit gguf stub writes one)"
            )));
        }
        Err(e) => {
            return Err(refuse(format!(
                "{shown}: cannot read it: {e}; pass a .gguf model you can read"
            )));
        }
        Ok(meta) if meta.is_dir() => {
            return Err(refuse(format!(
                "{shown}: a directory; pass a .gguf file (an NPU model directory has no GGUF header)"
            )));
        }
        Ok(meta) if meta.len() == 0 => {
            return Err(refuse(format!(
                "{shown}: the file is empty; pass a .gguf model (1bit gguf stub writes one)"
            )));
        }
        Ok(_) => {}
    }
    // The header as the memory check reads it (long arrays walked past), then the facts the
    // routes plan from, read as serve reads them (a header that cannot be read is a fact
    // there, for the route to judge; here it is the one line).
    let header = gguf::read_header_lean(file).map_err(|e| {
        let what_to_do = match e.kind() {
            ErrorKind::Io => "; pass a .gguf model you can read",
            _ if e.message().ends_with("the file is corrupt") => {
                ", download or convert the model again"
            }
            _ => "",
        };
        refuse(format!("{e}{what_to_do}"))
    })?;
    let facts = model::facts(file).map_err(|fatal| refuse(fatal.message))?;
    if let Some(why) = facts.gguf_error {
        return Err(refuse(why));
    }
    let or_none = |v: Option<String>| v.unwrap_or_else(|| "(none)".to_string());
    let arch_value = |suffix: &str| {
        or_none(
            header
                .arch_key(suffix)
                .and_then(|k| shown_value(&header, &k)),
        )
    };
    Ok(vec![
        format!("path: {}", facts.path),
        format!("bytes: {}", facts.bytes),
        format!("architecture: {}", or_none(facts.architecture.clone())),
        format!(
            "name: {}",
            or_none(header.get_str("general.name").map(str::to_string))
        ),
        format!(
            "file type: {}",
            or_none(shown_value(&header, "general.file_type"))
        ),
        format!("layers: {}", arch_value("block_count")),
        format!(
            "context length: {}",
            or_none(facts.context_length.map(|n| n.to_string()))
        ),
        format!("embedding length: {}", arch_value("embedding_length")),
        format!("heads: {}", arch_value("attention.head_count")),
        format!("kv heads: {}", arch_value("attention.head_count_kv")),
        format!(
            "expert count: {}",
            or_none(facts.expert_count.map(|n| n.to_string()))
        ),
        format!(
            "weights: {} bytes ({:.2} GiB)",
            facts.bytes,
            facts.bytes as f64 / (1024.0 * MIB)
        ),
        kv_line(&header),
    ])
}

/// A key's value as a line shows it: an integer, a string, or a per-layer array's elements.
fn shown_value(header: &Header, key: &str) -> Option<String> {
    let value = header.get(key)?;
    if let Some(n) = value.as_u64() {
        return Some(n.to_string());
    }
    if let Some(s) = value.as_str() {
        return Some(s.to_string());
    }
    match value.as_array().and_then(|a| a.to_u64s()) {
        Some(per_layer) => Some(format!(
            "per layer [{}]",
            per_layer
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
        None => Some(format!("a {}", value.value_type())),
    }
}

/// The memory check's KV/state estimate at the model's own context, with the settings the
/// llama-server routes run without `--ctx-size` or `--parallel`; or why it cannot be made
/// (serve then skips the check with a warning, as the line says).
fn kv_line(header: &Header) -> String {
    let settings = KvSettings {
        n_parallel: SERVE_SLOTS,
        unified: true,
        ..KvSettings::new(0)
    };
    match gguf::memory::kv_estimate(header, &settings) {
        Ok(estimate) => format!(
            "kv/state: {} bytes ({:.2} MiB) at ctx {} (the model's own; f16, {SERVE_SLOTS} slots sharing one cache){}",
            estimate.total_bytes(),
            estimate.total_bytes() as f64 / MIB,
            estimate.n_ctx,
            if estimate.exact {
                ""
            } else {
                ", approximate for this architecture"
            }
        ),
        Err(e) => format!(
            "kv/state: unknown ({e}); serve skips the memory check for this model with a warning"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn dir(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("onebit-gguf-tool-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `1bit gguf stub ARGS…` as the command line parses it.
    fn stub_args(args: &[&str]) -> StubArgs {
        let argv = ["1bit", "gguf", "stub"].iter().chain(args);
        match onebit_command::cli::Cli::try_parse_from(argv)
            .unwrap()
            .command
        {
            onebit_command::cli::Command::Gguf {
                action: GgufAction::Stub(args),
            } => args,
            other => panic!("{other:?}"),
        }
    }

    fn value<'a>(lines: &'a [String], key: &str) -> &'a str {
        let prefix = format!("{key}: ");
        lines
            .iter()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {key}: {lines:#?}"))
    }

    /// The one refusal line of inspecting `path`: prefixed, naming the file, saying what to do.
    fn refusal(path: &Path) -> String {
        let line = inspect(path).unwrap_err();
        let head = format!("1bit gguf inspect: {}: ", path.display());
        assert!(line.starts_with(&head), "{line}");
        assert!(!line.contains('\n'), "{line}");
        assert!(line[head.len()..].contains("; "), "{line}");
        line
    }

    #[test]
    fn a_stub_inspects_as_written() {
        let dir = dir("round-trip");
        let out = dir.join("tiny.gguf");
        let o = out.to_str().unwrap();
        let line = stub(&stub_args(&[o, "--size", "1073741824"])).unwrap();
        assert!(line.starts_with(&format!("wrote {o}: a header-only GGUF v3 (llama \"tiny\": 2 layers, 4 heads, 4 KV heads, embd 64, ctx 2048, file type 2), 1073741824 bytes, sparse past the ")), "{line}");
        let lines = inspect(&out).unwrap();
        for (key, want) in [
            ("path", o),
            ("bytes", "1073741824"),
            ("architecture", "llama"),
            ("name", "tiny"),
            ("file type", "2"),
            ("layers", "2"),
            ("context length", "2048"),
            ("embedding length", "64"),
            ("heads", "4"),
            ("kv heads", "4"),
            ("expert count", "(none)"),
            ("weights", "1073741824 bytes (1.00 GiB)"),
            // 2048 cells x 2 layers x (K + V) x 4 heads x 16 wide x 2 bytes (f16).
            (
                "kv/state",
                "1048576 bytes (1.00 MiB) at ctx 2048 (the model's own; f16, 4 slots sharing one cache)",
            ),
        ] {
            assert_eq!(value(&lines, key), want, "{lines:#?}");
        }
        // Another shape, and the header alone without --size.
        let other = dir.join("other.gguf");
        let line = stub(&stub_args(&[
            other.to_str().unwrap(),
            "--arch",
            "qwen3",
            "--layers",
            "3",
            "--heads",
            "8",
            "--kv-heads",
            "2",
            "--embd",
            "256",
            "--ctx",
            "4096",
            "--file-type",
            "7",
            "--name",
            "Q",
        ]))
        .unwrap();
        assert!(line.ends_with("bytes, the header alone"), "{line}");
        let lines = inspect(&other).unwrap();
        assert_eq!(value(&lines, "architecture"), "qwen3");
        assert_eq!(value(&lines, "name"), "Q");
        assert_eq!(value(&lines, "kv heads"), "2");
        assert_eq!(value(&lines, "file type"), "7");
        // 4096 x 3 x 2 x 2 x 32 x 2.
        assert!(
            value(&lines, "kv/state").starts_with("3145728 bytes (3.00 MiB) at ctx 4096"),
            "{lines:#?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stub_refuses_an_existing_file_and_a_shape_llama_cpp_would_not_load() {
        let dir = dir("refusals");
        let out = dir.join("m.gguf");
        let o = out.to_str().unwrap();
        std::fs::write(&out, b"keep me").unwrap();
        assert_eq!(
            stub(&stub_args(&[o])).unwrap_err(),
            format!("1bit gguf stub: {o} exists; pass --force to replace it, or another path")
        );
        assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
        for (args, why) in [
            (
                vec!["--arch", " "],
                "--arch is empty; pass an architecture such as --arch llama",
            ),
            (
                vec!["--layers", "0"],
                "--layers 0: llama.cpp loads 1 to 512 layers; pass one of those",
            ),
            (
                vec!["--heads", "0"],
                "--heads 0: a model has at least one head; pass --heads 1 or more",
            ),
            (
                vec!["--kv-heads", "3"],
                "--kv-heads 3: must divide --heads 4 (grouped-query attention); pass a divisor of it",
            ),
            (
                vec!["--embd", "66"],
                "--embd 66: must be a multiple of --heads 4 (each head as wide); pass such a width",
            ),
            (vec!["--size", "10"], "--size 10: smaller than the "),
        ] {
            let mut all = vec![o, "--force"];
            all.extend(args);
            let line = stub(&stub_args(&all)).unwrap_err();
            assert!(
                line.starts_with(&format!("1bit gguf stub: {why}")),
                "{line}"
            );
        }
        assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
        stub(&stub_args(&[o, "--force"])).unwrap();
        assert_eq!(value(&inspect(&out).unwrap(), "name"), "m");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_whole_gguf_is_one_line_never_a_panic() {
        let dir = dir("malformed");
        let missing = dir.join("missing.gguf");
        assert!(refusal(&missing).ends_with(
            ": no such file; pass the path of a .gguf model (1bit gguf stub writes one)"
        ));
        assert!(refusal(&dir).contains(": a directory; "));
        let empty = dir.join("empty.gguf");
        std::fs::write(&empty, b"").unwrap();
        assert!(
            refusal(&empty)
                .ends_with(": the file is empty; pass a .gguf model (1bit gguf stub writes one)")
        );
        let text = dir.join("text.gguf");
        std::fs::write(&text, b"hello, not a gguf").unwrap();
        assert!(refusal(&text).ends_with("not a GGUF file (magic 68656c6c); pass a .gguf model"));

        let whole = dir.join("whole.gguf");
        stub(&stub_args(&[whole.to_str().unwrap()])).unwrap();
        let bytes = std::fs::read(&whole).unwrap();
        // Inside the magic, the version, both counts, the first key's length, its text, its
        // type and value, and one byte short of the end.
        let cut = dir.join("cut.gguf");
        for at in [
            3,
            4,
            6,
            10,
            16,
            23,
            24,
            30,
            47,
            52,
            60,
            bytes.len() / 2,
            bytes.len() - 1,
        ] {
            std::fs::write(&cut, &bytes[..at]).unwrap();
            let line = refusal(&cut);
            assert!(
                line.contains(" again") || line.contains("pass a .gguf model"),
                "cut at {at}: {line}"
            );
        }
        // The first key's length (after magic, version and both counts) claims 2^62 bytes.
        let mut huge = bytes.clone();
        huge[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let long = dir.join("long.gguf");
        std::fs::write(&long, &huge).unwrap();
        let line = refusal(&long);
        assert!(
            line.contains("string of 4611686018427387904 bytes"),
            "{line}"
        );
        assert!(
            line.ends_with("the file is corrupt, download or convert the model again"),
            "{line}"
        );
        // A key/value count the file cannot hold.
        let mut many = bytes.clone();
        many[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&long, &many).unwrap();
        assert!(refusal(&long).contains("negative key/value count"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_header_without_the_shape_is_inspected_with_its_kv_unknown() {
        let dir = dir("arch-only");
        let path = dir.join("arch-only.gguf");
        Builder::new()
            .kv("general.architecture", "llama")
            .write(&path)
            .unwrap();
        let lines = inspect(&path).unwrap();
        assert_eq!(value(&lines, "layers"), "(none)");
        assert!(
            value(&lines, "kv/state").starts_with("unknown (")
                && value(&lines, "kv/state").contains("'llama.block_count' is missing"),
            "{lines:#?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
