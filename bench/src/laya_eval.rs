//! `cargo xtask laya-eval`: the figures docs/laya.md reports for `1bit serve --laya`'s
//! rule-based classifier: its accuracy on the labelled sets under tests/, and the decision's
//! p50 on a first turn and on a later one, from the host's own test in a release build.

use std::process::ExitCode;

use crate::{Failure, Workspace, process};

pub fn run(ws: &Workspace) -> Result<ExitCode, Failure> {
    let mut test = process::cargo();
    test.current_dir(&ws.root).args([
        "test",
        "--release",
        "-p",
        "onebit-host",
        "laya::eval::figures",
        "--",
        "--ignored",
        "--nocapture",
    ]);
    process::run(
        &mut test,
        "the laya figures did not run: fix the errors above, then rerun",
    )?;
    Ok(ExitCode::SUCCESS)
}
