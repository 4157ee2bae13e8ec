//! Trust that holds at every start: who a route name belongs to in a route folder, and the
//! judgment serve makes each time it loads a package (not only at install).
//!
//! `1bit plugins install` records, in `DIR/.1bit-owners/NAME.json`, the key that
//! signed the installed package (the name then belongs to that key: an upgrade signed by
//! another is refused without `--new-signer`), or, for `--allow-unsigned`, the sha256 of the
//! exact manifest the user allowed. At every start serve loads a package only when its signer
//! is a key the user trusts now (and, where the name has an owner, that key), or when it is
//! the very package the user allowed unsigned. A key removed from the trust store
//! (`1bit plugins distrust`) thus stops every package it signed at the next start; a package
//! copied into a route folder by hand loads only if a trusted key signed it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::keys::{Signed, TrustStore};
use crate::{Checked, PackageError};

/// The hidden folder of a route folder that holds its owner records.
pub const OWNERS: &str = ".1bit-owners";

/// Who installed a route name in a route folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The route's name.
    pub name: String,
    /// The key that signed the installed package: the name belongs to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Installed with `--allow-unsigned`: the sha256 of the manifest the user allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_manifest: Option<String>,
}

impl Owner {
    /// The record's path for route `name` in the route folder `plugins_dir`.
    pub fn path(plugins_dir: &Path, name: &str) -> PathBuf {
        plugins_dir.join(OWNERS).join(format!("{name}.json"))
    }

    /// The record of route `name` in `plugins_dir`, if one was written.
    pub fn read(plugins_dir: &Path, name: &str) -> Option<Owner> {
        let text = std::fs::read(Owner::path(plugins_dir, name)).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Write the record (a new file renamed over the old one).
    pub fn write(&self, plugins_dir: &Path) -> Result<(), PackageError> {
        let path = Owner::path(plugins_dir, &self.name);
        let dir = path.parent().unwrap_or(plugins_dir);
        std::fs::create_dir_all(dir).map_err(|e| PackageError::io("creating", dir, &e))?;
        let fresh = path.with_extension(format!("json.{}", std::process::id()));
        let text = serde_json::to_vec_pretty(self).expect("an owner record always encodes");
        std::fs::write(&fresh, text).map_err(|e| PackageError::io("writing", &fresh, &e))?;
        std::fs::rename(&fresh, &path).map_err(|e| PackageError::io("writing", &path, &e))
    }

    /// Remove the record of route `name` (its package was removed).
    pub fn remove(plugins_dir: &Path, name: &str) {
        let _ = std::fs::remove_file(Owner::path(plugins_dir, name));
    }
}

/// How a package earned its load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trusted {
    /// Signed by this key, which the user trusts (and which owns the name, where one does).
    SignedBy(String),
    /// Installed with `--allow-unsigned`, this very manifest.
    AllowedUnsigned,
}

/// Judge the checked package `checked`, found in the route folder `plugins_dir`, against the
/// trust store now. The error is one line naming the package and the command that repairs
/// it. Called by serve before the package's library is opened; reads a few small files.
pub fn judge(
    checked: &Checked,
    plugins_dir: &Path,
    store: Option<&TrustStore>,
) -> Result<Trusted, PackageError> {
    let m = &checked.manifest;
    let label = format!(
        "package {} {} ({})",
        m.name,
        m.version,
        checked.dir.display()
    );
    let owner = Owner::read(plugins_dir, &m.name);
    let allowed = owner.as_ref().and_then(|o| o.allowed_manifest.as_deref());
    if allowed.is_some_and(|sha| sha == crate::sha256_bytes(&checked.manifest_bytes)) {
        return Ok(Trusted::AllowedUnsigned);
    }
    let store_dir = || {
        store.map_or(
            "no trust store: set HOME or ONEBIT_TRUST_DIR".to_string(),
            |s| s.dir.display().to_string(),
        )
    };
    match &checked.signed {
        Signed::Unsigned => Err(PackageError::new(format!(
            "{label} is not signed, and was not installed with --allow-unsigned; install it with `1bit plugins install ARCHIVE --allow-unsigned` if you trust it, or remove it"
        ))),
        Signed::By(key) if store.is_none_or(|s| s.find(key).is_none()) => {
            Err(PackageError::new(format!(
                "{label} is signed by key {key}, which is not trusted now (trusted keys in {}); `1bit plugins trust VENDOR.pub` if it is its vendor's, or `1bit plugins remove {}`",
                store_dir(),
                m.name
            )))
        }
        Signed::By(key) => match owner.and_then(|o| o.key) {
            Some(owning) if &owning != key => Err(PackageError::new(format!(
                "{label} is signed by key {key}, but route {} belongs to key {owning}, which installed it; `1bit plugins install ARCHIVE --new-signer` if the vendor changed keys",
                m.name
            ))),
            _ => Ok(Trusted::SignedBy(key.clone())),
        },
    }
}
