//! `1bit plugins check PACKAGE`: a package folder or archive checked as `install` and serve
//! check it (the archive whole, the manifest, every checksum and mode, the platform, the
//! signature, the route's own name), installed into a scratch prefix, then its route loaded
//! from there with its package facts, as serve loads it.

use std::path::{Path, PathBuf};

use onebit_plugin_api::loader::LoadedRoute;
use onebit_route_package::install::Install;
use onebit_route_package::keys::{Signed, TrustStore};
use onebit_route_package::platform::Machine;
use onebit_route_package::{archive, check};

use super::Report;
use crate::routes;

/// A package opened for the check: its route, and the folder serve finds the package in.
pub struct Opened {
    /// The route, loaded with its package facts.
    pub route: LoadedRoute,
    /// The folder holding the package (serve's `--plugin-dir` for it).
    pub plugin_dir: PathBuf,
    /// The check's scratch folder (an archive unpacked, the package installed, an empty trust
    /// store), removed when the check ends; None for a route file loaded alone.
    scratch: Option<PathBuf>,
}

impl Opened {
    /// A route file loaded alone (not from a package), found in `plugin_dir`.
    pub fn loose(route: LoadedRoute, plugin_dir: PathBuf) -> Opened {
        Opened {
            route,
            plugin_dir,
            scratch: None,
        }
    }

    /// The trust store serve is run with for a package: an empty one, so that the package
    /// loads as installed with `--allow-unsigned` (the vendor's own key need not be trusted
    /// on the vendor's machine). None for a loose route file.
    pub fn trust_dir(&self) -> Option<PathBuf> {
        self.scratch.as_ref().map(|s| s.join("trust"))
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if let Some(dir) = &self.scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether `path` names a package (a folder holding a manifest, or an archive) rather than a
/// route library.
pub fn is_package(path: &Path) -> bool {
    archive::is_archive(path) || path.join(onebit_route_package::MANIFEST_FILE).is_file()
}

/// Open and check the package at `path`, install it into a scratch prefix as `1bit plugins
/// install` would, and load its route from there as serve would; None when a check failed
/// (reported).
pub fn open(path: &Path, report: &mut Report) -> Option<Opened> {
    let scratch =
        std::env::temp_dir().join(format!("1bit-plugins-check-package-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    if let Err(e) = std::fs::create_dir_all(scratch.join("unpacked")) {
        report.fail("scratch", format!("{}: {e}", scratch.display()));
        return None;
    }
    let opened = open_in(path, &scratch, report);
    if opened.is_none() {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    opened.map(|(route, plugin_dir)| Opened {
        route,
        plugin_dir,
        scratch: Some(scratch),
    })
}

fn open_in(path: &Path, scratch: &Path, report: &mut Report) -> Option<(LoadedRoute, PathBuf)> {
    let dir = if archive::is_archive(path) {
        match archive::unpack(path, &scratch.join("unpacked")) {
            Ok(dir) => {
                report.ok(
                    "archive",
                    format!("{} unpacks whole, modes kept", path.display()),
                );
                dir
            }
            Err(e) => {
                report.fail("archive", e.to_string());
                return None;
            }
        }
    } else {
        path.to_path_buf()
    };
    check_files(&dir, report)?;
    let plugin_dir = scratch.join("prefix").join(crate::routes::PREFIX_PLUGINS);
    let empty_trust = TrustStore {
        dir: scratch.join("trust"),
    };
    let installer = Install {
        plugins_dir: plugin_dir.clone(),
        trust: &empty_trust,
        allow_unsigned: true,
        new_signer: false,
        machine: Machine::this(),
        host_abi: semver::Version::parse(onebit_plugin_api::ABI_VERSION)
            .expect("the ABI version is semver"),
        probe_route: &crate::routes::probe_route,
    };
    let installed = match installer.run(&dir) {
        Ok(installed) => installed,
        Err(e) => {
            report.fail("install", e.to_string());
            return None;
        }
    };
    report.ok(
        "install",
        format!(
            "installs as `1bit plugins install` installs it (into {})",
            installed.link.display()
        ),
    );
    let found = routes::discover(std::slice::from_ref(&plugin_dir));
    let entry = found.into_iter().find(|f| f.file == installed.link);
    match entry.map(|f| f.outcome) {
        Some(Ok(route)) => Some((route, plugin_dir)),
        Some(Err(line)) => {
            report.fail("load", line);
            None
        }
        None => {
            report.fail(
                "load",
                format!(
                    "{}: serve does not find it as a package",
                    installed.link.display()
                ),
            );
            None
        }
    }
}

/// The package's files as install and serve check them: manifest, checksums and modes,
/// platform, signature. None when one failed (reported).
fn check_files(dir: &Path, report: &mut Report) -> Option<()> {
    let checked = match check(dir) {
        Ok(checked) => checked,
        Err(e) => {
            report.fail("package", e.to_string());
            return None;
        }
    };
    let m = &checked.manifest;
    report.ok(
        "manifest",
        format!(
            "{} {} by {} ({}), ABI {}, {} carried file{}",
            m.name,
            m.version,
            m.vendor,
            m.license,
            m.abi,
            m.files.len(),
            if m.files.len() == 1 { "" } else { "s" }
        ),
    );
    let programs = m
        .files
        .iter()
        .filter(|f| f.executable == Some(true))
        .count();
    report.ok(
        "checksums",
        format!(
            "{} files match the manifest, {programs} of them executable as recorded",
            1 + m.files.iter().map(|f| 1 + f.variants.len()).sum::<usize>()
        ),
    );
    match checked.runs_on(&Machine::this()) {
        Ok(()) => report.ok(
            "platform",
            match &m.platform {
                Some(p) => format!(
                    "{}{}{}: this machine runs it",
                    p.arch,
                    if p.cpu_features.is_empty() {
                        String::new()
                    } else {
                        format!(", CPU features {}", p.cpu_features.join(" "))
                    },
                    p.glibc
                        .as_ref()
                        .map(|g| format!(", glibc {g}"))
                        .unwrap_or_default()
                ),
                None => "none recorded (a package made before 1bit recorded platforms)".to_string(),
            },
        ),
        Err(e) => {
            report.fail("platform", e.to_string());
            return None;
        }
    }
    match &checked.signed {
        Signed::By(key) => {
            let trusted = TrustStore::users().is_some_and(|store| store.find(key).is_some());
            if trusted {
                report.ok("signature", format!("signed by {key}, a key you trust"));
            } else {
                report.ok(
                    "signature",
                    format!("signed by {key}, which verifies; a user trusts it with `1bit plugins trust KEY.pub`"),
                );
            }
        }
        Signed::Unsigned => report.skip(
            "signature",
            "unsigned: users must pass --allow-unsigned to install it; sign it with `1bit plugins package --sign KEY`",
        ),
    }
    Some(())
}
