//! `cargo xtask install --service` and `--uninstall-service`: the systemd user unit of
//! `config/systemd/` written with the paths of an install, and its environment file beside it
//! (docs/service.md). Nothing here starts, stops or enables anything: it writes files and prints
//! the `systemctl --user` commands that start the service.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::Failure;

/// The unit's file name, and so the service's name.
pub const UNIT: &str = "1bit-serve.service";
/// The environment file's name, beside the unit.
pub const ENV: &str = "1bit-serve.env";
/// The first line of each file this writes: uninstall removes only files that carry it.
const MARK: &str = "# Written by `cargo xtask install --service`";
/// The variable of the environment file that names the model.
const MODEL_VAR: &str = "ONEBIT_MODEL=";

/// Where the service's two files go.
pub struct ServiceFiles {
    /// The folder of both: the user's systemd folder, or `PREFIX/lib/systemd/user`.
    pub dir: PathBuf,
    pub unit: PathBuf,
    pub env: PathBuf,
    /// Whether the user's systemd manager finds the unit there by its name (else it is
    /// enabled by its path, which links it in).
    pub on_search_path: bool,
}

impl ServiceFiles {
    /// With `--prefix DIR`, `DIR/lib/systemd/user` (where packages put user units; found by
    /// name for /usr and /usr/local); without, the user's own systemd folder,
    /// `$XDG_CONFIG_HOME/systemd/user` (`~/.config/systemd/user`).
    pub fn new(prefix: Option<&Path>) -> Result<ServiceFiles, Failure> {
        let (dir, on_search_path) = match prefix {
            Some(p) => (
                p.join("lib/systemd/user"),
                p == Path::new("/usr") || p == Path::new("/usr/local"),
            ),
            None => (user_config_dir()?.join("systemd/user"), true),
        };
        Ok(ServiceFiles {
            unit: dir.join(UNIT),
            env: dir.join(ENV),
            dir,
            on_search_path,
        })
    }

    /// What `systemctl --user` is given to enable the unit: its name, or its path.
    fn enable_target(&self) -> String {
        if self.on_search_path {
            UNIT.to_string()
        } else {
            self.unit.display().to_string()
        }
    }
}

fn user_config_dir() -> Result<PathBuf, Failure> {
    if let Some(dir) = std::env::var_os("XDG_CONFIG_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".config"))
        .ok_or_else(|| Failure::new("HOME is not set", "pass --prefix DIR"))
}

/// Write the unit (always rewritten, so a second run updates it) and the environment file (kept
/// with the user's settings when it exists; its `ONEBIT_MODEL=` line set when `model` is given
/// or the file is new). `one_bit` is the installed `1bit`; `default_model` the model a new file
/// names when no `--model` was given. Prints the files and the two commands that start it.
pub fn install(
    root: &Path,
    files: &ServiceFiles,
    one_bit: &Path,
    model: Option<&Path>,
    default_model: &Path,
) -> Result<(), Failure> {
    let model = match model {
        Some(m) => Some(fs::canonicalize(m).map_err(|e| {
            Failure::new(
                format!("--model {}: {e}", m.display()),
                "pass the path of a GGUF file (or an NPU model directory) that exists",
            )
        })?),
        None => None,
    };
    let shipped = |name: &str| {
        let path = root.join("config/systemd").join(name);
        fs::read_to_string(&path).map_err(|e| {
            Failure::new(
                format!("cannot read {}: {e}", path.display()),
                "run from a checkout of the repository",
            )
        })
    };
    let env = match fs::read_to_string(&files.env) {
        Ok(old) => match &model {
            Some(m) => with_model(&old, m),
            None => old,
        },
        Err(_) => with_model(&shipped(ENV)?, model.as_deref().unwrap_or(default_model)),
    };
    fs::create_dir_all(&files.dir).map_err(|e| {
        Failure::new(
            format!("cannot create {}: {e}", files.dir.display()),
            "pass a writable --prefix",
        )
    })?;
    // The unit names absolute paths: the manager's working directory is not this one.
    let env_path = fs::canonicalize(&files.dir)
        .map_err(|e| {
            Failure::new(
                format!("cannot resolve {}: {e}", files.dir.display()),
                "pass an absolute --prefix",
            )
        })?
        .join(ENV);
    write(
        &files.unit,
        &unit_text(&shipped(UNIT)?, one_bit, &env_path),
        0o644,
    )?;
    // It may hold an API key: readable by the user alone.
    write(&files.env, &env, 0o600)?;
    println!("installed the 1bit-serve user service (docs/service.md)");
    println!("  {}", files.unit.display());
    println!(
        "  {} (the model and settings: edit, then restart the service)",
        files.env.display()
    );
    println!("start it, now and at each login:");
    println!("  systemctl --user daemon-reload");
    println!("  systemctl --user enable --now {}", files.enable_target());
    Ok(())
}

/// Remove the unit and the environment file this wrote (each only if it carries [`MARK`]);
/// nothing else, not the folder, not the binaries.
pub fn uninstall(files: &ServiceFiles) -> Result<(), Failure> {
    let mut removed = Vec::new();
    for path in [&files.unit, &files.env] {
        let Ok(text) = fs::read_to_string(path) else {
            continue;
        };
        if !text.starts_with(MARK) {
            println!(
                "left {}: `cargo xtask install --service` did not write it",
                path.display()
            );
            continue;
        }
        fs::remove_file(path).map_err(|e| {
            Failure::new(
                format!("cannot remove {}: {e}", path.display()),
                "check permissions",
            )
        })?;
        removed.push(path);
    }
    if removed.is_empty() {
        println!(
            "no 1bit-serve service files in {}: nothing to remove",
            files.dir.display()
        );
        return Ok(());
    }
    println!("removed the 1bit-serve user service files:");
    for path in removed {
        println!("  {}", path.display());
    }
    println!("if it was enabled, stop it and forget it:");
    println!("  systemctl --user disable --now {UNIT}");
    println!("  systemctl --user daemon-reload");
    Ok(())
}

/// The shipped unit with the install's paths in place of its `%h/.local/bin/1bit` and
/// `%E/systemd/user/1bit-serve.env`, under [`MARK`].
fn unit_text(shipped: &str, one_bit: &Path, env: &Path) -> String {
    let body = shipped
        .replace("%h/.local/bin/1bit", &one_bit.display().to_string())
        .replace(
            &format!("%E/systemd/user/{ENV}"),
            &env.display().to_string(),
        );
    format!("{MARK}; `cargo xtask install --uninstall-service` removes it.\n{body}")
}

/// `env` with its `ONEBIT_MODEL=` line naming `model` (added when it has none), under
/// [`MARK`] (added when it lacks it).
fn with_model(env: &str, model: &Path) -> String {
    let line = format!("{MODEL_VAR}{}", model.display());
    let mut lines: Vec<String> = env.lines().map(str::to_string).collect();
    match lines.iter_mut().find(|l| l.starts_with(MODEL_VAR)) {
        Some(l) => *l = line,
        None => lines.push(line),
    }
    if !lines.first().is_some_and(|l| l.starts_with(MARK)) {
        lines.insert(
            0,
            format!("{MARK}; `cargo xtask install --uninstall-service` removes it."),
        );
    }
    lines.join("\n") + "\n"
}

/// Write through a temporary sibling and a rename, so the manager never reads half a file.
fn write(path: &Path, text: &str, mode: u32) -> Result<(), Failure> {
    let temp = path.with_extension("installing");
    fs::write(&temp, text)
        .and_then(|()| fs::set_permissions(&temp, fs::Permissions::from_mode(mode)))
        .and_then(|()| fs::rename(&temp, path))
        .map_err(|e| {
            Failure::new(
                format!("cannot write {}: {e}", path.display()),
                "pass a writable --prefix",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_names_the_installed_paths_and_no_specifier_of_the_shipped_one() {
        let shipped = "ExecStart=%h/.local/bin/1bit serve -m ${ONEBIT_MODEL}\nEnvironmentFile=%E/systemd/user/1bit-serve.env\n";
        let text = unit_text(
            shipped,
            Path::new("/opt/1b/bin/1bit"),
            Path::new("/opt/1b/lib/systemd/user/1bit-serve.env"),
        );
        assert!(text.starts_with(MARK), "{text}");
        assert!(text.contains("ExecStart=/opt/1b/bin/1bit serve -m ${ONEBIT_MODEL}\n"));
        assert!(text.contains("EnvironmentFile=/opt/1b/lib/systemd/user/1bit-serve.env\n"));
    }

    #[test]
    fn the_model_line_is_replaced_and_the_rest_kept() {
        let env = format!("{MARK}\n# a comment\nONEBIT_MODEL=/old.gguf\nONEBIT_API_KEY=k\n");
        let new = with_model(&env, Path::new("/new.gguf"));
        assert_eq!(
            new,
            format!("{MARK}\n# a comment\nONEBIT_MODEL=/new.gguf\nONEBIT_API_KEY=k\n")
        );
        let added = with_model("ONEBIT_API_KEY=k\n", Path::new("/m.gguf"));
        assert!(added.starts_with(MARK), "{added}");
        assert!(
            added.ends_with("ONEBIT_API_KEY=k\nONEBIT_MODEL=/m.gguf\n"),
            "{added}"
        );
    }
}
