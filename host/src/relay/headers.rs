//! Which headers the relay passes on, in each direction, and the request head the backend
//! gets: one function each, used by both engines.

use axum::http::{HeaderMap, HeaderName, header};

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

/// The direction a message is passed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// The client's request, to the backend.
    Upstream,
    /// The backend's reply, to the client.
    Reply,
}

/// Whether a header of a message passed on in `way` goes through: not a hop-by-hop header, not
/// one its `Connection` headers name (`connection`: their values as sent), and besides, toward
/// the backend, not `Host` or `Content-Length` (the engine writes its own), and toward the
/// client, no CORS header. Framing headers of a reply (`Content-Length`) are the engine's.
/// Called per header by both engines on the connection's task; never blocks or allocates.
pub fn passes(way: Way, name: &str, connection: &[&[u8]]) -> bool {
    if is_hop_header(name) || named_by_connection(name, connection) {
        return false;
    }
    match way {
        Way::Upstream => {
            !name.eq_ignore_ascii_case("host") && !name.eq_ignore_ascii_case("content-length")
        }
        Way::Reply => !is_cors_header(name),
    }
}

/// Whether one of the `Connection` header values names `name` (a header that belongs to this
/// connection only, RFC 9110 7.6.1).
fn named_by_connection(name: &str, connection: &[&[u8]]) -> bool {
    connection.iter().any(|value| {
        value
            .split(|b| *b == b',')
            .any(|token| token.trim_ascii().eq_ignore_ascii_case(name.as_bytes()))
    })
}

/// [`passes`] applied to a header map (the general engine's messages).
pub fn filter(way: Way, headers: &mut HeaderMap) {
    let connection: Vec<Vec<u8>> = headers
        .get_all(header::CONNECTION)
        .iter()
        .map(|v| v.as_bytes().to_vec())
        .collect();
    let connection: Vec<&[u8]> = connection.iter().map(Vec::as_slice).collect();
    let dropped: Vec<HeaderName> = headers
        .keys()
        .filter(|name| !passes(way, name.as_str(), &connection))
        .cloned()
        .collect();
    for name in dropped {
        headers.remove(name);
    }
}

/// The request head the backend on `port` gets, appended to `out`: the client's method and
/// target, `Host` naming the backend, the client's headers that pass [`Way::Upstream`], and
/// `Content-Length` when the request has a body. The fast engine writes it as is; the general
/// engine's hyper client writes the same head from the filtered map.
pub fn upstream_head<'h>(
    out: &mut Vec<u8>,
    method: &str,
    target: &str,
    port: u16,
    headers: impl Iterator<Item = (&'h str, &'h [u8])> + Clone,
    body_len: Option<usize>,
) {
    let connection: [&[u8]; 4] = {
        let mut found: [&[u8]; 4] = [b""; 4];
        let mut n = 0;
        for (name, value) in headers.clone() {
            if name.eq_ignore_ascii_case("connection") && n < found.len() {
                found[n] = value;
                n += 1;
            }
        }
        found
    };
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nHost: 127.0.0.1:");
    out.extend_from_slice(port.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if !passes(Way::Upstream, name, &connection) {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if let Some(len) = body_len {
        out.extend_from_slice(b"Content-Length: ");
        out.extend_from_slice(len.to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_connection_named_cors_and_framing_headers_do_not_pass() {
        let conn: &[&[u8]] = &[b"keep-alive, X-Secret"];
        for name in [
            "Connection",
            "Keep-Alive",
            "TE",
            "Transfer-Encoding",
            "x-secret",
        ] {
            assert!(!passes(Way::Upstream, name, conn), "{name}");
            assert!(!passes(Way::Reply, name, conn), "{name}");
        }
        assert!(!passes(Way::Upstream, "Host", conn));
        assert!(!passes(Way::Upstream, "content-length", conn));
        assert!(passes(Way::Reply, "content-type", conn));
        assert!(!passes(Way::Reply, "Access-Control-Allow-Origin", conn));
        assert!(passes(Way::Upstream, "Access-Control-Request-Method", conn));
        assert!(passes(Way::Upstream, "x-secret-not", conn));
    }

    #[test]
    fn the_upstream_head_names_the_backend_and_its_own_length() {
        let headers: [(&str, &[u8]); 5] = [
            ("Host", b"localhost:8080"),
            ("Connection", b"close, X-Drop"),
            ("X-Drop", b"1"),
            ("Content-Length", b"7"),
            ("Content-Type", b"application/json"),
        ];
        let mut out = Vec::new();
        upstream_head(
            &mut out,
            "POST",
            "/v1/x?a=1",
            9000,
            headers.iter().copied(),
            Some(2),
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:9000\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n\r\n"
        );
    }

    #[test]
    fn a_header_map_is_filtered_by_the_same_rule() {
        let mut headers = HeaderMap::new();
        headers.insert("access-control-allow-origin", "*".parse().unwrap());
        headers.insert(header::CONNECTION, "x-hop".parse().unwrap());
        headers.insert("x-hop", "1".parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        filter(Way::Reply, &mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key(header::CONTENT_TYPE));
    }
}
