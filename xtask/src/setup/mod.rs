//! `cargo xtask setup`: installs the pinned llama-server and models into the cache, or confirms in well under a second that they are there.

mod build_target;
mod cmake;
mod llama_cpp;
mod models;
pub mod openai_sdk;
mod self_test;

use std::fs::{self, File, TryLockError};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::cache::temp_sibling;
use crate::{Failure, Workspace, process};
use build_target::BuildTarget;

/// What setup installed, for the subcommands that run it first.
pub struct Installed {
    pub llama_server: PathBuf,
    /// The folder of the shared libllama/libggml the inproc add-on loads.
    pub llama_lib_dir: PathBuf,
    /// Each pinned model's path, in pins order.
    pub models: Vec<PathBuf>,
    /// The python of the venv holding the pinned OpenAI SDK.
    pub openai_python: PathBuf,
}

/// Installs whatever is missing and prints where things are. Blocks for as long as a build takes
/// (about 10 minutes on 2 cores the first time); holds `<cache>/.setup.lock` so concurrent runs
/// (say two `cargo xtask test`) wait for each other instead of building twice.
pub fn run(ws: &Workspace) -> Result<Installed, Failure> {
    let layout = &ws.layout;
    fs::create_dir_all(&layout.cache_dir).map_err(|err| {
        Failure::new(
            format!(
                "cannot create cache dir {}: {err}",
                layout.cache_dir.display()
            ),
            "set ONEBIT_CACHE_DIR to a writable directory",
        )
    })?;
    let _lock = lock(&layout.cache_dir.join(".setup.lock"))?;
    // The models first: the builds' self-test decodes with the default one.
    let models: Vec<PathBuf> = ws
        .pins
        .models
        .iter()
        .map(|model| models::ensure(model, layout))
        .collect::<Result<_, _>>()?;
    let default_model = layout.model(ws.pins.default_model());
    let here = BuildTarget::of_this_machine()?;
    let llama_server = llama_cpp::ensure(&ws.pins.llama_cpp, layout, &here, &default_model)?;
    let llama_lib_dir =
        llama_cpp::ensure_shared(&ws.pins.llama_cpp, layout, &here, &default_model)?;
    let installed = Installed {
        llama_server,
        llama_lib_dir,
        models,
        openai_python: openai_sdk::ensure(layout)?,
    };
    ensure_prometheus_parser()?;
    ensure_iproute2()?;
    println!("llama-server: {}", installed.llama_server.display());
    println!("llama.cpp libraries: {}", installed.llama_lib_dir.display());
    for path in &installed.models {
        println!("model: {}", path.display());
    }
    Ok(installed)
}

/// The reference Prometheus text parser the metrics tests check serve's `/metrics` with.
const PROMETHEUS_CLIENT: (&str, &str) = ("prometheus_client", "0.26.0");

/// Installs Python's `prometheus_client` at its pinned version with pip, unless that version is
/// already importable (a fraction of a second when it is).
fn ensure_prometheus_parser() -> Result<(), Failure> {
    let (package, version) = PROMETHEUS_CLIENT;
    let check = format!(
        "import importlib.metadata as m, sys; import {package}; sys.exit(m.version('{package}') != '{version}')"
    );
    let present = Command::new("python3")
        .args(["-c", &check])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        println!("{package}: {version}");
        return Ok(());
    }
    let spec = format!("{package}=={version}");
    println!("installing {spec} with pip (the tests' Prometheus parser)");
    let mut pip = Command::new("python3");
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", &spec]);
    process::run(
        &mut pip,
        "check that python3 with pip is installed and PyPI is reachable, then rerun `cargo xtask setup`",
    )
}

/// `ip` (iproute2), which the RPC end-to-end test uses to put each worker in a network
/// namespace of its own; installed with apt-get when missing (a no-op when present).
fn ensure_iproute2() -> Result<(), Failure> {
    let present = Command::new("ip")
        .arg("-V")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        println!("ip: present (iproute2)");
        return Ok(());
    }
    println!("installing iproute2 with apt-get (the RPC test's network namespaces)");
    let hint = "install iproute2 (it provides `ip`), then rerun `cargo xtask setup`";
    process::run(Command::new("apt-get").arg("update"), hint)?;
    process::run(
        Command::new("apt-get").args(["install", "-y", "--no-install-recommends", "iproute2"]),
        hint,
    )
}

/// Takes the setup lock, waiting (and saying so) while another setup holds it; released on drop.
fn lock(path: &Path) -> Result<File, Failure> {
    let cannot = |err: io::Error| {
        Failure::new(
            format!("cannot lock {}: {err}", path.display()),
            "check that the cache dir is writable",
        )
    };
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(cannot)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            println!(
                "waiting for another `cargo xtask setup` to finish (it holds {})",
                path.display()
            );
            file.lock().map_err(cannot)?;
        }
        Err(TryLockError::Error(err)) => return Err(cannot(err)),
    }
    Ok(file)
}

/// A file pinned on PyPI: which package version to ask pip for, and what pip must hand back.
struct PypiFile<'a> {
    package: &'a str,
    version: &'a str,
    file_name: &'a str,
    sha256: &'a str,
    /// Ask for the source distribution rather than a wheel.
    source: bool,
}

/// Downloads `file` with pip into `dir` unless a copy with the pinned checksum is already there;
/// returns its verified path. A checksum mismatch after download stops setup.
fn fetch_from_pypi(file: &PypiFile<'_>, dir: &Path) -> Result<PathBuf, Failure> {
    let path = dir.join(file.file_name);
    if path.is_file() {
        if sha256_of_file(&path)? == file.sha256 {
            println!("using {} (sha256 matches the pin)", path.display());
            return Ok(path);
        }
        println!(
            "{} does not match its pinned sha256: downloading it again",
            path.display()
        );
        remove_file(&path)?;
    }
    let spec = format!("{}=={}", file.package, file.version);
    println!(
        "downloading {spec} from PyPI with pip into {}",
        dir.display()
    );
    let mut pip = Command::new("python3");
    pip.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
    ]);
    if file.source {
        // `--no-binary :all:` would also build pip's build requirements (cmake) from source.
        pip.args(["--no-binary", file.package]);
    }
    pip.arg(&spec).arg("-d").arg(dir);
    process::run(
        &mut pip,
        "check that python3 with pip is installed and PyPI is reachable, then rerun `cargo xtask setup`",
    )?;
    if !path.is_file() {
        return Err(Failure::new(
            format!("pip downloaded {spec} but {} is not there", path.display()),
            "the pinned file name differs from what PyPI serves: fix third_party/pins.json",
        ));
    }
    let actual = sha256_of_file(&path)?;
    if actual != file.sha256 {
        return Err(Failure::new(
            format!(
                "{} has sha256 {actual}, but the pin says {}",
                path.display(),
                file.sha256
            ),
            "PyPI served something other than what was pinned: do not use it; check third_party/pins.json",
        ));
    }
    println!("sha256 of {} matches the pin", file.file_name);
    Ok(path)
}

/// Hashes a file with sha256, printing a line first when it is big enough to take a moment.
fn sha256_of_file(path: &Path) -> Result<String, Failure> {
    let cannot = |err: io::Error| {
        Failure::new(
            format!("cannot read {}: {err}", path.display()),
            "check the cache dir's permissions",
        )
    };
    let mut file = File::open(path).map_err(cannot)?;
    let size = file.metadata().map_err(cannot)?.len();
    if size > 16 << 20 {
        println!(
            "checking the sha256 of {} ({} MB)",
            path.display(),
            size / 1_000_000
        );
    }
    let mut hasher = Sha256::new();
    let mut buffer = vec![0; 1 << 20];
    loop {
        match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buffer[..n]),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(cannot(err)),
        }
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Writes `contents` to a temporary sibling and renames it over `path`, so readers never see half a file.
fn write_atomically(path: &Path, contents: &[u8]) -> Result<(), Failure> {
    let temp = temp_sibling(path, "tmp");
    fs::write(&temp, contents)
        .and_then(|()| fs::rename(&temp, path))
        .map_err(|err| {
            Failure::new(
                format!("cannot write {}: {err}", path.display()),
                "check free space and permissions",
            )
        })
}

fn remove_file(path: &Path) -> Result<(), Failure> {
    fs::remove_file(path).map_err(|err| {
        Failure::new(
            format!("cannot remove {}: {err}", path.display()),
            "check the cache dir's permissions",
        )
    })
}

fn create_dir_all(path: &Path) -> Result<(), Failure> {
    fs::create_dir_all(path).map_err(|err| {
        Failure::new(
            format!("cannot create {}: {err}", path.display()),
            "check free space and permissions",
        )
    })
}

/// A writer that hashes what passes through it, so a model is verified while it is written.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
