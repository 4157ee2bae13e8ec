//! The API key (`--api-key`, `ONEBIT_API_KEY`, `--api-key-file`): every route but `/health`
//! then needs `Authorization: Bearer KEY`. Only the key's SHA-256 is kept, and a request's key
//! is compared with it in constant time, so neither the key nor how much of it a caller
//! guessed shows in memory dumps, logs or timing.

use sha2::{Digest, Sha256};

/// The key serve was started with. Its `Debug` shows nothing of it.
#[derive(Clone)]
pub struct ApiKey {
    digest: [u8; 32],
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

/// Why a request's key was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRefusal {
    /// No `Authorization: Bearer ...` header.
    Missing,
    /// A key, not serve's.
    Wrong,
}

impl ApiKey {
    /// The key from `--api-key`/`ONEBIT_API_KEY`, else the first line of `--api-key-file`;
    /// None when neither is given. Called once by `serve` before anything starts.
    pub fn from_args(
        flag: Option<&str>,
        file: Option<&std::path::Path>,
    ) -> Result<Option<ApiKey>, String> {
        let key = match (flag, file) {
            (Some(key), _) => key.to_string(),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "cannot read the API key file {} ({e}); pass a readable file to --api-key-file",
                        path.display()
                    )
                })?;
                text.lines().next().unwrap_or("").to_string()
            }
            (None, None) => return Ok(None),
        };
        let key = key.trim();
        if key.is_empty() {
            return Err("the API key is empty; pass a non-empty key to --api-key (or ONEBIT_API_KEY, or --api-key-file)".into());
        }
        if key.bytes().any(|b| b.is_ascii_control() || b == b' ') {
            return Err("the API key has spaces or control characters, which an Authorization header cannot carry; pass another key".into());
        }
        Ok(Some(ApiKey {
            digest: Sha256::digest(key.as_bytes()).into(),
        }))
    }

    /// Judge a request's `Authorization` header value. Both engines call it on the
    /// connection's task; it never blocks.
    pub fn admits(&self, authorization: Option<&[u8]>) -> Result<(), KeyRefusal> {
        let Some(value) = authorization else {
            return Err(KeyRefusal::Missing);
        };
        let value = value.trim_ascii();
        let scheme_ok = value.len() > 7 && value[..7].eq_ignore_ascii_case(b"bearer ");
        if !scheme_ok {
            return Err(KeyRefusal::Missing);
        }
        let given: [u8; 32] = Sha256::digest(value[7..].trim_ascii()).into();
        // Every byte compared, whatever the first difference.
        let difference = given
            .iter()
            .zip(self.digest.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if difference == 0 {
            Ok(())
        } else {
            Err(KeyRefusal::Wrong)
        }
    }
}

/// Whether a path is free of the key: `/health` (and its `/v1` alias), which load balancers
/// and Lemonade ask without one.
pub fn open_path(path: &str) -> bool {
    path == "/health" || path == "/v1/health"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_admits_its_bearer_only() {
        let key = ApiKey::from_args(Some("sk-test"), None).unwrap().unwrap();
        assert_eq!(key.admits(Some(b"Bearer sk-test")), Ok(()));
        assert_eq!(key.admits(Some(b"bearer  sk-test ")), Ok(()));
        assert_eq!(key.admits(Some(b"Bearer sk-tes")), Err(KeyRefusal::Wrong));
        assert_eq!(key.admits(Some(b"Bearer sk-test2")), Err(KeyRefusal::Wrong));
        assert_eq!(
            key.admits(Some(b"Basic c2stdGVzdA==")),
            Err(KeyRefusal::Missing)
        );
        assert_eq!(key.admits(Some(b"sk-test")), Err(KeyRefusal::Missing));
        assert_eq!(key.admits(None), Err(KeyRefusal::Missing));
        assert_eq!(format!("{key:?}"), "ApiKey(..)");
    }

    #[test]
    fn a_key_comes_from_the_flag_or_the_file_and_is_never_empty() {
        assert!(ApiKey::from_args(None, None).unwrap().is_none());
        let dir = std::env::temp_dir().join(format!("onebit-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "sk-file\n").unwrap();
        let key = ApiKey::from_args(None, Some(&file)).unwrap().unwrap();
        assert_eq!(key.admits(Some(b"Bearer sk-file")), Ok(()));
        std::fs::write(&file, "\n").unwrap();
        assert!(ApiKey::from_args(None, Some(&file)).is_err());
        assert!(ApiKey::from_args(Some(" "), None).is_err());
        assert!(ApiKey::from_args(None, Some(&dir.join("absent"))).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
