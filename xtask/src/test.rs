//! `cargo xtask test`: what CI runs: fmt and clippy checks, setup, a debug build of every target, then the whole test suite against the real llama-server.

use std::process::ExitCode;

use crate::{Failure, Workspace, process, setup};

/// Stops at the first failing check (fmt, clippy, setup, build); otherwise runs
/// `cargo test --workspace --no-fail-fast [extra]` and returns its exit status.
///
/// The tests find the installed llama-server and default model through
/// `ONEBIT_TEST_LLAMA_SERVER` and `ONEBIT_TEST_MODEL`.
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
    let installed = setup::run(ws)?;
    // Builds the `1bit` binary, the fake backend and every route cdylib, which the tests look for.
    cargo_step(
        ws,
        &["build", "--workspace", "--all-targets"],
        "the workspace does not build: fix the errors above, then rerun",
    )?;
    let model = ws.layout.model(ws.pins.default_model());
    let mut test = process::cargo();
    test.current_dir(&ws.root)
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(extra)
        .env("ONEBIT_TEST_LLAMA_SERVER", &installed.llama_server)
        .env("ONEBIT_TEST_MODEL", &model);
    println!("==> {}", process::describe(&test));
    Ok(process::exit_code(process::status(&mut test)?))
}

fn cargo_step(ws: &Workspace, args: &[&str], todo: &str) -> Result<(), Failure> {
    let mut cargo = process::cargo();
    cargo.current_dir(&ws.root).args(args);
    println!("==> cargo {}", args.join(" "));
    process::run(&mut cargo, todo)
}
