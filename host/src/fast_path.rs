//! The relay's fast path: a client connection is served here first, on the raw socket, and a
//! plain proxied request (a `Proxy` rule, HTTP/1.1, all of it read within 100 ms of its head,
//! a JSON body that needs no rewriting) goes to its backend and back without hyper, axum or a
//! task hand-off: one read, one write to the backend, one read, one write to the client.
//! Anything else (serve's own routes, a refusal, an error to report, a route that must be
//! asked, a reply serve must rewrite, a body slower than that) hands the connection, with
//! every byte read so far, to the hyper/axum stack in `proxy`, which serves it from then on. So
//! every rule and every error reply has one implementation, in `proxy`; this file only decides
//! when it can step aside from it, and the tests of both paths are the same tests.
//!
//! What it keeps of the general path: the browser guard (the same `guard::check`), the route's
//! rules, the status check, the JSON checks (a request that fails one is handed over and gets
//! its refusal there), the hop-by-hop and CORS headers removed, the watchdog ticket of a
//! streamed inference request, a client that leaves closing the backend connection, the header
//! timeout, and a graceful stop between requests.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::busy_poll::{BusyPollStream, InFlight, Side};
use crate::guard::{self, Seen};
use crate::proxy::{
    App, RequestShape, Status, is_cors_header, is_hop_header, json_content_type, no_answer,
};
use crate::sse_keepalive::{self, SseEdge};
use onebit_plugin_api::Action;

/// Header lines a fast request may have; more go the general way.
const MAX_HEADERS: usize = 64;
/// A request head (or a backend's reply head) larger than this goes the general way (or is a
/// bad gateway).
const MAX_HEAD: usize = 64 * 1024;
/// A body larger than this goes the general way: it takes several reads to arrive anyway.
const MAX_FAST_BODY: usize = 256 * 1024;
/// How long the rest of a fast request's body may take, from its head, before the general
/// path takes the request (and times the body itself).
const BODY_GRACE: Duration = Duration::from_millis(100);
/// Idle backend connections kept for reuse, all backends together.
const MAX_IDLE: usize = 128;

/// An idle pooled connection this much younger is reused without asking the socket whether
/// the backend closed it: llama-server closes an idle connection after 5 s, and says so in
/// the reply when it closes one after its 100th request. A rare miss is retried.
const TRUST_IDLE_FOR: Duration = Duration::from_secs(1);

/// Idle keep-alive connections to the backends, the most recently used last.
#[derive(Default)]
pub struct BackendPool {
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    port: u16,
    since: std::time::Instant,
    conn: BusyPollStream,
}

impl BackendPool {
    /// An idle connection to `port` that the backend has not closed, else a new one; whether
    /// it was reused.
    async fn checkout(&self, port: u16) -> std::io::Result<(BusyPollStream, bool)> {
        loop {
            let found = {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                idle.iter()
                    .rposition(|i| i.port == port)
                    .map(|i| idle.remove(i))
            };
            match found {
                Some(idle) if idle.since.elapsed() < TRUST_IDLE_FOR || idle.conn.is_idle_open() => {
                    return Ok((idle.conn, true));
                }
                Some(_) => continue,
                None => break,
            }
        }
        let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
        tcp.set_nodelay(true)?;
        Ok((BusyPollStream::new(tcp, Side::Backend), false))
    }

    fn checkin(&self, port: u16, conn: BusyPollStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() >= MAX_IDLE {
            idle.remove(0);
        }
        idle.push(Idle {
            port,
            since: std::time::Instant::now(),
            conn,
        });
    }
}

/// What became of one request on the fast path.
enum Outcome {
    /// Answered; the connection stays open for the next request.
    KeepAlive,
    /// Answered (or the client left, or the reply broke off); close the connection.
    Close,
    /// Not a fast request: the general path takes the connection, and the bytes read so far.
    HandOver,
    /// The request's head has not all arrived yet.
    HeadDue,
    /// A fast request whose body has not all arrived yet.
    BodyDue,
}

/// How a reply's body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

/// Serve one client connection: fast requests here, until one is not; then hand the
/// connection to `general`.
pub async fn serve_connection<F, Fut>(
    mut client: BusyPollStream,
    app: Arc<App>,
    header_timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    general: F,
) where
    F: FnOnce(Prefixed, tokio::sync::watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let deadline = tokio::time::sleep(header_timeout);
    tokio::pin!(deadline);
    loop {
        // Per request: its head within the header timeout (hyper's rule; an idle kept-alive
        // connection too), its body within the grace after the head.
        deadline
            .as_mut()
            .reset(tokio::time::Instant::now() + header_timeout);
        let mut body_deadline = None;
        loop {
            match exchange(&app, &mut client, &mut buf).await {
                Outcome::KeepAlive => break,
                Outcome::Close => {
                    let _ = client.shutdown().await;
                    return;
                }
                Outcome::HandOver => return general(Prefixed::new(client, buf), stop).await,
                Outcome::HeadDue => {
                    let idle = buf.is_empty();
                    tokio::select! {
                        biased;
                        read = client.read_buf(&mut buf) => match read {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        },
                        // Headers too slow (or an idle connection past the timeout): drop it,
                        // as hyper's header timeout does.
                        () = deadline.as_mut() => return,
                        () = crate::serve::stopped(&mut stop), if idle => return,
                    }
                }
                // Many clients write the body apart from the head; it follows at once. A body
                // that is not all there within the grace is the general path's to time.
                Outcome::BodyDue => {
                    let until = *body_deadline
                        .get_or_insert_with(|| tokio::time::Instant::now() + BODY_GRACE);
                    match tokio::time::timeout_at(until, client.read_buf(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(_) => return,
                        Err(_) => return general(Prefixed::new(client, buf), stop).await,
                    }
                }
            }
        }
    }
}

/// What [`qualify`] found.
enum Verdict {
    Fast(Fast),
    /// The head has not all arrived (and is not yet too large).
    HeadDue,
    /// All but the body is known to qualify; the body has not all arrived.
    BodyDue,
    /// Not a fast request (malformed and too large heads included: the general path answers
    /// them).
    HandOver,
}

/// What a request still lacks, when that is why it is not (yet) a fast one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Missing {
    Nothing,
    Head,
    Body,
}

/// A request that qualified: what to send where.
struct Fast {
    backend: usize,
    port: u16,
    /// The backend request, head and body.
    upstream: Vec<u8>,
    /// Bytes of the client's buffer the request took.
    consumed: usize,
    /// The client asked to close after this reply.
    close: bool,
    /// For the watchdog: an inference request, streamed.
    watched: Option<(String, String, usize)>,
}

/// Decide whether the request at the start of `buf` is a fast one.
fn qualify(app: &App, buf: &[u8]) -> Verdict {
    let mut missing = Missing::Nothing;
    match fast_request(app, buf, &mut missing) {
        Some(fast) => Verdict::Fast(fast),
        None => match missing {
            Missing::Head => Verdict::HeadDue,
            Missing::Body => Verdict::BodyDue,
            Missing::Nothing => Verdict::HandOver,
        },
    }
}

/// The fast request at the start of `buf`; None when there is none, with `missing` set when
/// only the rest of its head, or of its body, is missing.
fn fast_request(app: &App, buf: &[u8], missing: &mut Missing) -> Option<Fast> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let head_len = match request.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {
            *missing = Missing::Head;
            return None;
        }
        _ => return None,
    };
    if request.version != Some(1) {
        return None;
    }
    let method = request.method?;
    let target = request.path?;
    if !target.starts_with('/') {
        return None;
    }
    let path = target.split('?').next().unwrap_or(target);

    let mut hosts: [&[u8]; 4] = [b""; 4];
    let mut n_hosts = 0;
    let mut origins: [&[u8]; 4] = [b""; 4];
    let mut n_origins = 0;
    let mut content_length: Option<usize> = None;
    let mut content_type: Option<&[u8]> = None;
    let mut close = false;
    for header in request.headers.iter() {
        let name = header.name;
        let value = header.value;
        if name.eq_ignore_ascii_case("host") {
            *hosts.get_mut(n_hosts)? = value;
            n_hosts += 1;
        } else if name.eq_ignore_ascii_case("origin") {
            *origins.get_mut(n_origins)? = value;
            n_origins += 1;
        } else if name.eq_ignore_ascii_case("content-length") {
            if content_length.is_some() || value.is_empty() || !value.iter().all(u8::is_ascii_digit)
            {
                return None;
            }
            content_length = Some(std::str::from_utf8(value).ok()?.parse().ok()?);
        } else if name.eq_ignore_ascii_case("content-type") {
            content_type = Some(value);
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    return None;
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
            || name.eq_ignore_ascii_case("upgrade")
        {
            return None;
        }
    }
    let seen = Seen {
        method: method.as_bytes(),
        hosts: &hosts[..n_hosts],
        origins: &origins[..n_origins],
    };
    if guard::check(app.guard, &seen).is_err() {
        return None;
    }
    let rule = app.rule_for(method, path)?;
    let Action::Proxy { backend } = rule.action else {
        return None;
    };
    if app.status() != Status::Ready {
        return None;
    }
    let port = *app.ports.get(backend)?;

    let has_body = method != "GET" && method != "HEAD";
    let body_len = content_length.unwrap_or(0);
    if (!has_body && body_len > 0) || body_len > app.body_limit.min(MAX_FAST_BODY) {
        return None;
    }
    let Some(body) = buf.get(head_len..head_len + body_len) else {
        *missing = Missing::Body;
        return None;
    };
    let mut streamed = false;
    if has_body {
        if content_type.is_some_and(|ct| !json_content_type(ct)) {
            return None;
        }
        std::str::from_utf8(body).ok()?;
        streamed = serde_json::from_slice::<RequestShape>(body)
            .ok()?
            .stream
            .unwrap_or(false);
    }
    if rule.inference && (!streamed || app.precise || app.rename_in_streams) {
        // The general path renames the reply's model or rewrites the body.
        return None;
    }

    let mut upstream = Vec::with_capacity(head_len + body_len + 32);
    upstream.extend_from_slice(method.as_bytes());
    upstream.push(b' ');
    upstream.extend_from_slice(target.as_bytes());
    upstream.extend_from_slice(b" HTTP/1.1\r\nHost: 127.0.0.1:");
    upstream.extend_from_slice(port.to_string().as_bytes());
    upstream.extend_from_slice(b"\r\n");
    for header in request.headers.iter() {
        let name = header.name;
        if name.eq_ignore_ascii_case("host")
            || name.eq_ignore_ascii_case("content-length")
            || is_hop_header(name)
        {
            continue;
        }
        upstream.extend_from_slice(name.as_bytes());
        upstream.extend_from_slice(b": ");
        upstream.extend_from_slice(header.value);
        upstream.extend_from_slice(b"\r\n");
    }
    if has_body {
        upstream.extend_from_slice(b"Content-Length: ");
        upstream.extend_from_slice(body_len.to_string().as_bytes());
        upstream.extend_from_slice(b"\r\n");
    }
    upstream.extend_from_slice(b"\r\n");
    upstream.extend_from_slice(body);
    Some(Fast {
        backend,
        port,
        upstream,
        consumed: head_len + body_len,
        close,
        watched: rule
            .inference
            .then(|| (method.to_string(), path.to_string(), body_len)),
    })
}

/// One request: qualify it, send it, relay the reply.
async fn exchange(app: &Arc<App>, client: &mut BusyPollStream, buf: &mut BytesMut) -> Outcome {
    let fast = match qualify(app, buf) {
        Verdict::Fast(fast) => fast,
        Verdict::HeadDue => return Outcome::HeadDue,
        Verdict::BodyDue => return Outcome::BodyDue,
        Verdict::HandOver => return Outcome::HandOver,
    };
    let in_flight = InFlight::begin();
    buf.advance(fast.consumed);
    let ticket = match (&fast.watched, app.watchdog.get()) {
        (Some((method, path, bytes)), Some(dog)) => {
            Some(dog.track(method, path, true, fast.backend, *bytes))
        }
        _ => None,
    };

    // Send, and read the reply's head; a reused connection that the backend closed before
    // answering is retried once on a new one, as hyper's pool does.
    let mut reply = BytesMut::with_capacity(8 * 1024);
    let mut fresh_tries = 0;
    // A streamed inference request gets comments in its backend's silences (keep-alive on);
    // `early` once serve began the reply itself, before the backend's head.
    let keepalive = fast.watched.as_ref().and(sse_keepalive::every());
    let mut early = false;
    let (mut backend, head) = loop {
        reply.clear();
        let (mut conn, reused) = match app.pool.checkout(fast.port).await {
            Ok(c) => c,
            Err(e) => return bad_gateway(app, client, fast.close, &e.to_string()).await,
        };
        let sent = async {
            conn.write_all(&fast.upstream).await?;
            conn.flush().await
        }
        .await;
        let head = match sent {
            Ok(()) => match keepalive {
                None => read_reply_head(&mut conn, &mut reply).await,
                Some(every) => {
                    let head = read_reply_head(&mut conn, &mut reply);
                    tokio::pin!(head);
                    loop {
                        tokio::select! {
                            h = &mut head => break h,
                            () = tokio::time::sleep(every) => {
                                let mut out = Vec::new();
                                if !early {
                                    out.extend_from_slice(sse_keepalive::EARLY_HEAD);
                                    append_date(&mut out);
                                    out.extend_from_slice(b"connection: close\r\n\r\n");
                                    early = true;
                                }
                                sse_keepalive::count();
                                out.extend_from_slice(sse_keepalive::COMMENT_CHUNK);
                                if client.write_all(&out).await.is_err() {
                                    return Outcome::Close;
                                }
                            }
                        }
                    }
                }
            },
            // The backend closed the connection before it took the request.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Err(ReplyError::ClosedEarly)
            }
            Err(e) => Err(ReplyError::Io(e)),
        };
        match head {
            Ok(head) => break (conn, head),
            Err(ReplyError::ClosedEarly) if reused && fresh_tries == 0 => fresh_tries += 1,
            Err(e) if early => {
                let why = format!("the {} backend did not answer ({e})", app.device);
                let mut out = Vec::new();
                sse_keepalive::as_chunk(&sse_keepalive::error_event(502, why.as_bytes()), &mut out);
                out.extend_from_slice(b"0\r\n\r\n");
                let _ = client.write_all(&out).await;
                return Outcome::Close;
            }
            Err(e) => return bad_gateway(app, client, fast.close, &e.to_string()).await,
        }
    };
    if let Some(ticket) = &ticket {
        ticket.progress(0);
    }
    if early {
        return after_early_head(client, backend, reply, head, keepalive, ticket, in_flight).await;
    }

    let close = fast.close || head.framing == Framing::UntilClose;
    let mut out = Vec::with_capacity(head.lines.len() + 64);
    out.extend_from_slice(&head.lines);
    match head.framing {
        Framing::Chunked => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
        Framing::Length(n) => {
            out.extend_from_slice(b"Content-Length: ");
            out.extend_from_slice(n.to_string().as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Framing::None | Framing::UntilClose => {}
    }
    if close {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");

    // The body: what came with the head, then as it arrives, each read written at once.
    let mut body = Body::new(head.framing);
    let mut watch_client = true;
    // Comments go only into an event stream whose framing has room for them.
    let mut edge = keepalive
        .filter(|_| head.event_stream)
        .and_then(|every| match head.framing {
            Framing::Chunked => Some((every, SseEdge::new(sse_keepalive::Framing::Chunked))),
            Framing::UntilClose => Some((every, SseEdge::new(sse_keepalive::Framing::Payload))),
            _ => None,
        });
    // One timer for the whole reply, moved on lazily: a read only notes its time, and the
    // timer, when it fires early, is set again for `every` after the last byte.
    let mut silence = edge
        .as_ref()
        .map(|(every, _)| Box::pin(tokio::time::sleep(*every)));
    let mut last_byte = tokio::time::Instant::now();
    loop {
        let end = body.feed(&reply);
        let Some(end) = end else {
            return Outcome::Close; // a chunk size that is not one
        };
        let done = end.is_some();
        let take = end.unwrap_or(reply.len());
        if let Some((_, edge)) = &mut edge {
            edge.feed(&reply[..take]);
        }
        out.extend_from_slice(&reply[..take]);
        let leftover = reply.len() > take;
        reply.clear();
        if !out.is_empty() {
            if client.write_all(&out).await.is_err() {
                return Outcome::Close;
            }
            out.clear();
        }
        if done {
            if !head.backend_close && !leftover {
                app.pool.checkin(fast.port, backend);
            }
            drop(ticket);
            drop(in_flight);
            return if close {
                Outcome::Close
            } else {
                Outcome::KeepAlive
            };
        }
        // More to come: wait for it, and for a client that leaves meanwhile (its backend
        // connection is then dropped, which stops the engine).
        loop {
            tokio::select! {
                biased;
                () = async {
                    match silence.as_mut() {
                        Some(timer) => timer.as_mut().await,
                        None => std::future::pending().await,
                    }
                }, if silence.is_some() => {
                    if let (Some((every, edge)), Some(timer)) = (&mut edge, silence.as_mut()) {
                        let now = tokio::time::Instant::now();
                        let due = last_byte + *every;
                        if now < due {
                            timer.as_mut().reset(due);
                        } else {
                            if edge.at_boundary() && client.write_all(edge.comment()).await.is_err() {
                                return Outcome::Close;
                            }
                            last_byte = now;
                            timer.as_mut().reset(now + *every);
                        }
                    }
                },
                read = backend.read_buf(&mut reply) => match read {
                    Ok(0) if body.framing == Framing::UntilClose => {
                        drop(ticket);
                        drop(in_flight);
                        return Outcome::Close;
                    }
                    // The reply broke off: the client sees its connection close.
                    Ok(0) | Err(_) => return Outcome::Close,
                    Ok(n) => {
                        if let Some(ticket) = &ticket {
                            ticket.progress(n);
                        }
                        if silence.is_some() {
                            last_byte = tokio::time::Instant::now();
                        }
                        break;
                    }
                },
                read = client.read_buf(buf), if watch_client => match read {
                    Ok(0) | Err(_) => return Outcome::Close,
                    // The client's next request, early: keep it for later.
                    Ok(_) => watch_client = buf.len() < MAX_HEAD,
                },
            }
        }
    }
}

/// The reply's status line and the headers the client gets (hop-by-hop, CORS and framing
/// headers left out), and how its body ends.
struct ReplyHead {
    lines: Vec<u8>,
    framing: Framing,
    backend_close: bool,
    /// The status code.
    status: u16,
    /// `Content-Type: text/event-stream`.
    event_stream: bool,
}

enum ReplyError {
    /// The connection closed before a byte of the reply.
    ClosedEarly,
    Io(std::io::Error),
    Malformed(String),
}

impl std::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyError::ClosedEarly => f.write_str("connection closed before the reply"),
            ReplyError::Io(e) => write!(f, "{e}"),
            ReplyError::Malformed(why) => write!(f, "malformed reply: {why}"),
        }
    }
}

/// Read until the reply's head is whole; it is removed from `reply`, which keeps the body bytes
/// that came with it.
async fn read_reply_head(
    conn: &mut BusyPollStream,
    reply: &mut BytesMut,
) -> Result<ReplyHead, ReplyError> {
    loop {
        if !reply.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(reply) {
                Ok(httparse::Status::Complete(n)) => {
                    let head = reply_head(&response)?;
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
                return Err(ReplyError::ClosedEarly);
            }
            Err(e) => return Err(ReplyError::Io(e)),
        }
    }
}

fn reply_head(response: &httparse::Response<'_, '_>) -> Result<ReplyHead, ReplyError> {
    let code = response.code.unwrap_or(502);
    if response.version != Some(1) || code < 200 {
        // HTTP/1.0 framing rules or an interim reply: not what a llama-server sends.
        return Err(ReplyError::Malformed(format!(
            "HTTP/1.{} status {code}",
            response.version.unwrap_or(0)
        )));
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
    let mut dated = false;
    let mut event_stream = false;
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
            if !value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(ReplyError::Malformed(
                    "a transfer coding other than chunked".into(),
                ));
            }
            chunked = true;
            continue;
        }
        if name.eq_ignore_ascii_case("connection") {
            backend_close |= value
                .split(|b| *b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
            continue;
        }
        if is_hop_header(name) || is_cors_header(name) {
            continue;
        }
        dated |= name.eq_ignore_ascii_case("date");
        event_stream |=
            name.eq_ignore_ascii_case("content-type") && value.starts_with(b"text/event-stream");
        lines.extend_from_slice(name.as_bytes());
        lines.extend_from_slice(b": ");
        lines.extend_from_slice(value);
        lines.extend_from_slice(b"\r\n");
    }
    if !dated {
        // A proxy with a clock dates a reply that came without a date (RFC 9110, 6.6.1), as
        // the general path's replies are dated.
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
    Ok(ReplyHead {
        lines,
        framing,
        backend_close: backend_close || framing == Framing::UntilClose,
        status: code,
        event_stream,
    })
}

/// The rest of a streamed reply whose head serve already sent (`sse_keepalive::EARLY_HEAD`):
/// the backend's events re-framed as chunks, with comments in its silences; a backend that
/// answered other than 200 becomes one error event. A reply that breaks off leaves the
/// client's reply without its last chunk, and the connection closes.
async fn after_early_head(
    client: &mut BusyPollStream,
    mut backend: BusyPollStream,
    mut reply: BytesMut,
    head: ReplyHead,
    keepalive: Option<Duration>,
    ticket: Option<crate::watchdog::Ticket>,
    in_flight: InFlight,
) -> Outcome {
    let every = keepalive.unwrap_or(Duration::from_secs(sse_keepalive::DEFAULT_SECS));
    let mut body = Body::new(head.framing);
    let mut edge = SseEdge::new(if head.framing == Framing::Chunked {
        sse_keepalive::Framing::Chunked
    } else {
        sse_keepalive::Framing::Payload
    });
    let ok = head.status == 200;
    let mut kept = Vec::new();
    let mut ended = head.framing == Framing::None;
    loop {
        let mut payload = Vec::new();
        if !ended {
            let Some(end) = body.feed(&reply) else {
                return Outcome::Close;
            };
            ended = end.is_some();
            edge.feed_payload(&reply[..end.unwrap_or(reply.len())], &mut payload);
            reply.clear();
        }
        let mut out = Vec::new();
        if ok {
            sse_keepalive::as_chunk(&payload, &mut out);
        } else if kept.len() < 64 * 1024 {
            kept.extend_from_slice(&payload);
        }
        if ended {
            if !ok {
                sse_keepalive::as_chunk(&sse_keepalive::error_event(head.status, &kept), &mut out);
            }
            out.extend_from_slice(b"0\r\n\r\n");
        }
        if !out.is_empty() && client.write_all(&out).await.is_err() {
            return Outcome::Close;
        }
        if ended {
            drop(ticket);
            drop(in_flight);
            return Outcome::Close;
        }
        let silence = tokio::time::sleep(every);
        tokio::pin!(silence);
        loop {
            tokio::select! {
                read = backend.read_buf(&mut reply) => match read {
                    Ok(0) if head.framing == Framing::UntilClose => {
                        ended = true;
                        break;
                    }
                    Ok(0) | Err(_) => return Outcome::Close,
                    Ok(n) => {
                        if let Some(ticket) = &ticket {
                            ticket.progress(n);
                        }
                        break;
                    }
                },
                () = &mut silence => {
                    silence.as_mut().reset(tokio::time::Instant::now() + every);
                    if ok && edge.at_boundary() {
                        sse_keepalive::count();
                        if client.write_all(sse_keepalive::COMMENT_CHUNK).await.is_err() {
                            return Outcome::Close;
                        }
                    }
                },
            }
        }
    }
}

/// `Date: <now>`, formatted once a second.
fn append_date(out: &mut Vec<u8>) {
    thread_local! {
        static CACHED: std::cell::RefCell<(u64, String)> = const {
            std::cell::RefCell::new((0, String::new()))
        };
    }
    let now = std::time::SystemTime::now();
    let second = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != second || cached.1.is_empty() {
            *cached = (second, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(b"Date: ");
        out.extend_from_slice(cached.1.as_bytes());
        out.extend_from_slice(b"\r\n");
    });
}

/// Where a reply body ends, fed its bytes as they come (the bytes are passed on unchanged,
/// chunked coding included).
struct Body {
    framing: Framing,
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
    fn new(framing: Framing) -> Self {
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
    fn feed(&mut self, bytes: &[u8]) -> Option<Option<usize>> {
        match self.framing {
            Framing::None => Some(Some(0)),
            Framing::UntilClose => Some(None),
            Framing::Length(_) => {
                let take = (bytes.len() as u64).min(self.remaining);
                self.remaining -= take;
                Some((self.remaining == 0).then_some(take as usize))
            }
            Framing::Chunked => self.feed_chunked(bytes),
        }
    }

    fn feed_chunked(&mut self, bytes: &[u8]) -> Option<Option<usize>> {
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

/// Answer 502 as the general path would, after the request was committed to a backend.
async fn bad_gateway(app: &App, client: &mut BusyPollStream, close: bool, why: &str) -> Outcome {
    let error = no_answer(&app.device, why);
    let body =
        crate::error::openai_error_body(error.status(), error.error_type(), &error.message());
    let head = format!(
        "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n",
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    match client.write_all(&out).await {
        Ok(()) if !close => Outcome::KeepAlive,
        _ => Outcome::Close,
    }
}

/// A client connection handed to the general path: the bytes already read come first.
pub struct Prefixed {
    read: BytesMut,
    stream: BusyPollStream,
}

impl Prefixed {
    fn new(stream: BusyPollStream, read: BytesMut) -> Self {
        Prefixed { read, stream }
    }
}

impl AsyncRead for Prefixed {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.read.is_empty() {
            let n = this.read.len().min(out.remaining());
            out.put_slice(&this.read[..n]);
            this.read.advance(n);
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut this.stream).poll_read(cx, out)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn head_of(raw: &[u8]) -> Result<ReplyHead, ReplyError> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        assert!(response.parse(raw).is_ok());
        reply_head(&response)
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
        for bad in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: five\r\n\r\n",
            b"HTTP/1.0 200 OK\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
        ] {
            assert!(head_of(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
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
}
