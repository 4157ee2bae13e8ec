//! A streamed reply whose head serve sent itself, before the backend's
//! (`sse_keepalive::EARLY_HEAD`): the rest of it.

use super::*;

/// The rest of a streamed reply whose head serve already sent (`sse_keepalive::EARLY_HEAD`):
/// the backend's events re-framed as chunks, with comments in its silences; a backend that
/// answered other than 200 becomes one error event. A reply that breaks off leaves the
/// client's reply without its last chunk; the connection closes either way. Returns the body
/// bytes passed on.
pub(super) async fn after_early_head(
    app: &App,
    client: &mut BusyPollStream,
    mut backend: BusyPollStream,
    mut reply: BytesMut,
    head: ReplyHead,
    tracking: Tracking,
) -> u64 {
    let Tracking {
        keepalive,
        ticket,
        in_flight,
        mut clock,
    } = tracking;
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
