//! `1bit plugins check FILE`: every route of this repository, the in-process fixture and the
//! inproc add-on pass it; a file that is not a route and a route that misbehaves fail it, one
//! line per check, exit 1. `--route-opt` reaches the route's plan as serve passes it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use onebit_tests::inproc_addon::{libraries_installed, plugin_dir};
use onebit_tests::*;

/// `1bit plugins check FILE [ARGS]`: its exit status and its lines.
fn check(file: &Path, args: &[&str]) -> (Option<i32>, Vec<String>) {
    let output = Command::new(onebit())
        .args(["plugins", "check"])
        .arg(file)
        .args(args)
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    (output.status.code(), lines)
}

/// The in-process fixture route, built once for the tests that check it.
fn inproc_fixture() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        route_fixture::Fixture::current(
            "inproc",
            "tests/fixtures/inproc-route/src/lib.rs",
            onebit_plugin_api::ABI_VERSION,
        )
        .build()
    })
}

fn assert_passes(file: &Path, args: &[&str]) -> Vec<String> {
    let (code, lines) = check(file, args);
    assert_eq!(code, Some(0), "{}: {lines:#?}", file.display());
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("ok   ") || l.starts_with("skip ")),
        "{lines:#?}"
    );
    lines
}

#[test]
fn every_route_of_this_repository_passes_or_says_its_plan_needs_a_model_it_serves() {
    // Without -m, the cpu, hrx and hybrid routes plan the fixture file (their plans run child
    // processes, so the plan is all there is to check); the npu route refuses a file that is
    // not an NPU model directory, and ds4 refuses without ds4-server: nothing beyond the plan
    // was checked, exit 2.
    for name in ["cpu", "ds4", "hrx", "hybrid", "npu"] {
        let file = bin_dir().join(format!("libonebit_route_{name}.so"));
        let (code, lines) = check(&file, &[]);
        assert!(
            lines[1].starts_with(&format!("ok   info: {name}:")),
            "{lines:#?}"
        );
        assert!(
            lines[..lines.len() - 1]
                .iter()
                .all(|l| l.starts_with("ok   ") || l.starts_with("skip ")),
            "{lines:#?}"
        );
        let refused = lines.iter().any(|l| l.starts_with("ok   plan: refused "));
        if refused {
            assert_eq!(code, Some(2), "{name}: {lines:#?}");
            assert_eq!(
                lines.last().unwrap(),
                &format!(
                    "nothing beyond plan was checked: pass -m MODEL with a model the {name} route serves"
                ),
                "{lines:#?}"
            );
        } else {
            assert_eq!(code, Some(0), "{name}: {lines:#?}");
        }
        if ["cpu", "hrx", "hybrid"].contains(&name) {
            assert!(!refused, "{name} plans the fixture: {lines:#?}");
        }
    }
}

#[test]
fn the_in_process_fixture_passes_every_answer_check_and_its_panic_is_contained() {
    let lines = assert_passes(&inproc_fixture().join("libonebit_route_inproc.so"), &[]);
    for check in [
        "whole answer",
        "streamed answer",
        "slow reader",
        "client leaves",
        "panic contained",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("ok   {check}:"))),
            "{check}: {lines:#?}"
        );
    }
}

#[test]
fn the_inproc_addon_passes_with_a_real_model() {
    if !libraries_installed("the_inproc_addon_passes_with_a_real_model") {
        return;
    }
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let lines = assert_passes(
        &plugin_dir().join("libonebit_route_inproc.so"),
        &["-m", model.to_str().unwrap()],
    );
    for check in [
        "start",
        "health",
        "whole answer",
        "streamed answer",
        "slow reader",
        "client leaves",
        "bad input",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("ok   {check}:"))),
            "{check}: {lines:#?}"
        );
    }
}

#[test]
fn a_file_that_is_not_a_route_and_a_misbehaving_route_fail() {
    let dir = temp_dir("check-not-a-route");
    let file = dir.join("libonebit_route_fake.so");
    std::fs::write(&file, b"not a library").unwrap();
    let (code, lines) = check(&file, &[]);
    assert_eq!(code, Some(1), "{lines:#?}");
    assert!(lines[0].starts_with("FAIL load: "), "{lines:#?}");

    let dir = route_fixture::Fixture::current(
        "unruly",
        "tests/fixtures/unruly-route/src/lib.rs",
        onebit_plugin_api::ABI_VERSION,
    )
    .build();
    let (code, lines) = check(&dir.join("libonebit_route_unruly.so"), &[]);
    assert_eq!(code, Some(1), "{lines:#?}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("FAIL whole answer: the body is not JSON")),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("FAIL client leaves: the route sent 4 more times")),
        "{lines:#?}"
    );
    assert_eq!(lines.last().unwrap(), "2 checks failed", "{lines:#?}");
}

#[test]
fn a_route_of_abi_1_4_is_checked_through_its_own_sink_and_cannot_be_asked_to_panic() {
    // The unruly route built against the frozen 1.4 API: its sink is 1.4's (no client_gone),
    // its stream passes, and the panic check says why it cannot run.
    let dir = route_fixture::Fixture {
        name: "unruly14",
        route_source: route_fixture::root().join("tests/fixtures/unruly-route/src/lib.rs"),
        api_source: route_fixture::root().join("tests/fixtures/plugin-api-1.4/src"),
        api_version: "1.4.0",
    }
    .build();
    let (code, lines) = check(&dir.join("libonebit_route_unruly14.so"), &[]);
    assert_eq!(code, Some(1), "{lines:#?}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("ok   streamed answer: 6 sends ending in data: [DONE]")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(|l| l
            == "skip panic contained: the route was built against route ABI 1.4.0; rebuild it against onebit-plugin-api 1.5 or later for this check"),
        "{lines:#?}"
    );
}

#[test]
fn without_a_model_the_route_serves_the_check_exits_2_saying_to_pass_one() {
    // The npu route refuses the fixture file (not an NPU model directory), so nothing beyond
    // its plan is checked.
    let file = bin_dir().join("libonebit_route_npu.so");
    let (code, lines) = check(&file, &[]);
    assert_eq!(code, Some(2), "{lines:#?}");
    assert_eq!(
        lines.last().unwrap(),
        "nothing beyond plan was checked: pass -m MODEL with a model the npu route serves",
        "{lines:#?}"
    );
}

#[test]
fn route_options_reach_the_plan_as_serve_passes_them() {
    // Options the route takes: every check passes with them.
    let inproc = inproc_fixture().join("libonebit_route_inproc.so");
    assert_passes(
        &inproc,
        &["--route-opt", "pace_ms=1", "--route-opt", "event_bytes=3"],
    );
    // A value the route refuses, and a key a route does not know: the route's own one-line
    // refusal, so the option reached its plan; nothing beyond it was checked (exit 2).
    let cpu = bin_dir().join("libonebit_route_cpu.so");
    for (file, option, refusal, route) in [
        (
            &inproc,
            "pace_ms=soon",
            "route option pace_ms=soon: not a whole number; pass one such as pace_ms=10",
            "inproc",
        ),
        (
            &cpu,
            "threads=4",
            "--route-opt threads=4: the cpu route has no option threads; it takes no options",
            "cpu",
        ),
    ] {
        let (code, lines) = check(file, &["--route-opt", option]);
        assert_eq!(code, Some(2), "{lines:#?}");
        assert!(
            lines.iter().any(|l| l.starts_with("ok   plan: refused ")
                && l.ends_with(&format!("(exit 2): {refusal}"))),
            "{lines:#?}"
        );
        assert_eq!(
            lines.last().unwrap(),
            &format!(
                "nothing beyond plan was checked: pass -m MODEL with a model the {route} route serves, and --route-opt only with options it takes"
            ),
            "{lines:#?}"
        );
    }
    // Not KEY=VALUE: serve's own refusal, on stderr, before the route is loaded.
    let out = Command::new(onebit())
        .args(["plugins", "check"])
        .arg(&cpu)
        .args(["--route-opt", "threads"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "{}", output_text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "1bit plugins check: --route-opt threads: not KEY=VALUE; pass it as --route-opt KEY=VALUE\n"
    );
}

#[test]
fn route_options_to_a_route_older_than_1_2_are_refused_as_serve_refuses_them() {
    let dir = route_fixture::Fixture {
        name: "check10",
        route_source: route_fixture::root().join("tests/fixtures/route/src/lib.rs"),
        api_source: route_fixture::root().join("tests/fixtures/plugin-api-1.0/src"),
        api_version: "1.0.0",
    }
    .build();
    let out = Command::new(onebit())
        .args(["plugins", "check"])
        .arg(dir.join("libonebit_route_check10.so"))
        .args(["--route-opt", "x=1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "1bit plugins check: --route-opt: the check10 route was built against route ABI 1.0.0, which takes no route options; remove --route-opt or rebuild the route against onebit-plugin-api 1.2 or later\n"
    );
}

#[test]
fn a_child_process_route_is_checked_through_serve_with_the_fake_backend_standing_in() {
    let dir = temp_dir("check-through-serve");
    let model = dir.join("model.gguf");
    let stub = Command::new(onebit())
        .args(["gguf", "stub"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(stub.status.success(), "{}", output_text(&stub));
    let lines = assert_passes(
        &bin_dir().join("libonebit_route_cpu.so"),
        &["-m", model.to_str().unwrap()],
    );
    let line = |check: &str| {
        lines
            .iter()
            .find(|l| l.starts_with(&format!("ok   {check}:")))
            .unwrap_or_else(|| panic!("{check}: {lines:#?}"))
            .clone()
    };
    // What the plan runs, and that the fake started with the plan's own arguments.
    assert!(line("backend 0").contains(" -m "), "{lines:#?}");
    let started = line("backend start");
    assert!(started.contains("fake-backend -m "), "{started}");
    assert!(started.contains(model.to_str().unwrap()), "{started}");
    // serve's relay carried a whole chat and a stream from the fake.
    assert!(
        line("relayed chat").contains("fake reply to: Say hello."),
        "{lines:#?}"
    );
    assert!(
        line("relayed stream").contains("ending in data: [DONE]"),
        "{lines:#?}"
    );
    assert!(line("health").contains("200"), "{lines:#?}");
    line("metrics");
    line("stop");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_package_is_checked_whole_and_a_changed_file_fails_it() {
    let dir = temp_dir("check-package");
    let built = vendor_route::built();
    let kernels = format!("{}=1.0.3", built.join("libacme_kernels.so.1").display());
    let out = Command::new(onebit())
        .args(["plugins", "package"])
        .arg(built.join("libonebit_route_acme.so"))
        .args([
            "--version",
            "1.2.0",
            "--vendor",
            "Acme NPU Inc.",
            "--license",
            "MIT",
        ])
        .args(["--carry", &kernels, "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let model = dir.join("model.gguf");
    let stub = Command::new(onebit())
        .args(["gguf", "stub"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(stub.status.success(), "{}", output_text(&stub));
    let m = model.to_str().unwrap();
    for package in [dir.join("acme-1.2.0"), dir.join("acme-1.2.0.tar.gz")] {
        let lines = assert_passes(&package, &["-m", m]);
        for check in [
            "manifest",
            "checksums",
            "load",
            "whole answer",
            "streamed answer",
        ] {
            assert!(
                lines
                    .iter()
                    .any(|l| l.starts_with(&format!("ok   {check}:"))),
                "{check}: {lines:#?}"
            );
        }
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("skip signature: unsigned")),
            "{lines:#?}"
        );
    }
    let kernels = dir.join("acme-1.2.0/libacme_kernels.so.1");
    let mut bytes = std::fs::read(&kernels).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&kernels, bytes).unwrap();
    let (code, lines) = check(&dir.join("acme-1.2.0"), &["-m", m]);
    assert_eq!(code, Some(1), "{lines:#?}");
    assert!(
        lines[0].starts_with("FAIL package: package acme 1.2.0")
            && lines[0].contains("libacme_kernels.so.1's sha256 does not match its manifest"),
        "{lines:#?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
