//! A backend's reply head, read from the socket and parsed (httparse): the status line and the
//! headers the client gets (hop-by-hop, CORS and framing headers left out), how the body ends,
//! and what went wrong when no head came.

use super::*;

/// The reply's status line and the headers the client gets (hop-by-hop, CORS and framing
/// headers left out), and how its body ends.
pub(super) struct ReplyHead {
    pub(super) status: u16,
    pub(super) lines: Vec<u8>,
    pub(super) framing: Framing,
    pub(super) backend_close: bool,
    /// `Content-Type: text/event-stream`.
    pub(super) event_stream: bool,
    /// `Content-Type: application/json`.
    pub(super) json: bool,
}

impl ReplyHead {
    /// Whether the backend connection may carry another request once this reply's body has
    /// ended. Not after the backend said `Connection: close`, and not after a chunked reply (a
    /// stream): llama-server (its cpp-httplib) closes the connection then without saying so,
    /// and a request written before that FIN arrives meets a close no retry may answer.
    pub(super) fn keeps_connection(&self) -> bool {
        !self.backend_close && self.framing != Framing::Chunked
    }
}

pub(super) enum ReplyError {
    /// The connection closed cleanly before a byte of the reply: the backend may have read
    /// the request.
    ClosedEarly,
    /// The backend reset the connection (or it was reset when written) before a byte of the
    /// reply: it closed with the request unread, so the request can be sent again.
    Unread,
    Io(std::io::Error),
    Malformed(String),
}

impl std::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyError::ClosedEarly => f.write_str("connection closed before the reply"),
            ReplyError::Unread => f.write_str("connection reset before the reply"),
            ReplyError::Io(e) => write!(f, "{e}"),
            ReplyError::Malformed(why) => write!(f, "malformed reply: {why}"),
        }
    }
}

/// Read until the reply's head is whole; it is removed from `reply`, which keeps the body bytes
/// that came with it.
pub(super) async fn read_reply_head(
    conn: &mut BusyPollStream,
    reply: &mut BytesMut,
    to_client: Direction,
) -> Result<ReplyHead, ReplyError> {
    loop {
        if !reply.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(reply) {
                Ok(httparse::Status::Complete(n)) => {
                    let head = reply_head(&response, to_client)?;
                    reply.advance(n);
                    return Ok(head);
                }
                Ok(httparse::Status::Partial) if reply.len() < MAX_HEAD => {}
                Ok(httparse::Status::Partial) => {
                    return Err(ReplyError::Malformed("head too large".into()));
                }
                Err(e) => return Err(ReplyError::Malformed(e.to_string())),
            }
        }
        match conn.read_buf(reply).await {
            Ok(0) if reply.is_empty() => return Err(ReplyError::ClosedEarly),
            Ok(0) => return Err(ReplyError::Malformed("it ended inside the head".into())),
            Ok(_) => {}
            Err(e) if reply.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(ReplyError::Unread);
            }
            Err(e) => return Err(ReplyError::Io(e)),
        }
    }
}

pub(super) fn reply_head(
    response: &httparse::Response<'_, '_>,
    to_client: Direction,
) -> Result<ReplyHead, ReplyError> {
    let code = response.code.unwrap_or(502);
    let http10 = response.version == Some(0);
    if code < 200 {
        // An interim reply: the fast engine sends no Expect, so none is owed.
        return Err(ReplyError::Malformed(format!("an interim status {code}")));
    }
    let mut lines = Vec::with_capacity(256);
    lines.extend_from_slice(b"HTTP/1.1 ");
    lines.extend_from_slice(code.to_string().as_bytes());
    lines.push(b' ');
    lines.extend_from_slice(response.reason.unwrap_or("").as_bytes());
    lines.extend_from_slice(b"\r\n");
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut backend_close = false;
    let mut keep_alive = false;
    let mut dated = false;
    let mut event_stream = false;
    let mut json = false;
    let mut connection: [&[u8]; MAX_CONNECTION] = [b""; MAX_CONNECTION];
    let mut n_connection = 0;
    for header in response.headers.iter() {
        if header.name.eq_ignore_ascii_case("connection") {
            // More than are read: a header a later one names would pass.
            let slot = connection
                .get_mut(n_connection)
                .ok_or_else(|| ReplyError::Malformed("many Connection headers".into()))?;
            *slot = header.value;
            n_connection += 1;
        }
    }
    for header in response.headers.iter() {
        let name = header.name;
        let value = header.value;
        if name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| ReplyError::Malformed("bad Content-Length".into()))?;
            if length.is_some_and(|m| m != n) {
                return Err(ReplyError::Malformed("two Content-Lengths".into()));
            }
            length = Some(n);
            continue;
        }
        if name.eq_ignore_ascii_case("transfer-encoding") {
            // HTTP/1.0 has no transfer codings (RFC 9112 6.1): such a reply is not framed.
            if http10 || !value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(ReplyError::Malformed(
                    "a transfer coding other than chunked".into(),
                ));
            }
            chunked = true;
            continue;
        }
        if name.eq_ignore_ascii_case("connection") {
            for token in value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                backend_close |= token.eq_ignore_ascii_case(b"close");
                keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
            }
            continue;
        }
        if !plan::passes(to_client, name, &connection[..n_connection]) {
            continue;
        }
        dated |= name.eq_ignore_ascii_case("date");
        if name.eq_ignore_ascii_case("content-type") {
            event_stream |= value.starts_with(b"text/event-stream");
            json |= value.starts_with(b"application/json");
        }
        lines.extend_from_slice(name.as_bytes());
        lines.extend_from_slice(b": ");
        lines.extend_from_slice(value);
        lines.extend_from_slice(b"\r\n");
    }
    if !dated {
        // A proxy with a clock dates a reply that came without a date (RFC 9110, 6.6.1), as
        // the general engine's replies are dated.
        append_date(&mut lines);
    }
    let framing = if code == 204 || code == 304 {
        Framing::None
    } else if chunked {
        Framing::Chunked
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    // An HTTP/1.0 backend closes after its reply unless it said keep-alive (RFC 9112 9.3).
    let backend_close = backend_close || (http10 && !keep_alive);
    Ok(ReplyHead {
        status: code,
        lines,
        framing,
        backend_close: backend_close || framing == Framing::UntilClose,
        event_stream,
        json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head_of(raw: &[u8]) -> Result<ReplyHead, ReplyError> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        assert!(response.parse(raw).is_ok());
        reply_head(&response, Direction::Reply { cors: false })
    }

    #[test]
    fn only_a_reply_of_known_length_that_does_not_close_keeps_its_connection() {
        let keeps = |raw: &[u8]| head_of(raw).ok().map(|h| h.keeps_connection());
        assert_eq!(
            keeps(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"),
            Some(true)
        );
        assert_eq!(
            keeps(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"),
            Some(false)
        );
        // llama-server's stream: chunked, no `Connection: close`, and closed after it.
        assert_eq!(
            keeps(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Some(false)
        );
    }

    #[test]
    fn a_reply_head_loses_hop_and_cors_headers_and_gains_a_date() {
        let Ok(head) = head_of(
            b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: *\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\n{}",
        ) else {
            panic!("a good head");
        };
        let text = String::from_utf8(head.lines).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 200 OK\r\nServer: llama.cpp\r\n"),
            "{text}"
        );
        assert!(
            !text.to_ascii_lowercase().contains("access-control"),
            "{text}"
        );
        assert!(
            !text.contains("Keep-Alive") && !text.contains("Connection"),
            "{text}"
        );
        assert!(
            !text.contains("Content-Length"),
            "the framing is written apart: {text}"
        );
        assert!(text.contains("\r\nDate: "), "{text}");
        assert_eq!(head.framing, Framing::Length(2));
        assert!(!head.backend_close);
        // A dated reply keeps its own date.
        let Ok(head) = head_of(
            b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 00:00:00 GMT\r\nContent-Length: 0\r\n\r\n",
        ) else {
            panic!("a good head");
        };
        let text = String::from_utf8(head.lines).unwrap();
        assert_eq!(text.matches("ate: ").count(), 1, "{text}");
    }

    #[test]
    fn a_reply_head_says_how_its_body_ends() {
        let framing = |raw: &[u8]| head_of(raw).ok().map(|h| (h.framing, h.backend_close));
        assert_eq!(
            framing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Some((Framing::Chunked, false))
        );
        assert_eq!(
            framing(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"),
            Some((Framing::Length(5), true))
        );
        assert_eq!(
            framing(b"HTTP/1.1 204 No Content\r\n\r\n"),
            Some((Framing::None, false))
        );
        assert_eq!(
            framing(b"HTTP/1.1 200 OK\r\n\r\n"),
            Some((Framing::UntilClose, true))
        );
        // HTTP/1.0: to the close, and a length closes too unless the backend keeps it alive.
        assert_eq!(
            framing(b"HTTP/1.0 200 OK\r\n\r\n"),
            Some((Framing::UntilClose, true))
        );
        assert_eq!(
            framing(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n"),
            Some((Framing::Length(2), true))
        );
        assert_eq!(
            framing(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n"),
            Some((Framing::Length(2), false))
        );
        for bad in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: five\r\n\r\n",
            b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
        ] {
            assert!(head_of(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
