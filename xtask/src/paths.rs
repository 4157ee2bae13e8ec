//! `cargo xtask paths`: where setup puts things, as `name=value` lines, for scripts and the test support library.

use std::io::Write;
use std::process::ExitCode;

use crate::Workspace;

/// Prints `cache_dir`, `llama_server` and `model` (the default model); installs nothing and
/// does not check that the files exist.
pub fn run(ws: &Workspace) -> ExitCode {
    let layout = &ws.layout;
    let text = format!(
        "cache_dir={}\nllama_server={}\nmodel={}\n",
        layout.cache_dir.display(),
        layout.llama_server().display(),
        layout.model(ws.pins.default_model()).display()
    );
    // A reader that stops early (`| head -1`) is not an error worth a panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    ExitCode::SUCCESS
}
