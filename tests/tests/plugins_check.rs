//! `1bit plugins check FILE`: every route of this repository, the in-process fixture and the
//! inproc add-on pass it; a file that is not a route and a route that misbehaves fail it, one
//! line per check, exit 1.

use std::path::Path;
use std::process::Command;

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
    let dir = route_fixture::Fixture::current(
        "inproc",
        "tests/fixtures/inproc-route/src/lib.rs",
        onebit_plugin_api::ABI_VERSION,
    )
    .build();
    let lines = assert_passes(&dir.join("libonebit_route_inproc.so"), &[]);
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
