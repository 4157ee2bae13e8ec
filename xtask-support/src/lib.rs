//! What `cargo xtask` (the dispatcher, setup, install) and its measurements (`onebit-bench`)
//! share: the repository and its pinned third-party files, child programs, the one-line failure.
#![forbid(unsafe_code)]

pub mod cache;
pub mod pins;
pub mod process;

use std::fmt;
use std::path::{Path, PathBuf};

use cache::Layout;
use pins::Pins;

/// Why a subcommand stopped: one line saying what failed and what to do about it.
#[derive(Debug)]
pub struct Failure(
    /// The line as the user reads it; [`Failure::new`] joins what failed and what to do.
    pub String,
);

impl Failure {
    /// Joins what failed and what to do into the one line the user reads.
    pub fn new(what: impl fmt::Display, todo: impl fmt::Display) -> Self {
        Failure(format!("{what}: {todo}"))
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The repository and where its pinned third-party files live on this machine.
pub struct Workspace {
    /// The cargo workspace root (the parent of `xtask/`, `xtask-support/` and `bench/`).
    pub root: PathBuf,
    pub pins: Pins,
    pub layout: Layout,
}

impl Workspace {
    /// Reads `third_party/pins.json` and resolves the cache directory from the environment.
    pub fn load() -> Result<Self, Failure> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask-support/ lies inside the workspace root")
            .to_path_buf();
        let pins = Pins::load(&root.join("third_party/pins.json"))?;
        let layout = Layout::new(cache::cache_dir(&pins.cache_dir_name)?, &pins);
        Ok(Workspace { root, pins, layout })
    }
}
