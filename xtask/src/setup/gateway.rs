//! The gateway a fleet of serves runs behind (docs/fleet.md, `cargo xtask fleet`): SMG, the
//! SGLang project's model gateway (PyPI `smg`, Apache-2.0, a binary wheel), one pinned wheel
//! checked against its sha256 and installed into a venv of its own in the cache (its
//! dependencies come from PyPI as pip resolves them). The wheel is built for x86-64 Linux.

use std::path::PathBuf;

use super::PypiFile;
use super::venv::Venv;
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
fn venv(layout: &Layout) -> Venv {
    Venv::new(layout, &format!("{PACKAGE}-{VERSION}"), "gateway.log")
}

/// The gateway's command (`smg launch ...`).
pub fn smg(layout: &Layout) -> PathBuf {
    venv(layout).bin("smg")
}

/// Installs the pinned gateway into its venv unless it is there (a fraction of a second then).
/// Blocks on pip.
pub fn ensure(layout: &Layout) -> Result<PathBuf, Failure> {
    let venv = venv(layout);
    let check = format!(
        "import importlib.metadata as m, sys; sys.exit(m.version('{PACKAGE}') != '{VERSION}')"
    );
    if venv.passes(&check) && smg(layout).is_file() {
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
    venv.install(layout, &[&WHEEL])?;
    Ok(smg(layout))
}

/// The pinned gateway and its venv, in words, for setup's last lines.
pub fn versions() -> String {
    format!("the fleet's gateway {PACKAGE} {VERSION} (venv {PACKAGE}-{VERSION})")
}
