//! Checking a package folder against its manifest: every named file present, a regular file,
//! with its sha256; nothing in the folder the manifest does not name; the signature, when
//! there is one, verified. Done by `install` before anything is copied and by serve each time
//! it loads a package, before the route's library is opened.

use std::path::{Path, PathBuf};

use crate::keys::{self, Signed};
use crate::platform::Machine;
use crate::{MANIFEST_FILE, Manifest, PackageError, SIGNATURE_FILE, sha256_of};

/// A package folder whose files all match its manifest.
#[derive(Clone, Debug)]
pub struct Checked {
    /// The package folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// The manifest's exact bytes (what a signature covers).
    pub manifest_bytes: Vec<u8>,
    /// Who signed it, when signed (the signature verified over the manifest).
    pub signed: Signed,
}

impl Checked {
    /// The route library's path.
    pub fn route_file(&self) -> PathBuf {
        self.dir.join(&self.manifest.route.path)
    }

    /// Whether `machine` runs this package (its manifest's platform; a package that records
    /// none is judged by nothing). The error is one line naming the package and what to do.
    /// Called by install and by serve before any file of the package is opened.
    pub fn runs_on(&self, machine: &Machine) -> Result<(), PackageError> {
        let Some(platform) = &self.manifest.platform else {
            return Ok(());
        };
        machine.judge(platform).map_err(|why| {
            PackageError::new(format!(
                "package {} {} ({}) cannot run here: {why}; install a build of {} for this machine from its vendor (`1bit plugins install ARCHIVE`)",
                self.manifest.name,
                self.manifest.version,
                self.dir.display(),
                self.manifest.name
            ))
        })
    }
}

/// Check the package folder `dir`. The error is one line naming the package, the file and
/// what to do.
pub fn check(dir: &Path) -> Result<Checked, PackageError> {
    let (manifest, manifest_bytes) = Manifest::read(dir)?;
    let named = |why: String| {
        PackageError::new(format!(
            "package {} {} ({}): {why}",
            manifest.name,
            manifest.version,
            dir.display()
        ))
    };
    let files = std::iter::once((
        manifest.route.path.as_str(),
        manifest.route.sha256.as_str(),
        None,
    ))
    .chain(manifest.files.iter().flat_map(|f| f.every_file()));
    for (path, sha256, executable) in files {
        let file = dir.join(path);
        let meta = match std::fs::symlink_metadata(&file) {
            Ok(meta) if meta.is_file() => meta,
            Ok(_) => {
                return Err(named(format!(
                    "{path} is not a regular file; a package holds files alone"
                )));
            }
            Err(_) => {
                return Err(named(format!(
                    "its manifest names {path}, which is not in the package; get the whole package again"
                )));
            }
        };
        // The content first: a changed file is said as changed, whatever its mode became.
        let actual = sha256_of(&file).map_err(|e| PackageError::io("reading", &file, &e))?;
        if actual != sha256 {
            return Err(named(format!(
                "{path}'s sha256 does not match its manifest (the file changed after the package was made); reinstall the package with `1bit plugins install ARCHIVE`"
            )));
        }
        use std::os::unix::fs::PermissionsExt;
        let is = meta.permissions().mode() & 0o111 != 0;
        if let Some(recorded) = executable
            && recorded != is
        {
            return Err(named(format!(
                "{path} is {}executable, but its manifest records it {}executable (its mode changed after the package was made); reinstall the package with `1bit plugins install ARCHIVE`",
                if is { "" } else { "not " },
                if recorded { "" } else { "not " },
            )));
        }
    }
    if let Some(extra) = unlisted(dir, &manifest)? {
        return Err(named(format!(
            "{extra} is in the package but not in its manifest; remove it, or rebuild the package with it carried"
        )));
    }
    let signed = keys::signature_of(dir, &manifest_bytes)?;
    Ok(Checked {
        dir: dir.to_path_buf(),
        manifest,
        manifest_bytes,
        signed,
    })
}

/// The first file under `dir` that the manifest does not name (its path in the package).
fn unlisted(dir: &Path, manifest: &Manifest) -> Result<Option<String>, PackageError> {
    let mut listed: std::collections::HashSet<&str> = manifest
        .files
        .iter()
        .flat_map(|f| f.every_file().map(|(path, _, _)| path))
        .collect();
    listed.extend([manifest.route.path.as_str(), MANIFEST_FILE, SIGNATURE_FILE]);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(folder) = stack.pop() {
        let entries =
            std::fs::read_dir(&folder).map_err(|e| PackageError::io("reading", &folder, &e))?;
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let meta = std::fs::symlink_metadata(&path)
                .map_err(|e| PackageError::io("reading", &path, &e))?;
            let inside = path
                .strip_prefix(dir)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            if meta.is_dir() {
                stack.push(path);
            } else if !listed.contains(inside.as_str()) {
                return Ok(Some(inside));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::make::{self, Carry, Meta};
    use crate::testing::scratch;

    /// A package folder made from two small files standing for a route and its kernels.
    pub fn sample_package(root: &Path, version: &str) -> PathBuf {
        let built = root.join("built");
        std::fs::create_dir_all(&built).unwrap();
        std::fs::write(
            built.join("libonebit_route_acme.so"),
            format!("route {version}"),
        )
        .unwrap();
        std::fs::write(built.join("libacme_kernels.so.1"), "kernels").unwrap();
        std::fs::write(built.join("acme-engine"), "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::write(built.join("acme-engine-avx2"), "#!/bin/sh\nexit 0\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        for program in ["acme-engine", "acme-engine-avx2"] {
            std::fs::set_permissions(built.join(program), std::fs::Permissions::from_mode(0o755))
                .unwrap();
        }
        std::fs::set_permissions(
            built.join("libacme_kernels.so.1"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let meta = Meta {
            name: "acme".into(),
            version: version.into(),
            abi: "1.8.0".into(),
            vendor: "Acme NPU Inc.".into(),
            summary: "Acme's NPU".into(),
            license: "LicenseRef-Acme".into(),
            cpu_features: Vec::new(),
        };
        let carry = [
            Carry {
                file: built.join("libacme_kernels.so.1"),
                version: "1.0.3".into(),
            },
            Carry {
                file: built.join("acme-engine"),
                version: "2.0.0".into(),
            },
        ];
        let variants = [make::CarryVariant {
            file: built.join("acme-engine-avx2"),
            of: "acme-engine".into(),
            cpu_features: vec!["avx2".into()],
        }];
        make::folder(
            &built.join("libonebit_route_acme.so"),
            &carry,
            &variants,
            &meta,
            &root.join("dist"),
        )
        .unwrap()
    }

    #[test]
    fn a_made_package_checks_and_each_change_is_named() {
        let root = scratch("check");
        let dir = sample_package(&root, "1.2.0");
        let checked = check(&dir).unwrap();
        assert_eq!(checked.manifest.files[0].version, "1.0.3");
        assert_eq!(checked.signed, Signed::Unsigned);

        let kernels = dir.join("libacme_kernels.so.1");
        std::fs::write(&kernels, "kernelz").unwrap();
        let why = check(&dir).unwrap_err().to_string();
        assert!(why.starts_with("package acme 1.2.0 ("), "{why}");
        assert!(
            why.contains("libacme_kernels.so.1's sha256 does not match its manifest"),
            "{why}"
        );

        std::fs::remove_file(&kernels).unwrap();
        let why = check(&dir).unwrap_err().to_string();
        assert!(
            why.contains("names libacme_kernels.so.1, which is not in the package"),
            "{why}"
        );

        std::fs::write(&kernels, "kernels").unwrap();
        std::fs::write(dir.join("libsneaky.so"), "x").unwrap();
        let why = check(&dir).unwrap_err().to_string();
        assert!(
            why.contains("libsneaky.so is in the package but not in its manifest"),
            "{why}"
        );
        std::fs::remove_file(dir.join("libsneaky.so")).unwrap();

        // A program's executable bit is recorded and checked like its sha256.
        use std::os::unix::fs::PermissionsExt;
        let engine = &checked.manifest.files[1];
        assert_eq!(
            (engine.path.as_str(), engine.executable),
            ("acme-engine", Some(true))
        );
        assert_eq!(checked.manifest.files[0].executable, Some(false));
        assert_eq!(engine.variants[0].path, "acme-engine.avx2");
        let set_mode = |name: &str, mode: u32| {
            std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(mode))
                .unwrap();
        };
        set_mode("acme-engine", 0o644);
        let why = check(&dir).unwrap_err().to_string();
        assert!(
            why.contains("acme-engine is not executable, but its manifest records it executable")
                && why.contains("`1bit plugins install ARCHIVE`"),
            "{why}"
        );
        set_mode("acme-engine", 0o755);
        set_mode("libacme_kernels.so.1", 0o755);
        let why = check(&dir).unwrap_err().to_string();
        assert!(
            why.contains(
                "libacme_kernels.so.1 is executable, but its manifest records it not executable"
            ),
            "{why}"
        );
        set_mode("libacme_kernels.so.1", 0o644);
        std::fs::write(dir.join("acme-engine.avx2"), "changed").unwrap();
        let why = check(&dir).unwrap_err().to_string();
        assert!(
            why.contains("acme-engine.avx2's sha256 does not match"),
            "a variant is checked too: {why}"
        );
        std::fs::write(dir.join("acme-engine.avx2"), "#!/bin/sh\nexit 0\n").unwrap();
        check(&dir).unwrap();

        std::os::unix::fs::symlink("/etc/passwd", dir.join("lib")).unwrap();
        let why = check(&dir).unwrap_err().to_string();
        assert!(
            why.contains("lib is in the package but not in its manifest"),
            "{why}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
