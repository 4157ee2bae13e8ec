//! This repository's routes as route packages, made and installed by `1bit plugins package`
//! and `1bit plugins install`, as a vendor makes and a user installs theirs (docs/plugins.md).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{Failure, process};

/// Who ships this repository's packages, and under which license.
const VENDOR: &str = "1bit serve";
const LICENSE: &str = "MIT";

/// What a package holds besides its route library.
#[derive(Default)]
pub struct Contents<'a> {
    /// `--carry FILE=VERSION`: each file and its version.
    pub carry: &'a [(PathBuf, String)],
    /// `--variant FILE=OF:FEATURES`: each build and `OF:FEATURES`.
    pub variants: &'a [(PathBuf, String)],
    /// `--cpu-features`: what every file needs.
    pub cpu_features: &'a [String],
}

/// `ONEBIT plugins package LIBRARY --version VERSION --vendor "1bit serve" --license MIT
/// --carry FILE=V... --variant FILE=OF:F,... [--cpu-features F,...] --out OUT`: the archive's path (the command's last line; its other lines
/// are printed). `todo` is what the user does when it fails.
pub fn package(
    onebit: &Path,
    library: &Path,
    version: &str,
    contents: &Contents,
    out: &Path,
    todo: &str,
) -> Result<PathBuf, Failure> {
    let mut package = Command::new(onebit);
    package.args(["plugins", "package"]).arg(library).args([
        "--version",
        version,
        "--vendor",
        VENDOR,
        "--license",
        LICENSE,
    ]);
    for (file, version) in contents.carry {
        let mut pair = file.clone().into_os_string();
        pair.push(format!("={version}"));
        package.arg("--carry").arg(pair);
    }
    for (file, of_features) in contents.variants {
        let mut pair = file.clone().into_os_string();
        pair.push(format!("={of_features}"));
        package.arg("--variant").arg(pair);
    }
    if !contents.cpu_features.is_empty() {
        package
            .arg("--cpu-features")
            .arg(contents.cpu_features.join(","));
    }
    package.arg("--out").arg(out);
    let lines = run(&mut package, todo)?;
    // Its lines but the archive's path, which the subcommand prints last.
    for line in lines.iter().take(lines.len().saturating_sub(1)) {
        println!("{line}");
    }
    let archive = lines.last().map(PathBuf::from).unwrap_or_default();
    if !archive.is_file() {
        return Err(Failure::new(
            format!("`1bit plugins package` named no archive (its last line: {archive:?})"),
            "check host/src/packages.rs still prints the archive's path last",
        ));
    }
    Ok(archive)
}

/// `ONEBIT plugins install ARCHIVE --prefix PREFIX --allow-unsigned` (this repository's
/// packages are unsigned: no key of the project's is kept anywhere). Its line is printed.
pub fn install(onebit: &Path, archive: &Path, prefix: &Path, todo: &str) -> Result<(), Failure> {
    let mut install = Command::new(onebit);
    install
        .args(["plugins", "install"])
        .arg(archive)
        .arg("--prefix")
        .arg(prefix)
        .arg("--allow-unsigned");
    for line in run(&mut install, todo)? {
        println!("{line}");
    }
    Ok(())
}

/// Run `command`, its stdout captured (stderr passes through): its lines, or the failure.
fn run(command: &mut Command, todo: &str) -> Result<Vec<String>, Failure> {
    command.stdout(Stdio::piped());
    let output = command
        .spawn()
        .and_then(std::process::Child::wait_with_output)
        .map_err(|e| {
            Failure::new(
                format!("cannot run {}: {e}", process::describe(command)),
                "check that `cargo build -p onebit-host` made 1bit",
            )
        })?;
    let lines: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    if !output.status.success() {
        for line in &lines {
            println!("{line}");
        }
        return Err(Failure::new(
            format!(
                "`{}` failed ({})",
                process::describe(command),
                process::describe_status(output.status)
            ),
            todo,
        ));
    }
    Ok(lines)
}
