//! A whole reply the fast engine rewrites before the client sees it: the served name in a
//! non-streamed generation's JSON (`served_name::in_reply`), the README's chat. The body is
//! read whole on the raw socket, watched for the client leaving and for the generation's
//! deadline (`ending`: a reply not begun, so a 504), renamed, and written with its length.

use super::*;
use crate::served_name;

/// Relay a whole JSON reply with the model named as serve serves it. `sent`'s head is read;
/// the body follows by its framing. The connection stays open as the client asked.
pub(super) async fn relay_named(
    app: &Arc<App>,
    client: &mut BusyPollStream,
    buf: &mut BytesMut,
    fast: &Fast,
    sent: Sent,
    mut exchange: Exchange,
    backend_time: Duration,
) -> Outcome {
    let Sent {
        mut backend,
        head,
        mut reply,
        ..
    } = sent;
    let collecting = Instant::now();
    let deadline = exchange.deadline();
    let mut body = Body::new(head.framing);
    let mut whole = Vec::with_capacity(reply.len());
    let mut watch_client = true;
    loop {
        let Some(end) = body.feed_data(&reply, |data| whole.extend_from_slice(data)) else {
            return Outcome::Close; // a chunk size that is not one
        };
        let leftover = end.is_some_and(|n| n < reply.len());
        reply.clear();
        if end.is_some() || head.framing == Framing::None {
            if head.keeps_connection() && !leftover {
                app.pool.checkin(fast.port, backend);
            }
            break;
        }
        match more(
            client,
            &mut backend,
            &mut reply,
            buf,
            &mut watch_client,
            &deadline,
        )
        .await
        {
            More::Read(n) => exchange.arrived(n),
            More::Ended if head.framing == Framing::UntilClose => break,
            More::Ended => {
                let why = "its connection broke off inside the reply";
                return bad_gateway(app, client, fast, why, &mut exchange).await;
            }
            More::ClientLeft => return Outcome::Close,
            More::Deadline(deadline) => {
                deadline.ended();
                return refuse(client, fast, &deadline.error(), &mut exchange).await;
            }
        }
    }
    let named = served_name::in_reply(whole.into(), &app.settings.served_name);
    let head_status = head.status;
    let mut out = client_head(
        &ReplyHead {
            framing: Framing::Length(named.len() as u64),
            ..head
        },
        fast.close,
        &fast.id,
    );
    out.extend_from_slice(&named);
    exchange.answered(head_status);
    if client.write_all(&out).await.is_err() {
        return Outcome::Close;
    }
    exchange.head_written(backend_time + collecting.elapsed());
    exchange.passed(named.len());
    drop(exchange);
    if fast.close {
        Outcome::Close
    } else {
        Outcome::KeepAlive
    }
}

/// What came while a whole reply's body was due.
enum More {
    /// `n` more bytes of it.
    Read(usize),
    /// The backend closed (or its connection failed).
    Ended,
    /// The client closed its connection.
    ClientLeft,
    /// The generation's deadline passed.
    Deadline(Deadline),
}

/// Wait for more of the body, watching the client (its next request, sent early, is kept in
/// `buf`) and the deadline.
async fn more(
    client: &mut BusyPollStream,
    backend: &mut BusyPollStream,
    reply: &mut BytesMut,
    buf: &mut BytesMut,
    watch_client: &mut bool,
    deadline: &Option<Deadline>,
) -> More {
    loop {
        tokio::select! {
            biased;
            read = backend.read_buf(reply) => return match read {
                Ok(n) if n > 0 => More::Read(n),
                _ => More::Ended,
            },
            read = client.read_buf(buf), if *watch_client => match read {
                Ok(0) | Err(_) => return More::ClientLeft,
                Ok(_) => *watch_client = buf.len() < MAX_HEAD,
            },
            () = Deadline::passed(deadline.as_ref()), if deadline.is_some() => {
                if let Some(deadline) = deadline {
                    return More::Deadline(deadline.clone());
                }
            },
        }
    }
}
