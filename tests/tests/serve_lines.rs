//! The original's own lines where the specification spells none out: an architecture the pinned
//! llama.cpp does not build, an H32 file, and `--moe-slots` (their wording read from
//! 1bit-MONSTER/engine's tests/device_route.sh and docs/serve.md), each with its exit status.

use std::path::{Path, PathBuf};
use std::process::Command;

use onebit_tests::*;

/// `1bit serve ARGS` on the fake backend with a clean ONEBIT_/GGML_HRX_ environment plus `env`:
/// (exit status, stderr). A serve that is not refused is stopped after 20 s (`timeout`, 124).
fn refusal(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut command = Command::new("timeout");
    command
        .args(["-s", "KILL", "20"])
        .arg(onebit())
        .arg("serve")
        .args(args)
        .args(["--llama-server", fake_backend().to_str().unwrap()]);
    for (k, _) in std::env::vars() {
        if k.starts_with("GGML_HRX_") || k.starts_with("ONEBIT_") {
            command.env_remove(k);
        }
    }
    let out = command
        .envs(env.iter().copied())
        .output()
        .expect("1bit runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A header-only GGUF of `arch`, with `extra` keys as i32.
fn gguf_of(dir: &Path, name: &str, arch: &str, extra: &[(&str, i32)]) -> PathBuf {
    let path = dir.join(name);
    let mut b = gguf::writer::Builder::new().kv("general.architecture", arch);
    for (k, v) in extra {
        b = b.kv(*k, *v);
    }
    b.write(&path).unwrap();
    path
}

/// serve's own lines in `stderr` (one is expected), leaving out `--device auto`'s choice.
fn ours(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("1bit serve:") && !l.contains("--device auto chose"))
        .collect()
}

#[test]
fn an_architecture_the_pinned_llama_cpp_does_not_build_is_not_in_it() {
    let dir = temp_dir("lines-arch");
    // (The pinned fork builds Qwen3.8-Flash-Next's qwen4exp, which the original refused before
    // its port; Zyphra's zamba2 is still missing.)
    for arch in ["zamba2", "not-an-arch"] {
        let model = gguf_of(&dir, &format!("{arch}.gguf"), arch, &[]);
        let m = model.to_str().unwrap();
        for (device, hrx) in [("hrx", "1"), ("cpu", "0"), ("auto", "1"), ("auto", "0")] {
            let (code, stderr) = refusal(
                &["-m", m, "--device", device],
                &[("ONEBIT_HRX_PRESENT", hrx)],
            );
            assert_eq!(code, 2, "{arch} on {device}: {stderr}");
            let lines = ours(&stderr);
            assert_eq!(lines.len(), 1, "{stderr}");
            assert!(
                lines[0].contains(&format!("architecture {arch} is not in "))
                    && lines[0].contains("Lemonade's llamacpp backend"),
                "{arch} on {device}: {stderr}"
            );
        }
    }
}

#[test]
fn an_h32_file_is_refused_on_every_device_because_the_engine_dropped_that_format() {
    let dir = temp_dir("lines-h32");
    let model = gguf_of(&dir, "h32.gguf", "qwen35", &[("onebit.hadamard_q4_0", 32)]);
    let m = model.to_str().unwrap();
    for device in ["hrx", "cpu", "auto", "hybrid", "ds4"] {
        let (code, stderr) = refusal(&["-m", m, "--device", device], &[]);
        assert_eq!(code, 2, "{device}: {stderr}");
        let lines = ours(&stderr);
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].contains("an H32 file") && lines[0].contains("dropped that format"),
            "{device}: {stderr}"
        );
    }
}

#[test]
fn moe_slots_is_not_available_in_this_build_and_moves_to_hrx() {
    let dir = temp_dir("lines-moe");
    let model = gguf_of(&dir, "plain.gguf", "llama", &[]);
    let m = model.to_str().unwrap();
    for extra in [
        &["--moe-slots", "64"][..],
        &["--moe-slots", "auto", "--device", "auto"],
        &["--moe-slots", "auto", "--device", "hrx"],
    ] {
        let mut args = vec!["-m", m];
        args.extend_from_slice(extra);
        let (code, stderr) = refusal(&args, &[("ONEBIT_HRX_PRESENT", "1")]);
        assert_eq!(code, 2, "{extra:?}: {stderr}");
        let lines = ours(&stderr);
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].contains("--moe-slots is not available in this build")
                && lines[0].contains("moves to HRX"),
            "{extra:?}: {stderr}"
        );
    }
}
