//! The manifest, `1bit-package.json`: who the route is, what it was built against, and every
//! file of the package with its sha256 (docs/plugins.md, "The manifest").

use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

use crate::{FORMAT, MANIFEST_FILE, PackageError, SIGNATURE_FILE};

/// A package's manifest, as written in its folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The manifest format ([`FORMAT`]).
    pub format: u32,
    /// The route's name: `--device NAME`, and the route library's own name for itself.
    pub name: String,
    /// The package's version (semver): a newer one replaces an older one at install.
    pub version: String,
    /// The plugin ABI (onebit-plugin-api's version) the route was built against.
    pub abi: String,
    /// Who ships it.
    pub vendor: String,
    /// One line on what the route runs.
    pub summary: String,
    /// Its license: an SPDX expression, or `LicenseRef-...` for a vendor's own terms.
    pub license: String,
    /// The route library.
    pub route: RouteFile,
    /// The files the route carries (its kernels, say), each with its own version.
    #[serde(default)]
    pub files: Vec<CarriedFile>,
}

/// The route library of a package.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteFile {
    /// Its path in the package: `libonebit_route_NAME.so`.
    pub path: String,
    /// Its sha256, lowercase hex.
    pub sha256: String,
}

/// One file a package carries besides its route library.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarriedFile {
    /// Its path in the package, relative (`libacme_kernels.so.1`, `lib/libggml.so`).
    pub path: String,
    /// Its own version (a kernels library's, say), as its vendor numbers it.
    pub version: String,
    /// Its sha256, lowercase hex.
    pub sha256: String,
}

impl Manifest {
    /// The route library's file name for a route called `name`.
    pub fn route_file_name(name: &str) -> String {
        format!("libonebit_route_{name}.so")
    }

    /// Read and validate the manifest of the package folder `dir`.
    pub fn read(dir: &Path) -> Result<(Manifest, Vec<u8>), PackageError> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                PackageError::new(format!(
                    "{}: not a route package (it has no {MANIFEST_FILE}); build one with `1bit plugins package`",
                    dir.display()
                ))
            } else {
                PackageError::io("reading", &path, &e)
            }
        })?;
        let manifest = Manifest::parse(&bytes)
            .map_err(|why| PackageError::new(format!("{}: {why}", path.display())))?;
        Ok((manifest, bytes))
    }

    /// Parse and validate manifest text; the error says what is wrong in it.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, String> {
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| {
            format!("not a manifest this 1bit reads ({e}); rebuild the package with `1bit plugins package`")
        })?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// The manifest as the text written to [`MANIFEST_FILE`] (pretty JSON and a newline).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut text = serde_json::to_string_pretty(self).expect("a manifest always encodes");
        text.push('\n');
        text.into_bytes()
    }

    /// Every rule a manifest keeps, each broken one named.
    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "manifest format {} is not {FORMAT}, the one this 1bit reads; use a 1bit as new as the package",
                self.format
            ));
        }
        check_name(&self.name)?;
        semver::Version::parse(&self.version)
            .map_err(|e| format!("version {:?} is not semver ({e}), as 1.2.0", self.version))?;
        semver::Version::parse(&self.abi)
            .map_err(|e| format!("abi {:?} is not a version ({e}), as 1.8.0", self.abi))?;
        for (field, value) in [("vendor", &self.vendor), ("license", &self.license)] {
            if value.trim().is_empty() {
                return Err(format!(
                    "it names no {field}; every package says its {field}"
                ));
            }
        }
        let route_name = Manifest::route_file_name(&self.name);
        if self.route.path != route_name {
            return Err(format!(
                "its route library is {:?}, but route {} must ship as {route_name}",
                self.route.path, self.name
            ));
        }
        check_sha256(&self.route.path, &self.route.sha256)?;
        let mut seen = std::collections::HashSet::new();
        seen.insert(self.route.path.as_str());
        for file in &self.files {
            check_relative(&file.path)?;
            if [MANIFEST_FILE, SIGNATURE_FILE].contains(&file.path.as_str()) {
                return Err(format!(
                    "{} is the package's own file, not a carried one",
                    file.path
                ));
            }
            if !seen.insert(file.path.as_str()) {
                return Err(format!("{} is named twice", file.path));
            }
            if file.version.trim().is_empty() {
                return Err(format!(
                    "{} has no version; give every carried file its own",
                    file.path
                ));
            }
            check_sha256(&file.path, &file.sha256)?;
        }
        Ok(())
    }
}

/// A route name: 1 to 32 of `a-z`, `0-9`, `_`, `-`, starting with a letter.
pub fn check_name(name: &str) -> Result<(), String> {
    let good = !name.is_empty()
        && name.len() <= 32
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if good {
        Ok(())
    } else {
        Err(format!(
            "route name {name:?} is not 1 to 32 of a-z, 0-9, _ and -, starting with a letter"
        ))
    }
}

/// A path inside the package: relative, without `..`, `.` or an empty part.
pub fn check_relative(path: &str) -> Result<(), String> {
    let p = Path::new(path);
    let plain = !path.is_empty()
        && !path.contains('\\')
        && p.components().all(|c| matches!(c, Component::Normal(_)))
        && !path.ends_with('/');
    if plain {
        Ok(())
    } else {
        Err(format!(
            "{path:?} is not a plain relative path inside the package (no leading /, no .., no .)"
        ))
    }
}

fn check_sha256(path: &str, sha256: &str) -> Result<(), String> {
    let good = sha256.len() == 64
        && sha256
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    if good {
        Ok(())
    } else {
        Err(format!(
            "{path}: sha256 {sha256:?} is not 64 lowercase hex digits"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            format: FORMAT,
            name: "acme".into(),
            version: "1.2.0".into(),
            abi: "1.8.0".into(),
            vendor: "Acme NPU Inc.".into(),
            summary: "Acme's NPU".into(),
            license: "LicenseRef-Acme".into(),
            route: RouteFile {
                path: "libonebit_route_acme.so".into(),
                sha256: "a".repeat(64),
            },
            files: vec![CarriedFile {
                path: "libacme_kernels.so.1".into(),
                version: "1.0.3".into(),
                sha256: "b".repeat(64),
            }],
        }
    }

    #[test]
    fn a_manifest_round_trips_through_its_text() {
        let m = sample();
        assert_eq!(Manifest::parse(&m.to_bytes()).unwrap(), m);
    }

    #[test]
    fn each_broken_rule_is_named() {
        type Break = fn(&mut Manifest);
        let cases: Vec<(Break, &str)> = vec![
            (|m| m.format = 2, "manifest format 2"),
            (|m| m.name = "Acme".into(), "route name \"Acme\""),
            (|m| m.version = "1.2".into(), "is not semver"),
            (|m| m.abi = "x".into(), "abi \"x\""),
            (|m| m.vendor = " ".into(), "names no vendor"),
            (|m| m.license.clear(), "names no license"),
            (
                |m| m.route.path = "libother.so".into(),
                "must ship as libonebit_route_acme.so",
            ),
            (|m| m.route.sha256 = "A".repeat(64), "not 64 lowercase hex"),
            (
                |m| m.files[0].path = "../evil.so".into(),
                "not a plain relative path",
            ),
            (
                |m| m.files[0].path = "/etc/passwd".into(),
                "not a plain relative path",
            ),
            (
                |m| m.files[0].path = MANIFEST_FILE.into(),
                "the package's own file",
            ),
            (
                |m| m.files[0].path = "libonebit_route_acme.so".into(),
                "named twice",
            ),
            (|m| m.files[0].version.clear(), "has no version"),
        ];
        for (breaks, says) in cases {
            let mut m = sample();
            breaks(&mut m);
            let why = m.validate().expect_err(says);
            assert!(why.contains(says), "{why:?} should say {says:?}");
        }
    }

    #[test]
    fn text_that_is_not_a_manifest_is_refused_in_one_line() {
        let why = Manifest::parse(b"{\"format\": 1").unwrap_err();
        assert!(why.starts_with("not a manifest this 1bit reads"), "{why}");
        assert!(!why.contains('\n'));
    }
}
