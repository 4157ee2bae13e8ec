//! Signing a manifest with a vendor's ed25519 key, and verifying it against the keys a user
//! trusts (a folder of public key files, `1bit plugins trust KEYFILE`).
//!
//! The signature covers the manifest's exact bytes, and the manifest covers every file by its
//! sha256, so a signed package cannot change by one byte without the signature failing.

use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::{PackageError, SIGNATURE_FILE, hex};

const SECRET_TAG: &str = "1bit-ed25519-secret-key";
const PUBLIC_TAG: &str = "1bit-ed25519-public-key";

/// A public key, as a user trusts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey {
    key: VerifyingKey,
    /// What the key file says after the key (the vendor's name, say).
    pub comment: String,
}

impl PublicKey {
    /// `ed25519:` and the first 16 hex digits of the key's sha256: how lines name a key.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.key)
    }

    /// Read a public key file (`1bit-ed25519-public-key HEX [comment]`).
    pub fn read(path: &Path) -> Result<PublicKey, PackageError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| PackageError::io("reading", path, &e))?;
        PublicKey::parse(&text).ok_or_else(|| {
            PackageError::new(format!(
                "{}: not a 1bit public key (a line `{PUBLIC_TAG} HEX`); use the .pub file `1bit plugins keygen` wrote, not the .key",
                path.display()
            ))
        })
    }

    fn parse(text: &str) -> Option<PublicKey> {
        let mut words = text.trim().splitn(3, ' ');
        (words.next()? == PUBLIC_TAG).then_some(())?;
        let key = VerifyingKey::from_bytes(&hex::decode::<32>(words.next()?)?).ok()?;
        Some(PublicKey {
            key,
            comment: words.next().unwrap_or("").trim().to_string(),
        })
    }

    fn text(&self) -> String {
        format!(
            "{PUBLIC_TAG} {} {}\n",
            hex::encode(self.key.as_bytes()),
            self.comment
        )
    }
}

fn fingerprint(key: &VerifyingKey) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_bytes());
    format!("ed25519:{}", hex::encode(&digest[..8]))
}

/// A vendor's secret key, which signs manifests.
pub struct SecretKey {
    key: SigningKey,
}

impl SecretKey {
    /// A new key from the operating system's random source.
    pub fn generate() -> Result<SecretKey, PackageError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed)
            .map_err(|e| PackageError::new(format!("no random bytes for a key: {e}")))?;
        Ok(SecretKey {
            key: SigningKey::from_bytes(&seed),
        })
    }

    /// Read a secret key file (`1bit-ed25519-secret-key HEX`).
    pub fn read(path: &Path) -> Result<SecretKey, PackageError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| PackageError::io("reading", path, &e))?;
        let seed = text
            .trim()
            .strip_prefix(SECRET_TAG)
            .and_then(|rest| hex::decode::<32>(rest.trim()));
        seed.map(|seed| SecretKey {
            key: SigningKey::from_bytes(&seed),
        })
        .ok_or_else(|| {
            PackageError::new(format!(
                "{}: not a 1bit secret key (a line `{SECRET_TAG} HEX`); make one with `1bit plugins keygen NAME`",
                path.display()
            ))
        })
    }

    /// The public half, with `comment`.
    pub fn public(&self, comment: &str) -> PublicKey {
        PublicKey {
            key: self.key.verifying_key(),
            comment: comment.to_string(),
        }
    }

    /// Write `BASE.key` (readable by its owner alone) and `BASE.pub`; refuses to overwrite
    /// either. Returns both paths.
    pub fn write_pair(
        &self,
        base: &Path,
        comment: &str,
    ) -> Result<(PathBuf, PathBuf), PackageError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let with = |ext: &str| {
            let mut name = base.as_os_str().to_owned();
            name.push(ext);
            PathBuf::from(name)
        };
        let (secret_path, public_path) = (with(".key"), with(".pub"));
        for path in [&secret_path, &public_path] {
            if path.exists() {
                return Err(PackageError::new(format!(
                    "{} exists; keygen never overwrites a key: pick another name or move it away",
                    path.display()
                )));
            }
        }
        let mut secret = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&secret_path)
            .map_err(|e| PackageError::io("creating", &secret_path, &e))?;
        secret
            .write_all(format!("{SECRET_TAG} {}\n", hex::encode(self.key.as_bytes())).as_bytes())
            .map_err(|e| PackageError::io("writing", &secret_path, &e))?;
        std::fs::write(&public_path, self.public(comment).text())
            .map_err(|e| PackageError::io("writing", &public_path, &e))?;
        Ok((secret_path, public_path))
    }

    /// Sign the manifest bytes of the package folder `dir`: writes [`SIGNATURE_FILE`].
    pub fn sign_package(&self, dir: &Path, manifest_bytes: &[u8]) -> Result<String, PackageError> {
        let file = SignatureFile {
            key: hex::encode(self.key.verifying_key().as_bytes()),
            signature: hex::encode(&self.key.sign(manifest_bytes).to_bytes()),
        };
        let path = dir.join(SIGNATURE_FILE);
        let text = serde_json::to_string_pretty(&file).expect("a signature always encodes") + "\n";
        std::fs::write(&path, text).map_err(|e| PackageError::io("writing", &path, &e))?;
        Ok(fingerprint(&self.key.verifying_key()))
    }
}

/// [`SIGNATURE_FILE`]'s content: the signing key and its signature of the manifest's bytes.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct SignatureFile {
    key: String,
    signature: String,
}

/// What a package's signature says, before trust is asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signed {
    /// No [`SIGNATURE_FILE`].
    Unsigned,
    /// Signed, and the signature verifies over the manifest, by the key with this fingerprint.
    By(String),
}

/// Read the signature of the package folder `dir` and verify it over `manifest_bytes`. A
/// signature that does not verify (the manifest changed after signing, or the file is not a
/// signature) is an error.
pub fn signature_of(dir: &Path, manifest_bytes: &[u8]) -> Result<Signed, PackageError> {
    let path = dir.join(SIGNATURE_FILE);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Signed::Unsigned),
        Err(e) => return Err(PackageError::io("reading", &path, &e)),
    };
    let bad = |why: &str| {
        PackageError::new(format!(
            "{}: {why}; the package was changed after its vendor signed it, or the signature is damaged: get the package again from its vendor",
            path.display()
        ))
    };
    let file: SignatureFile =
        serde_json::from_slice(&text).map_err(|_| bad("not a package signature"))?;
    let key = hex::decode::<32>(&file.key)
        .and_then(|k| VerifyingKey::from_bytes(&k).ok())
        .ok_or_else(|| bad("its key is not an ed25519 key"))?;
    let signature = hex::decode::<64>(&file.signature)
        .map(|s| Signature::from_bytes(&s))
        .ok_or_else(|| bad("its signature is not an ed25519 signature"))?;
    key.verify(manifest_bytes, &signature)
        .map_err(|_| bad("the signature does not match the manifest"))?;
    Ok(Signed::By(fingerprint(&key)))
}

/// The keys a user trusts: every `*.pub` file in one folder.
pub struct TrustStore {
    /// The folder.
    pub dir: PathBuf,
}

impl TrustStore {
    /// The variable that sets the trust store's folder (tests, system-wide installs).
    pub const DIR_VAR: &str = "ONEBIT_TRUST_DIR";

    /// The user's: `$ONEBIT_TRUST_DIR`, else `$XDG_CONFIG_HOME/1bit/trusted-keys`, else
    /// `$HOME/.config/1bit/trusted-keys`. None without any of the three.
    pub fn users() -> Option<TrustStore> {
        let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        if let Some(dir) = env(TrustStore::DIR_VAR) {
            return Some(TrustStore {
                dir: PathBuf::from(dir),
            });
        }
        let config = env("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".config")))?;
        Some(TrustStore {
            dir: config.join("1bit").join("trusted-keys"),
        })
    }

    /// The trusted keys; a file that is not a key is skipped.
    pub fn keys(&self) -> Vec<PublicKey> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "pub"))
            .collect();
        paths.sort();
        paths
            .iter()
            .filter_map(|p| PublicKey::read(p).ok())
            .collect()
    }

    /// The trusted key with this fingerprint.
    pub fn find(&self, fingerprint: &str) -> Option<PublicKey> {
        self.keys()
            .into_iter()
            .find(|k| k.fingerprint() == fingerprint)
    }

    /// Stop trusting a key, named by its fingerprint (`ed25519:...`) or by its `.pub` file:
    /// removes every file of the store holding it. Returns the key; an error when the store
    /// does not hold it (the line lists the keys it holds).
    pub fn distrust(&self, key: &str) -> Result<PublicKey, PackageError> {
        let fingerprint = if key.starts_with("ed25519:") {
            key.to_string()
        } else {
            PublicKey::read(Path::new(key))?.fingerprint()
        };
        let mut removed = None;
        for path in std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
        {
            if let Ok(k) = PublicKey::read(&path)
                && k.fingerprint() == fingerprint
            {
                std::fs::remove_file(&path).map_err(|e| PackageError::io("removing", &path, &e))?;
                removed = Some(k);
            }
        }
        removed.ok_or_else(|| {
            let held: Vec<String> = self.keys().iter().map(PublicKey::fingerprint).collect();
            PackageError::new(format!(
                "key {fingerprint} is not trusted in {} (trusted: {}); `1bit plugins trusted` lists them",
                self.dir.display(),
                if held.is_empty() { "none".to_string() } else { held.join(", ") }
            ))
        })
    }

    /// Trust the public key in `file`: copies it in as `FINGERPRINT.pub`. Returns the key.
    pub fn trust(&self, file: &Path) -> Result<PublicKey, PackageError> {
        let key = PublicKey::read(file)?;
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| PackageError::io("creating", &self.dir, &e))?;
        let name = key.fingerprint().replace(':', "-") + ".pub";
        let path = self.dir.join(name);
        std::fs::write(&path, key.text()).map_err(|e| PackageError::io("writing", &path, &e))?;
        Ok(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::scratch;

    #[test]
    fn a_signed_manifest_verifies_and_one_changed_byte_does_not() {
        let dir = scratch("sign");
        let key = SecretKey::generate().unwrap();
        let manifest = b"{\"name\":\"acme\"}\n".to_vec();
        let fp = key.sign_package(&dir, &manifest).unwrap();
        assert_eq!(
            signature_of(&dir, &manifest).unwrap(),
            Signed::By(fp.clone())
        );
        assert!(fp.starts_with("ed25519:") && fp.len() == 8 + 16, "{fp}");
        let mut changed = manifest.clone();
        changed[3] ^= 1;
        let why = signature_of(&dir, &changed).unwrap_err().to_string();
        assert!(why.contains("does not match the manifest"), "{why}");
        std::fs::write(dir.join(SIGNATURE_FILE), "garbage").unwrap();
        let why = signature_of(&dir, &manifest).unwrap_err().to_string();
        assert!(why.contains("not a package signature"), "{why}");
        std::fs::remove_file(dir.join(SIGNATURE_FILE)).unwrap();
        assert_eq!(signature_of(&dir, &manifest).unwrap(), Signed::Unsigned);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn keygen_writes_a_pair_the_store_trusts_and_never_overwrites() {
        let dir = scratch("keys");
        let key = SecretKey::generate().unwrap();
        let (secret, public) = key.write_pair(&dir.join("acme"), "Acme NPU Inc.").unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "the secret key is the owner's alone");
        let again = SecretKey::read(&secret).unwrap();
        assert_eq!(again.public("").fingerprint(), key.public("").fingerprint());
        let why = key
            .write_pair(&dir.join("acme"), "")
            .unwrap_err()
            .to_string();
        assert!(why.contains("never overwrites"), "{why}");
        let store = TrustStore {
            dir: dir.join("trusted"),
        };
        assert!(store.find(&key.public("").fingerprint()).is_none());
        let trusted = store.trust(&public).unwrap();
        assert_eq!(trusted.comment, "Acme NPU Inc.");
        assert!(store.find(&key.public("").fingerprint()).is_some());
        let why = store.trust(&secret).unwrap_err().to_string();
        assert!(why.contains("not a 1bit public key"), "{why}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
