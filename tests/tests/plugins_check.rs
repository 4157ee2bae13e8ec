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
fn every_route_of_this_repository_passes() {
    for name in ["cpu", "ds4", "hrx", "hybrid", "npu"] {
        let file = bin_dir().join(format!("libonebit_route_{name}.so"));
        let lines = assert_passes(&file, &[]);
        assert!(
            lines[1].starts_with(&format!("ok   info: {name}:")),
            "{lines:#?}"
        );
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
