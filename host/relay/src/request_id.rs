//! A request's id: the client's `X-Request-Id` when it is fit to repeat, else one serve makes.
//! It is sent to the backend, comes back on the reply, and is on the request's log lines, on
//! both engines and the in-process path.
//!
//! Fit to repeat: 1 to [`MAX_LEN`] bytes, each visible ASCII (`!` to `~`). Anything else (too
//! long, a control character, a space, a byte above ASCII, a second `X-Request-Id`) is
//! replaced by a made one and never echoed. A made id is 16 lowercase hex digits: a counter
//! through a bijective mix (splitmix64's finaliser) from a start seeded by the clock and the
//! PID, so ids differ across requests and restarts. Made or kept, the id lives inline (no
//! allocation) and costs a copy of at most 128 bytes.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The longest client id repeated.
pub const MAX_LEN: usize = 128;
/// The header's name, as written.
pub const HEADER: &str = "X-Request-Id";

/// One request's id.
#[derive(Clone, Copy)]
pub struct RequestId {
    bytes: [u8; MAX_LEN],
    len: u8,
}

impl RequestId {
    /// The id for a request whose `X-Request-Id` values are `sent` (none, one or more).
    pub fn for_request<'a>(mut sent: impl Iterator<Item = &'a [u8]>) -> RequestId {
        match (sent.next(), sent.next()) {
            (Some(one), None) if fit(one) => {
                let mut bytes = [0; MAX_LEN];
                bytes[..one.len()].copy_from_slice(one);
                RequestId {
                    bytes,
                    len: one.len() as u8,
                }
            }
            _ => RequestId::made(),
        }
    }

    /// A new id of serve's own.
    pub fn made() -> RequestId {
        // Statics because an id must be unique in the process's logs (and, with the start
        // time and pid mixed in, across its restarts): one sequence per process.
        static START: OnceLock<u64> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let start = *START.get_or_init(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            nanos ^ (u64::from(std::process::id()) << 40)
        });
        let n = start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed));
        let mixed = mix(n);
        let mut bytes = [0; MAX_LEN];
        for (i, slot) in bytes[..16].iter_mut().enumerate() {
            let nibble = (mixed >> (60 - 4 * i)) & 0xf;
            *slot = b"0123456789abcdef"[nibble as usize];
        }
        RequestId { bytes, len: 16 }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    pub fn as_str(&self) -> &str {
        // Visible ASCII only, by construction.
        std::str::from_utf8(self.as_bytes()).unwrap_or("")
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a client's id may be repeated as it is.
fn fit(id: &[u8]) -> bool {
    !id.is_empty() && id.len() <= MAX_LEN && id.iter().all(|b| (b'!'..=b'~').contains(b))
}

/// splitmix64's finaliser: a bijection of u64, so distinct counters give distinct ids.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_id_is_kept_and_a_hostile_one_replaced() {
        let kept = RequestId::for_request([&b"abc-123_XYZ"[..]].into_iter());
        assert_eq!(kept.as_str(), "abc-123_XYZ");
        let long = [b'a'; MAX_LEN];
        assert_eq!(
            RequestId::for_request([&long[..]].into_iter()).as_bytes(),
            &long[..]
        );
        let too_long = [b'a'; MAX_LEN + 1];
        for hostile in [
            &too_long[..],
            b"",
            b"a b",
            b"a\x1b[31m",
            b"a\r\nX-Evil: 1",
            "é".as_bytes(),
            b"\x7f",
        ] {
            let id = RequestId::for_request([hostile].into_iter());
            assert_eq!(id.as_bytes().len(), 16, "{hostile:?}");
            assert!(id.as_bytes().iter().all(u8::is_ascii_hexdigit));
        }
        // Two ids sent: neither is chosen.
        let two = RequestId::for_request([&b"a"[..], b"b"].into_iter());
        assert_eq!(two.as_bytes().len(), 16);
    }

    #[test]
    fn made_ids_differ() {
        let a = RequestId::made();
        let b = RequestId::made();
        assert_ne!(a.as_str(), b.as_str());
        assert_eq!(
            RequestId::for_request(std::iter::empty()).as_str().len(),
            16
        );
    }
}
