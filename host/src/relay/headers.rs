//! Which headers the relay passes on: one list of the headers that belong to one connection,
//! one test for CORS headers, used by both engines.

use axum::http::{HeaderMap, header};

/// Headers that belong to one connection, not to the message (lowercase, as `http` keeps
/// names); both relay paths drop them.
const HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether a header (any case) belongs to one connection, not to the message.
pub fn is_hop_header(name: &str) -> bool {
    HOP_HEADERS.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// Whether a header (any case) is a CORS header. llama-server answers any Origin with
/// `Access-Control-Allow-Origin` (and credentials), which would let any web page read the
/// replies it can make a browser request; serve sends no CORS headers at all
/// (docs/security.md).
pub fn is_cors_header(name: &str) -> bool {
    name.get(..15)
        .is_some_and(|p| p.eq_ignore_ascii_case("access-control-"))
}

/// Remove the hop-by-hop headers, as both engines pass a message on.
pub fn strip_hop_headers(headers: &mut HeaderMap) {
    for name in HOP_HEADERS {
        headers.remove(name);
    }
}

/// Remove every CORS header of a backend's reply (see [`is_cors_header`]).
pub fn strip_cors_headers(headers: &mut HeaderMap) {
    let cors: Vec<header::HeaderName> = headers
        .keys()
        .filter(|name| is_cors_header(name.as_str()))
        .cloned()
        .collect();
    for name in cors {
        headers.remove(name);
    }
}
