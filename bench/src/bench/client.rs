//! A small blocking HTTP/1.1 client for the benchmarks: one request at a time per connection,
//! replies framed by Content-Length, chunked encoding or the connection's end.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long any read may wait before the benchmark gives up on an arm.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// One connection and the bytes read from it but not yet consumed (`buf[pos..len]`).
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    pos: usize,
    len: usize,
    /// CLOCK_REALTIME when the last read returned: the receipt time of the bytes it brought.
    read_at: SystemTime,
}

/// What the benchmarks need of a reply.
pub struct Reply {
    pub status: u16,
    /// The server will close the connection after this reply.
    pub close: bool,
}

impl Conn {
    /// Connects with TCP_NODELAY on, as every server under test has it on its side.
    pub fn open(addr: SocketAddr) -> io::Result<Conn> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        Ok(Conn {
            stream,
            buf: vec![0; 16 * 1024],
            pos: 0,
            len: 0,
            read_at: SystemTime::now(),
        })
    }

    /// A longer (or shorter) limit on each read than the default 30 s.
    pub fn set_read_timeout(&mut self, limit: Duration) -> io::Result<()> {
        self.stream.set_read_timeout(Some(limit))
    }

    /// Writes `request` whole and reads the reply whole, discarding its body.
    pub fn exchange(&mut self, request: &[u8]) -> io::Result<Reply> {
        self.stream.write_all(request)?;
        self.read_reply(|_, _| {})
    }

    /// Writes `request`, then reads the reply, handing each piece of body to `on_body` with
    /// the CLOCK_REALTIME at which the read that brought it returned.
    pub fn stream(
        &mut self,
        request: &[u8],
        on_body: impl FnMut(&[u8], SystemTime),
    ) -> io::Result<Reply> {
        self.stream.write_all(request)?;
        self.read_reply(on_body)
    }

    fn read_reply(&mut self, mut on_body: impl FnMut(&[u8], SystemTime)) -> io::Result<Reply> {
        let head_len = loop {
            if let Some(i) = find(&self.buf[self.pos..self.len], b"\r\n\r\n") {
                break i;
            }
            self.fill()?;
        };
        let head = &self.buf[self.pos..self.pos + head_len];
        let mut lines = head.split(|&b| b == b'\n').map(trim_cr);
        let status_line = lines.next().unwrap_or_default();
        let status = status_line
            .split(|&b| b == b' ')
            .nth(1)
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| bad("no status line"))?;
        let mut close = status_line.starts_with(b"HTTP/1.0");
        let mut length = None;
        let mut chunked = false;
        for line in lines {
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                continue;
            };
            let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
            if name.eq_ignore_ascii_case(b"content-length") {
                length = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                chunked = contains_ignore_case(value, b"chunked");
            } else if name.eq_ignore_ascii_case(b"connection") {
                close = contains_ignore_case(value, b"close");
            }
        }
        self.pos += head_len + 4;
        if chunked {
            loop {
                let size = self.chunk_size()?;
                if size == 0 {
                    // Trailers, if any, end with an empty line.
                    while !self.line_is_empty()? {}
                    break;
                }
                self.body(size, &mut on_body)?;
                if !self.line_is_empty()? {
                    return Err(bad("a chunk did not end with CRLF"));
                }
            }
        } else if let Some(n) = length {
            self.body(n, &mut on_body)?;
        } else if !(status == 204 || status == 304 || status < 200) {
            // No framing: the body runs to the end of the connection.
            close = true;
            loop {
                on_body(&self.buf[self.pos..self.len], self.read_at);
                self.pos = self.len;
                match self.fill() {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(Reply { status, close })
    }

    /// Passes the next `n` body bytes to `on_body`, reading as they come.
    fn body(
        &mut self,
        mut n: usize,
        on_body: &mut impl FnMut(&[u8], SystemTime),
    ) -> io::Result<()> {
        while n > 0 {
            if self.pos == self.len {
                self.fill()?;
            }
            let take = n.min(self.len - self.pos);
            on_body(&self.buf[self.pos..self.pos + take], self.read_at);
            self.pos += take;
            n -= take;
        }
        Ok(())
    }

    /// Consumes one CRLF-terminated line; returns the range it occupied in `buf`.
    fn line(&mut self) -> io::Result<(usize, usize)> {
        loop {
            if let Some(i) = find(&self.buf[self.pos..self.len], b"\r\n") {
                let range = (self.pos, self.pos + i);
                self.pos += i + 2;
                return Ok(range);
            }
            self.fill()?;
        }
    }

    fn line_is_empty(&mut self) -> io::Result<bool> {
        let (start, end) = self.line()?;
        Ok(start == end)
    }

    fn chunk_size(&mut self) -> io::Result<usize> {
        let (start, end) = self.line()?;
        let line = &self.buf[start..end];
        let digits = line.split(|&b| b == b';').next().unwrap_or_default();
        std::str::from_utf8(trim(digits))
            .ok()
            .and_then(|d| usize::from_str_radix(d, 16).ok())
            .ok_or_else(|| bad("a chunk size is not hexadecimal"))
    }

    /// Reads more bytes after `buf[..len]`, moving unconsumed bytes to the front or growing
    /// the buffer when it is full.
    fn fill(&mut self) -> io::Result<usize> {
        if self.pos == self.len {
            self.pos = 0;
            self.len = 0;
        } else if self.len == self.buf.len() {
            self.buf.copy_within(self.pos..self.len, 0);
            self.len -= self.pos;
            self.pos = 0;
            if self.len == self.buf.len() {
                self.buf.resize(self.buf.len() * 2, 0);
            }
        }
        let n = self.stream.read(&mut self.buf[self.len..])?;
        self.read_at = SystemTime::now();
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            ));
        }
        self.len += n;
        Ok(n)
    }
}

/// A request with a JSON body, as serve's guard wants it: a loopback Host and a JSON type.
pub fn post_json(addr: SocketAddr, path: &str, body: &str, close: bool) -> Vec<u8> {
    let connection = if close { "Connection: close\r\n" } else { "" };
    format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{connection}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub fn get(addr: SocketAddr, path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").into_bytes()
}

/// Nanoseconds since the Unix epoch, the unit of the fake backend's `fake_sent_ns`.
pub fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn trim(s: &[u8]) -> &[u8] {
    s.trim_ascii()
}

fn contains_ignore_case(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("bad reply: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Replies as written by a server that splits them anywhere; the client reads them whole.
    fn serve_bytes(reply: &'static [u8]) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut tcp, _) = listener.accept().unwrap();
            let mut request = [0u8; 1024];
            let _ = tcp.read(&mut request);
            for piece in reply.chunks(7) {
                tcp.write_all(piece).unwrap();
                tcp.flush().unwrap();
            }
        });
        addr
    }

    fn body_of(reply: &'static [u8]) -> (u16, bool, Vec<u8>) {
        let addr = serve_bytes(reply);
        let mut conn = Conn::open(addr).unwrap();
        let mut body = Vec::new();
        let r = conn
            .stream(&get(addr, "/"), |b, _| body.extend_from_slice(b))
            .unwrap();
        (r.status, r.close, body)
    }

    #[test]
    fn content_length_chunked_and_close_delimited_bodies() {
        let (status, close, body) = body_of(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
        assert_eq!(
            (status, close, body.as_slice()),
            (200, false, &b"hello"[..])
        );
        let (status, close, body) = body_of(
            b"HTTP/1.1 201 Created\r\ntransfer-encoding: Chunked\r\nConnection: close\r\n\r\n\
              3;ext=1\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nX-Trailer: 1\r\n\r\n",
        );
        assert_eq!((status, close), (201, true));
        assert_eq!(body, b"abc0123456789abcdef");
        let (status, close, body) = body_of(b"HTTP/1.0 404 Not Found\r\n\r\nno length");
        assert_eq!(
            (status, close, body.as_slice()),
            (404, true, &b"no length"[..])
        );
    }
}
