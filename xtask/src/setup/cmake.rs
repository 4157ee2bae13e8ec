//! The cmake that builds llama.cpp (from PATH, else one pip installs into the cache) and
//! whether a build folder is already configured with the flags asked for.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::steps::Step;
use crate::Failure;
use crate::cache::Layout;

/// cmake from PATH, else one installed with pip into `<cache>/tools/cmake` (a step line when
/// it is installed).
pub(super) fn find_cmake(layout: &Layout) -> Result<PathBuf, Failure> {
    if cmake_version(Path::new("cmake")).is_some() {
        return Ok(PathBuf::from("cmake"));
    }
    let target = layout.tools_dir().join("cmake");
    let locate = || {
        Command::new("python3")
            .env("PYTHONPATH", &target)
            .args(["-c", "import cmake; print(cmake.CMAKE_BIN_DIR)"])
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| {
                PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()).join("cmake")
            })
            .filter(|cmake| cmake.is_file())
    };
    let cmake = match locate() {
        Some(cmake) => cmake,
        None => {
            let mut pip = Command::new("python3");
            pip.args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--upgrade",
                "--target",
            ])
            .arg(&target)
            .arg("cmake");
            Step::short(
                &format!(
                    "cmake is not on PATH: installing it with pip into {}",
                    target.display()
                ),
                layout.logs_dir().join("pip-cmake.log"),
                "install cmake yourself (apt-get install cmake), then rerun `cargo xtask setup`",
            )
            .run(&mut pip)?;
            locate().ok_or_else(|| {
                Failure::new(
                    format!("pip installed cmake into {} but it cannot be found there", target.display()),
                    "install cmake yourself (apt-get install cmake), then rerun `cargo xtask setup`",
                )
            })?
        }
    };
    cmake_version(&cmake).ok_or_else(|| {
        Failure::new(
            format!("{} --version failed", cmake.display()),
            format!(
                "delete {} and install cmake yourself (apt-get install cmake)",
                target.display()
            ),
        )
    })?;
    Ok(cmake)
}

/// The first line of `cmake --version`, or `None` when it does not run.
fn cmake_version(cmake: &Path) -> Option<String> {
    let output = Command::new(cmake).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    output
        .status
        .success()
        .then(|| text.lines().next().unwrap_or("cmake").to_owned())
}

/// True when `build` was configured (generation finished) from `source` with every `-DNAME=VALUE` in `flags`.
///
/// Any other kind of flag cannot be checked against CMakeCache.txt, so it counts as not configured.
pub(super) fn is_configured(build: &Path, source: &Path, flags: &[String]) -> bool {
    let generated = build.join("Makefile").is_file() || build.join("build.ninja").is_file();
    let Ok(text) = fs::read_to_string(build.join("CMakeCache.txt")) else {
        return false;
    };
    // Lines read `NAME:TYPE=VALUE`.
    let cache: HashMap<&str, &str> = text
        .lines()
        .filter(|line| !line.starts_with(['#', '/']))
        .filter_map(|line| {
            let (key, value) = line.split_once('=')?;
            Some((key.split_once(':').map_or(key, |(name, _)| name), value))
        })
        .collect();
    let same_source = cache
        .get("CMAKE_HOME_DIRECTORY")
        .and_then(|home| fs::canonicalize(home).ok())
        .is_some_and(|home| fs::canonicalize(source).is_ok_and(|source| source == home));
    let flags_match = flags.iter().all(|flag| {
        flag.strip_prefix("-D")
            .and_then(|definition| definition.split_once('='))
            .is_some_and(|(key, value)| {
                let name = key.split_once(':').map_or(key, |(name, _)| name);
                cache.get(name) == Some(&value)
            })
    });
    generated && same_source && flags_match
}
