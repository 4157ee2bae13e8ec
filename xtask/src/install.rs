//! `cargo xtask install [--prefix DIR] [--debug] [--service [--model PATH]]`: installs `1bit`
//! like a program: the binary, the `llama-server` name linked to it (what Lemonade's
//! `LEMONADE_LLAMACPP_CPU_BIN` points at), its routes (as route packages, through `1bit
//! plugins package` and `install`), the fake backend `1bit plugins check` uses, and the pinned
//! llama-server it runs,
//! under one prefix (docs/lemonade.md); with `--service`, the systemd user unit that runs it
//! (service.rs, docs/service.md). `--uninstall-service [--prefix DIR]` removes that unit.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::service::{self, ServiceFiles};
use crate::{Failure, Workspace, process, setup};

/// The route libraries, by cargo package.
const ROUTES: [&str; 5] = [
    "onebit-route-cpu",
    "onebit-route-hrx",
    "onebit-route-hybrid",
    "onebit-route-ds4",
    "onebit-route-npu",
];

/// Programs beside `1bit` in `bin/`: the hybrid route's prefill provider (built with its
/// package), named with `--prefill-provider`.
const PROGRAMS: [&str; 1] = ["1bit-prefill-llama"];

/// The fake backend (package onebit-tests), installed beside `1bit` under this name: what
/// `1bit plugins check` runs a child-process route's backends with (docs/fake-backend.md).
const FAKE_BACKEND: &str = "1bit-fake-backend";

/// Where each part goes under the prefix.
pub struct Layout {
    pub bin: PathBuf,
    pub plugins: PathBuf,
    /// The real llama-server, apart from `bin/` so the `llama-server` link never shadows it.
    pub llama_server_dir: PathBuf,
}

impl Layout {
    pub fn new(prefix: &Path) -> Self {
        Layout {
            bin: prefix.join("bin"),
            plugins: prefix.join("lib/1bit/plugins"),
            llama_server_dir: prefix.join("lib/1bit/llama-server"),
        }
    }
}

/// Builds (release unless `--debug`), runs setup for the pinned llama-server, and copies
/// everything under the prefix. Blocks for the build.
pub fn run(ws: &Workspace, args: &[String]) -> Result<ExitCode, Failure> {
    let mut prefix: Option<PathBuf> = None;
    let mut release = true;
    let mut with_service = false;
    let mut uninstall_service = false;
    let mut model: Option<PathBuf> = None;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--prefix" => {
                let dir = rest.next().ok_or_else(|| {
                    Failure::new("--prefix needs a directory", "e.g. --prefix ~/.local")
                })?;
                prefix = Some(PathBuf::from(dir));
            }
            "--debug" => release = false,
            "--service" => with_service = true,
            "--uninstall-service" => uninstall_service = true,
            "--model" => {
                let path = rest.next().ok_or_else(|| {
                    Failure::new("--model needs a path", "e.g. --model ~/models/m.gguf")
                })?;
                model = Some(PathBuf::from(path));
            }
            other => {
                return Err(Failure::new(
                    format!("`cargo xtask install` does not take `{other}`"),
                    "use --prefix DIR, --debug, --service [--model PATH] or --uninstall-service",
                ));
            }
        }
    }
    if uninstall_service {
        if with_service || model.is_some() || !release {
            return Err(Failure::new(
                "--uninstall-service removes the service files only",
                "pass it alone, or with the --prefix DIR of the install",
            ));
        }
        service::uninstall(&ServiceFiles::new(prefix.as_deref())?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if model.is_some() && !with_service {
        return Err(Failure::new(
            "--model names the service's model",
            "pass it with --service",
        ));
    }
    let service_files = if with_service {
        Some(ServiceFiles::new(prefix.as_deref())?)
    } else {
        None
    };
    let prefix = match prefix {
        Some(p) => p,
        None => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".local"))
            .ok_or_else(|| Failure::new("HOME is not set", "pass --prefix DIR"))?,
    };
    let installed = setup::run_for(ws, setup::Needs::Serving)?;
    let mut build = process::cargo();
    build
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host"])
        .args(["-p", "onebit-tests", "--bin", "fake-backend"]);
    for route in ROUTES {
        build.args(["-p", route]);
    }
    if release {
        build.arg("--release");
    }
    process::run(
        &mut build,
        "fix the build, then rerun `cargo xtask install`",
    )?;
    let target = ws
        .root
        .join("target")
        .join(if release { "release" } else { "debug" });

    let layout = Layout::new(&prefix);
    for dir in [&layout.bin, &layout.plugins, &layout.llama_server_dir] {
        fs::create_dir_all(dir).map_err(|e| {
            Failure::new(
                format!("cannot create {}: {e}", dir.display()),
                "pass a writable --prefix",
            )
        })?;
    }
    copy(&target.join("1bit"), &layout.bin.join("1bit"))?;
    for program in PROGRAMS {
        copy(&target.join(program), &layout.bin.join(program))?;
    }
    copy(&target.join("fake-backend"), &layout.bin.join(FAKE_BACKEND))?;
    link_llama_server(&layout.bin)?;
    // The routes ship as route packages, made and installed as a vendor's are.
    let version = env!("CARGO_PKG_VERSION");
    let todo = "see its line above, fix the cause, then rerun `cargo xtask install`";
    for route in ROUTES {
        let file = format!("lib{}.so", route.replace('-', "_"));
        let archive = crate::route_packages::package(
            &target.join("1bit"),
            &target.join(&file),
            version,
            &crate::route_packages::Contents::default(),
            &ws.root.join("target/packages"),
            todo,
        )?;
        crate::route_packages::install(&layout.bin.join("1bit"), &archive, &prefix, todo)?;
        // A loose copy from an install before packages would shadow nothing (the package
        // sorts first) but would list as shadowed: it goes.
        let _ = fs::remove_file(layout.plugins.join(&file));
    }
    copy(
        &installed.llama_server,
        &layout.llama_server_dir.join("llama-server"),
    )?;
    println!("installed 1bit into {}", prefix.display());
    println!("  {}", layout.bin.join("1bit").display());
    println!(
        "  {} -> 1bit (for Lemonade: LEMONADE_LLAMACPP_CPU_BIN={0})",
        layout.bin.join("llama-server").display()
    );
    for program in PROGRAMS.iter().chain(&[FAKE_BACKEND]) {
        println!("  {}", layout.bin.join(program).display());
    }
    println!("  {}/<route> (route packages)", layout.plugins.display());
    println!(
        "  {}",
        layout.llama_server_dir.join("llama-server").display()
    );
    if let Some(files) = service_files {
        // The unit names absolute paths: the manager's working directory is not this one.
        let one_bit = fs::canonicalize(layout.bin.join("1bit")).map_err(|e| {
            Failure::new(
                format!("cannot resolve {}: {e}", layout.bin.display()),
                "pass an absolute --prefix",
            )
        })?;
        let default_model = installed
            .models
            .first()
            .ok_or_else(|| Failure::new("setup installed no model", "pass --model PATH"))?;
        service::install(&ws.root, &files, &one_bit, model.as_deref(), default_model)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Copy through a temporary sibling and rename, so a running copy is never half overwritten.
fn copy(from: &Path, to: &Path) -> Result<(), Failure> {
    let temp = to.with_extension("installing");
    fs::copy(from, &temp)
        .and_then(|_| fs::set_permissions(&temp, fs::Permissions::from_mode(0o755)))
        .and_then(|()| fs::rename(&temp, to))
        .map_err(|e| {
            Failure::new(
                format!("cannot install {} as {}: {e}", from.display(), to.display()),
                "check that it was built and the prefix is writable",
            )
        })
}

/// `bin/llama-server` -> `1bit`; an existing file there that is not such a link is left alone.
fn link_llama_server(bin: &Path) -> Result<(), Failure> {
    let link = bin.join("llama-server");
    match fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => {
            fs::remove_file(&link).map_err(|e| {
                Failure::new(
                    format!("cannot replace {}: {e}", link.display()),
                    "check permissions",
                )
            })?;
        }
        Ok(_) => {
            return Err(Failure::new(
                format!("{} exists and is not a link to 1bit", link.display()),
                "move that llama-server elsewhere, or install with another --prefix",
            ));
        }
        Err(_) => {}
    }
    symlink("1bit", &link).map_err(|e| {
        Failure::new(
            format!("cannot link {}: {e}", link.display()),
            "check permissions",
        )
    })
}
