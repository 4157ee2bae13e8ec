//! Installing a package into a route folder, and removing it, so that a serve starting at any
//! moment sees the old version whole or the new version whole, never a mix.
//!
//! Layout of a route folder `DIR` (`PREFIX/lib/1bit/plugins`):
//!
//! ```text
//! DIR/acme -> .1bit-packages/acme-1.2.0-PID-N     the installed package: a link, swapped by rename
//! DIR/.1bit-packages/acme-1.2.0-PID-N/            its files, as checked
//! DIR/.1bit-packages/incoming-PID-N/              an install under way (or cut short)
//! ```
//!
//! An install unpacks and checks everything in `incoming-*` first (manifest, checksums,
//! signature, ABI, the route's own name); only then does one `rename` of a link make it the
//! installed version. An install cut short (an error, a kill) leaves the old link untouched;
//! its leftovers, named with the dead process's id, are removed by the next install.

use std::path::{Path, PathBuf};

use crate::keys::{Signed, TrustStore};
use crate::owners::Owner;
use crate::platform::Machine;
use crate::{Checked, PackageError, archive, check};

/// The hidden folder of a route folder that holds the packages' files.
pub const STORE: &str = ".1bit-packages";

/// Opens a route library (the host's loader: ABI and layout checks, then `info`) and says its
/// name and ABI version, or why it is not a route.
pub type ProbeRoute = dyn Fn(&Path) -> Result<(String, String), String>;

/// What an install is allowed and checks.
pub struct Install<'a> {
    /// The route folder to install into.
    pub plugins_dir: PathBuf,
    /// The keys the user trusts.
    pub trust: &'a TrustStore,
    /// `--allow-unsigned`: install a package that is unsigned or signed by an untrusted key.
    pub allow_unsigned: bool,
    /// `--new-signer`: install a package signed by another key than the one the installed
    /// route name belongs to ([`crate::owners`]).
    pub new_signer: bool,
    /// The machine the package must run on ([`Machine::this`], or another in tests).
    pub machine: Machine,
    /// This host's plugin ABI.
    pub host_abi: semver::Version,
    /// How the route library's own name and ABI are read.
    pub probe_route: &'a ProbeRoute,
}

/// What an install did.
#[derive(Debug)]
pub struct Installed {
    /// The package as checked, in its installed folder.
    pub package: Checked,
    /// The link serve finds it by (`DIR/NAME`).
    pub link: PathBuf,
    /// The version it replaced, if any.
    pub replaced: Option<String>,
}

impl Install<'_> {
    /// Install the package folder or archive `source`. Nothing changes in the route folder
    /// unless every check passes.
    pub fn run(&self, source: &Path) -> Result<Installed, PackageError> {
        let store = self.plugins_dir.join(STORE);
        std::fs::create_dir_all(&store).map_err(|e| PackageError::io("creating", &store, &e))?;
        remove_leftovers(&self.plugins_dir);
        let staging = store.join(format!("incoming-{}-{}", std::process::id(), nonce()));
        std::fs::create_dir(&staging).map_err(|e| PackageError::io("creating", &staging, &e))?;
        let outcome = self.stage_and_swap(source, &staging);
        if outcome.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        outcome
    }

    fn stage_and_swap(&self, source: &Path, staging: &Path) -> Result<Installed, PackageError> {
        let staged = if archive::is_archive(source) {
            archive::unpack(source, staging)?
        } else {
            // A folder is checked where it is, before anything of it is copied.
            let original = check(source)?;
            copy_package(&original, staging)?;
            staging.to_path_buf()
        };
        let checked = check(&staged)?;
        let manifest = &checked.manifest;
        let label = format!("package {} {}", manifest.name, manifest.version);
        self.check_abi(&label, &manifest.abi)?;
        self.check_signature(&label, &checked.signed)?;
        let owner = self.owner_after(&label, &checked)?;
        // Before the route library is opened: a package for another CPU would crash here.
        checked.runs_on(&self.machine)?;
        let (route_name, route_abi) = (self.probe_route)(&checked.route_file()).map_err(|why| {
            PackageError::new(format!("{label}: its route library does not load: {why}"))
        })?;
        if route_name != manifest.name {
            return Err(PackageError::new(format!(
                "{label}: its route library calls itself {route_name}, not {}; rebuild the package with the route's own name",
                manifest.name
            )));
        }
        if route_abi != manifest.abi {
            return Err(PackageError::new(format!(
                "{label}: its route library was built against ABI {route_abi}, but its manifest says {}; rebuild the package with `1bit plugins package`",
                manifest.abi
            )));
        }
        let link = self.plugins_dir.join(&manifest.name);
        let replaced = self.installed_version(&link, &label, &manifest.version)?;
        let final_name = format!(
            "{}-{}-{}-{}",
            manifest.name,
            manifest.version,
            std::process::id(),
            nonce()
        );
        let final_dir = self.plugins_dir.join(STORE).join(&final_name);
        std::fs::rename(&staged, &final_dir)
            .map_err(|e| PackageError::io("placing", &final_dir, &e))?;
        if staged != staging {
            let _ = std::fs::remove_dir_all(staging);
        }
        let old_target = std::fs::read_link(&link).ok();
        swap_link(&link, &Path::new(STORE).join(&final_name)).inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&final_dir);
        })?;
        if let Some(old) = old_target {
            let _ = std::fs::remove_dir_all(self.plugins_dir.join(old));
        }
        owner.write(&self.plugins_dir)?;
        Ok(Installed {
            package: Checked {
                dir: link.clone(),
                ..checked
            },
            link,
            replaced,
        })
    }

    fn check_abi(&self, label: &str, abi: &str) -> Result<(), PackageError> {
        let host = &self.host_abi;
        let compatible = semver::Version::parse(abi)
            .is_ok_and(|route| route.major == host.major && route.minor <= host.minor);
        if compatible {
            Ok(())
        } else {
            Err(PackageError::new(format!(
                "{label} was built against route ABI {abi}, but this 1bit has ABI {host}; install a 1bit as new as the package, or a package built for ABI {}.0 to {}.{}",
                host.major, host.major, host.minor
            )))
        }
    }

    fn check_signature(&self, label: &str, signed: &Signed) -> Result<(), PackageError> {
        if self.allow_unsigned {
            return Ok(());
        }
        match signed {
            Signed::By(fingerprint) if self.trust.find(fingerprint).is_some() => Ok(()),
            Signed::By(fingerprint) => Err(PackageError::new(format!(
                "{label} is signed by key {fingerprint}, which you do not trust; if it is its vendor's, `1bit plugins trust VENDOR.pub` first (keys in {}), or pass --allow-unsigned",
                self.trust.dir.display()
            ))),
            Signed::Unsigned => Err(PackageError::new(format!(
                "{label} is not signed; install only what you trust to run inside serve: pass --allow-unsigned to install it anyway"
            ))),
        }
    }

    /// The owner record the install leaves: the signer, when the user trusts it, owns the
    /// name; otherwise (`--allow-unsigned`) this very manifest is allowed. Refuses a package
    /// signed by another key than the one the installed name belongs to, unless `new_signer`.
    fn owner_after(&self, label: &str, checked: &Checked) -> Result<Owner, PackageError> {
        let name = &checked.manifest.name;
        let key = match &checked.signed {
            Signed::By(key) if self.trust.find(key).is_some() => Some(key.clone()),
            _ => None,
        };
        let owning = Owner::read(&self.plugins_dir, name).and_then(|o| o.key);
        if let Some(owning) = owning
            && key.as_ref() != Some(&owning)
            && !self.new_signer
        {
            let signer = match &checked.signed {
                Signed::By(k) => format!("is signed by key {k}"),
                Signed::Unsigned => "is not signed".to_string(),
            };
            return Err(PackageError::new(format!(
                "{label} {signer}, but route {name} belongs to key {owning}, which signed the installed version; pass --new-signer if its vendor changed keys"
            )));
        }
        Ok(Owner {
            name: name.clone(),
            allowed_manifest: key
                .is_none()
                .then(|| crate::sha256_bytes(&checked.manifest_bytes)),
            key,
        })
    }

    /// The version installed at `link`, when there is one; refuses a downgrade and a folder
    /// at `link` that this installer did not make.
    fn installed_version(
        &self,
        link: &Path,
        label: &str,
        new: &str,
    ) -> Result<Option<String>, PackageError> {
        let Ok(meta) = std::fs::symlink_metadata(link) else {
            return Ok(None);
        };
        if !meta.file_type().is_symlink() {
            return Err(PackageError::new(format!(
                "{label}: {} exists and was not installed by `1bit plugins install`; move it away first",
                link.display()
            )));
        }
        let Ok((old, _)) = crate::Manifest::read(link) else {
            return Ok(None);
        };
        let older = |a: &str, b: &str| match (semver::Version::parse(a), semver::Version::parse(b))
        {
            (Ok(a), Ok(b)) => a < b,
            _ => false,
        };
        if older(new, &old.version) {
            return Err(PackageError::new(format!(
                "{label} is older than the installed {}; `1bit plugins remove {}` first to go back",
                old.version, old.name
            )));
        }
        Ok(Some(old.version))
    }
}

/// Remove the installed package `name` from `plugins_dir`: its link first (a serve starting
/// now no longer finds it), then its files. Returns the version removed.
pub fn remove(plugins_dir: &Path, name: &str) -> Result<String, PackageError> {
    let link = plugins_dir.join(name);
    let is_link = std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink());
    if !is_link {
        let names = installed(plugins_dir)
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect::<Vec<_>>();
        return Err(PackageError::new(format!(
            "no package {name} is installed in {} (installed: {}); `1bit plugins` lists them",
            plugins_dir.display(),
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        )));
    }
    let version = crate::Manifest::read(&link)
        .map(|(m, _)| m.version)
        .unwrap_or_else(|_| "?".to_string());
    let target = std::fs::read_link(&link).map_err(|e| PackageError::io("reading", &link, &e))?;
    std::fs::remove_file(&link).map_err(|e| PackageError::io("removing", &link, &e))?;
    Owner::remove(plugins_dir, name);
    sync_dir(plugins_dir);
    let _ = std::fs::remove_dir_all(plugins_dir.join(target));
    Ok(version)
}

/// The package folders installed in `plugins_dir` (its links), by name.
pub fn installed(plugins_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(plugins_dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()))
        .filter(|p| p.join(crate::MANIFEST_FILE).is_file())
        .collect();
    out.sort();
    out
}

/// Copy the checked package's files (and nothing else) into `into`.
fn copy_package(package: &Checked, into: &Path) -> Result<(), PackageError> {
    let m = &package.manifest;
    let mut names: Vec<&str> = vec![crate::MANIFEST_FILE, m.route.path.as_str()];
    names.extend(
        m.files
            .iter()
            .flat_map(|f| f.every_file().map(|(path, _, _)| path)),
    );
    if package.dir.join(crate::SIGNATURE_FILE).is_file() {
        names.push(crate::SIGNATURE_FILE);
    }
    for name in names {
        let (from, to) = (package.dir.join(name), into.join(name));
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| PackageError::io("creating", parent, &e))?;
        }
        std::fs::copy(&from, &to).map_err(|e| PackageError::io("copying", &from, &e))?;
        std::fs::File::open(&to)
            .and_then(|f| f.sync_all())
            .map_err(|e| PackageError::io("writing", &to, &e))?;
    }
    Ok(())
}

/// Point `link` at `target` in one step: a new link beside it, renamed over it.
fn swap_link(link: &Path, target: &Path) -> Result<(), PackageError> {
    let dir = link.parent().unwrap_or(Path::new("."));
    sync_dir(&dir.join(STORE));
    let temporary = dir.join(format!(".1bit-link-{}-{}", std::process::id(), nonce()));
    std::os::unix::fs::symlink(target, &temporary)
        .map_err(|e| PackageError::io("linking", &temporary, &e))?;
    std::fs::rename(&temporary, link).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        PackageError::io("installing", link, &e)
    })?;
    sync_dir(dir);
    Ok(())
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Remove what installs cut short left: store folders no link points to whose installer
/// (the process id in the name) is gone, and stray temporary links.
fn remove_leftovers(plugins_dir: &Path) {
    let linked: std::collections::HashSet<PathBuf> = installed(plugins_dir)
        .iter()
        .filter_map(|l| std::fs::read_link(l).ok())
        .filter_map(|t| t.file_name().map(PathBuf::from))
        .collect();
    let dead = |name: &str| {
        let pid = name.rsplit('-').nth(1).and_then(|p| p.parse::<u32>().ok());
        pid.is_some_and(|pid| {
            pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
        })
    };
    let entries = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .map(|es| es.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    };
    for path in entries(&plugins_dir.join(STORE)) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !linked.contains(Path::new(&name)) && dead(&name) {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
    for path in entries(plugins_dir) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with(".1bit-link-") && dead(&name) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// A number no other install of this process used.
fn nonce() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
#[path = "install_tests.rs"]
mod tests;
