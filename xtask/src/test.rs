//! `cargo xtask test`: what CI runs: fmt and clippy checks, setup, a debug build of every target, then the whole test suite against the real llama-server.

use std::io::{BufRead, BufReader};
use std::process::{ExitCode, Stdio};

use crate::{Failure, Workspace, addon, bench, process, setup, soak};

/// Stops at the first failing check (fmt, clippy, setup, build); otherwise runs
/// `cargo test --workspace --no-fail-fast [extra]`, then the hop regression check (`cargo
/// xtask bench hop --quick`: serve's added keep-alive p50 at most twice nginx's), the
/// one-minute soak (`cargo xtask soak --minutes 1`: its report's targets) and the short starved
/// soak (`cargo xtask soak --starved --minutes 0.5`), each counted as one more test, and fails
/// if any failed. The `N passed, N failed, N skipped` line is last.
///
/// The tests find the installed llama-server and default model through
/// `ONEBIT_TEST_LLAMA_SERVER` and `ONEBIT_TEST_MODEL`, the OpenAI SDK's python through
/// `ONEBIT_TEST_OPENAI_PYTHON`, llama.cpp's shared libraries through `ONEBIT_INPROC_LIB_DIR`.
/// The inproc add-on (outside the workspace) gets its own fmt and clippy checks and build.
pub fn run(ws: &Workspace, extra: &[String]) -> Result<ExitCode, Failure> {
    cargo_step(
        ws,
        &["fmt", "--all", "--", "--check"],
        "formatting differs from rustfmt: run `cargo fmt --all`, then rerun",
    )?;
    cargo_step(
        ws,
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        "clippy found problems: fix the warnings above, then rerun",
    )?;
    addon::check(ws)?;
    check_vendor_examples(ws)?;
    let installed = setup::run(ws)?;
    // Builds the `1bit` binary, the fake backend and every route cdylib, which the tests look for.
    cargo_step(
        ws,
        &["build", "--workspace", "--all-targets"],
        "the workspace does not build: fix the errors above, then rerun",
    )?;
    // The inproc add-on is outside the workspace: built here so its tests find it built.
    addon::build(ws, false)?;
    let model = ws.layout.model(ws.pins.default_model());
    let mut test = process::cargo();
    test.current_dir(&ws.root)
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(extra)
        .env("ONEBIT_TEST_LLAMA_SERVER", &installed.llama_server)
        .env("ONEBIT_TEST_MODEL", &model)
        .envs((installed.openai_python.iter()).map(|p| ("ONEBIT_TEST_OPENAI_PYTHON", p)))
        .envs((installed.llama_lib_dir.iter()).map(|d| ("ONEBIT_INPROC_LIB_DIR", d)))
        .envs((installed.agents_dir.iter()).map(|d| ("ONEBIT_TEST_AGENTS_DIR", d)))
        .stdout(Stdio::piped());
    let mut totals = Totals::default();
    let mut failed_tests = Vec::new();
    let status = pass_through(&mut test, &mut totals, &mut failed_tests)?;
    // The example vendor routes (outside the workspace) run their own tests, the last of each
    // packages and installs the example with the `1bit` just built (the engine example serves
    // it too).
    let mut status = status;
    for dir in VENDOR_EXAMPLES {
        let mut example = process::cargo();
        example
            .current_dir(ws.root.join(dir))
            .args(["test", "--no-fail-fast"])
            .env("ONEBIT_BIN", ws.root.join("target/debug/1bit"));
        let example_status = pass_through(&mut example, &mut totals, &mut failed_tests)?;
        if status.success() {
            status = example_status;
        }
    }
    println!();
    println!(
        "==> regression check: cargo xtask bench hop --quick (fails when serve's added keep-alive p50 exceeds 2 × nginx's)"
    );
    let check_passed = match bench::regression_check(ws, &crate::Prepared) {
        Ok(bench::Gate::Passed) => {
            println!("regression check: ok");
            totals.passed += 1;
            true
        }
        Ok(bench::Gate::Failed(breaches)) => {
            for line in breaches {
                println!("regression check FAILED: {line}");
            }
            totals.failed += 1;
            false
        }
        Ok(bench::Gate::Noisy(why)) => {
            // Not a pass: counted as skipped, and said.
            println!(
                "regression check SKIPPED: the machine was too busy to measure the hop: {why}"
            );
            totals.ignored += 1;
            true
        }
        Err(failure) => {
            println!("regression check FAILED: could not run: {failure}");
            totals.failed += 1;
            false
        }
    };
    println!();
    println!("==> soak, one minute: cargo xtask soak --minutes 1");
    let soak_passed = match soak::soak(ws, &crate::Prepared, 1.0) {
        Ok(true) => {
            totals.passed += 1;
            true
        }
        Ok(false) => {
            println!("soak FAILED: a target was missed (the report above)");
            totals.failed += 1;
            false
        }
        Err(failure) => {
            println!("soak FAILED: could not run: {failure}");
            totals.failed += 1;
            false
        }
    };
    println!();
    println!(
        "==> starved soak, half a minute of traffic: cargo xtask soak --starved --minutes {STARVED_MINUTES}"
    );
    let starved_passed = match soak::soak_starved(ws, &crate::Prepared, STARVED_MINUTES) {
        Ok(true) => {
            totals.passed += 1;
            true
        }
        Ok(false) => {
            println!("starved soak FAILED: a target was missed (the report above)");
            totals.failed += 1;
            false
        }
        Err(failure) => {
            println!("starved soak FAILED: could not run: {failure}");
            totals.failed += 1;
            false
        }
    };
    let check_passed = check_passed && soak_passed && starved_passed;
    println!();
    // Named again next to the total, where a CI log's tail shows them.
    for name in &failed_tests {
        println!("FAILED: {name}");
    }
    println!(
        "{} passed, {} failed, {} skipped",
        totals.passed, totals.failed, totals.ignored
    );
    Ok(if status.success() && !check_passed {
        ExitCode::FAILURE
    } else {
        process::exit_code(status)
    })
}

/// The starved soak's traffic in the suite: half a minute, so the whole starved run (the
/// stops and the worker's loss after it) stays near a minute and a half.
const STARVED_MINUTES: f64 = 0.5;

/// The example vendor routes' folders, each a crate of its own, checked and tested here too:
/// closed kernels answered in process (acme), and a closed engine program (zeta).
const VENDOR_EXAMPLES: [&str; 2] = ["examples/vendor-route", "examples/vendor-engine-route"];

/// Run `cargo test` as `command`, its report passed through, its `test result:` lines added
/// to `totals` (so the run ends with one total rather than the last crate's, often empty,
/// doc-test line) and its failed tests named in `failed`.
fn pass_through(
    command: &mut std::process::Command,
    totals: &mut Totals,
    failed: &mut Vec<String>,
) -> Result<std::process::ExitStatus, Failure> {
    command.stdout(Stdio::piped());
    println!("==> {}", process::describe(command));
    let mut child = command
        .spawn()
        .map_err(|e| Failure(format!("cannot run cargo test: {e}")))?;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            println!("{line}");
            totals.add(&line);
            if let Some(name) = failed_test(&line) {
                failed.push(name.to_string());
            }
        }
    }
    child
        .wait()
        .map_err(|e| Failure(format!("cannot wait for cargo test: {e}")))
}

/// fmt and clippy for each example vendor route, as for the workspace.
fn check_vendor_examples(ws: &Workspace) -> Result<(), Failure> {
    for example in VENDOR_EXAMPLES {
        for (args, todo) in [
            (
                &["fmt", "--", "--check"][..],
                format!(
                    "the example vendor route's formatting differs: run `cargo fmt` in {example}"
                ),
            ),
            (
                &["clippy", "--all-targets", "--", "-D", "warnings"][..],
                format!("clippy found problems in {example}: fix them, then rerun"),
            ),
        ] {
            let mut cargo = process::cargo();
            cargo.current_dir(ws.root.join(example)).args(args);
            println!("==> ({example}) cargo {}", args.join(" "));
            process::run(&mut cargo, &todo)?;
        }
    }
    Ok(())
}

/// The test a `test NAME ... FAILED` line of cargo test's report names.
fn failed_test(line: &str) -> Option<&str> {
    line.strip_prefix("test ")?.strip_suffix(" ... FAILED")
}

/// The sum of cargo test's `test result: ok. N passed; N failed; N ignored; ...` lines.
#[derive(Default, Debug, PartialEq)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Totals {
    fn add(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                _ => {}
            }
        }
    }
}

fn cargo_step(ws: &Workspace, args: &[&str], todo: &str) -> Result<(), Failure> {
    let mut cargo = process::cargo();
    cargo.current_dir(&ws.root).args(args);
    println!("==> cargo {}", args.join(" "));
    process::run(&mut cargo, todo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_tests_are_named() {
        assert_eq!(
            failed_test("test relay::streams ... FAILED"),
            Some("relay::streams")
        );
        assert_eq!(failed_test("test relay::streams ... ok"), None);
        assert_eq!(failed_test("test result: FAILED. 1 passed; 1 failed"), None);
    }

    #[test]
    fn totals_add_up_every_result_line() {
        let mut t = Totals::default();
        t.add("test result: ok. 16 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.64s");
        t.add("test result: FAILED. 2 passed; 1 failed; 3 ignored; 0 measured; 0 filtered out");
        t.add("running 3 tests");
        assert_eq!(
            t,
            Totals {
                passed: 18,
                failed: 1,
                ignored: 3
            }
        );
    }
}
