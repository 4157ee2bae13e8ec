//! The Python SDKs the client tests drive `1bit serve` with, OpenAI's and Anthropic's: one
//! pinned wheel each from PyPI, checked against its sha256, installed into one virtual
//! environment in the cache (named after the OpenAI SDK, which came first).

use std::path::PathBuf;

use super::PypiFile;
use super::venv::Venv;
use crate::Failure;
use crate::cache::Layout;

/// The pinned SDK: its version and wheel, and the wheel's sha256 (its dependencies come from
/// PyPI as pip resolves them).
pub const PACKAGE: &str = "openai";
pub const VERSION: &str = "3.51.0";
const WHEEL: &str = "openai-3.51.0-py3-none-any.whl";
const WHEEL_SHA256: &str = "802b7e8c6ff8cf4d59a2a163126c10ce472adf0409ac41fdaadd47c9b4ed091a";

/// The pinned Anthropic SDK, for `/v1/messages` (same venv).
pub const ANTHROPIC_VERSION: &str = "2.16.0";
const ANTHROPIC_WHEEL: &str = "anthropic-2.16.0-py3-none-any.whl";
const ANTHROPIC_WHEEL_SHA256: &str =
    "fda498e294f8e29cda37862d8cdfa9721dd8ac9489b1c6d5fefadcd6f01d3b33";

/// Each pinned SDK: its wheel on PyPI, and the module that says its version.
const SDKS: [(PypiFile<'static>, &str); 2] = [
    (
        PypiFile {
            package: PACKAGE,
            version: VERSION,
            file_name: WHEEL,
            sha256: WHEEL_SHA256,
            source: false,
        },
        "openai",
    ),
    (
        PypiFile {
            package: "anthropic",
            version: ANTHROPIC_VERSION,
            file_name: ANTHROPIC_WHEEL,
            sha256: ANTHROPIC_WHEEL_SHA256,
            source: false,
        },
        "anthropic",
    ),
];

/// `<cache>/venvs/openai-<version>`.
fn venv(layout: &Layout) -> Venv {
    Venv::new(layout, &format!("{PACKAGE}-{VERSION}"), "python-sdks.log")
}

/// Installs the pinned SDKs into their venv unless they are there (a fraction of a second
/// then): the venv is made once, and each SDK whose pinned version it lacks is installed.
/// Blocks on pip.
pub fn ensure(layout: &Layout) -> Result<PathBuf, Failure> {
    let venv = venv(layout);
    let missing: Vec<&PypiFile<'_>> = SDKS
        .iter()
        .filter(|(file, module)| {
            !venv.passes(&format!(
                "import sys, {module}; sys.exit({module}.__version__ != '{}')",
                file.version
            ))
        })
        .map(|(file, _)| file)
        .collect();
    venv.install(layout, &missing)?;
    Ok(venv.python())
}

/// The pinned SDKs and their venv, in words, for setup's last lines.
pub fn versions() -> String {
    let names: Vec<String> = SDKS
        .iter()
        .map(|(file, _)| format!("{} {}", file.package, file.version))
        .collect();
    format!(
        "Python SDKs {} (venv {PACKAGE}-{VERSION})",
        names.join(", ")
    )
}
