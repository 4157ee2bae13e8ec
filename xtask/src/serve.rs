//! `cargo xtask serve`: set up, build 1bit in release mode, and replace this process with `1bit serve` on the default model.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use crate::cache::Layout;
use crate::setup::steps::{Gauge, Step};
use crate::{Failure, Workspace, process, setup};

const DEFAULT_HOST: &str = "127.0.0.1";
const DEFAULT_PORT: &str = "8000";

/// Runs setup and the release build, then execs `1bit serve -m <default model> --port 8000
/// --host 127.0.0.1 [args]`; a model, port or host in `args` replaces the default instead of
/// repeating the flag. Returns only on failure: on success the server owns this process, so
/// Ctrl-C and SIGTERM reach it directly and its exit status is the command's.
pub fn run(ws: &Workspace, args: &[String]) -> Result<ExitCode, Failure> {
    // Only what serving needs: the rest (the shared libraries, the tests' tools) is set up by
    // the commands that use it.
    setup::run_for(ws, setup::Needs::Serving)?;
    let binary = build_release(&ws.root, &ws.layout)?;
    let model = ws.pins.default_model();
    let mut server = Command::new(&binary);
    server.arg("serve");
    let name = match flag_value(args, &["-m", "--model"]) {
        Some(path) => Path::new(path).file_stem().map_or_else(
            || path.to_owned(),
            |stem| stem.to_string_lossy().into_owned(),
        ),
        None => {
            server.arg("-m").arg(ws.layout.model(model));
            model.name.clone()
        }
    };
    let port = flag_value(args, &["--port"]).unwrap_or_else(|| {
        server.args(["--port", DEFAULT_PORT]);
        DEFAULT_PORT
    });
    let host = flag_value(args, &["--host"]).unwrap_or_else(|| {
        server.args(["--host", DEFAULT_HOST]);
        DEFAULT_HOST
    });
    server.args(args);
    let url = format!("http://{host}:{port}");
    println!("serving {name} on {url}");
    println!(
        "try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France? Answer in one word.\"}}],\"temperature\":0}}'"
    );
    let err = server.exec();
    Err(Failure::new(
        format!("cannot start {}: {err}", binary.display()),
        "rerun `cargo xtask serve` to rebuild it",
    ))
}

/// Builds the workspace in release mode (one step line, cargo's output in
/// `<cache>/logs/cargo-build-release.log`) and returns the `1bit` executable under the target
/// folder cargo reports, which honours `CARGO_TARGET_DIR` and `build.target-dir` without this
/// code knowing about either.
fn build_release(root: &Path, layout: &Layout) -> Result<PathBuf, Failure> {
    let mut cargo = process::cargo();
    cargo
        .current_dir(root)
        .args(["build", "--release", "--workspace"]);
    Step {
        title: "building 1bit (cargo build --release --workspace)",
        about: "",
        log: layout.logs_dir().join("cargo-build-release.log"),
        todo: "fix the errors the log shows, then rerun `cargo xtask serve`",
        gauge: Gauge::Crates,
        tail: 40,
    }
    .run(&mut cargo)?;
    let mut metadata = process::cargo();
    metadata
        .current_dir(root)
        .args(["metadata", "--format-version", "1", "--no-deps"]);
    let out = metadata.output().map_err(|err| {
        Failure::new(
            format!("cannot start `{}`: {err}", process::describe(&metadata)),
            "check your Rust toolchain",
        )
    })?;
    let target = serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| v["target_directory"].as_str().map(PathBuf::from));
    let binary = target.map(|dir| dir.join("release").join("1bit"));
    binary.filter(|b| b.is_file()).ok_or_else(|| {
        Failure::new(
            "cargo built the workspace but its target folder has no release `1bit`",
            "check that host/Cargo.toml still declares the `1bit` [[bin]]",
        )
    })
}

/// The value the user gave for any of `names`, as `--name value` or `--name=value`; the last one wins.
fn flag_value<'a>(args: &'a [String], names: &[&str]) -> Option<&'a str> {
    let mut found = None;
    for (i, arg) in args.iter().enumerate() {
        for name in names {
            if arg == name {
                found = args.get(i + 1).map(String::as_str).or(found);
            } else if let Some(value) = arg
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('='))
            {
                found = Some(value);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::flag_value;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|arg| (*arg).to_owned()).collect()
    }

    #[test]
    fn user_flags_replace_the_defaults() {
        let args = strings(&["--port", "9000", "--host=0.0.0.0", "-m", "/m/x.gguf"]);
        assert_eq!(flag_value(&args, &["--port"]), Some("9000"));
        assert_eq!(flag_value(&args, &["--host"]), Some("0.0.0.0"));
        assert_eq!(flag_value(&args, &["-m", "--model"]), Some("/m/x.gguf"));
        assert_eq!(flag_value(&strings(&["--portal", "1"]), &["--port"]), None);
    }
}
