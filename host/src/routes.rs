//! Finding device route files at run time, loading them, and picking the one for `--device`.

use std::path::{Path, PathBuf};

use onebit_plugin_api::loader::{self, LoadedRoute};
use onebit_plugin_api::{ABI_VERSION, Claim, PackageFacts, PackageFile, PlanRequest};
use onebit_route_package::keys::{Signed, TrustStore};
use onebit_route_package::platform::Machine;
use onebit_route_package::{Checked, MANIFEST_FILE, owners};

use onebit_command::error::Fatal;

/// A route file's name: `libonebit_route_<name>.so`.
const FILE_PREFIX: &str = "libonebit_route_";
const FILE_SUFFIX: &str = ".so";

/// One route file or route package found on disk, loaded or not.
#[derive(Debug)]
pub struct Found {
    /// The route file, or the package folder.
    pub file: PathBuf,
    /// The route's name when it is known without loading it: a package's manifest says it,
    /// a loose file's name promises it.
    pub package_name: Option<String>,
    /// The route, or the one line saying why it was not loaded.
    pub outcome: Result<LoadedRoute, String>,
    /// A package that loads because the user installed it with `--allow-unsigned` (no key
    /// they trust signed it).
    pub allowed_unsigned: bool,
}

/// A package whose files failed their check, or a route file that failed to load: it claims
/// nothing, and `--device NAME` refuses with its line (exit 1).
#[derive(Debug, Clone)]
pub struct Unusable {
    /// The route's name, from the manifest.
    pub name: String,
    /// Why, in one line.
    pub line: String,
}

/// Where a prefix's packages are: `PREFIX/lib/1bit/plugins` (`1bit plugins install --prefix`,
/// `cargo xtask install --prefix`).
pub const PREFIX_PLUGINS: &str = "lib/1bit/plugins";

/// The user's route folder, where `1bit plugins install` puts packages without `--prefix`:
/// `$HOME/.local/lib/1bit/plugins` (the layout `cargo xtask install` makes under `~/.local`).
pub fn user_dir() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|home| PathBuf::from(home).join(".local/lib/1bit/plugins"))
}

/// Where route files and packages are looked for, in order: `--plugin-dir`, each entry of
/// `ONEBIT_PLUGIN_PATH` (colon-separated), the `plugins` folder beside the binary, the
/// binary's own folder (where `cargo build` puts the route libraries), the installed
/// layout's `../lib/1bit/plugins`, and the user's route folder ([`user_dir`]).
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
    dirs.extend(user_dir());
    dirs
}

/// Every route file and package in `dirs`, loaded. A package's files are checked against its
/// manifest before its library is opened. A route name found twice keeps its first (an
/// earlier directory overrides a later one); the later one is reported as shadowed.
pub fn discover(dirs: &[PathBuf]) -> Vec<Found> {
    let trust = TrustStore::users();
    let mut found: Vec<Found> = Vec::new();
    let mut seen_files = std::collections::HashSet::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_route_file(p) || is_package(p))
            .collect();
        files.sort();
        for file in files {
            let canonical = file.canonicalize().unwrap_or_else(|_| file.clone());
            if !seen_files.insert(canonical) {
                continue;
            }
            let (package_name, mut outcome, allowed_unsigned) = if is_package(&file) {
                load_package(&file, trust.as_ref())
            } else {
                // A loose file's name promises its route's name, for `--device NAME`'s line.
                let promised = name_in_file(&file).map(str::to_string);
                (
                    promised,
                    loader::load(&file).map_err(|e| e.to_string()),
                    false,
                )
            };
            if let Ok(route) = &outcome {
                let name = &route.info.name;
                if let Some(first) = found
                    .iter()
                    .find(|f| matches!(&f.outcome, Ok(r) if &r.info.name == name))
                {
                    let kind = |f: &Path, r: Option<&LoadedRoute>| match r
                        .and_then(|r| r.package.as_ref())
                    {
                        Some(p) => {
                            format!("the package {} {} in {}", p.name, p.version, f.display())
                        }
                        None if is_package(f) => format!("the package in {}", f.display()),
                        None => format!("the route file {}", f.display()),
                    };
                    let used = kind(&first.file, first.outcome.as_ref().ok());
                    let unused = kind(&file, outcome.as_ref().ok());
                    outcome = Err(format!(
                        "{}: shadowed: route {name} is {used}, not {unused}, because its folder comes first in the search order; remove one, or pass --plugin-dir to put the other first",
                        file.display(),
                    ));
                }
            }
            found.push(Found {
                file,
                package_name,
                outcome,
                allowed_unsigned,
            });
        }
    }
    found
}

/// A folder (or a link to one) holding a package manifest; hidden folders (the install
/// store) are not packages.
fn is_package(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'));
    !hidden && path.join(MANIFEST_FILE).is_file()
}

/// Check the package folder `dir` and load its route: its name (when the manifest could be
/// read) and the route with its package facts, or the line saying why not. In order, before
/// its library is opened: its files against its manifest (sha256, mode), this machine against
/// its platform, its signer against the trust store as it is now (`owners::judge`).
fn load_package(
    dir: &Path,
    trust: Option<&TrustStore>,
) -> (Option<String>, Result<LoadedRoute, String>, bool) {
    // The installed version's own folder, not the link an install swaps: what the route is
    // told stays the version checked here.
    let real = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let plugins_dir = dir.parent().unwrap_or(Path::new("."));
    let machine = Machine::this();
    let checked = onebit_route_package::check(&real).and_then(|checked| {
        checked.runs_on(&machine)?;
        let trusted = owners::judge(&checked, plugins_dir, trust)?;
        Ok((checked, trusted == owners::Trusted::AllowedUnsigned))
    });
    let (checked, allowed_unsigned) = match checked {
        Ok(checked) => checked,
        Err(e) => {
            let name = onebit_route_package::Manifest::read(dir)
                .ok()
                .map(|(m, _)| m.name);
            return (name, Err(e.to_string()), false);
        }
    };
    let name = checked.manifest.name.clone();
    let outcome = loader::load(&checked.route_file())
        .map_err(|e| e.to_string())
        .and_then(|mut route| {
            if route.info.name != name {
                return Err(format!(
                    "package {name} ({}): its route library calls itself {}; reinstall a package whose manifest names its route",
                    dir.display(),
                    route.info.name
                ));
            }
            route.package = Some(package_facts(&checked, &machine));
            Ok(route)
        });
    (Some(name), outcome, allowed_unsigned)
}

/// What a route is told of its package (ABI 1.8): each carried file's path is the variant this
/// CPU runs best (said in one line when there is a choice).
fn package_facts(checked: &Checked, machine: &Machine) -> PackageFacts {
    let dir = std::path::absolute(&checked.dir).unwrap_or_else(|_| checked.dir.clone());
    let m = &checked.manifest;
    PackageFacts {
        name: m.name.clone(),
        version: m.version.clone(),
        vendor: m.vendor.clone(),
        license: m.license.clone(),
        dir: dir.to_string_lossy().into_owned(),
        files: m
            .files
            .iter()
            .map(|f| {
                let chosen = machine.best_variant(f);
                let sha256 = f
                    .every_file()
                    .find(|(path, _, _)| *path == chosen)
                    .map_or(f.sha256.clone(), |(_, sha, _)| sha.to_string());
                if !f.variants.is_empty() {
                    tracing::info!(
                        "1bit serve: package {} {}: {} is {chosen}, the build for this CPU of {}",
                        m.name,
                        m.version,
                        f.path,
                        std::iter::once(f.path.as_str())
                            .chain(f.variants.iter().map(|v| v.path.as_str()))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                PackageFile {
                    path: dir.join(chosen).to_string_lossy().into_owned(),
                    name: f.path.clone(),
                    version: f.version.clone(),
                    sha256,
                }
            })
            .collect(),
        signed_by: match &checked.signed {
            Signed::By(fingerprint) => Some(fingerprint.clone()),
            Signed::Unsigned => None,
        },
    }
}

/// The name and ABI a route library says of itself, through the same loader serve uses.
pub fn probe_route(file: &Path) -> Result<(String, String), String> {
    loader::load(file)
        .map(|route| (route.info.name, route.abi_version))
        .map_err(|e| e.to_string())
}

/// The loaded routes, and the packages that failed, each said in one line as it is skipped,
/// but for a package of the route `device` names when no other route of that name loaded:
/// `choose` refuses with that very line, which is said once.
pub fn loaded(found: Vec<Found>, device: &str) -> (Vec<LoadedRoute>, Vec<Unusable>) {
    let mut routes = Vec::new();
    let mut skipped = Vec::new();
    for f in found {
        match f.outcome {
            Ok(route) => routes.push(route),
            Err(line) => skipped.push((f.package_name, line)),
        }
    }
    let mut unusable = Vec::new();
    for (name, line) in skipped {
        let refused_later = name.as_deref() == Some(device)
            && !routes.iter().any(|r: &LoadedRoute| r.info.name == device);
        if !refused_later {
            tracing::info!("1bit serve: skipping a route: {line}");
        }
        if let Some(name) = name {
            unusable.push(Unusable { name, line });
        }
    }
    (routes, unusable)
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

/// The table `1bit plugins` prints: name, file, ABI version, and whether it loaded; for a
/// package, its version, vendor, license, signer and the files it carries; a route whose own
/// name differs from its file's says so (`--device` takes the route's name); then the shared
/// libraries that are not route files.
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
                let package = route.package.as_ref().map(|p| {
                    format!(
                        "  package {} by {} ({}), {}",
                        p.version,
                        p.vendor,
                        p.license,
                        match (&p.signed_by, f.allowed_unsigned) {
                            (None, _) => "unsigned (installed with --allow-unsigned)".to_string(),
                            (Some(k), true) => format!(
                                "signed by {k}, not a key you trust (installed with --allow-unsigned)"
                            ),
                            (Some(k), false) => format!("signed by {k}"),
                        }
                    )
                });
                out.push_str(&format!(
                    "{:<8} {}{}  ABI {}  loaded: {}{renamed}\n",
                    route.info.name,
                    f.file.display(),
                    package.unwrap_or_default(),
                    route.abi_version,
                    route.info.summary
                ));
                for carried in route.package.iter().flat_map(|p| &p.files) {
                    out.push_str(&format!(
                        "{:<8}   carries {} {}\n",
                        "", carried.name, carried.version
                    ));
                }
            }
            Err(e) => out.push_str(&format!(
                "{:<8} {}  not loaded: {e}\n",
                f.package_name.as_deref().unwrap_or("-"),
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
    unusable: &[Unusable],
    request: &PlanRequest,
) -> Result<(&'a LoadedRoute, Option<Claim>), Fatal> {
    let names = || {
        let mut names: Vec<&str> = routes.iter().map(|r| r.info.name.as_str()).collect();
        names.sort();
        names.join(", ")
    };
    if device != "auto" {
        if !routes.iter().any(|r| r.info.name == device)
            && let Some(failed) = unusable.iter().find(|u| u.name == device)
        {
            return Err(Fatal::backend(format!(
                "--device {device}: {}",
                failed.line
            )));
        }
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
