//! A streamed reply whose head serve sent itself, before the backend's
//! (`sse_keepalive::EARLY_HEAD`): the fast engine's driver of the one early-stream state
//! machine (`relay::early_stream`), framing what it says as chunks.

use super::*;
use crate::early_stream::{EarlyStream, Say};

/// Append what the early stream says to `out` as chunked bytes (`fed`: the event bytes just
/// fed, for [`Say::Pass`]). True when the reply is over (ended whole or cut).
pub(super) fn framed(say: Say, fed: &[u8], out: &mut Vec<u8>) -> bool {
    match say {
        Say::Nothing => false,
        Say::Pass => {
            wire::append_chunk(out, fed);
            false
        }
        Say::Comment => {
            out.extend_from_slice(sse_keepalive::COMMENT_CHUNK);
            false
        }
        Say::Last(event) => {
            wire::append_chunk(out, &event);
            out.extend_from_slice(b"0\r\n\r\n");
            true
        }
        Say::End => {
            out.extend_from_slice(b"0\r\n\r\n");
            true
        }
        Say::Cut => true,
    }
}

/// The rest of a streamed reply whose head serve already sent: the backend's head just read
/// goes to the early stream, then its body as it arrives, with the stream's comments in its
/// silences. The connection closes after it either way.
pub(super) async fn after_early_head(
    client: &mut BusyPollStream,
    mut backend: BusyPollStream,
    mut stream: EarlyStream,
    mut reply: BytesMut,
    head: ReplyHead,
    tracking: Tracking,
) {
    let Tracking {
        keepalive,
        mut exchange,
    } = tracking;
    let every = keepalive.unwrap_or(Duration::from_secs(sse_keepalive::DEFAULT_SECS));
    let deadline = exchange.deadline();
    stream.head(head.status);
    let mut body = Body::new(head.framing);
    // Bytes read past the head come first; a body with no bytes ends at once.
    let mut closed = head.framing == Framing::None;
    loop {
        let mut out = Vec::new();
        let mut payload = Vec::new();
        let mut passed = false;
        let over = match body.feed_data(&reply, |data| payload.extend_from_slice(data)) {
            None => framed(stream.broke(), &[], &mut out),
            Some(end) => {
                let fed = stream.payload(&payload);
                passed = fed == Say::Pass;
                let mut over = framed(fed, &payload, &mut out);
                if !over && (end.is_some() || closed) {
                    over = framed(stream.end(), &[], &mut out);
                }
                over
            }
        };
        reply.clear();
        if !out.is_empty() && client.write_all(&out).await.is_err() {
            return;
        }
        if passed {
            exchange.passed(payload.len());
        }
        if over {
            drop(exchange);
            return;
        }
        let silence = tokio::time::sleep(every);
        tokio::pin!(silence);
        loop {
            tokio::select! {
                read = backend.read_buf(&mut reply) => match read {
                    Ok(0) if head.framing == Framing::UntilClose => {
                        closed = true;
                        break;
                    }
                    Ok(0) | Err(_) => {
                        let mut out = Vec::new();
                        framed(stream.broke(), &[], &mut out);
                        let _ = client.write_all(&out).await;
                        return;
                    }
                    Ok(n) => {
                        exchange.arrived(n);
                        break;
                    }
                },
                () = Deadline::passed(deadline.as_ref()), if deadline.is_some() => {
                    // The generation's deadline (`ending`): its last event, the backend
                    // connection dropped.
                    if let Some(deadline) = &deadline {
                        let mut out = Vec::new();
                        deadline.ended();
                        framed(stream.ended(deadline.event()), &[], &mut out);
                        let _ = client.write_all(&out).await;
                    }
                    return;
                },
                () = &mut silence => {
                    silence.as_mut().reset(tokio::time::Instant::now() + every);
                    let mut out = Vec::new();
                    framed(stream.silence(), &[], &mut out);
                    if !out.is_empty() && client.write_all(&out).await.is_err() {
                        return;
                    }
                },
            }
        }
    }
}
