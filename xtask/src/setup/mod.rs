//! `cargo xtask setup`: installs the pinned llama-server and models into the cache, or confirms in well under a second that they are there.
//!
//! Each step is one line (`steps`); what serving needs comes first, and a command that only
//! serves (`cargo xtask serve`, `install`) sets up only that ([`Needs`]).

mod agents;
mod build_target;
mod cmake;
pub mod gateway;
mod llama_cpp;
mod models;
pub mod openai_sdk;
mod self_test;
pub mod steps;
mod venv;

use std::fs::{self, File, TryLockError};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::cache::{Layout, temp_sibling};
use crate::{Failure, Workspace};
use build_target::BuildTarget;
use steps::Step;

/// What a command needs set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Serving the default model: it and the llama.cpp build llama-server (and the RPC server)
    /// come from. `cargo xtask serve` and `install`.
    Serving,
    /// Everything the tests and benchmarks use besides: every pinned model, the shared
    /// libraries the inproc add-on loads (a second llama.cpp build), the Python SDKs, the
    /// Prometheus parser, `ip`. `cargo xtask setup`, `test`, `bench`, `soak`.
    Everything,
}

/// What setup installed, for the subcommands that run it first.
pub struct Installed {
    pub llama_server: PathBuf,
    /// The folder of the shared libllama/libggml the inproc add-on loads (with
    /// [`Needs::Everything`]).
    pub llama_lib_dir: Option<PathBuf>,
    /// Each pinned model's path, in pins order (the default one alone with [`Needs::Serving`]).
    pub models: Vec<PathBuf>,
    /// The python of the venv holding the pinned OpenAI SDK (with [`Needs::Everything`]).
    pub openai_python: Option<PathBuf>,
    /// The folder of the pinned coding agents' npm packages (with [`Needs::Everything`]).
    pub agents_dir: Option<PathBuf>,
}

/// Installs everything that is missing ([`Needs::Everything`]); see [`run_for`].
pub fn run(ws: &Workspace) -> Result<Installed, Failure> {
    run_for(ws, Needs::Everything)
}

/// Installs whatever `needs` asks for and is missing, one line a step, and ends with a few lines
/// saying where things are. Blocks for as long as a build takes (about 6 minutes on 2 cores the
/// first time, 2 more for the shared libraries); holds `<cache>/.setup.lock` so concurrent runs
/// (say two `cargo xtask test`) wait for each other instead of building twice.
pub fn run_for(ws: &Workspace, needs: Needs) -> Result<Installed, Failure> {
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
    let everything = needs == Needs::Everything;
    // The models first: the builds' self-test decodes with the default one.
    let default_model = ws.pins.default_model();
    let models: Vec<PathBuf> = ws
        .pins
        .models
        .iter()
        .filter(|model| everything || model.name == default_model.name)
        .map(|model| models::ensure(model, layout))
        .collect::<Result<_, _>>()?;
    let default_model = layout.model(default_model);
    let here = BuildTarget::of_this_machine()?;
    let llama_server = llama_cpp::ensure(&ws.pins.llama_cpp, layout, &here, &default_model)?;
    let mut installed = Installed {
        llama_server,
        llama_lib_dir: None,
        models,
        openai_python: None,
        agents_dir: None,
    };
    println!("llama-server: {}", installed.llama_server.display());
    if everything {
        let lib_dir = llama_cpp::ensure_shared(&ws.pins.llama_cpp, layout, &here, &default_model)?;
        println!("llama.cpp libraries: {}", lib_dir.display());
        let portable = llama_cpp::ensure_portable_cpu(&ws.pins.llama_cpp, layout, &here)?;
        println!(
            "llama.cpp's portable kernels (the inproc package's): {}",
            portable.display()
        );
        installed.llama_lib_dir = Some(lib_dir);
    }
    let names: Vec<String> = installed
        .models
        .iter()
        .filter_map(|path| path.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    println!(
        "models: {} in {}",
        names.join(", "),
        layout.models_dir().display()
    );
    if everything {
        let python = openai_sdk::ensure(layout)?;
        gateway::ensure(layout)?;
        let agents = agents::ensure(layout, &ws.pins.npm)?;
        let tools = [
            openai_sdk::versions(),
            gateway::versions(),
            agents::versions(&ws.pins.npm),
            ensure_prometheus_parser(layout)?,
            ensure_prometheus_server(layout)?,
            ensure_iproute2(layout)?,
        ];
        println!("for the tests: {}", tools.join("; "));
        installed.openai_python = Some(python);
        installed.agents_dir = Some(agents);
    }
    Ok(installed)
}

/// The reference Prometheus text parser the metrics tests check serve's `/metrics` with.
const PROMETHEUS_CLIENT: (&str, &str) = ("prometheus_client", "0.26.0");

/// Installs Python's `prometheus_client` at its pinned version with pip, unless that version is
/// already importable (a fraction of a second when it is); what it has, in words.
fn ensure_prometheus_parser(layout: &Layout) -> Result<String, Failure> {
    let (package, version) = PROMETHEUS_CLIENT;
    let check = format!(
        "import importlib.metadata as m, sys; import {package}; sys.exit(m.version('{package}') != '{version}')"
    );
    let present = Command::new("python3")
        .args(["-c", &check])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let have = format!("{package} {version}");
    if present {
        return Ok(have);
    }
    let spec = format!("{package}=={version}");
    let mut pip = Command::new("python3");
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", &spec]);
    Step::short(
        &format!("installing {spec} with pip (the tests' Prometheus parser)"),
        layout.logs_dir().join("pip-prometheus-client.log"),
        "check that python3 with pip is installed and PyPI is reachable, then rerun `cargo xtask setup`",
    )
    .run(&mut pip)?;
    Ok(have)
}

/// Debian's Prometheus server, which the dashboard's test (tests/tests/serve_prometheus.rs)
/// asks for every expression the dashboard uses; installed with apt-get when missing (a no-op
/// when present).
fn ensure_prometheus_server(layout: &Layout) -> Result<String, Failure> {
    let have = "prometheus (Debian)".to_owned();
    if ["/usr/bin/prometheus", "/usr/sbin/prometheus"]
        .iter()
        .any(|p| std::path::Path::new(p).is_file())
    {
        return Ok(have);
    }
    let todo = "install Debian's prometheus package, then rerun `cargo xtask setup`";
    apt_install(
        layout,
        "prometheus",
        "the dashboard test's Prometheus server",
        todo,
    )?;
    Ok(have)
}

/// `ip` (iproute2), which the RPC end-to-end test uses to put each worker in a network
/// namespace of its own; installed with apt-get when missing (a no-op when present).
fn ensure_iproute2(layout: &Layout) -> Result<String, Failure> {
    let present = Command::new("ip")
        .arg("-V")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let have = "ip (iproute2)".to_owned();
    if present {
        return Ok(have);
    }
    let todo = "install iproute2 (it provides `ip`), then rerun `cargo xtask setup`";
    apt_install(
        layout,
        "iproute2",
        "the RPC test's network namespaces",
        todo,
    )?;
    Ok(have)
}

/// Installs Debian packages (`packages`, space-separated) with apt-get (after `apt-get
/// update`), one step with its log.
fn apt_install(layout: &Layout, packages: &str, why: &str, todo: &str) -> Result<(), Failure> {
    let log = layout
        .logs_dir()
        .join(format!("apt-{}.log", packages.replace(' ', "-")));
    let mut update = Command::new("sh");
    update.args([
        "-c",
        &format!("apt-get update && apt-get install -y --no-install-recommends {packages}"),
    ]);
    Step::short(
        &format!("installing {packages} with apt-get ({why})"),
        log,
        todo,
    )
    .run(&mut update)
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

/// Downloads `file` with pip into `dir` unless a copy with the pinned checksum is already there
/// (one step line for the download, pip's output in its log); returns its verified path. A
/// checksum mismatch after download stops setup.
fn fetch_from_pypi(file: &PypiFile<'_>, dir: &Path, layout: &Layout) -> Result<PathBuf, Failure> {
    let path = dir.join(file.file_name);
    if path.is_file() {
        if sha256_of_file(&path)? == file.sha256 {
            return Ok(path);
        }
        println!(
            "{} does not match its pinned sha256: downloading it again",
            path.display()
        );
        remove_file(&path)?;
    }
    let spec = format!("{}=={}", file.package, file.version);
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
    Step::short(
        &format!("downloading {spec} from PyPI"),
        layout.logs_dir().join("pip-download.log"),
        "check that python3 with pip is installed and PyPI is reachable, then rerun `cargo xtask setup`",
    )
    .run(&mut pip)?;
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
