//! The gateway a fleet of serves runs behind (docs/fleet.md, `cargo xtask fleet`): SMG, the
//! SGLang project's model gateway (PyPI `smg`, Apache-2.0, a binary wheel), one pinned wheel
//! checked against its sha256 and installed into a venv of its own in the cache (its
//! dependencies come from PyPI as pip resolves them). The wheel is built for x86-64 Linux.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::steps::{Gauge, Step};
use super::{PypiFile, fetch_from_pypi};
use crate::Failure;
use crate::cache::Layout;

/// The pinned gateway.
pub const PACKAGE: &str = "smg";
pub const VERSION: &str = "1.13.0";
const WHEEL: PypiFile<'static> = PypiFile {
    package: PACKAGE,
    version: VERSION,
    file_name: "smg-1.13.0-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    sha256: "cfae8171dac68a74b4822263b1864fa79952992ee472a25ba7266ccd200399b4",
    source: false,
};

/// `<cache>/venvs/smg-<version>`.
pub fn venv(layout: &Layout) -> PathBuf {
    layout
        .cache_dir
        .join("venvs")
        .join(format!("{PACKAGE}-{VERSION}"))
}

/// The gateway's command (`smg launch ...`).
pub fn smg(layout: &Layout) -> PathBuf {
    venv(layout).join("bin").join("smg")
}

/// Installs the pinned gateway into its venv unless it is there (a fraction of a second then).
/// Blocks on pip.
pub fn ensure(layout: &Layout) -> Result<PathBuf, Failure> {
    let python = venv(layout).join("bin").join("python");
    let check = format!(
        "import importlib.metadata as m, sys; sys.exit(m.version('{PACKAGE}') != '{VERSION}')"
    );
    let present = Command::new(&python)
        .args(["-c", &check])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present && smg(layout).is_file() {
        return Ok(smg(layout));
    }
    if std::env::consts::ARCH != "x86_64" {
        return Err(Failure::new(
            format!(
                "the pinned {PACKAGE} {VERSION} wheel is built for x86-64 Linux, not {}",
                std::env::consts::ARCH
            ),
            "run the fleet's gateway on an x86-64 machine, or install smg yourself (docs/fleet.md)",
        ));
    }
    let downloads = layout.downloads_dir();
    super::create_dir_all(&downloads)?;
    let todo = "check that python3 with venv and pip is installed and PyPI is reachable, then rerun `cargo xtask setup`";
    let log = layout.logs_dir().join("gateway.log");
    if !python.is_file() {
        let mut make = Command::new("python3");
        make.args(["-m", "venv"]).arg(venv(layout));
        let title = format!("making the venv {}", venv(layout).display());
        step(&title, &log, todo).run(&mut make)?;
    }
    let wheel = fetch_from_pypi(&WHEEL, &downloads, layout)?;
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "install", "--disable-pip-version-check"])
        .arg(&wheel);
    let title = format!("installing the gateway {PACKAGE} {VERSION} into its venv");
    step(&title, &log, todo).run(&mut pip)?;
    Ok(smg(layout))
}

fn step<'a>(title: &'a str, log: &Path, todo: &'a str) -> Step<'a> {
    Step {
        title,
        log: log.to_path_buf(),
        about: "",
        todo,
        gauge: Gauge::Time,
        tail: 10,
    }
}

/// The pinned gateway and its venv, in words, for setup's last lines.
pub fn versions() -> String {
    format!("the fleet's gateway {PACKAGE} {VERSION} (venv {PACKAGE}-{VERSION})")
}
