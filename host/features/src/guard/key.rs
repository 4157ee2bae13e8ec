//! The API key (`--api-key`, `ONEBIT_API_KEY`, `--api-key-file`; the drop-in's llama-server
//! flags of the same names): every route but `/health` then needs `Authorization: Bearer KEY`
//! or, as llama-server also reads it, `X-Api-Key: KEY`. Several keys may be given, as
//! llama-server takes them (a comma list, a file of one key a line). Only the keys' SHA-256 are
//! kept, and a request's key is compared with each in constant time, so neither a key nor how
//! much of it a caller guessed shows in memory dumps, logs or timing.

use sha2::{Digest, Sha256};

use onebit_command::error::Fatal;

/// The keys serve was started with (one or more). Its `Debug` shows nothing of them.
#[derive(Clone)]
pub struct ApiKey {
    digests: Vec<[u8; 32]>,
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
    /// The keys from `--api-key`/`ONEBIT_API_KEY` (a comma list, as llama-server's
    /// `--api-key` takes it), else `--api-key-file` (one key a line; empty lines and lines
    /// starting with `#` skipped, as llama-server reads it); None when neither is given.
    /// Called once by `serve` before anything starts.
    pub fn from_args(
        flag: Option<&str>,
        file: Option<&std::path::Path>,
    ) -> Result<Option<ApiKey>, Fatal> {
        let keys: Vec<String> = match (flag, file) {
            (Some(list), _) => list.split(',').map(|k| k.trim().to_string()).collect(),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Fatal::usage(format!(
                        "cannot read the API key file {} ({e}); pass a readable file to --api-key-file",
                        path.display()
                    ))
                })?;
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string)
                    .collect()
            }
            (None, None) => return Ok(None),
        };
        let keys: Vec<&String> = keys.iter().filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            return Err(Fatal::usage(
                "the API key is empty; pass a non-empty key to --api-key (or ONEBIT_API_KEY, or --api-key-file)",
            ));
        }
        if keys
            .iter()
            .any(|k| k.bytes().any(|b| b.is_ascii_control() || b == b' '))
        {
            return Err(Fatal::usage(
                "the API key has spaces or control characters, which an Authorization header cannot carry; pass another key",
            ));
        }
        Ok(Some(ApiKey {
            digests: keys
                .iter()
                .map(|k| Sha256::digest(k.as_bytes()).into())
                .collect(),
        }))
    }

    /// Judge a request's key: its `Authorization` header value (`Bearer KEY`) or, when it has
    /// none, its `X-Api-Key` value (the key, as Anthropic's clients send it; llama-server reads
    /// both). Both engines call it on the connection's task; it never blocks.
    pub fn admits(
        &self,
        authorization: Option<&[u8]>,
        x_api_key: Option<&[u8]>,
    ) -> Result<(), KeyRefusal> {
        let given = match (authorization, x_api_key) {
            (Some(value), _) => {
                let value = value.trim_ascii();
                let scheme_ok = value.len() > 7 && value[..7].eq_ignore_ascii_case(b"bearer ");
                if !scheme_ok {
                    return Err(KeyRefusal::Missing);
                }
                value[7..].trim_ascii()
            }
            (None, Some(value)) => value.trim_ascii(),
            (None, None) => return Err(KeyRefusal::Missing),
        };
        if given.is_empty() {
            return Err(KeyRefusal::Missing);
        }
        let given: [u8; 32] = Sha256::digest(given).into();
        // Every byte of every key compared, whatever the first difference or match.
        let matched = self.digests.iter().fold(0u8, |found, digest| {
            let difference = given
                .iter()
                .zip(digest.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            found | u8::from(difference == 0)
        });
        if matched == 1 {
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
        assert_eq!(key.admits(Some(b"Bearer sk-test"), None), Ok(()));
        assert_eq!(key.admits(Some(b"bearer  sk-test "), None), Ok(()));
        assert_eq!(
            key.admits(Some(b"Bearer sk-tes"), None),
            Err(KeyRefusal::Wrong)
        );
        assert_eq!(
            key.admits(Some(b"Bearer sk-test2"), None),
            Err(KeyRefusal::Wrong)
        );
        assert_eq!(
            key.admits(Some(b"Basic c2stdGVzdA=="), None),
            Err(KeyRefusal::Missing)
        );
        assert_eq!(key.admits(Some(b"sk-test"), None), Err(KeyRefusal::Missing));
        assert_eq!(key.admits(None, None), Err(KeyRefusal::Missing));
        // X-Api-Key, as llama-server reads it when there is no Authorization.
        assert_eq!(key.admits(None, Some(b"sk-test")), Ok(()));
        assert_eq!(key.admits(None, Some(b"sk-other")), Err(KeyRefusal::Wrong));
        assert_eq!(key.admits(None, Some(b"")), Err(KeyRefusal::Missing));
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
        assert_eq!(key.admits(Some(b"Bearer sk-file"), None), Ok(()));
        // llama-server's file: a key a line, `#` comments skipped.
        std::fs::write(&file, "# ours\nsk-one\n\nsk-two\n").unwrap();
        let key = ApiKey::from_args(None, Some(&file)).unwrap().unwrap();
        assert_eq!(key.admits(Some(b"Bearer sk-two"), None), Ok(()));
        assert_eq!(key.admits(None, Some(b"sk-one")), Ok(()));
        assert_eq!(key.admits(None, Some(b"# ours")), Err(KeyRefusal::Wrong));
        // llama-server's --api-key: a comma list.
        let key = ApiKey::from_args(Some("sk-a,sk-b"), None).unwrap().unwrap();
        assert_eq!(key.admits(Some(b"Bearer sk-b"), None), Ok(()));
        assert_eq!(
            key.admits(Some(b"Bearer sk-a,sk-b"), None),
            Err(KeyRefusal::Wrong)
        );
        std::fs::write(&file, "\n").unwrap();
        assert!(ApiKey::from_args(None, Some(&file)).is_err());
        assert!(ApiKey::from_args(Some(" "), None).is_err());
        assert!(ApiKey::from_args(None, Some(&dir.join("absent"))).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
