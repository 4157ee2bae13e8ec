//! Route packages: what a vendor ships and a user drops into `1bit serve`.
//!
//! A package is one folder (or the same folder as a `.tar.gz`) holding a route library
//! (`libonebit_route_NAME.so`), the libraries it carries (a vendor's closed kernels, say) and
//! a manifest, [`MANIFEST_FILE`], that names every file with its sha256; optionally a
//! signature of the manifest by the vendor's ed25519 key, [`SIGNATURE_FILE`]. This crate
//! makes packages ([`make`]), checks them ([`check`]), signs and verifies them ([`keys`]),
//! judges where they run ([`platform`]) and whom they belong to ([`owners`]), and installs
//! and removes them atomically ([`install`]). It never loads a library: the
//! host does that, after [`check`] passed.
//!
//! Every error is one line saying what is wrong and what to do ([`PackageError`]).

#![forbid(unsafe_code)]

pub mod archive;
pub mod check;
pub mod install;
pub mod keys;
pub mod make;
pub mod manifest;
pub mod owners;
pub mod platform;

mod error;
mod hex;

pub use check::{Checked, check};
pub use error::PackageError;
pub use manifest::{CarriedFile, Manifest, Platform, RouteFile, Variant};

/// The manifest's file name inside a package folder.
pub const MANIFEST_FILE: &str = "1bit-package.json";
/// The signature's file name inside a package folder (absent: the package is unsigned).
pub const SIGNATURE_FILE: &str = "1bit-package.sig";
/// The manifest format this crate writes and reads.
pub const FORMAT: u32 = 1;

/// The sha256 of `bytes`, lowercase hex.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(bytes))
}

/// The sha256 of a file, lowercase hex, read in 1 MiB pieces. Blocks on the disk.
pub fn sha256_of(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(&hasher.finalize()))
}

#[cfg(test)]
pub(crate) mod testing {
    use std::path::PathBuf;

    /// A fresh, empty folder under the system's temporary folder, removed by the caller.
    pub fn scratch(name: &str) -> PathBuf {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "onebit-package-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
