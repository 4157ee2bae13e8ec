//! Finding device route files at run time, loading them, and picking the one for `--device`.

use std::path::{Path, PathBuf};

use onebit_plugin_api::loader::{self, LoadError, LoadedRoute};
use onebit_plugin_api::{ABI_VERSION, Claim, PlanRequest};

use crate::error::Fatal;

/// A route file's name: `libonebit_route_<name>.so`.
const FILE_PREFIX: &str = "libonebit_route_";
const FILE_SUFFIX: &str = ".so";

/// One route file found on disk, loaded or not.
#[derive(Debug)]
pub struct Found {
    pub file: PathBuf,
    pub outcome: Result<LoadedRoute, LoadError>,
}

/// Where route files are looked for, in order: `--plugin-dir`, each entry of
/// `ONEBIT_PLUGIN_PATH` (colon-separated), the `plugins` folder beside the binary, the
/// binary's own folder (where `cargo build` puts the route libraries), and the installed
/// layout's `../lib/1bit/plugins`.
pub fn search_dirs(plugin_dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = plugin_dirs.to_vec();
    if let Some(path) = std::env::var_os("ONEBIT_PLUGIN_PATH") {
        dirs.extend(std::env::split_paths(&path).filter(|p| !p.as_os_str().is_empty()));
    }
    if let Some(exe_dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    {
        dirs.push(exe_dir.join("plugins"));
        dirs.push(exe_dir.clone());
        dirs.push(exe_dir.join("../lib/1bit/plugins"));
    }
    dirs
}

/// Every route file in `dirs`, loaded. A route name found twice keeps its first file (an
/// earlier directory overrides a later one); the later file is reported as shadowed.
pub fn discover(dirs: &[PathBuf]) -> Vec<Found> {
    let mut found: Vec<Found> = Vec::new();
    let mut seen_files = std::collections::HashSet::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_route_file(p))
            .collect();
        files.sort();
        for file in files {
            let canonical = file.canonicalize().unwrap_or_else(|_| file.clone());
            if !seen_files.insert(canonical) {
                continue;
            }
            let mut outcome = loader::load(&file);
            if let Ok(route) = &outcome {
                let name = &route.info.name;
                if let Some(first) = found
                    .iter()
                    .find(|f| matches!(&f.outcome, Ok(r) if &r.info.name == name))
                {
                    outcome = Err(LoadError::NotARoute {
                        file: file.clone(),
                        why: format!(
                            "route {name} is already provided by {}",
                            first.file.display()
                        ),
                    });
                }
            }
            found.push(Found { file, outcome });
        }
    }
    found
}

/// Shared libraries in `dirs` that are not route files by name (an ELF `.so` not named
/// `libonebit_route_<name>.so`): never loaded, but `1bit plugins` names them, since a route
/// library renamed by hand would otherwise vanish without a word.
pub fn other_libraries(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_shared_library(p) && !is_route_file(p))
            .collect();
        files.sort();
        for file in files {
            if seen.insert(file.canonicalize().unwrap_or_else(|_| file.clone())) {
                out.push(file);
            }
        }
    }
    out
}

/// A file named `*.so` or `*.so.N` that starts with the ELF magic.
fn is_shared_library(path: &Path) -> bool {
    let named = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(FILE_SUFFIX) || n.contains(".so."));
    let mut magic = [0u8; 4];
    named
        && path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok()
        && magic == *b"\x7fELF"
}

/// The route name a file's name promises: `libonebit_route_<name>.so` gives `<name>`.
fn name_in_file(path: &Path) -> Option<&str> {
    path.file_name()?
        .to_str()?
        .strip_prefix(FILE_PREFIX)?
        .strip_suffix(FILE_SUFFIX)
}

fn is_route_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(FILE_PREFIX) && n.ends_with(FILE_SUFFIX))
}

/// The table `1bit plugins` prints: name, file, ABI version, and whether it loaded; a route
/// whose own name differs from its file's says so (`--device` takes the route's name); then
/// the shared libraries that are not route files.
pub fn listing(found: &[Found], others: &[PathBuf]) -> String {
    let mut out = format!("host route ABI {ABI_VERSION}\n");
    if found.is_empty() {
        out.push_str(
            "no route files found; build them with `cargo build`, or pass --plugin-dir DIR\n",
        );
    }
    for f in found {
        match &f.outcome {
            Ok(route) => {
                let renamed = match name_in_file(&f.file) {
                    Some(file_name) if file_name != route.info.name => format!(
                        " (the route names itself {}, its file says {file_name}: use --device {})",
                        route.info.name, route.info.name
                    ),
                    _ => String::new(),
                };
                out.push_str(&format!(
                    "{:<8} {}  ABI {}  loaded: {}{renamed}\n",
                    route.info.name,
                    f.file.display(),
                    route.abi_version,
                    route.info.summary
                ))
            }
            Err(e) => out.push_str(&format!(
                "{:<8} {}  not loaded: {e}\n",
                "-",
                f.file.display()
            )),
        }
    }
    for other in others {
        out.push_str(&format!(
            "{:<8} {}  not loaded: a shared library, but not a route file (route files are named {FILE_PREFIX}<name>{FILE_SUFFIX})\n",
            "-",
            other.display()
        ));
    }
    out
}

/// The route for `--device`: the one of that name, or for `auto` the strongest claim; of
/// equal claims, the route found first (`routes` is in search order).
pub fn choose<'a>(
    device: &str,
    routes: &'a [LoadedRoute],
    request: &PlanRequest,
) -> Result<(&'a LoadedRoute, Option<Claim>), Fatal> {
    let names = || {
        let mut names: Vec<&str> = routes.iter().map(|r| r.info.name.as_str()).collect();
        names.sort();
        names.join(", ")
    };
    if device != "auto" {
        return routes
            .iter()
            .find(|r| r.info.name == device)
            .map(|r| (r, None))
            .ok_or_else(|| {
                Fatal::usage(format!(
                    "--device {device}: no such route (loaded: {}); run `1bit plugins` to see what was found",
                    if routes.is_empty() { "none".to_string() } else { names() }
                ))
            });
    }
    let mut best: Option<(&LoadedRoute, Claim)> = None;
    for route in routes {
        let claim = match route.claim(request) {
            Ok(claim) => claim,
            Err(e) => {
                tracing::info!(
                    "1bit serve: route {} failed to claim the model: {e}",
                    route.info.name
                );
                continue;
            }
        };
        if claim.strength > 0
            && best
                .as_ref()
                .is_none_or(|(_, b)| claim.strength > b.strength)
        {
            best = Some((route, claim));
        }
    }
    best.map(|(r, c)| (r, Some(c))).ok_or_else(|| {
        Fatal::usage(format!(
            "--device auto: no route claims {} (loaded: {}); pass --device",
            request.options.model,
            if routes.is_empty() {
                "none".to_string()
            } else {
                names()
            }
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_route_libraries_are_considered() {
        assert!(is_route_file(Path::new("/x/libonebit_route_cpu.so")));
        assert!(!is_route_file(Path::new("/x/libonebit_route_cpu.d")));
        assert!(!is_route_file(Path::new("/x/libfoo.so")));
    }

    #[test]
    fn a_directory_with_a_bad_file_lists_it_as_not_loaded() {
        let dir = std::env::temp_dir().join(format!("onebit-routes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libonebit_route_broken.so"), b"not a library").unwrap();
        let found = discover(std::slice::from_ref(&dir));
        assert_eq!(found.len(), 1);
        let text = listing(&found, &[]);
        assert!(
            text.contains("libonebit_route_broken.so  not loaded: "),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
