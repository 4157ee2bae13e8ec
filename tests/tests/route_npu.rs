//! The npu route on fixture NPU model directories: it claims one under `--device auto`, checks
//! for the NPU (an amdxdna accel device, from a fixture sysfs) and the kernels, refuses in one
//! line what it cannot serve, exits 5 for `--print-backend`, says that the Qwen3.6-35B-A3B route
//! is not part of this build, and gives way to an add-on route that claims the directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use onebit_tests::*;

/// An NPU model directory of `model_type`, with its kernels when `kernels`.
fn npu_dir(parent: &Path, name: &str, model_type: &str, kernels: bool) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.q4nx"), b"Q4NX tiles").unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!(r#"{{"model_type":"{model_type}"}}"#),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
    if kernels {
        std::fs::create_dir_all(dir.join("npu")).unwrap();
        for k in ["layer_ctx1.elf", "lmhead.elf", "layer.pdi"] {
            std::fs::write(dir.join("npu").join(k), b"kernel").unwrap();
        }
    }
    dir
}

/// A sysfs root with an accel device bound to `driver`.
fn sysfs_with(parent: &Path, driver: &str) -> PathBuf {
    let root = parent.join("sys");
    let drivers = root.join("bus/pci/drivers").join(driver);
    std::fs::create_dir_all(&drivers).unwrap();
    let device = root.join("class/accel/accel0/device");
    std::fs::create_dir_all(&device).unwrap();
    std::os::unix::fs::symlink(&drivers, device.join("driver")).unwrap();
    root
}

/// serve run to its end (bounded): (exit code, everything it printed).
fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut serve = Serve::start(args, env);
    let code = serve
        .wait_exit(Duration::from_secs(10))
        .and_then(|s| s.code())
        .unwrap_or(-1);
    (code, serve.output())
}

#[test]
fn the_npu_route_claims_a_model_directory_and_refuses_what_it_cannot_serve() {
    let tmp = temp_dir("npu");
    let with = npu_dir(&tmp, "Qwen3-0.6B-NPU", "qwen3", true);
    let without = npu_dir(&tmp, "Qwen3-0.6B-nokernels", "qwen3", false);
    let no_npu = tmp.join("empty-sys");
    std::fs::create_dir_all(&no_npu).unwrap();
    let npu = sysfs_with(&tmp, "amdxdna");
    let other = sysfs_with(&tmp.join("other"), "i915");

    let (code, out) = run(
        &["-m", with.to_str().unwrap()],
        &[("ONEBIT_SYSFS_ROOT", no_npu.to_str().unwrap())],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("1bit serve: --device auto chose npu (an NPU model directory (model.q4nx))"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "1bit serve: no NPU: no accel device bound to amdxdna under {}/class/accel; load the amdxdna driver",
            no_npu.display()
        )),
        "{out}"
    );
    // An accel device of another driver is no NPU either.
    let (code, out) = run(
        &["-m", with.to_str().unwrap(), "--device", "npu"],
        &[("ONEBIT_SYSFS_ROOT", other.to_str().unwrap())],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("no NPU: no accel device bound to amdxdna"),
        "{out}"
    );

    let (code, out) = run(
        &["-m", without.to_str().unwrap(), "--device", "npu"],
        &[("ONEBIT_SYSFS_ROOT", npu.to_str().unwrap())],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("/npu: the NPU kernels layer_ctx1.elf, lmhead.elf, layer.pdi are missing; copy the model's npu/ folder"),
        "{out}"
    );

    let (code, out) = run(
        &["-m", with.to_str().unwrap(), "--device", "npu"],
        &[("ONEBIT_SYSFS_ROOT", npu.to_str().unwrap())],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("the NPU lane runtime (XRT) is not part of this build yet (accel0 found, kernels present)"),
        "{out}"
    );

    let gguf = dummy_model(&tmp, "m.gguf");
    let (code, out) = run(&["-m", gguf.to_str().unwrap(), "--device", "npu"], &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("--device npu serves an NPU model directory"),
        "{out}"
    );

    let (code, out) = run(
        &[
            "-m",
            with.to_str().unwrap(),
            "--device",
            "npu",
            "--npu-opt",
            "lane=fast",
        ],
        &[],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("--npu-opt lane=fast: the npu route has no option lane; it takes no options"),
        "{out}"
    );
}

#[test]
fn print_backend_exits_5_on_the_npu_route() {
    let tmp = temp_dir("npu-print");
    let dir = npu_dir(&tmp, "m-npu", "qwen3", true);
    let gguf = dummy_model(&tmp, "m.gguf");
    for model in [&dir, &gguf] {
        let out = Command::new(onebit())
            .args(["serve", "-m"])
            .arg(model)
            .args(["--device", "npu", "--port", "8001", "--print-backend"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(5), "{stderr}");
        assert!(out.stdout.is_empty());
        assert!(
            stderr.contains("needs 1bit serve in the request path"),
            "{stderr}"
        );
    }
}

/// The add-on fixture route, built once per run.
fn add_on() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        route_fixture::Fixture::current(
            "npuaddon",
            "tests/fixtures/npu-addon/src/lib.rs",
            onebit_plugin_api::ABI_VERSION,
        )
        .build()
    })
}

#[test]
fn a_qwen3_5_moe_directory_needs_the_add_on_which_outranks_the_npu_route() {
    let tmp = temp_dir("npu-35b");
    let dir = npu_dir(&tmp, "Qwen3.6-35B-A3B-NPU", "qwen3_5_moe", true);
    let (code, out) = run(&["-m", dir.to_str().unwrap()], &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(
            "the Qwen3.6-35B-A3B NPU route is not part of this build; add the NPU add-on route"
        ),
        "{out}"
    );

    let plugins = add_on();
    let listing = Command::new(onebit())
        .args(["plugins", "--plugin-dir"])
        .arg(plugins)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("npu ") && l.contains("loaded: ")),
        "{listing}"
    );
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with("npuaddon ") && l.contains("loaded: ")),
        "{listing}"
    );

    // The public routes' folder first, so the npu route is found before the add-on: the
    // add-on wins by its stronger claim, not by being found first.
    let serve = Serve::start(
        &[
            "-m",
            dir.to_str().unwrap(),
            "--plugin-dir",
            bin_dir().to_str().unwrap(),
            "--plugin-dir",
            plugins.to_str().unwrap(),
            "--npu-opt",
            "experts=8",
        ],
        &[],
    );
    serve.ready();
    assert!(
        serve
            .output()
            .contains("--device auto chose npuaddon (a qwen3_5_moe NPU model directory)"),
        "{}",
        serve.output()
    );
    let (status, body) = post(&serve.url("/v1/chat/completions"), r#"{"messages":[]}"#);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("add-on answer, experts=8"), "{body}");
    assert!(body.contains(r#""model":"Qwen3.6-35B-A3B-NPU""#), "{body}");
}
