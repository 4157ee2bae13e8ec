//! `1bit plugins install|remove|trust|keygen|package` (and `check`, run by `plugin_check`):
//! route packages from the command line, for the vendor who makes them and the user who drops
//! them in (docs/plugins.md).

use std::path::{Path, PathBuf};

use onebit_plugin_api::ABI_VERSION;
use onebit_plugin_api::loader;
use onebit_route_package::install::{self, Install};
use onebit_route_package::keys::{SecretKey, Signed, TrustStore};
use onebit_route_package::make::{self, Carry, CarryVariant, Meta};
use onebit_route_package::platform::Machine;
use onebit_route_package::{PackageError, archive};

use onebit_command::cli::{PackageArgs, PluginAction};
use onebit_command::error::exit;

/// Run one `1bit plugins` action; its exit status. An error is one line on stderr, exit 1
/// (clap refuses bad usage before this, exit 2).
pub fn run(action: PluginAction) -> i32 {
    let outcome = match action {
        PluginAction::Install {
            package,
            prefix,
            allow_unsigned,
            new_signer,
        } => install_package(&package, prefix.as_deref(), allow_unsigned, new_signer),
        PluginAction::Remove { name, prefix } => plugins_dir(prefix.as_deref()).and_then(|dir| {
            let version = install::remove(&dir, &name)?;
            println!("removed {name} {version} from {}", dir.display());
            Ok(())
        }),
        PluginAction::Trust { key } => trust(&key),
        PluginAction::Distrust { key } => distrust(&key),
        PluginAction::Keygen { name, comment } => keygen(&name, &comment),
        PluginAction::Package(args) => package(&args),
        PluginAction::Check {
            file,
            model,
            route_opt,
            real_backends,
            ready_s,
        } => {
            let asked = crate::plugin_check::Asked {
                route_opt: &route_opt,
                real_backends,
                ready: std::time::Duration::from_secs(ready_s),
            };
            return crate::plugin_check::run(&file, model.as_deref(), &asked);
        }
    };
    match outcome {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("1bit plugins: {e}");
            exit::BACKEND
        }
    }
}

/// `PREFIX/lib/1bit/plugins`, or the user's route folder.
fn plugins_dir(prefix: Option<&Path>) -> Result<PathBuf, PackageError> {
    match prefix {
        Some(prefix) => Ok(prefix.join(crate::routes::PREFIX_PLUGINS)),
        None => crate::routes::user_dir().ok_or_else(|| {
            PackageError::new(
                "HOME is not set, so there is no user route folder; pass --prefix DIR",
            )
        }),
    }
}

fn install_package(
    source: &Path,
    prefix: Option<&Path>,
    allow_unsigned: bool,
    new_signer: bool,
) -> Result<(), PackageError> {
    if !source.exists() {
        return Err(PackageError::new(format!(
            "{}: no such package folder or archive",
            source.display()
        )));
    }
    let trust = user_trust()?;
    let host_abi = semver::Version::parse(ABI_VERSION).expect("the ABI version is semver");
    let installer = Install {
        plugins_dir: plugins_dir(prefix)?,
        trust: &trust,
        allow_unsigned,
        new_signer,
        machine: Machine::this(),
        host_abi,
        probe_route: &crate::routes::probe_route,
    };
    let done = installer.run(source)?;
    let m = &done.package.manifest;
    let signed = match &done.package.signed {
        Signed::By(key) => format!("signed by {key}"),
        Signed::Unsigned => "unsigned (--allow-unsigned)".to_string(),
    };
    let replaced = done
        .replaced
        .map(|v| format!(", replacing {v}"))
        .unwrap_or_default();
    println!(
        "installed {} {} by {} ({signed}) in {}{replaced}; serve it with `1bit serve -m MODEL --device {}`",
        m.name,
        m.version,
        m.vendor,
        done.link.display(),
        m.name
    );
    Ok(())
}

fn user_trust() -> Result<TrustStore, PackageError> {
    TrustStore::users().ok_or_else(|| {
        PackageError::new(
            "none of ONEBIT_TRUST_DIR, XDG_CONFIG_HOME and HOME is set, so there are no trusted keys; set HOME or ONEBIT_TRUST_DIR",
        )
    })
}

/// `1bit plugins distrust KEY`: the key leaves the trust store; the packages it signed that
/// serve would find now are named, each stopping at serve's next start.
fn distrust(key: &str) -> Result<(), PackageError> {
    let store = user_trust()?;
    let removed = store.distrust(key)?;
    let fingerprint = removed.fingerprint();
    println!(
        "distrusted key {fingerprint}{} (removed from {})",
        if removed.comment.is_empty() {
            String::new()
        } else {
            format!(" ({})", removed.comment)
        },
        store.dir.display()
    );
    let dirs = crate::routes::search_dirs(&[]);
    for dir in &dirs {
        for package in install::installed(dir) {
            let Ok((m, bytes)) = onebit_route_package::Manifest::read(&package) else {
                continue;
            };
            let signer = onebit_route_package::keys::signature_of(&package, &bytes);
            if signer.is_ok_and(|s| s == Signed::By(fingerprint.clone())) {
                println!(
                    "package {} {} ({}) was signed by it: it no longer loads; `1bit plugins remove {}`, or install a version signed by a key you trust",
                    m.name,
                    m.version,
                    package.display(),
                    m.name
                );
            }
        }
    }
    Ok(())
}

fn trust(key: &Path) -> Result<(), PackageError> {
    let store = user_trust()?;
    let key = store.trust(key)?;
    println!(
        "trusted key {} {}in {}",
        key.fingerprint(),
        if key.comment.is_empty() {
            String::new()
        } else {
            format!("({}) ", key.comment)
        },
        store.dir.display()
    );
    Ok(())
}

fn keygen(name: &Path, comment: &str) -> Result<(), PackageError> {
    let key = SecretKey::generate()?;
    let (secret, public) = key.write_pair(name, comment)?;
    println!(
        "wrote {} (secret: keep it out of every package and repository) and {} (give it to your users), key {}",
        secret.display(),
        public.display(),
        key.public(comment).fingerprint()
    );
    Ok(())
}

fn package(args: &PackageArgs) -> Result<(), PackageError> {
    let route = loader::load(&args.route).map_err(|e| {
        PackageError::new(format!(
            "{e}; package a route library built with `cargo build --release`"
        ))
    })?;
    let carry = args
        .carry
        .iter()
        .map(|c| Carry::parse(c).map_err(PackageError::new))
        .collect::<Result<Vec<_>, _>>()?;
    // `native`: this build machine's own CPU features, for a build made for this CPU alone.
    let native = |features: Vec<String>| {
        if features == ["native"] {
            Machine::this().cpu_features.into_iter().collect()
        } else {
            features
        }
    };
    let variants = args
        .variant
        .iter()
        .map(|v| {
            CarryVariant::parse(v)
                .map(|v| CarryVariant {
                    cpu_features: native(v.cpu_features),
                    ..v
                })
                .map_err(PackageError::new)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let key = args.sign.as_deref().map(SecretKey::read).transpose()?;
    let meta = Meta {
        name: route.info.name.clone(),
        version: args.package_version.clone(),
        abi: route.abi_version.clone(),
        vendor: args.vendor.clone(),
        summary: args.summary.clone().unwrap_or(route.info.summary),
        license: args.license.clone(),
        cpu_features: native(args.cpu_features.clone()),
    };
    let dir = make::folder(&args.route, &carry, &variants, &meta, &args.out)?;
    if let Some(key) = key {
        let manifest = dir.join(onebit_route_package::MANIFEST_FILE);
        let bytes =
            std::fs::read(&manifest).map_err(|e| PackageError::io("reading", &manifest, &e))?;
        let fingerprint = key.sign_package(&dir, &bytes)?;
        println!("signed with {fingerprint}");
    }
    let archive = archive::pack(&dir)?;
    println!(
        "package {} {} (ABI {}, {} carried file{}) in {}",
        meta.name,
        meta.version,
        meta.abi,
        carry.len(),
        if carry.len() == 1 { "" } else { "s" },
        dir.display()
    );
    println!("{}", archive.display());
    Ok(())
}
