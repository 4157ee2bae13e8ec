//! The fast engine: a client connection is served here first, on the raw socket. A request
//! whose [`RelayPlan`] the fast engine can carry (a backend target, no rewrite, HTTP/1.1, all
//! of it read within 100 ms of its head; `relay::wire` reads the head) goes to its backend and
//! back without hyper, axum or a task hand-off: one read, one write to the backend, one read,
//! one write to the client. Anything else (serve's own routes, a refusal, an error to report,
//! a route that must be asked, a reply serve must rewrite, a body slower than that) hands the
//! connection, with every byte read so far and the plan when there is one, to the general
//! engine (`relay::general`), which serves it from then on. So every rule and every error
//! reply has one implementation, there; this file only carries what the plan gives it.
//!
//! What it shares with the general engine: the browser guard and the API key (`guard`), the
//! plan (`relay::plan`: the route's rules, the status check, the body checks by kind, the
//! headers that pass), the watchdog ticket of a streamed inference request, a client that
//! leaves closing the backend connection, the header timeout, and a graceful stop between
//! requests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use onebit_plugin_api::BodyKind;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::error::ApiError;
use crate::guard::{self, Seen};
use crate::metrics::requests::{PathClass, StreamClock};
use crate::relay::App;
use crate::relay::busy_poll::BusyPollStream;
use crate::relay::in_flight::InFlight;
use crate::relay::plan::{self, Decided, Engine, RelayPlan, Target, Way};
use crate::relay::request_id::RequestId;
use crate::relay::sse_keepalive::{self, SseEdge};
use crate::relay::wire::{self, Body, Framing, Head, MAX_CONNECTION, MAX_HEAD, MAX_HEADERS};

/// A body larger than this goes the general way: it takes several reads to arrive anyway.
const MAX_FAST_BODY: usize = 256 * 1024;
/// How long the rest of a fast request's body may take, from its head, before the general
/// path takes the request (and times the body itself).
const BODY_GRACE: Duration = Duration::from_millis(100);
/// What became of one request on the fast engine.
enum Outcome {
    /// Answered; the connection stays open for the next request.
    KeepAlive,
    /// Answered (or the client left, or the reply broke off); close the connection.
    Close,
    /// Not a fast request: the general engine takes the connection, the bytes read so far,
    /// and the request's plan when the fast engine got as far as making it.
    HandOver(Option<Decided>),
    /// The request's head has not all arrived yet.
    HeadDue,
    /// A fast request whose body has not all arrived yet; its plan so far.
    BodyDue(RelayPlan),
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
    F: FnOnce(Prefixed, tokio::sync::watch::Receiver<bool>, Option<Decided>) -> Fut,
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
                Outcome::HandOver(decided) => {
                    return general(Prefixed::new(client, buf), stop, decided).await;
                }
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
                        () = crate::relay::stopped(&mut stop), if idle => return,
                    }
                }
                // Many clients write the body apart from the head; it follows at once. A body
                // that is not all there within the grace is the general engine's to time.
                Outcome::BodyDue(plan) => {
                    let until = *body_deadline
                        .get_or_insert_with(|| tokio::time::Instant::now() + BODY_GRACE);
                    match tokio::time::timeout_at(until, client.read_buf(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(_) => return,
                        Err(_) => {
                            let decided = Decided {
                                plan,
                                body_checked: false,
                            };
                            return general(Prefixed::new(client, buf), stop, Some(decided)).await;
                        }
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
    /// The plan so far is the fast engine's; the body has not all arrived.
    BodyDue(RelayPlan),
    /// Not a fast request (malformed and too large heads included: the general engine answers
    /// them), with its plan when the request got that far.
    HandOver(Option<Decided>),
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
    /// For `onebit_requests_total`.
    path: PathClass,
    /// The backend abandons it at its stop, so the drain does not wait for it (`in_flight`).
    abandoned_at_stop: bool,
    /// Sent to the backend, and on the reply.
    id: RequestId,
    /// The method and path for the request's log line, kept only when that line is on.
    logged: Option<Box<(String, String)>>,
}

impl Fast {
    /// The request's one line (`ONEBIT_LOG=debug`); nothing when it is off.
    fn log(&self, status: u16, added: Duration, bytes: u64) {
        if let Some(seen) = &self.logged {
            tracing::debug!(
                target: crate::log::REQUEST,
                method = %seen.0,
                path = %seen.1,
                status,
                engine = "fast",
                backend = self.backend,
                added_us = added.as_micros() as u64,
                bytes,
                request_id = %self.id,
                "1bit serve: request"
            );
        }
    }
}

/// `X-Request-Id: <id>` for a reply's head.
fn append_id(out: &mut Vec<u8>, id: &RequestId) {
    out.extend_from_slice(b"X-Request-Id: ");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Read the request at the start of `buf` and decide it: the transport conditions the fast
/// engine needs (a whole HTTP/1.1 head, no Transfer-Encoding, Expect or Upgrade, a body of at
/// most 256 KiB), the guard, and the request's [`RelayPlan`]. Runs on the connection's task;
/// never blocks.
fn qualify(app: &App, buf: &[u8]) -> Verdict {
    let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let head = match wire::read_head(buf, &mut storage) {
        Head::Whole(head) => head,
        Head::Due => return Verdict::HeadDue,
        Head::Unfit => return Verdict::HandOver(None),
    };
    let (method, target, path, head_len) = (head.method, head.target, head.path, head.head_len);
    let seen = Seen {
        method: method.as_bytes(),
        hosts: head.hosts(),
        authority: None,
        origins: head.origins(),
    };
    if guard::check(app.guard, &seen).is_err() {
        return Verdict::HandOver(None);
    }
    // The API key: a refusal (401) is the general engine's to send.
    if let Some(key) = &app.api_key
        && !guard::key::open_path(path)
        && key.admits(head.authorization(), head.x_api_key()).is_err()
    {
        return Verdict::HandOver(None);
    }
    // A refusal (404, 503) is the general engine's to send.
    let Ok(plan) = RelayPlan::for_head(app, method, path) else {
        return Verdict::HandOver(None);
    };
    // From here the request is judged: a hand-over carries its plan.
    let decided = |plan, body_checked| Verdict::HandOver(Some(Decided { plan, body_checked }));
    let Target::Backend(backend) = plan.target else {
        return decided(plan, false);
    };

    // The rule's kind says whether there is a body to relay: a body sent where none is
    // read (a GET's, say) is the general engine's to drop.
    let has_body = plan.body != BodyKind::None;
    let body_len = head.content_length.unwrap_or(0);
    if !has_body && body_len > 0 {
        return decided(plan, false);
    }
    if body_len > app.body_limit.min(MAX_FAST_BODY) {
        return decided(plan, false);
    }
    let Some(body) = buf.get(head_len..head_len + body_len) else {
        return Verdict::BodyDue(plan);
    };
    let mut streamed = false;
    if has_body {
        // A body that fails a check gets its refusal from the general engine.
        match plan::check_body(plan.body, head.content_type, body) {
            Ok(stream) => streamed = stream,
            Err(_) => return decided(plan, false),
        }
    }
    let plan = plan.with_body(app, streamed, body.len());
    let Some(port) = app.ports.get(backend).copied().filter(|_| plan.fast()) else {
        return decided(plan, has_body);
    };

    let id = RequestId::for_request(head.request_ids());
    let mut upstream = Vec::with_capacity(head_len + body_len + 64);
    let line = plan::UpstreamLine {
        method,
        target,
        port,
        body_len: has_body.then_some(body_len),
        request_id: id.as_bytes(),
    };
    plan::upstream_head(
        &mut upstream,
        &line,
        head.headers.iter().map(|h| (h.name, h.value)),
        head.connection(),
    );
    upstream.extend_from_slice(body);
    Verdict::Fast(Fast {
        backend,
        port,
        upstream,
        consumed: head_len + body_len,
        close: head.close,
        watched: plan
            .watched
            .then(|| (method.to_string(), path.to_string(), body_len)),
        path: PathClass::of(path),
        abandoned_at_stop: crate::relay::in_flight::abandoned_at_stop(path),
        id,
        logged: tracing::enabled!(target: crate::log::REQUEST, tracing::Level::DEBUG)
            .then(|| Box::new((method.to_string(), path.to_string()))),
    })
}

/// One request: qualify it, send it, relay the reply.
async fn exchange(app: &Arc<App>, client: &mut BusyPollStream, buf: &mut BytesMut) -> Outcome {
    // serve's added time runs from here (the request in hand) to the reply's head written,
    // less the backend's own time (`metrics::requests`).
    let began = Instant::now();
    let fast = match qualify(app, buf) {
        Verdict::Fast(fast) => fast,
        Verdict::HeadDue => return Outcome::HeadDue,
        Verdict::BodyDue(plan) => return Outcome::BodyDue(plan),
        Verdict::HandOver(decided) => return Outcome::HandOver(decided),
    };
    let mut in_flight = InFlight::begin();
    if fast.abandoned_at_stop {
        in_flight.abandoned_at_stop();
    }
    buf.advance(fast.consumed);
    let ticket = match (&fast.watched, app.watchdog.get()) {
        (Some((method, path, bytes)), Some(dog)) => {
            Some(dog.track(method, path, true, fast.backend, *bytes))
        }
        _ => None,
    };

    // Send, and read the reply's head. A request that a reused connection's backend refused
    // unread (a reset: it had closed the connection) is sent once more, on a new connection;
    // one it may have read (a clean close before any reply) is never sent twice.
    let mut reply = BytesMut::with_capacity(8 * 1024);
    let mut retried = false;
    let mut sent_at;
    // A watched request here is a streamed inference request (a whole one is the general
    // engine's, to name its reply): it gets comments in its backend's silences (keep-alive
    // on); `early` once serve began the reply itself, before the backend's head.
    let keepalive = fast.watched.as_ref().and(sse_keepalive::every());
    let mut early = false;
    let (mut backend, head) = loop {
        reply.clear();
        let taken = if retried {
            app.pool.connect(fast.port).await.map(|c| (c, false))
        } else {
            app.pool.checkout(fast.port).await
        };
        let (mut conn, reused) = match taken {
            Ok(c) => c,
            Err(e) => return bad_gateway(app, client, &fast, &e.to_string(), began).await,
        };
        let sent = async {
            conn.write_all(&fast.upstream).await?;
            conn.flush().await
        }
        .await;
        sent_at = Instant::now();
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
                                    append_id(&mut out, &fast.id);
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
            // The backend had closed the connection: the request went unread.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Err(ReplyError::Unread)
            }
            Err(e) => Err(ReplyError::Io(e)),
        };
        match head {
            Ok(head) => break (conn, head),
            Err(ReplyError::Unread) if reused && !retried && !early => retried = true,
            Err(e) if early => {
                // The client already has a 200 event stream: the failure is its last event.
                let why = format!("the {} backend did not answer ({e})", app.device);
                let mut out = Vec::new();
                wire::append_chunk(&mut out, &sse_keepalive::error_event(502, why.as_bytes()));
                out.extend_from_slice(b"0\r\n\r\n");
                let _ = client.write_all(&out).await;
                app.requests.count(fast.path, 200, Engine::Fast);
                app.requests
                    .lasted(fast.path, Engine::Fast, began.elapsed());
                fast.log(200, Duration::ZERO, 0);
                return Outcome::Close;
            }
            Err(e) => return bad_gateway(app, client, &fast, &e.to_string(), began).await,
        }
    };
    let backend_time = sent_at.elapsed();
    if let Some(ticket) = &ticket {
        ticket.progress(0);
    }
    // A streamed inference request's events are timed as they are written.
    let mut clock = fast
        .watched
        .is_some()
        .then(|| StreamClock::new(began, fast.path, Engine::Fast));
    if early {
        app.requests.count(fast.path, 200, Engine::Fast);
        let early = Early {
            keepalive,
            ticket,
            in_flight,
            clock,
        };
        let bytes = after_early_head(app, client, backend, reply, head, early).await;
        app.requests
            .lasted(fast.path, Engine::Fast, began.elapsed());
        fast.log(200, Duration::ZERO, bytes);
        return Outcome::Close;
    }
    app.requests.count(fast.path, head.status, Engine::Fast);
    let mut head_written = false;

    // A body that ends at the backend's close goes to the (HTTP/1.1) client chunked, each
    // read one chunk, so the client's connection stays framed and can be kept alive.
    let close = fast.close;
    let mut out = Vec::with_capacity(head.lines.len() + 64);
    out.extend_from_slice(&head.lines);
    match head.framing {
        Framing::Chunked | Framing::UntilClose => {
            out.extend_from_slice(b"Transfer-Encoding: chunked\r\n")
        }
        Framing::Length(n) => {
            out.extend_from_slice(b"Content-Length: ");
            out.extend_from_slice(n.to_string().as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Framing::None => {}
    }
    if close {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    append_id(&mut out, &fast.id);
    out.extend_from_slice(b"\r\n");
    let mut added = Duration::ZERO;
    let mut bytes: u64 = 0;

    // The body: what came with the head, then as it arrives, each read written at once.
    let mut body = Body::new(head.framing);
    let mut watch_client = true;
    // Comments go only into an event stream whose framing has room for them: chunks, or a
    // body that ends at the close (which the client gets chunked).
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
        if body.framing == Framing::UntilClose {
            wire::append_chunk(&mut out, &reply[..take]);
        } else {
            out.extend_from_slice(&reply[..take]);
        }
        let leftover = reply.len() > take;
        reply.clear();
        if !out.is_empty() {
            if client.write_all(&out).await.is_err() {
                return Outcome::Close;
            }
            out.clear();
            if !std::mem::replace(&mut head_written, true) {
                added = began.elapsed().saturating_sub(backend_time);
                app.requests.added(fast.path, Engine::Fast, added);
            }
            if take > 0 {
                bytes += take as u64;
                if let Some(clock) = &mut clock {
                    clock.wrote(&app.requests);
                }
            }
        }
        if done {
            if !head.backend_close && !leftover {
                app.pool.checkin(fast.port, backend);
            }
            drop(ticket);
            drop(in_flight);
            app.requests
                .lasted(fast.path, Engine::Fast, began.elapsed());
            fast.log(head.status, added, bytes);
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
                            // The client's reply is chunked either way (a body to the close
                            // is re-framed), so the comment goes as a chunk.
                            if edge.at_boundary() {
                                sse_keepalive::count();
                                if client.write_all(sse_keepalive::COMMENT_CHUNK).await.is_err() {
                                    return Outcome::Close;
                                }
                            }
                            last_byte = now;
                            timer.as_mut().reset(now + *every);
                        }
                    }
                },
                read = backend.read_buf(&mut reply) => match read {
                    Ok(0) if body.framing == Framing::UntilClose => {
                        // The backend's close ends the body: so does the last chunk.
                        drop(ticket);
                        drop(in_flight);
                        app.requests.lasted(fast.path, Engine::Fast, began.elapsed());
                        fast.log(head.status, added, bytes);
                        if client.write_all(b"0\r\n\r\n").await.is_err() || close {
                            return Outcome::Close;
                        }
                        return Outcome::KeepAlive;
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
    status: u16,
    lines: Vec<u8>,
    framing: Framing,
    backend_close: bool,
    /// `Content-Type: text/event-stream`.
    event_stream: bool,
}

enum ReplyError {
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
                return Err(ReplyError::Unread);
            }
            Err(e) => return Err(ReplyError::Io(e)),
        }
    }
}

fn reply_head(response: &httparse::Response<'_, '_>) -> Result<ReplyHead, ReplyError> {
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
        if !plan::passes(Way::Reply, name, &connection[..n_connection]) {
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
    })
}

/// The rest of a streamed reply whose head serve already sent (`sse_keepalive::EARLY_HEAD`):
/// the backend's events re-framed as chunks, with comments in its silences; a backend that
/// answered other than 200 becomes one error event. A reply that breaks off leaves the
/// client's reply without its last chunk; the connection closes either way. Returns the body
/// bytes passed on.
async fn after_early_head(
    app: &App,
    client: &mut BusyPollStream,
    mut backend: BusyPollStream,
    mut reply: BytesMut,
    head: ReplyHead,
    early: Early,
) -> u64 {
    let Early {
        keepalive,
        ticket,
        in_flight,
        mut clock,
    } = early;
    let mut bytes = 0;
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
                return bytes;
            };
            ended = end.is_some();
            edge.feed_payload(&reply[..end.unwrap_or(reply.len())], &mut payload);
            reply.clear();
        }
        let mut out = Vec::new();
        if ok {
            wire::append_chunk(&mut out, &payload);
        } else if kept.len() < 64 * 1024 {
            kept.extend_from_slice(&payload);
        }
        if ended {
            if !ok {
                wire::append_chunk(&mut out, &sse_keepalive::error_event(head.status, &kept));
            }
            out.extend_from_slice(b"0\r\n\r\n");
        }
        if !out.is_empty() && client.write_all(&out).await.is_err() {
            return bytes;
        }
        if ok && !payload.is_empty() {
            bytes += payload.len() as u64;
            if let Some(clock) = &mut clock {
                clock.wrote(&app.requests);
            }
        }
        if ended {
            drop(ticket);
            drop(in_flight);
            return bytes;
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
                    Ok(0) | Err(_) => return bytes,
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
                            return bytes;
                        }
                    }
                },
            }
        }
    }
}

/// What a stream whose head serve sent early carries on with.
struct Early {
    keepalive: Option<Duration>,
    ticket: Option<crate::backends::watchdog::Ticket>,
    in_flight: InFlight,
    clock: Option<StreamClock>,
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

/// Answer 502 as the general engine would, after the request was committed to a backend.
async fn bad_gateway(
    app: &App,
    client: &mut BusyPollStream,
    fast: &Fast,
    why: &str,
    began: Instant,
) -> Outcome {
    app.requests.count(fast.path, 502, Engine::Fast);
    app.requests
        .lasted(fast.path, Engine::Fast, began.elapsed());
    fast.log(502, Duration::ZERO, 0);
    let close = fast.close;
    let error = ApiError::no_answer(&app.device, why);
    let body =
        crate::error::openai_error_body(error.status(), error.error_type(), &error.message());
    let head = format!(
        "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\nX-Request-Id: {}\r\n{}\r\n",
        body.len(),
        fast.id,
        if close { "Connection: close\r\n" } else { "" }
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    match client.write_all(&out).await {
        Ok(()) if !close => Outcome::KeepAlive,
        _ => Outcome::Close,
    }
}

/// A client connection handed to the general engine: the bytes already read come first.
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
