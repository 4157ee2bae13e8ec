//! The fast engine: a client connection is served here first, on the raw socket. A request
//! whose [`RelayPlan`] the fast engine can carry (a backend target, no rewrite but the served
//! name in a whole reply (`whole`), HTTP/1.1, all of it read within 100 ms of its head;
//! `relay::wire` reads the head) goes to its backend and back without hyper, axum or a task
//! hand-off: one read, one write to the backend, one read, one write to the client. Anything
//! else (serve's own routes, a refusal, an error to report, a route that must be asked, a
//! request or stream serve must rewrite, a body slower than that) hands the connection, with
//! every byte read so far and the plan when there is one, to the general
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

use crate::App;
use crate::busy_poll::BusyPollStream;
use crate::early_stream::EarlyStream;
use crate::ending::Deadline;
use crate::exchange::{Exchange, Record};
use crate::plan::{self, Direction, Engine, HandedPlan, RelayPlan, Target};
use crate::request_id::RequestId;
use crate::sse_keepalive;
use crate::wire::{self, Body, Framing, Head, MAX_CONNECTION, MAX_HEAD, MAX_HEADERS};
use onebit_command::error::ApiError;
use onebit_features::guard::{self, Seen};
use onebit_metrics::requests::PathClass;

mod early;
mod handover;
mod qualify;
mod reply_head;
mod silences;
mod whole;

use early::{after_early_head, framed};
pub use handover::Prefixed;
use qualify::{Fast, Verdict, qualify};
use reply_head::{ReplyError, ReplyHead, read_reply_head};
use silences::Silences;

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
    HandOver(Option<HandedPlan>),
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
    F: FnOnce(Prefixed, tokio::sync::watch::Receiver<bool>, Option<HandedPlan>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut buf = BytesMut::with_capacity(8 * 1024);
    if !app.settings.fast_engine {
        return general(Prefixed::new(client, buf), stop, None).await;
    }
    let head_due = tokio::time::sleep(header_timeout);
    tokio::pin!(head_due);
    loop {
        // Per request: its head within the header timeout (hyper's rule; an idle kept-alive
        // connection too), its body within the grace after the head.
        head_due
            .as_mut()
            .reset(tokio::time::Instant::now() + header_timeout);
        let mut body_due = None;
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
                        () = head_due.as_mut() => return,
                        () = crate::stopped(&mut stop), if idle => return,
                    }
                }
                // Many clients write the body apart from the head; it follows at once. A body
                // that is not all there within the grace is the general engine's to time.
                Outcome::BodyDue(plan) => {
                    let until =
                        *body_due.get_or_insert_with(|| tokio::time::Instant::now() + BODY_GRACE);
                    match tokio::time::timeout_at(until, client.read_buf(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(_) => return,
                        Err(_) => {
                            let decided = HandedPlan {
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

/// `X-Request-Id: <id>` for a reply's head.
fn append_id(out: &mut Vec<u8>, id: &RequestId) {
    out.extend_from_slice(b"X-Request-Id: ");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// One request: qualify it, send it, relay the reply.
async fn exchange(app: &Arc<App>, client: &mut BusyPollStream, buf: &mut BytesMut) -> Outcome {
    // serve's added time runs from here (the request in hand) to the reply's head written,
    // less the backend's own time (`metrics::requests`).
    let began = Instant::now();
    let (fast, exchange) = match qualify(app, buf, began) {
        Verdict::Fast(fast, exchange) => (fast, exchange),
        Verdict::HeadDue => return Outcome::HeadDue,
        Verdict::BodyDue(plan) => return Outcome::BodyDue(plan),
        Verdict::HandOver(decided) => return Outcome::HandOver(decided),
    };
    buf.advance(fast.consumed);
    // A streamed generation gets comments in its backend's silences (keep-alive on).
    let keepalive = app.settings.sse_keepalive.filter(|_| fast.streamed);
    let mut tracking = Tracking {
        keepalive,
        exchange,
    };
    let sent = match send(app, client, &fast, &mut tracking).await {
        Ok(sent) => sent,
        Err(outcome) => return outcome,
    };
    let backend_time = sent.at.elapsed();
    tracking.exchange.reply_head();
    if let Some(stream) = sent.early {
        tracking.exchange.answered(200);
        after_early_head(
            client,
            sent.backend,
            stream,
            sent.reply,
            sent.head,
            tracking,
        )
        .await;
        return Outcome::Close;
    }
    if fast.name_reply && sent.head.json {
        // Counted when its head goes out, after the body (a deadline before is a 504).
        return whole::relay_named(
            app,
            client,
            buf,
            &fast,
            sent,
            tracking.exchange,
            backend_time,
        )
        .await;
    }
    tracking.exchange.answered(sent.head.status);
    relay_reply(app, client, buf, &fast, sent, tracking, backend_time).await
}

/// The request sent and its reply's head read: the backend connection, the head, the bytes
/// read past it, when the request was sent, and whether serve already began the client's
/// reply itself (`early`: the early stream, begun by a silence before the backend's head).
struct Sent {
    backend: BusyPollStream,
    head: ReplyHead,
    reply: BytesMut,
    at: Instant,
    early: Option<EarlyStream>,
}

/// Send the request and read its reply's head. A request that a reused connection's backend
/// refused unread (a reset: it had closed the connection) is sent once more, on a new
/// connection; one it may have read (a clean close before any reply) is never sent twice.
/// With `keepalive`, the client gets comments while the head is due (its reply's head first).
/// Err: the request is over, answered with a 502 or ended in the early stream.
async fn send(
    app: &Arc<App>,
    client: &mut BusyPollStream,
    fast: &Fast,
    tracking: &mut Tracking,
) -> Result<Sent, Outcome> {
    let keepalive = tracking.keepalive;
    let deadline = tracking.exchange.deadline();
    let to_client = Direction::Reply {
        cors: app.settings.cors.is_some(),
    };
    let mut reply = BytesMut::with_capacity(8 * 1024);
    let mut retried = false;
    let mut early: Option<EarlyStream> = None;
    loop {
        reply.clear();
        let taken = if retried {
            app.pool.connect(fast.port).await.map(|c| (c, false))
        } else {
            app.pool.checkout(fast.port).await
        };
        let (mut conn, reused) = match taken {
            Ok(c) => c,
            Err(e) => {
                return Err(
                    bad_gateway(app, client, fast, &e.to_string(), &mut tracking.exchange).await,
                );
            }
        };
        // No flush: a socket has nothing to flush, and `BusyPollStream`'s flush would spin
        // by peeking; the reply's first read spins by reading, so the call that finds the
        // reply takes it.
        let sent = conn.write_all(&fast.upstream).await;
        let at = Instant::now();
        let head = match sent {
            Ok(()) => match (keepalive, &deadline) {
                (None, None) => read_reply_head(&mut conn, &mut reply, to_client).await,
                (None, Some(deadline)) => tokio::time::timeout_at(
                    deadline.at(),
                    read_reply_head(&mut conn, &mut reply, to_client),
                )
                .await
                .unwrap_or(Err(ReplyError::Deadline)),
                (Some(every), _) => {
                    let head = read_reply_head(&mut conn, &mut reply, to_client);
                    tokio::pin!(head);
                    loop {
                        tokio::select! {
                            h = &mut head => break h,
                            () = Deadline::passed(deadline.as_ref()) => break Err(ReplyError::Deadline),
                            // Once serve began the stream (it closes after it), a client
                            // that leaves is noticed at once, not at the next silence: the
                            // backend connection is dropped while the prefill runs.
                            () = left(client), if early.is_some() => return Err(Outcome::Close),
                            () = tokio::time::sleep(every) => {
                                let mut out = Vec::new();
                                let said = match &mut early {
                                    Some(stream) => stream.silence(),
                                    None => {
                                        out.extend_from_slice(sse_keepalive::EARLY_HEAD);
                                        append_date(&mut out);
                                        append_id(&mut out, &fast.id);
                                        out.extend_from_slice(b"connection: close\r\n\r\n");
                                        let (stream, said) = EarlyStream::begin(
                                            &app.settings.device,
                                            &app.metrics.counters,
                                        );
                                        early = Some(stream);
                                        said
                                    }
                                };
                                framed(said, &[], &mut out);
                                if client.write_all(&out).await.is_err() {
                                    return Err(Outcome::Close);
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
            Ok(head) => {
                return Ok(Sent {
                    backend: conn,
                    head,
                    reply,
                    at,
                    early,
                });
            }
            Err(ReplyError::Unread) if reused && !retried && early.is_none() => retried = true,
            Err(ReplyError::Deadline) => {
                // The generation's deadline (`ending`): the backend connection is dropped here.
                let deadline = deadline.as_ref();
                return Err(past_deadline(client, fast, deadline, early, tracking).await);
            }
            Err(e) if early.is_some() => {
                // The client already has a 200 event stream: the failure is its last event.
                let mut out = Vec::new();
                if let Some(stream) = &mut early {
                    framed(stream.no_head(&e.to_string()), &[], &mut out);
                }
                let _ = client.write_all(&out).await;
                tracking.exchange.answered(200);
                return Err(Outcome::Close);
            }
            Err(e) => {
                return Err(
                    bad_gateway(app, client, fast, &e.to_string(), &mut tracking.exchange).await,
                );
            }
        }
    }
}

/// The generation's deadline passed before its reply's head: a 504, or the last event of the
/// stream serve already began (`early`).
async fn past_deadline(
    client: &mut BusyPollStream,
    fast: &Fast,
    deadline: Option<&Deadline>,
    early: Option<EarlyStream>,
    tracking: &mut Tracking,
) -> Outcome {
    let Some(deadline) = deadline else {
        return Outcome::Close;
    };
    deadline.ended();
    let Some(mut stream) = early else {
        return refuse(client, fast, &deadline.error(), &mut tracking.exchange).await;
    };
    let mut out = Vec::new();
    framed(stream.ended(deadline.event()), &[], &mut out);
    let _ = client.write_all(&out).await;
    tracking.exchange.answered(200);
    Outcome::Close
}

/// Resolves when the client closes its connection (or it fails); bytes it sends meanwhile
/// are read and dropped. Only for a reply after which the connection closes.
async fn left(client: &mut BusyPollStream) {
    let mut scrap = [0u8; 256];
    while let Ok(n) = client.read(&mut scrap).await {
        if n == 0 {
            return;
        }
    }
}

/// The client's reply head: the backend's lines, the framing the client gets (a body that
/// ends at the backend's close goes chunked), the close the client asked for, the request id.
fn client_head(head: &ReplyHead, close: bool, id: &RequestId) -> Vec<u8> {
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
    append_id(&mut out, id);
    out.extend_from_slice(b"\r\n");
    out
}

/// Relay the reply: its head, then the body as it arrives, each read written at once, with
/// keep-alive comments in an event stream's silences, the watchdog told of each read, and the
/// client watched meanwhile (one that leaves drops the backend connection, which stops the
/// engine; its next request, sent early, is kept in `buf`).
async fn relay_reply(
    app: &Arc<App>,
    client: &mut BusyPollStream,
    buf: &mut BytesMut,
    fast: &Fast,
    sent: Sent,
    tracking: Tracking,
    backend_time: Duration,
) -> Outcome {
    let Sent {
        mut backend,
        head,
        mut reply,
        ..
    } = sent;
    let Tracking {
        keepalive,
        mut exchange,
    } = tracking;
    let mut head_written = false;
    let close = fast.close;
    let mut out = client_head(&head, close, &fast.id);
    // The body: what came with the head, then as it arrives, each read written at once.
    let mut body = Body::new(head.framing);
    let mut watch_client = true;
    let mut silences = Silences::for_reply(keepalive, &head, &app.metrics.counters);
    let deadline = exchange.deadline();
    loop {
        let end = body.feed(&reply);
        let Some(end) = end else {
            return Outcome::Close; // a chunk size that is not one
        };
        let done = end.is_some();
        let take = end.unwrap_or(reply.len());
        if let Some(silences) = &mut silences {
            silences.edge.feed(&reply[..take]);
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
                exchange.head_written(backend_time);
            }
            if take > 0 {
                exchange.passed(take);
            }
        }
        if done {
            if head.keeps_connection() && !leftover {
                app.pool.checkin(fast.port, backend);
            }
            drop(exchange);
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
                    match silences.as_mut() {
                        Some(silences) => silences.timer.as_mut().await,
                        None => std::future::pending().await,
                    }
                }, if silences.is_some() => {
                    if let Some(silences) = &mut silences
                        && silences.fired(client).await.is_err()
                    {
                        return Outcome::Close;
                    }
                },
                read = backend.read_buf(&mut reply) => match read {
                    Ok(0) if body.framing == Framing::UntilClose => {
                        // The backend's close ends the body: so does the last chunk.
                        drop(exchange);
                        if client.write_all(b"0\r\n\r\n").await.is_err() || close {
                            return Outcome::Close;
                        }
                        return Outcome::KeepAlive;
                    }
                    // The reply broke off: the client sees its connection close.
                    Ok(0) | Err(_) => return Outcome::Close,
                    Ok(n) => {
                        exchange.arrived(n);
                        if let Some(silences) = &mut silences {
                            silences.last_byte = tokio::time::Instant::now();
                        }
                        break;
                    }
                },
                read = client.read_buf(buf), if watch_client => match read {
                    Ok(0) | Err(_) => return Outcome::Close,
                    // The client's next request, early: keep it for later.
                    Ok(_) => watch_client = buf.len() < MAX_HEAD,
                },
                () = Deadline::passed(deadline.as_ref()), if deadline.is_some() => {
                    // The generation's deadline (`ending`): an event stream between chunks
                    // gets its last event; the backend connection is dropped either way.
                    if let Some(deadline) = &deadline {
                        deadline.ended();
                        let mut last = Vec::new();
                        let room = matches!(body.framing, Framing::Chunked | Framing::UntilClose)
                            && body.between_chunks()
                            && silences.as_ref().is_none_or(|s| s.edge.at_boundary());
                        if head.event_stream && room {
                            wire::append_chunk(&mut last, &deadline.event());
                            last.extend_from_slice(b"0\r\n\r\n");
                        }
                        let _ = client.write_all(&last).await;
                    }
                    return Outcome::Close;
                },
            }
        }
    }
}

/// What a relayed reply carries along: its keep-alive period and the request's exchange.
struct Tracking {
    keepalive: Option<Duration>,
    exchange: Exchange,
}

/// `Date: <now>`, formatted once a second.
fn append_date(out: &mut Vec<u8>) {
    // Per thread, not configuration: each runtime worker keeps the last second it formatted,
    // so a reply's head costs no lock and no formatting.
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
    exchange: &mut Exchange,
) -> Outcome {
    let error = ApiError::no_answer(&app.settings.device, why);
    refuse(client, fast, &error, exchange).await
}

/// Answer `error` as the general engine would (its status, `ApiError`'s body), after the
/// request was committed to a backend.
async fn refuse(
    client: &mut BusyPollStream,
    fast: &Fast,
    error: &ApiError,
    exchange: &mut Exchange,
) -> Outcome {
    let status = error.status();
    exchange.answered(status.as_u16());
    let close = fast.close;
    let body =
        onebit_command::error::openai_error_body(status, error.error_type(), &error.message());
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nX-Request-Id: {}\r\n{}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
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
