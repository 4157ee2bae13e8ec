//! Making a package folder from a built route and the files it carries: what
//! `1bit plugins package` does for a vendor, and what this repository does for its own routes.

use std::path::{Path, PathBuf};

use crate::manifest::{self, CarriedFile, Platform, RouteFile, Variant};
use crate::platform;
use crate::{FORMAT, Manifest, PackageError, sha256_of};

/// Who the route is, for the manifest (the host reads `name`, `abi` and `summary` from the
/// route library itself).
#[derive(Clone, Debug)]
pub struct Meta {
    /// The route's name.
    pub name: String,
    /// The package's version (semver).
    pub version: String,
    /// The plugin ABI the route was built against.
    pub abi: String,
    /// Who ships it.
    pub vendor: String,
    /// One line on what the route runs.
    pub summary: String,
    /// Its license.
    pub license: String,
    /// The CPU features every file of the package needs (`--cpu-features`): recorded in the
    /// manifest's platform with the architecture and glibc read from the files themselves.
    pub cpu_features: Vec<String>,
}

/// One file to carry, with its version.
#[derive(Clone, Debug)]
pub struct Carry {
    /// The file as built; it is carried under its own file name.
    pub file: PathBuf,
    /// Its version.
    pub version: String,
}

impl Carry {
    /// `FILE=VERSION`, as `--carry` takes it (the version after the last `=`).
    pub fn parse(text: &str) -> Result<Carry, String> {
        match text.rsplit_once('=') {
            Some((file, version)) if !file.is_empty() && !version.trim().is_empty() => Ok(Carry {
                file: PathBuf::from(file),
                version: version.trim().to_string(),
            }),
            _ => Err(format!(
                "--carry {text}: give the file and its version as FILE=VERSION (libacme_kernels.so.1=1.0.3)"
            )),
        }
    }
}

/// A build of a carried file for CPUs with more features (`--variant FILE=OF:FEATURE,...`).
#[derive(Clone, Debug)]
pub struct CarryVariant {
    /// The build.
    pub file: PathBuf,
    /// The carried file's name in the package it is a variant of.
    pub of: String,
    /// The CPU features it needs (`/proc/cpuinfo` names).
    pub cpu_features: Vec<String>,
}

impl CarryVariant {
    /// `FILE=OF:FEATURE,FEATURE`, as `--variant` takes it.
    pub fn parse(text: &str) -> Result<CarryVariant, String> {
        let usage = || {
            format!(
                "--variant {text}: give the build, the carried file it is a variant of and the CPU features it needs as FILE=OF:FEATURE,FEATURE (build-avx2/zeta-engine=zeta-engine:avx2,fma)"
            )
        };
        let (file, rest) = text.rsplit_once('=').ok_or_else(usage)?;
        let (of, features) = rest.split_once(':').ok_or_else(usage)?;
        let cpu_features: Vec<String> = features
            .split(',')
            .map(|f| f.trim().to_string())
            .filter(|f| !f.is_empty())
            .collect();
        if file.is_empty() || of.is_empty() || cpu_features.is_empty() {
            return Err(usage());
        }
        Ok(CarryVariant {
            file: PathBuf::from(file),
            of: of.to_string(),
            cpu_features,
        })
    }

    /// Its name in the package: `OF.FEATURE-FEATURE` (`zeta-engine.avx2-fma`), or for more than
    /// three features (a `native` build's) `OF.cpuN`, N its place among `variants`.
    fn name(&self, place: usize) -> String {
        if self.cpu_features.len() <= 3 {
            format!("{}.{}", self.of, self.cpu_features.join("-"))
        } else {
            format!("{}.cpu{}", self.of, place + 1)
        }
    }
}

/// Write the package folder `OUT/NAME-VERSION/` (replacing an earlier one of that name):
/// the route library as `libonebit_route_NAME.so`, each carried file under its own name (its
/// executable bit recorded), each variant as `OF.FEATURES`, and the manifest, whose platform
/// is the files' architecture and glibc and `meta.cpu_features`. Returns the folder.
pub fn folder(
    route: &Path,
    carry: &[Carry],
    variants: &[CarryVariant],
    meta: &Meta,
    out: &Path,
) -> Result<PathBuf, PackageError> {
    let route_name = Manifest::route_file_name(&meta.name);
    let mut files = Vec::new();
    for c in carry {
        let name = c
            .file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| {
                PackageError::new(format!("--carry {}: not a file", c.file.display()))
            })?;
        if !c.file.is_file() {
            return Err(PackageError::new(format!(
                "--carry {}: no such file; build it first, or fix the path",
                c.file.display()
            )));
        }
        if name == route_name || files.iter().any(|(n, _): &(String, &Carry)| *n == name) {
            return Err(PackageError::new(format!(
                "--carry {}: a file named {name} is already in the package; carry each file once",
                c.file.display()
            )));
        }
        files.push((name, c));
    }
    for v in variants {
        if !files.iter().any(|(n, _)| *n == v.of) {
            return Err(PackageError::new(format!(
                "--variant {}: {} is not a carried file; carry it with --carry {}=VERSION first",
                v.file.display(),
                v.of,
                v.of
            )));
        }
        if !v.file.is_file() {
            return Err(PackageError::new(format!(
                "--variant {}: no such file; build it first, or fix the path",
                v.file.display()
            )));
        }
    }
    let sha = |p: &Path| sha256_of(p).map_err(|e| PackageError::io("reading", p, &e));
    let manifest = Manifest {
        format: FORMAT,
        name: meta.name.clone(),
        version: meta.version.clone(),
        abi: meta.abi.clone(),
        vendor: meta.vendor.clone(),
        summary: meta.summary.clone(),
        license: meta.license.clone(),
        route: RouteFile {
            path: route_name.clone(),
            sha256: sha(route)?,
        },
        files: files
            .iter()
            .map(|(name, c)| {
                let variants = variants
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.of == *name)
                    .map(|(place, v)| {
                        Ok(Variant {
                            path: v.name(place),
                            sha256: sha(&v.file)?,
                            executable: Some(is_executable(&v.file)),
                            cpu_features: v.cpu_features.clone(),
                        })
                    })
                    .collect::<Result<_, PackageError>>()?;
                Ok(CarriedFile {
                    path: name.clone(),
                    version: c.version.clone(),
                    sha256: sha(&c.file)?,
                    executable: Some(is_executable(&c.file)),
                    variants,
                })
            })
            .collect::<Result<_, PackageError>>()?,
        platform: Some(platform_of(
            route,
            carry
                .iter()
                .map(|c| c.file.as_path())
                .chain(variants.iter().map(|v| v.file.as_path())),
            &meta.cpu_features,
        )),
    };
    manifest
        .validate()
        .map_err(|why| PackageError::new(format!("the package cannot be made: {why}")))?;
    manifest::check_name(&meta.name).map_err(PackageError::new)?;
    let dir = out.join(format!("{}-{}", meta.name, meta.version));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| PackageError::io("replacing", &dir, &e))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| PackageError::io("creating", &dir, &e))?;
    let copy = |from: &Path, name: &str| {
        std::fs::copy(from, dir.join(name))
            .map(|_| ())
            .map_err(|e| PackageError::io("copying", from, &e))
    };
    copy(route, &route_name)?;
    for (name, c) in &files {
        copy(&c.file, name)?;
    }
    for (place, v) in variants.iter().enumerate() {
        copy(&v.file, &v.name(place))?;
    }
    let path = dir.join(crate::MANIFEST_FILE);
    std::fs::write(&path, manifest.to_bytes())
        .map_err(|e| PackageError::io("writing", &path, &e))?;
    Ok(dir)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o111 != 0)
}

/// The platform the files need: the route library's architecture (this build's when it is not
/// ELF), the newest glibc any file names, and the CPU features the vendor gave.
fn platform_of<'a>(
    route: &'a Path,
    carried: impl Iterator<Item = &'a Path>,
    cpu_features: &[String],
) -> Platform {
    let glibc = std::iter::once(route)
        .chain(carried)
        .filter_map(|p| std::fs::read(p).ok())
        .filter_map(|bytes| platform::newest_glibc_named(&bytes))
        .max();
    Platform {
        arch: platform::elf_arch(route)
            .unwrap_or(std::env::consts::ARCH)
            .to_string(),
        cpu_features: cpu_features.to_vec(),
        glibc: glibc.map(|(major, minor)| format!("{major}.{minor}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carry_takes_the_version_after_the_last_equals_sign() {
        let c = Carry::parse("dir/a=b/libk.so.1=1.0.3").unwrap();
        assert_eq!(c.file, PathBuf::from("dir/a=b/libk.so.1"));
        assert_eq!(c.version, "1.0.3");
        for bad in ["libk.so", "libk.so=", "=1.0"] {
            let why = Carry::parse(bad).unwrap_err();
            assert!(why.contains("FILE=VERSION"), "{why}");
        }
    }

    #[test]
    fn a_missing_or_doubled_carried_file_is_refused() {
        let root = crate::testing::scratch("make");
        std::fs::write(root.join("libonebit_route_acme.so"), "r").unwrap();
        std::fs::write(root.join("libk.so"), "k").unwrap();
        let meta = Meta {
            name: "acme".into(),
            version: "1.0.0".into(),
            abi: "1.8.0".into(),
            vendor: "v".into(),
            summary: "s".into(),
            license: "MIT".into(),
            cpu_features: Vec::new(),
        };
        let carry = |f: &str| Carry {
            file: root.join(f),
            version: "1".into(),
        };
        let route = root.join("libonebit_route_acme.so");
        let why = folder(&route, &[carry("nope.so")], &[], &meta, &root)
            .unwrap_err()
            .to_string();
        assert!(why.contains("no such file"), "{why}");
        let why = folder(
            &route,
            &[carry("libk.so"), carry("libk.so")],
            &[],
            &meta,
            &root,
        )
        .unwrap_err()
        .to_string();
        assert!(why.contains("carry each file once"), "{why}");
        let bad = Meta {
            version: "one".into(),
            ..meta
        };
        let why = folder(&route, &[], &[], &bad, &root)
            .unwrap_err()
            .to_string();
        assert!(why.contains("is not semver"), "{why}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
