//! `1bit plugins check PACKAGE`: a package folder or archive checked as `install` and serve
//! check it (the archive whole, the manifest, every checksum, the signature, the route's own
//! name), then its route loaded with its package facts, as serve loads it.

use std::path::{Path, PathBuf};

use onebit_plugin_api::loader::LoadedRoute;
use onebit_route_package::keys::{Signed, TrustStore};
use onebit_route_package::{archive, check};

use super::Report;
use crate::routes;

/// A package opened for the check: its route, and the folder serve finds the package in.
pub struct Opened {
    /// The route, loaded with its package facts.
    pub route: LoadedRoute,
    /// The folder holding the package folder (serve's `--plugin-dir` for it).
    pub plugin_dir: PathBuf,
    /// Where an archive was unpacked, removed when the check ends.
    unpacked: Option<PathBuf>,
}

impl Opened {
    /// A route file loaded alone (not from a package), found in `plugin_dir`.
    pub fn loose(route: LoadedRoute, plugin_dir: PathBuf) -> Opened {
        Opened {
            route,
            plugin_dir,
            unpacked: None,
        }
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if let Some(dir) = &self.unpacked {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Whether `path` names a package (a folder holding a manifest, or an archive) rather than a
/// route library.
pub fn is_package(path: &Path) -> bool {
    archive::is_archive(path) || path.join(onebit_route_package::MANIFEST_FILE).is_file()
}

/// Open and check the package at `path`; None when a check failed (reported).
pub fn open(path: &Path, report: &mut Report) -> Option<Opened> {
    let (dir, unpacked) = if archive::is_archive(path) {
        let into =
            std::env::temp_dir().join(format!("1bit-plugins-check-package-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&into);
        if let Err(e) = std::fs::create_dir_all(&into) {
            report.fail("archive", format!("{}: {e}", into.display()));
            return None;
        }
        match archive::unpack(path, &into) {
            Ok(dir) => {
                report.ok("archive", format!("{} unpacks whole", path.display()));
                (dir, Some(into))
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&into);
                report.fail("archive", e.to_string());
                return None;
            }
        }
    } else {
        (path.to_path_buf(), None)
    };
    let opened = check_and_load(&dir, report);
    if opened.is_none()
        && let Some(into) = &unpacked
    {
        let _ = std::fs::remove_dir_all(into);
    }
    opened.map(|(route, plugin_dir)| Opened {
        route,
        plugin_dir,
        unpacked,
    })
}

fn check_and_load(dir: &Path, report: &mut Report) -> Option<(LoadedRoute, PathBuf)> {
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
    report.ok(
        "checksums",
        format!("{} files match the manifest", m.files.len() + 1),
    );
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
    let plugin_dir = std::path::absolute(dir)
        .ok()
        .and_then(|d| d.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let found = routes::discover(std::slice::from_ref(&plugin_dir));
    let entry = found
        .into_iter()
        .find(|f| f.file.file_name() == dir.file_name());
    match entry.map(|f| f.outcome) {
        Some(Ok(route)) => Some((route, plugin_dir)),
        Some(Err(line)) => {
            report.fail("load", line);
            None
        }
        None => {
            report.fail(
                "load",
                format!("{}: serve does not find it as a package", dir.display()),
            );
            None
        }
    }
}
