//! What `cargo xtask` measures, each the library side of its subcommand: `bench` (serve's hop
//! against llama-server direct and nginx, and the parts beside it), `soak` (mixed traffic and
//! faults), `llama_suite` (llama.cpp's server tests direct and through the drop-in),
//! `dashboard` (the Grafana dashboard's test, drawn) and `laya_eval` (the --laya classifier's
//! figures). xtask dispatches to them and lends them its setup and add-on build ([`Prepare`]).
#![forbid(unsafe_code)]

pub mod bench;
pub mod dashboard;
pub mod laya_eval;
pub mod llama_suite;
pub mod soak;

use std::path::PathBuf;

use xtask_support::{Failure, Workspace, process};

/// What the measurements need from xtask's own subcommands, which stay in xtask.
pub trait Prepare {
    /// `cargo xtask setup`: the pinned llama-server and models installed (fast when done).
    fn setup(&self, ws: &Workspace) -> Result<(), Failure>;
    /// `cargo xtask addon [--release]`: the inproc add-on built; its library's path.
    fn addon(&self, ws: &Workspace, release: bool) -> Result<PathBuf, Failure>;
    /// The pinned gateway a fleet runs behind (SMG, `setup::gateway`) installed; its command.
    fn gateway(&self, ws: &Workspace) -> Result<PathBuf, Failure>;
}
