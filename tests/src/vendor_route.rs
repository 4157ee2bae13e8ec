//! The example vendor route (examples/vendor-route) for the tests: built with cargo from its
//! own manifest, as a vendor builds it, with its closed kernels library beside it.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::route_fixture::root;

/// The folder holding the built `libonebit_route_acme.so` and `libacme_kernels.so.1`
/// (built once per test run).
pub fn built() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let manifest = root().join("examples/vendor-route/Cargo.toml");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "--manifest-path"])
            .arg(&manifest)
            .status()
            .expect("cargo runs");
        assert!(status.success(), "the example vendor route builds");
        root().join("examples/vendor-route/target/debug")
    })
}
