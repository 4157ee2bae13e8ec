//! serve's `/metrics` text read as Prometheus and Lemonade read it: `promtool check metrics`
//! (Debian's `prometheus` package) before and after Lemonade's merge of a llamacpp backend's
//! text (written here from Lemonade's `prometheus_metrics.cpp`: each name sanitised, a leading
//! `llamacpp_` dropped, `lemonade_llamacpp_` put before it, and Lemonade's own labels appended).

use std::io::Write;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use onebit_tests::*;

/// A sysfs with one amdgpu card and k10temp, so every own series of serve has a source.
fn fake_sysfs(dir: &Path) -> PathBuf {
    let root = dir.join("sys");
    let card = root.join("class/drm/card0/device");
    std::fs::create_dir_all(&card).unwrap();
    std::fs::write(
        card.join("mem_info_gtt_total"),
        format!("{}\n", 120u64 << 30),
    )
    .unwrap();
    std::fs::write(card.join("mem_info_gtt_used"), format!("{}\n", 96u64 << 30)).unwrap();
    let k10 = root.join("class/hwmon/hwmon2");
    std::fs::create_dir_all(&k10).unwrap();
    std::fs::write(k10.join("name"), "k10temp\n").unwrap();
    std::fs::write(k10.join("temp1_label"), "Tctl\n").unwrap();
    std::fs::write(k10.join("temp1_input"), "71500\n").unwrap();
    root
}

const LINES: &str = "W ggml_hrx: HRX graph program cache over its limit (512 MiB); flushing\\nW ggml_hrx: load report: 5 nodes on CPU fallback: MUL_MAT=3, ROPE x2";

/// promtool, installed with apt when absent; None (with a line saying why) when it cannot be.
fn promtool() -> Option<&'static str> {
    let found = || {
        Command::new("promtool")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if found() {
        return Some("promtool");
    }
    let installed = Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends", "prometheus"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if installed && found() {
        return Some("promtool");
    }
    eprintln!(
        "SKIPPED: promtool is not installed and `apt-get install prometheus` did not work (no root or no network); install Debian's prometheus package to run this check"
    );
    None
}

/// promtool's complaints about `text` (empty when it passes); its exit status says whether it
/// parsed at all.
fn promtool_check(tool: &str, text: &str) -> (i32, Vec<String>) {
    let mut child = Command::new(tool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (
        out.status.code().unwrap_or(-1),
        said.lines()
            .map(str::to_string)
            .filter(|l| !l.is_empty())
            .collect(),
    )
}

/// Lemonade's name rule for a llamacpp backend's series.
fn lemonade_name(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    let s = s.strip_prefix("llamacpp_").unwrap_or(&s).to_string();
    format!("lemonade_llamacpp_{s}")
}

/// Lemonade's merge of one backend's text, with its labels (a sorted map there) appended.
fn lemonade_merge(text: &str) -> String {
    let labels = r#"checkpoint="extra.m.gguf",device="cpu",model_name="extra.m",recipe="llamacpp",type="llm""#;
    let mut described = std::collections::HashSet::new();
    let mut out = String::new();
    for line in text.lines() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if let Some((kind, rest)) = line
            .strip_prefix("# HELP ")
            .map(|r| ("HELP", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("TYPE", r)))
        {
            let Some((name, tail)) = rest.split_once(' ') else {
                continue;
            };
            let name = lemonade_name(name);
            if described.insert(format!("{kind}:{name}")) {
                out.push_str(&format!("# {kind} {name} {tail}\n"));
            }
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some(end) = line.find(['{', ' ', '\t']).filter(|e| *e > 0) else {
            continue;
        };
        let name = lemonade_name(&line[..end]);
        let (existing, rest) = if line[end..].starts_with('{') {
            let close = line.find('}').unwrap();
            (&line[end + 1..close], &line[close + 1..])
        } else {
            ("", &line[end..])
        };
        let merged = if existing.is_empty() {
            labels.to_string()
        } else {
            format!("{existing},{labels}")
        };
        out.push_str(&format!("{name}{{{merged}}}{rest}\n"));
    }
    out
}

/// serve's /metrics once every series it can have is there.
fn scrape_full(serve: &Serve) -> String {
    serve.ready();
    assert!(serve.wait_output("ROPE x2", Duration::from_secs(5)));
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    for series in [
        "onebit_serve_starts_total",
        "onebit_gtt_bytes",
        "onebit_tctl_celsius",
        "onebit_cpu_fallback_ops",
        "onebit_program_cache_flushes_total",
        "llamacpp:prompt_tokens_total",
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }
    text
}

/// Before the merge, the only complaints are promtool's naming advice against llama.cpp's own
/// `llamacpp:` names, which serve relays as llama-server sends them (the specification keeps
/// them, and Lemonade's merge turns the colon into `_`).
fn assert_passes_before(tool: &str, text: &str) {
    let (code, said) = promtool_check(tool, text);
    let other: Vec<&String> = said
        .iter()
        .filter(|l| {
            !(l.starts_with("llamacpp:") && l.ends_with("metric names should not contain ':'"))
        })
        .collect();
    assert!(
        other.is_empty(),
        "promtool (exit {code}): {other:?}\n{text}"
    );
    assert!(
        code == 0 || code == 3,
        "promtool could not read it (exit {code}): {said:?}"
    );
}

fn assert_passes_after_merge(tool: &str, text: &str) {
    let merged = lemonade_merge(text);
    let (code, said) = promtool_check(tool, &merged);
    assert_eq!(
        (code, &said),
        (0, &Vec::new()),
        "after Lemonade's merge:\n{merged}"
    );
    for line in merged.lines().filter(|l| !l.starts_with('#')) {
        assert_eq!(line.matches("device=").count(), 1, "{line}");
    }
    let samples = parse_prometheus(&merged);
    assert_eq!(
        samples.len(),
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .count(),
        "a series lost in the merge:\n{merged}"
    );
}

#[test]
fn serves_text_passes_promtool_and_counters_are_typed_by_their_total_name() {
    let Some(tool) = promtool() else { return };
    let dir = temp_dir("promtool-serve");
    let model = dummy_model(&dir, "m.gguf");
    let sysfs = fake_sysfs(&dir);
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("ONEBIT_SYSFS_ROOT", sysfs.to_str().unwrap()),
            ("FAKE_STDERR_LINES", LINES),
        ],
    );
    let text = scrape_full(&serve);
    assert!(
        text.contains("# TYPE onebit_serve_starts_total counter\n"),
        "{text}"
    );
    assert!(
        !text.contains("# TYPE onebit_serve_starts counter"),
        "{text}"
    );
    assert!(text.contains("onebit_up{device=\"cpu\"} 1\n"), "{text}");
    assert_passes_before(tool, &text);
}

#[test]
fn as_lemonades_llama_server_the_text_survives_lemonades_merge_with_one_device_label() {
    let Some(tool) = promtool() else { return };
    let dir = temp_dir("promtool-dropin");
    let model = dummy_model(&dir, "m.gguf");
    let sysfs = fake_sysfs(&dir);
    let link = dir.join("llama-server");
    symlink(onebit(), &link).unwrap();
    let port = free_port();
    let mut command = Command::new(&link);
    command
        .args([
            "-m",
            model.to_str().unwrap(),
            "--ctx-size",
            "4096",
            "--port",
            &port.to_string(),
        ])
        .args([
            "--jinja",
            "--metrics",
            "--reasoning-format",
            "auto",
            "--no-ui",
        ])
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .env("ONEBIT_LLAMA_SERVER", fake_backend())
        .env("ONEBIT_HRX_PRESENT", "0")
        .env("ONEBIT_SYSFS_ROOT", &sysfs)
        .env("FAKE_STDERR_LINES", LINES);
    let serve = Serve::spawn(command, port);
    let text = scrape_full(&serve);
    assert!(text.contains("onebit_up{route=\"cpu\"} 1\n"), "{text}");
    assert_passes_before(tool, &text);
    assert_passes_after_merge(tool, &text);
}
