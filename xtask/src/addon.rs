//! `cargo xtask addon [--release]`: builds the inproc add-on (addons/inproc, outside the
//! workspace, with its own lock file) as a vendor builds an add-on, and prints its library's
//! path as the last line.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::{Failure, Workspace, process};

/// The add-on's manifest, relative to the repository.
const MANIFEST: &str = "addons/inproc/Cargo.toml";
/// The library cargo builds.
const LIBRARY: &str = "libonebit_route_inproc.so";

/// The subcommand: build, then print the path.
pub fn run(ws: &Workspace, rest: &[String]) -> Result<ExitCode, Failure> {
    let release = match rest {
        [] => false,
        [flag] if flag == "--release" => true,
        [other, ..] => {
            return Err(Failure::new(
                format!("`cargo xtask addon` does not take `{other}`"),
                "run `cargo xtask addon` or `cargo xtask addon --release`",
            ));
        }
    };
    let library = build(ws, release)?;
    println!("{}", library.display());
    Ok(ExitCode::SUCCESS)
}

/// Build the add-on (debug unless `release`) and return its library's path. Called by the
/// `addon` and `test` subcommands; blocks for the build.
pub fn build(ws: &Workspace, release: bool) -> Result<PathBuf, Failure> {
    let manifest = ws.root.join(MANIFEST);
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "--manifest-path"])
        .arg(&manifest);
    if release {
        cargo.arg("--release");
    }
    println!("==> {}", process::describe(&cargo));
    process::run(
        &mut cargo,
        "the inproc add-on does not build: fix the errors above, then rerun",
    )?;
    let profile = if release { "release" } else { "debug" };
    let library = ws
        .root
        .join("addons/inproc/target")
        .join(profile)
        .join(LIBRARY);
    if !library.is_file() {
        return Err(Failure::new(
            format!("the build finished but {} is missing", library.display()),
            "check addons/inproc/Cargo.toml's [lib] name and crate-type",
        ));
    }
    Ok(library)
}

/// fmt, clippy and the unit tests of the add-on, which `cargo ... --workspace` does not reach.
/// Called by `cargo xtask test` before its build.
pub fn check(ws: &Workspace) -> Result<(), Failure> {
    let manifest = ws.root.join(MANIFEST);
    for (args, todo) in [
        (
            vec!["fmt", "--manifest-path", "", "--", "--check"],
            "the add-on's formatting differs from rustfmt: run `cargo fmt --manifest-path addons/inproc/Cargo.toml`",
        ),
        (
            vec![
                "clippy",
                "--manifest-path",
                "",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
            "clippy found problems in the add-on: fix the warnings above, then rerun",
        ),
        (
            vec!["test", "--manifest-path", ""],
            "the add-on's unit tests failed: fix them, then rerun",
        ),
    ] {
        let mut cargo = process::cargo();
        cargo.current_dir(&ws.root);
        for arg in args {
            if arg.is_empty() {
                cargo.arg(&manifest);
            } else {
                cargo.arg(arg);
            }
        }
        println!("==> {}", process::describe(&cargo));
        process::run(&mut cargo, todo)?;
    }
    Ok(())
}
