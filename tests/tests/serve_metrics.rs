//! `GET /metrics` against the fake backend: every series with a source, none without, the
//! backend's own series last, and the counters kept across restarts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use onebit_tests::*;

const SECS: fn(u64) -> Duration = Duration::from_secs;

/// A sysfs with one amdgpu card at 96 GiB of GTT used, and k10temp at 71.5 C.
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

fn scrape(serve: &Serve) -> (String, Vec<Sample>) {
    let reply = ureq::get(&serve.url("/metrics"))
        .call()
        .expect("/metrics answers");
    let content_type = reply
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = reply.into_body().read_to_string().unwrap();
    let samples = parse_prometheus(&text);
    (text, samples)
}

#[test]
fn metrics_hold_every_series_with_a_source_then_the_backends_own() {
    let dir = temp_dir("metrics-all");
    let model = dummy_model(&dir, "m.gguf");
    let sysfs = fake_sysfs(&dir);
    let state = dir.join("state");
    let lines = [
        "W ggml_hrx: HRX graph program cache over its limit (512 MiB); flushing",
        "W ggml_hrx: HRX graph program cache over its limit (512 MiB); flushing",
        "W ggml_hrx: load report: 5 nodes on CPU fallback: MUL_MAT=3, ROPE x2",
    ]
    .join("\\n");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("ONEBIT_SYSFS_ROOT", sysfs.to_str().unwrap()),
            ("ONEBIT_STATE_DIR", state.to_str().unwrap()),
            ("FAKE_STDERR_LINES", &lines),
        ],
    );
    serve.ready();
    assert!(serve.wait_output("ROPE x2", SECS(5)));
    let (text, s) = scrape(&serve);
    let v = |name: &str, labels: &[(&str, &str)]| {
        sample(&s, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} missing:\n{text}"))
    };
    assert_eq!(v("onebit_up", &[("device", "cpu")]), 1.0);
    assert_eq!(v("onebit_serve_starts_total", &[]), 1.0);
    assert_eq!(v("onebit_watchdog_kills_total", &[]), 0.0);
    assert_eq!(v("onebit_backend_exits_total", &[]), 0.0);
    assert_eq!(v("onebit_program_cache_flushes_total", &[]), 2.0);
    assert_eq!(v("onebit_cpu_fallback_ops", &[("op", "MUL_MAT")]), 3.0);
    assert_eq!(v("onebit_cpu_fallback_ops", &[("op", "ROPE")]), 2.0);
    assert_eq!(v("onebit_cpu_fallback_ops", &[("op", "all")]), 5.0);
    assert_eq!(
        v("onebit_gtt_bytes", &[("kind", "total")]),
        (120u64 << 30) as f64
    );
    assert_eq!(
        v("onebit_gtt_bytes", &[("kind", "used")]),
        (96u64 << 30) as f64
    );
    assert_eq!(v("onebit_gtt_fault_zone", &[]), 1.0);
    assert_eq!(v("onebit_tctl_celsius", &[]), 71.5);
    // serve's own first, the backend's own (the fake's llamacpp: series) after them.
    let first_backend = s.iter().position(|x| x.name.starts_with("llamacpp:"));
    let last_own = s.iter().rposition(|x| x.name.starts_with("onebit_"));
    assert!(
        matches!((first_backend, last_own), (Some(b), Some(o)) if o < b),
        "{text}"
    );
    assert!(s.last().unwrap().name.starts_with("llamacpp:"), "{text}");
}

#[test]
fn metrics_leave_out_series_whose_source_never_appeared() {
    let dir = temp_dir("metrics-none");
    let model = dummy_model(&dir, "m.gguf");
    let empty = dir.join("empty-sys");
    std::fs::create_dir_all(&empty).unwrap();
    let state = dir.join("state");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("ONEBIT_SYSFS_ROOT", empty.to_str().unwrap()),
            ("ONEBIT_STATE_DIR", state.to_str().unwrap()),
        ],
    );
    serve.ready();
    let (text, s) = scrape(&serve);
    assert!(
        sample(&s, "onebit_up", &[("device", "cpu")]).is_some(),
        "{text}"
    );
    for absent in [
        "onebit_program_cache_flushes_total",
        "onebit_cpu_fallback_ops",
        "onebit_gtt_bytes",
        "onebit_gtt_fault_zone",
        "onebit_tctl_celsius",
    ] {
        assert!(!text.contains(absent), "{absent} has no source:\n{text}");
    }
}

#[test]
fn counters_survive_a_restart_and_a_corrupt_state_file_does_not_stop_serve() {
    let dir = temp_dir("metrics-state");
    let model = dummy_model(&dir, "m.gguf");
    let state = dir.join("state");
    let env = [("ONEBIT_STATE_DIR", state.to_str().unwrap())];
    let starts = |serve: &Serve| sample(&scrape(serve).1, "onebit_serve_starts_total", &[]);

    let mut serve = Serve::with_fake(&model, &[], &env);
    serve.ready();
    assert_eq!(starts(&serve), Some(1.0));
    serve.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(serve.wait_exit(SECS(10)).unwrap().code(), Some(0));

    // A backend that exits on its own is counted too.
    let mut serve = Serve::with_fake(&model, &[], &[env[0], ("FAKE_EXIT_AFTER_MS", "1500")]);
    serve.ready();
    assert_eq!(starts(&serve), Some(2.0));
    assert_eq!(serve.wait_exit(SECS(10)).unwrap().code(), Some(1));

    let serve = Serve::with_fake(&model, &[], &env);
    serve.ready();
    let s = scrape(&serve).1;
    assert_eq!(sample(&s, "onebit_serve_starts_total", &[]), Some(3.0));
    assert_eq!(sample(&s, "onebit_backend_exits_total", &[]), Some(1.0));
    drop(serve);

    // The state directory also holds the prompt cache's folder.
    let files: Vec<PathBuf> = std::fs::read_dir(&state)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    assert_eq!(files.len(), 1, "one file per model: {files:?}");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files[0]).unwrap()).unwrap();
    assert_eq!(saved["model"], "m", "the file names the model");
    std::fs::write(&files[0], b"{\"serve_starts\": tru").unwrap();

    let serve = Serve::with_fake(&model, &[], &env);
    serve.ready();
    assert!(
        serve.output().contains("warning: the state file")
            && serve.output().contains("is not valid"),
        "{}",
        serve.output()
    );
    assert_eq!(starts(&serve), Some(1.0), "counted again from a fresh file");
}
