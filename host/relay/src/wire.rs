//! The fast engine's reading of HTTP/1 on the wire: a client's request head, checked for what
//! the fast engine can carry without a second opinion, and where a backend's reply body ends.
//! std and httparse only, so the fuzz target (`host/fuzz/`) compiles this file on its own.

/// Header lines a fast request may have; more go the general way.
pub const MAX_HEADERS: usize = 64;
/// A request head (or a backend's reply head) larger than this goes the general way (or is a
/// bad gateway).
pub const MAX_HEAD: usize = 64 * 1024;
/// Host and Origin headers kept of one request. The guard refuses a second Host; more Origins
/// than this go to the general engine, which judges every one.
const KEPT: usize = 4;
/// `Connection` headers read of one message: more, and a request goes the general way (a
/// header a fifth one names would otherwise pass).
pub const MAX_CONNECTION: usize = 4;

/// What [`read_head`] found at the start of the buffer.
// Returned once per request, on the stack: boxing the large variant would allocate per request.
#[allow(clippy::large_enum_variant)]
pub enum Head<'h, 'b> {
    /// Not all of it yet (and not yet too large).
    Due,
    /// Not for the fast engine: malformed or too large, or something it does not carry
    /// (HTTP/1.0, a transfer coding, Expect, Upgrade, an absolute-form target, two or bad
    /// Content-Lengths, too many headers). The general engine answers it.
    Unfit,
    /// A request head the fast engine can carry, if the guard and the plan agree.
    Whole(RequestHead<'h, 'b>),
}

/// A whole request head, read once.
pub struct RequestHead<'h, 'b> {
    pub method: &'b str,
    /// The request target as sent (origin-form: a path and query).
    pub target: &'b str,
    /// The target's path, without the query.
    pub path: &'b str,
    /// Bytes of the buffer the head took.
    pub head_len: usize,
    /// The one Content-Length, when sent.
    pub content_length: Option<usize>,
    pub content_type: Option<&'b [u8]>,
    /// The client asked to close after this reply.
    pub close: bool,
    hosts: [&'b [u8]; KEPT],
    n_hosts: usize,
    origins: [&'b [u8]; KEPT],
    n_origins: usize,
    connection: [&'b [u8]; MAX_CONNECTION],
    /// Every header line, for the backend's head.
    pub headers: &'h [httparse::Header<'b>],
}

impl<'b> RequestHead<'_, 'b> {
    /// The Host header values (at most [`KEPT`]; a head with more is unfit).
    pub fn hosts(&self) -> &[&'b [u8]] {
        &self.hosts[..self.n_hosts]
    }

    /// The Origin header values, every one.
    pub fn origins(&self) -> &[&'b [u8]] {
        &self.origins[..self.n_origins]
    }

    /// Its `Authorization` header's value (the first; a second makes the key check fail).
    pub fn authorization(&self) -> Option<&'b [u8]> {
        self.one_value("authorization")
    }

    /// Its `X-Api-Key` header's value, the same way.
    pub fn x_api_key(&self) -> Option<&'b [u8]> {
        self.one_value("x-api-key")
    }

    /// Its `X-Request-Id` header values, every one (`relay::request_id` judges them).
    pub fn request_ids(&self) -> impl Iterator<Item = &'b [u8]> + '_ {
        self.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("x-request-id"))
            .map(|h| h.value)
    }

    fn one_value(&self, name: &str) -> Option<&'b [u8]> {
        let mut values = self
            .headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name));
        match (values.next(), values.next()) {
            (Some(one), None) => Some(one.value),
            (Some(_), Some(_)) => Some(b""),
            _ => None,
        }
    }

    /// The values of its `Connection` headers, every one.
    pub fn connection(&self) -> &[&'b [u8]] {
        let n = self.connection.iter().take_while(|v| !v.is_empty()).count();
        &self.connection[..n]
    }
}

/// Read the request head at the start of `buf` with httparse (hyper's own parser), into
/// `storage`. Runs on the connection's task; never blocks or allocates.
pub fn read_head<'h, 'b>(
    buf: &'b [u8],
    storage: &'h mut [httparse::Header<'b>; MAX_HEADERS],
) -> Head<'h, 'b> {
    let mut request = httparse::Request::new(storage);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Head::Due,
        Ok(httparse::Status::Partial) => return Head::Unfit,
        Err(_) => return Head::Unfit,
    };
    if request.version != Some(1) {
        return Head::Unfit;
    }
    let (Some(method), Some(target)) = (request.method, request.path) else {
        return Head::Unfit;
    };
    if !target.starts_with('/') {
        return Head::Unfit;
    }
    let path = target.split('?').next().unwrap_or(target);
    let mut head = RequestHead {
        method,
        target,
        path,
        head_len,
        content_length: None,
        content_type: None,
        close: false,
        hosts: [b""; KEPT],
        n_hosts: 0,
        origins: [b""; KEPT],
        n_origins: 0,
        connection: [b""; MAX_CONNECTION],
        headers: &[],
    };
    let mut n_connection = 0;
    for header in request.headers.iter() {
        let name = header.name;
        let value = header.value;
        if name.eq_ignore_ascii_case("host") {
            let Some(slot) = head.hosts.get_mut(head.n_hosts) else {
                return Head::Unfit;
            };
            *slot = value;
            head.n_hosts += 1;
        } else if name.eq_ignore_ascii_case("origin") {
            let Some(slot) = head.origins.get_mut(head.n_origins) else {
                return Head::Unfit;
            };
            *slot = value;
            head.n_origins += 1;
        } else if name.eq_ignore_ascii_case("content-length") {
            // Digits only (no sign, no space, no list), once, and a length that fits.
            let length = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
            if head.content_length.is_some()
                || value.is_empty()
                || !value.iter().all(u8::is_ascii_digit)
                || length.is_none()
            {
                return Head::Unfit;
            }
            head.content_length = length;
        } else if name.eq_ignore_ascii_case("content-type") {
            head.content_type = Some(value);
        } else if name.eq_ignore_ascii_case("connection") {
            let Some(slot) = head.connection.get_mut(n_connection) else {
                return Head::Unfit;
            };
            if value.is_empty() {
                continue;
            }
            *slot = value;
            n_connection += 1;
            for token in value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    head.close = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    return Head::Unfit;
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
            || name.eq_ignore_ascii_case("upgrade")
        {
            // A transfer coding, a body promised on a 100, another protocol: hyper's.
            return Head::Unfit;
        }
    }
    head.headers = request.headers;
    Head::Whole(head)
}

/// How a reply's body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

/// Where a reply body ends, fed its bytes as they come (the bytes are passed on unchanged,
/// chunked coding included).
#[derive(Debug)]
pub struct Body {
    pub framing: Framing,
    remaining: u64,
    chunk: ChunkState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    /// Reading a chunk-size line (hex digits, then extensions up to CRLF); the size so far and
    /// whether a digit was seen and the extension started.
    Size {
        size: u64,
        digits: bool,
        ext: bool,
    },
    /// The LF after the size line's CR.
    SizeLf {
        size: u64,
    },
    /// Chunk data left.
    Data,
    /// The CRLF after chunk data.
    DataCr,
    DataLf,
    /// After the last chunk: trailer lines until an empty one; whether the line is empty so far.
    Trailer {
        line_empty: bool,
        cr: bool,
    },
}

impl Body {
    pub fn new(framing: Framing) -> Self {
        Body {
            framing,
            remaining: match framing {
                Framing::Length(n) => n,
                _ => 0,
            },
            chunk: ChunkState::Size {
                size: 0,
                digits: false,
                ext: false,
            },
        }
    }

    /// Feed the next bytes: Some(Some(n)) when the body ends after `n` of them, Some(None) when
    /// it goes on past them, None when the chunked coding is broken.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<Option<usize>> {
        self.feed_data(bytes, |_| {})
    }

    /// [`Body::feed`], handing `data` the body's own bytes among them as they are passed
    /// (chunked coding's sizes and line ends left out), in order: the one chunked decoder, which
    /// the keep-alive tracker follows too.
    pub fn feed_data(
        &mut self,
        bytes: &[u8],
        mut data: impl FnMut(&[u8]),
    ) -> Option<Option<usize>> {
        match self.framing {
            Framing::None => Some(Some(0)),
            Framing::UntilClose => {
                data(bytes);
                Some(None)
            }
            Framing::Length(_) => {
                let take = (bytes.len() as u64).min(self.remaining);
                self.remaining -= take;
                data(&bytes[..take as usize]);
                Some((self.remaining == 0).then_some(take as usize))
            }
            Framing::Chunked => self.feed_chunked(bytes, &mut data),
        }
    }

    /// Whether a chunked body stands between two chunks (at the start of a size line, the
    /// last chunk not yet begun).
    pub fn between_chunks(&self) -> bool {
        self.chunk
            == ChunkState::Size {
                size: 0,
                digits: false,
                ext: false,
            }
    }

    fn feed_chunked(
        &mut self,
        bytes: &[u8],
        data: &mut impl FnMut(&[u8]),
    ) -> Option<Option<usize>> {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self.chunk {
                ChunkState::Size { size, digits, ext } => {
                    if b == b'\r' {
                        if !digits {
                            return None;
                        }
                        self.chunk = ChunkState::SizeLf { size };
                    } else if ext {
                        // Extensions are passed on, not read.
                    } else if let Some(d) = (b as char).to_digit(16) {
                        let size = size.checked_mul(16)?.checked_add(u64::from(d))?;
                        self.chunk = ChunkState::Size {
                            size,
                            digits: true,
                            ext: false,
                        };
                    } else if b == b';' || b == b' ' || b == b'\t' {
                        self.chunk = ChunkState::Size {
                            size,
                            digits,
                            ext: true,
                        };
                    } else {
                        return None;
                    }
                    i += 1;
                }
                ChunkState::SizeLf { size } => {
                    if b != b'\n' {
                        return None;
                    }
                    i += 1;
                    if size == 0 {
                        self.chunk = ChunkState::Trailer {
                            line_empty: true,
                            cr: false,
                        };
                    } else {
                        self.remaining = size;
                        self.chunk = ChunkState::Data;
                    }
                }
                ChunkState::Data => {
                    let take = ((bytes.len() - i) as u64).min(self.remaining);
                    self.remaining -= take;
                    data(&bytes[i..i + take as usize]);
                    i += take as usize;
                    if self.remaining == 0 {
                        self.chunk = ChunkState::DataCr;
                    }
                }
                ChunkState::DataCr => {
                    if b != b'\r' {
                        return None;
                    }
                    i += 1;
                    self.chunk = ChunkState::DataLf;
                }
                ChunkState::DataLf => {
                    if b != b'\n' {
                        return None;
                    }
                    i += 1;
                    self.chunk = ChunkState::Size {
                        size: 0,
                        digits: false,
                        ext: false,
                    };
                }
                ChunkState::Trailer { line_empty, cr } => {
                    i += 1;
                    if b == b'\n' && cr {
                        if line_empty {
                            return Some(Some(i));
                        }
                        self.chunk = ChunkState::Trailer {
                            line_empty: true,
                            cr: false,
                        };
                    } else if b == b'\r' {
                        self.chunk = ChunkState::Trailer {
                            line_empty,
                            cr: true,
                        };
                    } else {
                        self.chunk = ChunkState::Trailer {
                            line_empty: false,
                            cr: false,
                        };
                    }
                }
            }
        }
        Some(None)
    }
}

/// Append `bytes` to `out` as one chunk of chunked coding (nothing for no bytes: an empty
/// chunk would end the body). The one chunk encoder of both engines.
pub fn append_chunk(out: &mut Vec<u8>, bytes: &[u8]) {
    use std::io::Write as _;
    if bytes.is_empty() {
        return;
    }
    let _ = write!(out, "{:x}\r\n", bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// The fuzz target's input, also replayed on stable by the host's tests: the bytes as a
/// client's request, then whatever follows its head as a chunked reply body, fed whole and in
/// pieces. Panics when an invariant breaks: a head taken is within the bytes, at most one
/// Content-Length and no transfer coding were let through, and the chunked end does not depend
/// on how the bytes are split.
#[allow(dead_code)] // the fuzz target and the corpus test call it
pub fn fuzz_one(data: &[u8]) {
    let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let rest = match read_head(data, &mut storage) {
        Head::Whole(head) => {
            assert!(head.head_len <= data.len(), "a head past the bytes");
            let lengths = head
                .headers
                .iter()
                .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
                .count();
            assert!(lengths <= 1, "{lengths} Content-Lengths let through");
            assert!(
                !head
                    .headers
                    .iter()
                    .any(|h| h.name.eq_ignore_ascii_case("transfer-encoding")),
                "a transfer coding let through"
            );
            assert!(head.hosts().len() <= KEPT && head.origins().len() <= KEPT);
            &data[head.head_len..]
        }
        Head::Due | Head::Unfit => data,
    };
    let whole = Body::new(Framing::Chunked).feed(rest);
    let mut piecewise = Body::new(Framing::Chunked);
    let mut at = 0;
    let mut split = Some(None);
    // Pieces of 1 to 3 bytes: a split inside every kind of token.
    for piece in rest.chunks(7).flat_map(|c| c.chunks(1 + c.len() % 3)) {
        match piecewise.feed(piece) {
            None => {
                split = None;
                break;
            }
            Some(Some(n)) => {
                split = Some(Some(at + n));
                break;
            }
            Some(None) => at += piece.len(),
        }
    }
    assert_eq!(whole, split, "the chunked end moved with the split");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_the_encoder_writes_are_read_back_whole_by_the_decoder() {
        let mut out = Vec::new();
        append_chunk(&mut out, b"");
        assert!(out.is_empty(), "an empty chunk would end the body");
        let long = vec![b'x'; 300];
        append_chunk(&mut out, b"data: {}\n\n");
        append_chunk(&mut out, &long);
        assert!(out.starts_with(b"a\r\ndata: {}\n\n\r\n12c\r\n"));
        out.extend_from_slice(b"0\r\n\r\n");
        let mut body = Body::new(Framing::Chunked);
        assert_eq!(body.feed(&out), Some(Some(out.len())));
    }

    fn ends(framing: Framing, parts: &[&[u8]]) -> Vec<Option<Option<usize>>> {
        let mut body = Body::new(framing);
        parts.iter().map(|p| body.feed(p)).collect()
    }

    #[test]
    fn a_length_body_ends_after_its_bytes() {
        assert_eq!(
            ends(Framing::Length(5), &[b"abc", b"defgh"]),
            [Some(None), Some(Some(2))]
        );
        assert_eq!(ends(Framing::Length(0), &[b""]), [Some(Some(0))]);
        assert_eq!(ends(Framing::None, &[b"x"]), [Some(Some(0))]);
        assert_eq!(ends(Framing::UntilClose, &[b"x"]), [Some(None)]);
    }

    #[test]
    fn a_chunked_body_ends_after_its_last_chunk_and_trailers() {
        let whole = b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\nNEXT";
        assert_eq!(
            ends(Framing::Chunked, &[whole]),
            [Some(Some(whole.len() - 4))]
        );
        // Byte by byte, the end is found at the same place.
        let mut body = Body::new(Framing::Chunked);
        let at = whole
            .iter()
            .position(|b| body.feed(std::slice::from_ref(b)) == Some(Some(1)))
            .unwrap();
        assert_eq!(at, whole.len() - 5);
        let trailers = b"0\r\nX-T: 1\r\n\r\n";
        assert_eq!(
            ends(Framing::Chunked, &[&trailers[..6], &trailers[6..]]),
            [Some(None), Some(Some(trailers.len() - 6))]
        );
        // An SSE stream, event by event.
        assert_eq!(
            ends(
                Framing::Chunked,
                &[
                    b"a\r\ndata: {}\n\n\r\n",
                    b"e\r\ndata: [DONE]\n\n\r\n",
                    b"0\r\n\r\n"
                ]
            ),
            [Some(None), Some(None), Some(Some(5))]
        );
    }

    /// Random chunked bodies, fed in random pieces: the end is found exactly where the body
    /// ends, whatever the split (a small LCG keeps the test deterministic without a crate).
    #[test]
    fn the_chunked_end_does_not_depend_on_how_the_bytes_are_split() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        for _ in 0..300 {
            let mut body = Vec::new();
            for _ in 0..next(6) {
                let size = 1 + next(300) as usize;
                let ext = if next(4) == 0 { ";name=value" } else { "" };
                body.extend_from_slice(format!("{size:x}{ext}\r\n").as_bytes());
                body.extend(std::iter::repeat_n(b'\r', size));
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n");
            if next(3) == 0 {
                body.extend_from_slice(b"X-Trailer: 1\r\n");
            }
            body.extend_from_slice(b"\r\n");
            let whole = body.len();
            body.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
            let mut tracker = Body::new(Framing::Chunked);
            let mut at = 0;
            let end = loop {
                let piece = (1 + next(64) as usize).min(body.len() - at);
                match tracker.feed(&body[at..at + piece]) {
                    Some(Some(n)) => break at + n,
                    Some(None) => at += piece,
                    None => panic!("refused a valid body at {at}"),
                }
                assert!(at < body.len(), "no end found");
            };
            assert_eq!(end, whole);
        }
    }

    #[test]
    fn a_broken_chunked_body_is_refused() {
        for bad in [
            &b"zz\r\n"[..],
            b"\r\n",
            b"5\r\nhelloXX",
            b"5\rX",
            b"fffffffffffffffff\r\n",
        ] {
            assert_eq!(ends(Framing::Chunked, &[bad]), [None], "{bad:?}");
        }
    }

    fn head(raw: &[u8]) -> &'static str {
        let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
        match read_head(raw, &mut storage) {
            Head::Due => "due",
            Head::Unfit => "unfit",
            Head::Whole(_) => "whole",
        }
    }

    /// Every framing a careful proxy does not pass on as it came goes to the general engine
    /// (which answers 400, 413 or 431: tests/tests/serve_framing.rs); none is carried here.
    #[test]
    fn framing_attacks_are_not_the_fast_engines() {
        let ok = b"POST /x HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(head(ok), "whole");
        for attack in [
            &b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 2\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: +2\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n folded\r\nContent-Length: 2\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
            b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",
            b"GET http://evil.example/x HTTP/1.1\r\nHost: localhost\r\n\r\n",
            b"GET /x HTTP/1.0\r\nHost: a\r\n\r\n",
            b"GET /x HTTP/1.1\r\nHost : a\r\n\r\n",
            b"GET /x HTTP/1.1\r\nHost: a\r\nHost: a\r\nHost: a\r\nHost: a\r\nHost: b\r\n\r\n",
            b"GET /x HTTP/1.1\r\nConnection: a\r\nConnection: b\r\nConnection: c\r\nConnection: d\r\nConnection: e\r\n\r\n",
        ] {
            assert_eq!(head(attack), "unfit", "{}", String::from_utf8_lossy(attack));
        }
        // A head still arriving waits, up to 64 KiB; a longer one (a request line over the
        // limit) is not the fast engine's.
        assert_eq!(head(b"GET /x HTTP/1.1\r\nHost: a\r\n"), "due");
        let mut long = b"GET /".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_HEAD));
        assert_eq!(head(&long), "unfit");
    }

    /// Bare LF line ends: httparse (as hyper) reads them; the backend never sees them, since
    /// the fast engine writes the head it sends anew, with CRLF (`plan::upstream_head`).
    #[test]
    fn bare_lf_heads_are_read_and_two_requests_in_one_write_are_two() {
        let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let two = b"GET /a HTTP/1.1\nHost: a\n\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n";
        let Head::Whole(first) = read_head(two, &mut storage) else {
            panic!("a bare-LF head is read");
        };
        assert_eq!((first.path, first.head_len), ("/a", 25));
        let rest = &two[first.head_len..];
        let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let Head::Whole(second) = read_head(rest, &mut storage) else {
            panic!("the second request is its own");
        };
        assert_eq!((second.path, second.head_len), ("/b", rest.len()));
    }

    /// The fuzz corpus as a regression suite on stable: every input keeps the invariants.
    #[test]
    fn the_fuzz_corpus_keeps_the_invariants() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/fast");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("the corpus directory exists") {
            let data = std::fs::read(entry.expect("a corpus entry").path()).expect("readable");
            fuzz_one(&data);
            seen += 1;
        }
        assert!(seen >= 10, "only {seen} corpus files in {}", dir.display());
    }
}
