//! A venv of its own in the cache (`<cache>/venvs/NAME-VERSION`) holding pinned wheels from
//! PyPI, each checked against its sha256: what the gateway and the Python SDKs are installed
//! into. Its steps' output goes to one log under `<cache>/logs/`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::steps::Step;
use super::{PypiFile, fetch_from_pypi};
use crate::Failure;
use crate::cache::Layout;

/// What to do when making the venv or installing into it failed.
const TODO: &str = "check that python3 with venv and pip is installed and PyPI is reachable, then rerun `cargo xtask setup`";

/// One venv in the cache, and the log its steps write.
pub struct Venv {
    dir: PathBuf,
    log: PathBuf,
}

impl Venv {
    /// `<cache>/venvs/<name>`, its steps logged in `<cache>/logs/<log>`.
    pub fn new(layout: &Layout, name: &str, log: &str) -> Venv {
        Venv {
            dir: layout.cache_dir.join("venvs").join(name),
            log: layout.logs_dir().join(log),
        }
    }

    /// The venv's python.
    pub fn python(&self) -> PathBuf {
        self.dir.join("bin").join("python")
    }

    /// A program the venv installed (`bin/NAME`).
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// Whether the venv's python runs `code` (a version check) and exits 0.
    pub fn passes(&self, code: &str) -> bool {
        Command::new(self.python())
            .args(["-c", code])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Make the venv when it is not there, then download and install each of `wheels` into
    /// it, a step line each. Blocks on pip.
    pub fn install(&self, layout: &Layout, wheels: &[&PypiFile<'_>]) -> Result<(), Failure> {
        let downloads = layout.downloads_dir();
        super::create_dir_all(&downloads)?;
        if !self.python().is_file() {
            let mut make = Command::new("python3");
            make.args(["-m", "venv"]).arg(&self.dir);
            let title = format!("making the venv {}", self.dir.display());
            self.step(&title).run(&mut make)?;
        }
        for file in wheels {
            let wheel = fetch_from_pypi(file, &downloads, layout)?;
            let mut pip = Command::new(self.python());
            pip.args(["-m", "pip", "install", "--disable-pip-version-check"])
                .arg(&wheel);
            let title = format!(
                "installing {} {} into the venv {}",
                file.package,
                file.version,
                self.dir.display()
            );
            self.step(&title).run(&mut pip)?;
        }
        Ok(())
    }

    fn step<'a>(&self, title: &'a str) -> Step<'a> {
        Step::short(title, self.log.clone(), TODO)
    }
}
