//! The fast engine's driver of a reply's phases (`reply_loop::ReplyPhases`): the request
//! written on a pooled backend socket, the reply's head read, its body read and written to the
//! client as it comes, on the raw sockets. It waits on the backend, the client and the one
//! wake-up time the phases give it, feeds them what happened, and writes what they say in the
//! framing the client gets (the backend's length when nothing is added, else chunks). Every
//! decision (comments, the early stream, the served name, the deadline, the clocks) is the
//! phases'; a reply with no wake-up and no rewrite (the hot path) costs one call per read.

use super::*;
use crate::reply_loop::{ReplyPhases, Say};

/// Carry the request to its backend and the reply back: `phases` hold its exchange.
pub(super) async fn relay(
    app: &Arc<App>,
    client: &mut BusyPollStream,
    buf: &mut BytesMut,
    fast: &Fast,
    mut phases: ReplyPhases,
) -> Outcome {
    let timer = tokio::time::sleep_until(tokio::time::Instant::now());
    tokio::pin!(timer);
    let sent = match send(app, client, fast, &mut phases, timer.as_mut()).await {
        Ok(sent) => sent,
        Err(outcome) => return outcome,
    };
    let Sent {
        mut backend,
        head,
        mut reply,
        at,
    } = sent;
    let backend_time = at.elapsed();
    let (chunked, mut out) = reply_began(&head, &mut phases, fast);
    let early = phases.early();
    // Written with the first bytes of the body, if any came with the head.
    let mut head_pending = !out.is_empty();
    let mut head_backend_time = backend_time;
    let mut body = Body::new(head.framing);
    // A body that ends at the backend's close has ended.
    let mut closed = false;
    let mut watch_client = true;
    loop {
        let mut step = Step::Go;
        let fed = body.feed_data(&reply, |data| {
            if matches!(step, Step::Go) {
                let say = phases.payload(data);
                step = put(say, data, &mut out, chunked);
            }
        });
        if matches!(step, Step::Go) {
            step = match fed {
                None => put(
                    phases.broke("its chunked coding broke"),
                    &[],
                    &mut out,
                    chunked,
                ),
                Some(end) if end.is_some() || closed => put(phases.end(), &[], &mut out, chunked),
                Some(_) => Step::Go,
            };
        }
        let leftover = fed.flatten().is_some_and(|taken| taken < reply.len());
        reply.clear();
        if let Step::Whole(named) = step {
            let mut whole = client_head(
                &head,
                Framing::Length(named.len() as u64),
                fast.close,
                &fast.id,
            );
            whole.extend_from_slice(&named);
            if let Some(exchange) = phases.exchange() {
                exchange.answered(head.status);
            }
            out = whole;
            head_pending = true;
            head_backend_time = at.elapsed();
            step = Step::Ended;
        }
        if let Step::Refuse(error) = step {
            return refuse(client, fast, &error, &mut phases).await;
        }
        if !out.is_empty() {
            if client.write_all(&out).await.is_err() {
                return Outcome::Close;
            }
            out.clear();
            if std::mem::take(&mut head_pending)
                && let Some(exchange) = phases.exchange()
            {
                exchange.head_written(head_backend_time);
            }
        }
        match step {
            Step::Go => {}
            Step::Ended => {
                if head.keeps_connection() && !leftover && !closed {
                    app.pool.checkin(fast.port, backend);
                }
                drop(phases);
                return if fast.close || early {
                    Outcome::Close
                } else {
                    Outcome::KeepAlive
                };
            }
            Step::Cut | Step::Refuse(_) | Step::Whole(_) => return Outcome::Close,
        }
        match more(
            client,
            buf,
            &mut backend,
            &mut reply,
            &mut phases,
            timer.as_mut(),
            &mut watch_client,
            fast,
            Reframe {
                chunked,
                until_close: head.framing == Framing::UntilClose,
            },
        )
        .await
        {
            More::Read => {}
            More::Closed => closed = true,
            More::Over(outcome) => return outcome,
        }
    }
}

/// How the client's body is framed, and whether the backend's ends at its close.
#[derive(Clone, Copy)]
struct Reframe {
    chunked: bool,
    until_close: bool,
}

/// What came while more of the reply was due.
enum More {
    /// Bytes, in the reply buffer.
    Read,
    /// The backend closed the connection, which ends a body framed by its close.
    Closed,
    /// The request is over.
    Over(Outcome),
}

/// More of the reply is due: wait for it, for the phases' wake-up (what they say written at
/// once), and for a client that leaves meanwhile (its backend connection is then dropped,
/// which stops the engine).
#[allow(clippy::too_many_arguments)]
async fn more(
    client: &mut BusyPollStream,
    buf: &mut BytesMut,
    backend: &mut BusyPollStream,
    reply: &mut BytesMut,
    phases: &mut ReplyPhases,
    mut timer: std::pin::Pin<&mut tokio::time::Sleep>,
    watch_client: &mut bool,
    fast: &Fast,
    framing: Reframe,
) -> More {
    let mut out = Vec::new();
    loop {
        let wake = phases.wake_at();
        if let Some(at) = wake
            && timer.deadline() != at
        {
            timer.as_mut().reset(at);
        }
        tokio::select! {
            biased;
            () = timer.as_mut(), if wake.is_some() => {
                match put(phases.woke(), &[], &mut out, framing.chunked) {
                    Step::Go => {}
                    Step::Refuse(error) => {
                        return More::Over(refuse(client, fast, &error, phases).await);
                    }
                    Step::Ended | Step::Cut | Step::Whole(_) => {
                        let _ = client.write_all(&out).await;
                        return More::Over(Outcome::Close);
                    }
                }
                if !out.is_empty() {
                    if client.write_all(&out).await.is_err() {
                        return More::Over(Outcome::Close);
                    }
                    out.clear();
                }
            },
            read = backend.read_buf(reply) => return match read {
                Ok(0) if framing.until_close => More::Closed,
                Ok(0) | Err(_) => {
                    let broke = phases.broke("its connection broke off inside the reply");
                    More::Over(match put(broke, &[], &mut out, framing.chunked) {
                        Step::Refuse(error) => refuse(client, fast, &error, phases).await,
                        _ => {
                            // The client sees its connection close (a cut), or the last event.
                            let _ = client.write_all(&out).await;
                            Outcome::Close
                        }
                    })
                }
                Ok(n) => {
                    phases.arrived(n);
                    More::Read
                }
            },
            read = client.read_buf(buf), if *watch_client => match read {
                Ok(0) | Err(_) => return More::Over(Outcome::Close),
                // The client's next request, early: keep it for later.
                Ok(_) => *watch_client = buf.len() < MAX_HEAD,
            },
        }
    }
}

/// The backend's head, told to the phases: whether the client's body goes in chunks, and the
/// client's head when it goes now (else nothing: serve sent its own, or the whole reply is
/// collected first).
fn reply_began(head: &ReplyHead, phases: &mut ReplyPhases, fast: &Fast) -> (bool, Vec<u8>) {
    let kind: &[u8] = if head.event_stream {
        b"text/event-stream"
    } else if head.json {
        b"application/json"
    } else {
        b""
    };
    let say = phases.head(head.status, kind);
    // Comments and last events need chunks; so does a rewritten body, and one that ends at
    // the backend's close.
    let chunked = phases.early()
        || head.event_stream
        || phases.rewrites()
        || matches!(head.framing, Framing::Chunked | Framing::UntilClose);
    let mut out = Vec::new();
    if let Say::Head = say {
        let framing = if chunked {
            Framing::Chunked
        } else {
            head.framing
        };
        out = client_head(head, framing, fast.close, &fast.id);
        if let Some(exchange) = phases.exchange() {
            exchange.answered(head.status);
        }
    }
    (chunked, out)
}

/// Where the reply stands after what the phases said.
enum Step {
    /// More to come.
    Go,
    /// Ended whole (its last bytes are in `out`).
    Ended,
    /// Ended without its last chunk: the connection closes.
    Cut,
    /// Nothing went out yet: this error reply instead.
    Refuse(ApiError),
    /// The whole reply, named: its head and these bytes.
    Whole(bytes::Bytes),
}

/// Append what the phases said to `out`, in chunks when `chunked`, else as the bytes are
/// (`fed`: the bytes just fed).
fn put(say: Say, fed: &[u8], out: &mut Vec<u8>, chunked: bool) -> Step {
    let append = |bytes: &[u8], out: &mut Vec<u8>| {
        if chunked {
            if !bytes.is_empty() {
                wire::append_chunk(out, bytes);
            }
        } else {
            out.extend_from_slice(bytes);
        }
    };
    match say {
        Say::Nothing | Say::Head => Step::Go,
        Say::Pass => {
            append(fed, out);
            Step::Go
        }
        Say::Send(bytes) => {
            append(&bytes, out);
            Step::Go
        }
        Say::Comment | Say::Early => {
            out.extend_from_slice(sse_keepalive::COMMENT_CHUNK);
            Step::Go
        }
        Say::End(bytes) => {
            append(&bytes, out);
            if chunked {
                out.extend_from_slice(b"0\r\n\r\n");
            }
            Step::Ended
        }
        Say::Last(event) => {
            wire::append_chunk(out, &event);
            out.extend_from_slice(b"0\r\n\r\n");
            Step::Ended
        }
        Say::Cut => Step::Cut,
        Say::Refuse(error) => Step::Refuse(error),
        Say::Whole(bytes) => Step::Whole(bytes),
    }
}

/// The request sent and its reply's head read: the backend connection, the head, the bytes
/// read past it, and when the request was sent.
struct Sent {
    backend: BusyPollStream,
    head: ReplyHead,
    reply: BytesMut,
    at: Instant,
}

/// Send the request and read its reply's head, the phases woken when they ask (serve's own
/// head and comments while the head is due: the early stream; the deadline). A request that a
/// reused connection's backend refused unread (a reset: it had closed the connection) is sent
/// once more, on a new connection; one it may have read (a clean close before any reply) is
/// never sent twice. Err: the request is over (answered, or the client gone).
async fn send(
    app: &Arc<App>,
    client: &mut BusyPollStream,
    fast: &Fast,
    phases: &mut ReplyPhases,
    mut timer: std::pin::Pin<&mut tokio::time::Sleep>,
) -> Result<Sent, Outcome> {
    let to_client = Direction::Reply {
        cors: app.settings.cors.is_some(),
    };
    let mut reply = BytesMut::with_capacity(8 * 1024);
    let mut retried = false;
    loop {
        reply.clear();
        let taken = if retried {
            app.pool.connect(fast.port).await.map(|c| (c, false))
        } else {
            app.pool.checkout(fast.port).await
        };
        let (mut conn, reused) = match taken {
            Ok(c) => c,
            Err(e) => return Err(said_before_head(client, fast, phases, &e.to_string()).await),
        };
        // No flush: a socket has nothing to flush, and `BusyPollStream`'s flush would spin
        // by peeking; the reply's first read spins by reading, so the call that finds the
        // reply takes it.
        let sent = conn.write_all(&fast.upstream).await;
        let at = Instant::now();
        let head = match sent {
            // The hot path: nothing to wake for.
            Ok(()) if phases.wake_at().is_none() => {
                read_reply_head(&mut conn, &mut reply, to_client).await
            }
            Ok(()) => {
                let head = read_reply_head(&mut conn, &mut reply, to_client);
                tokio::pin!(head);
                loop {
                    let wake = phases.wake_at();
                    if let Some(at) = wake {
                        timer.as_mut().reset(at);
                    }
                    tokio::select! {
                        h = &mut head => break h,
                        // Once serve began the stream (it closes after it), a client that
                        // leaves is noticed at once: the backend connection is dropped while
                        // the prefill runs.
                        () = left(client), if phases.early() => return Err(Outcome::Close),
                        () = timer.as_mut(), if wake.is_some() => {
                            let mut out = Vec::new();
                            let say = phases.woke();
                            if let Say::Early = say {
                                out.extend_from_slice(sse_keepalive::EARLY_HEAD);
                                append_date(&mut out);
                                append_id(&mut out, &fast.id);
                                out.extend_from_slice(b"connection: close\r\n\r\n");
                                if let Some(exchange) = phases.exchange() {
                                    exchange.answered(200);
                                    exchange.head_written(at.elapsed());
                                }
                            }
                            match put(say, &[], &mut out, true) {
                                Step::Go => {}
                                Step::Refuse(error) => {
                                    return Err(refuse(client, fast, &error, phases).await);
                                }
                                Step::Ended | Step::Cut | Step::Whole(_) => {
                                    let _ = client.write_all(&out).await;
                                    return Err(Outcome::Close);
                                }
                            }
                            if !out.is_empty() && client.write_all(&out).await.is_err() {
                                return Err(Outcome::Close);
                            }
                        }
                    }
                }
            }
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
                });
            }
            Err(ReplyError::Unread) if reused && !retried && !phases.early() => retried = true,
            Err(e) => return Err(said_before_head(client, fast, phases, &e.to_string()).await),
        }
    }
}

/// The backend gave no head (`why`): a 502, or the early stream's last event.
async fn said_before_head(
    client: &mut BusyPollStream,
    fast: &Fast,
    phases: &mut ReplyPhases,
    why: &str,
) -> Outcome {
    let mut out = Vec::new();
    match put(phases.broke(why), &[], &mut out, true) {
        Step::Refuse(error) => refuse(client, fast, &error, phases).await,
        _ => {
            let _ = client.write_all(&out).await;
            Outcome::Close
        }
    }
}

/// The client's reply head: the backend's lines, the framing the client gets, the close the
/// client asked for, the request id.
fn client_head(head: &ReplyHead, framing: Framing, close: bool, id: &RequestId) -> Vec<u8> {
    let mut out = Vec::with_capacity(head.lines.len() + 64);
    out.extend_from_slice(&head.lines);
    match framing {
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

/// Answer `error` as the general engine would (its status, `ApiError`'s body), after the
/// request was committed to a backend.
async fn refuse(
    client: &mut BusyPollStream,
    fast: &Fast,
    error: &ApiError,
    phases: &mut ReplyPhases,
) -> Outcome {
    let status = error.status();
    if let Some(exchange) = phases.exchange() {
        exchange.answered(status.as_u16());
    }
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
