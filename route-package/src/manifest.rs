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
    /// Where the package runs: the architecture, the CPU features and the glibc its files
    /// need. Absent (packages made before it was recorded): judged by nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

/// What a machine must have to run a package's files (checked at install and at every start,
/// before any of them is opened; `platform.rs`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    /// The CPU architecture, as Rust names it (`x86_64`, `aarch64`).
    pub arch: String,
    /// CPU features every file needs, as the kernel names them in `/proc/cpuinfo` (`avx2`,
    /// `avx512f`, `amx_tile`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cpu_features: Vec<String>,
    /// The oldest glibc that runs the files (`2.36`): the newest `GLIBC_` symbol version any
    /// of them names. None: no file names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glibc: Option<String>,
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
    /// Whether it is executable (a program the route runs): its mode is checked like its
    /// sha256. None in packages made before modes were recorded: not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executable: Option<bool>,
    /// Builds of the same file for more capable CPUs: the host uses the one whose
    /// `cpu_features` this CPU has, the most of them winning, else the file itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub variants: Vec<Variant>,
}

/// One build of a carried file for a CPU level ([`CarriedFile::variants`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Variant {
    /// Its path in the package (`zeta-engine.avx2`).
    pub path: String,
    /// Its sha256, lowercase hex.
    pub sha256: String,
    /// Whether it is executable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executable: Option<bool>,
    /// The CPU features it needs beyond the package's own (`/proc/cpuinfo` names); at least one.
    pub cpu_features: Vec<String>,
}

impl CarriedFile {
    /// The file itself and each variant: path, sha256, executable.
    pub fn every_file(&self) -> impl Iterator<Item = (&str, &str, Option<bool>)> {
        std::iter::once((self.path.as_str(), self.sha256.as_str(), self.executable)).chain(
            self.variants
                .iter()
                .map(|v| (v.path.as_str(), v.sha256.as_str(), v.executable)),
        )
    }
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
            for (path, sha256, _) in file.every_file() {
                check_relative(path)?;
                if [MANIFEST_FILE, SIGNATURE_FILE].contains(&path) {
                    return Err(format!(
                        "{path} is the package's own file, not a carried one"
                    ));
                }
                if !seen.insert(path) {
                    return Err(format!("{path} is named twice"));
                }
                check_sha256(path, sha256)?;
            }
            if file.version.trim().is_empty() {
                return Err(format!(
                    "{} has no version; give every carried file its own",
                    file.path
                ));
            }
            for variant in &file.variants {
                if variant.cpu_features.is_empty() {
                    return Err(format!(
                        "variant {} of {} names no CPU feature; a variant is for a CPU with more features than the file itself needs",
                        variant.path, file.path
                    ));
                }
                variant
                    .cpu_features
                    .iter()
                    .try_for_each(|f| check_feature(f))?;
            }
        }
        if let Some(platform) = &self.platform {
            if platform.arch.trim().is_empty() {
                return Err("its platform names no arch; as x86_64".to_string());
            }
            platform
                .cpu_features
                .iter()
                .try_for_each(|f| check_feature(f))?;
            if let Some(glibc) = &platform.glibc
                && glibc_version(glibc).is_none()
            {
                return Err(format!(
                    "its platform's glibc {glibc:?} is not a version, as 2.36"
                ));
            }
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

/// `2.36` as (2, 36).
pub fn glibc_version(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.trim().split_once('.')?;
    let minor = minor.split('.').next()?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// A CPU feature as `/proc/cpuinfo` names it: 1 to 32 of `a-z`, `0-9` and `_`.
fn check_feature(name: &str) -> Result<(), String> {
    let good = !name.is_empty()
        && name.len() <= 32
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if good {
        Ok(())
    } else {
        Err(format!(
            "CPU feature {name:?} is not a name as /proc/cpuinfo gives it (avx2, avx512f)"
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
                executable: Some(true),
                variants: vec![Variant {
                    path: "libacme_kernels.so.1.avx2".into(),
                    sha256: "c".repeat(64),
                    executable: Some(true),
                    cpu_features: vec!["avx2".into()],
                }],
            }],
            platform: Some(Platform {
                arch: "x86_64".into(),
                cpu_features: vec!["sse4_2".into()],
                glibc: Some("2.36".into()),
            }),
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
            (
                |m| m.files[0].variants[0].path = "libacme_kernels.so.1".into(),
                "named twice",
            ),
            (
                |m| m.files[0].variants[0].cpu_features.clear(),
                "names no CPU feature",
            ),
            (
                |m| m.files[0].variants[0].cpu_features = vec!["AVX2".into()],
                "CPU feature \"AVX2\"",
            ),
            (
                |m| m.platform.as_mut().unwrap().glibc = Some("new".into()),
                "glibc \"new\" is not a version",
            ),
            (
                |m| m.platform.as_mut().unwrap().arch.clear(),
                "names no arch",
            ),
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
