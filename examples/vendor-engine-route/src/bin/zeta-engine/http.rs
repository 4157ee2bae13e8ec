//! Just enough HTTP/1.1 for a backend behind serve: a request read (its head and a
//! `Content-Length` or chunked body), a whole reply, and a chunked one for server-sent events.
//! Connections are kept alive, as serve's relay pools them.

use std::io::{self, BufRead, Write};

/// The most a request's head may hold.
const MAX_HEAD_BYTES: usize = 64 << 10;

/// The most a request's body may hold.
const MAX_BODY_BYTES: usize = 16 << 20;

/// One request.
pub struct Request {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without its query.
    pub path: String,
    /// The body, whole.
    pub body: Vec<u8>,
    /// The client asked to close the connection after the reply.
    pub close: bool,
}

/// Read the next request on a connection: None when the client closed it between requests.
pub fn read_request(reader: &mut impl BufRead) -> io::Result<Option<Request>> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut words = line.split_whitespace();
    let (Some(method), Some(target)) = (words.next(), words.next()) else {
        return Err(invalid("a request line without a method and a path"));
    };
    let method = method.to_string();
    let path = target.split('?').next().unwrap_or(target).to_string();
    let http10 = words.next() == Some("HTTP/1.0");
    let (mut length, mut chunked, mut close, mut head) = (0usize, false, http10, line.len());
    loop {
        line.clear();
        head += reader.read_line(&mut line)?;
        if head > MAX_HEAD_BYTES {
            return Err(invalid("a request head over 64 KiB"));
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                length = value
                    .parse()
                    .map_err(|_| invalid("a Content-Length that is not a number"))?;
            }
            "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
            "connection" => close = value.eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let body = if chunked {
        read_chunked(reader)?
    } else {
        if length > MAX_BODY_BYTES {
            return Err(invalid("a request body over 16 MiB"));
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        body
    };
    Ok(Some(Request {
        method,
        path,
        body,
        close,
    }))
}

/// A chunked body, whole.
fn read_chunked(reader: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let size = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size, 16).map_err(|_| invalid("a bad chunk size"))?;
        if body.len() + size > MAX_BODY_BYTES {
            return Err(invalid("a request body over 16 MiB"));
        }
        if size == 0 {
            // Trailers, then the empty line.
            loop {
                line.clear();
                if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                    return Ok(body);
                }
            }
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..])?;
        line.clear();
        reader.read_line(&mut line)?;
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// The reason phrase of the statuses this engine sends.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// A whole reply.
pub fn write_whole(
    out: &mut impl Write,
    status: u16,
    content_type: &str,
    body: &[u8],
    close: bool,
) -> io::Result<()> {
    let connection = if close { "close" } else { "keep-alive" };
    write!(
        out,
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: {connection}\r\n\r\n",
        reason(status),
        body.len()
    )?;
    out.write_all(body)?;
    out.flush()
}

/// The head of a streamed reply: server-sent events, chunked.
pub fn start_events(out: &mut impl Write) -> io::Result<()> {
    out.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n",
    )?;
    out.flush()
}

/// One event (`data: ...\n\n`) as one chunk, sent at once.
pub fn event(out: &mut impl Write, data: &str) -> io::Result<()> {
    let event = format!("data: {data}\n\n");
    write!(out, "{:x}\r\n{event}\r\n", event.len())?;
    out.flush()
}

/// The end of a streamed reply.
pub fn end_events(out: &mut impl Write) -> io::Result<()> {
    out.write_all(b"0\r\n\r\n")?;
    out.flush()
}
