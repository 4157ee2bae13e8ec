//! The general engine's driver of the early stream (`early_stream`): the pending reply, then
//! its body, fed to the state machine as hyper frames and silences; what it says becomes the
//! client's frames, through a channel to the reply body hyper writes.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Body as HttpBody;

use crate::early_stream::{EarlyStream, Say};
use crate::sse_keepalive::COMMENT;
use onebit_metrics::Counters;

/// A streamed reply serve answers itself, 200 and `text/event-stream`, because its backend has
/// been silent for `every` before its head: the general engine's driver of the one
/// early-stream state machine (`relay::early_stream`), which decides every byte; here the
/// backend's frames and the silences are fed to it and what it says becomes the client's
/// frames. `wrap` puts the request's watchdog ticket and counters on the backend's body; it is
/// told whether that body is an event stream (`text/event-stream`; an error reply is JSON).
/// Called by the general path; the relay runs on a task of its own that ends as soon as the
/// client goes away (or the reply's deadline, `ending::Bounded`, drops its end).
pub fn early_stream<F, E, W, B>(
    pending: Pin<Box<F>>,
    wrap: W,
    device: String,
    (every, sent): (Duration, Counters),
) -> axum::response::Response
where
    F: Future<Output = Result<hyper::Response<hyper::body::Incoming>, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
    W: FnOnce(hyper::body::Incoming, bool) -> B + Send + 'static,
    B: HttpBody<Data = Bytes> + Unpin + Send + 'static,
    B::Error: std::fmt::Display + Send,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(drive_early(pending, wrap, (device, sent), every, tx));
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    axum::response::Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(axum::body::Body::from_stream(stream))
        .unwrap_or_default()
}

/// The early stream's task: the pending reply, then its body, fed to the state machine.
async fn drive_early<F, E, W, B>(
    mut pending: Pin<Box<F>>,
    wrap: W,
    (device, sent): (String, Counters),
    every: Duration,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) where
    F: Future<Output = Result<hyper::Response<hyper::body::Incoming>, E>>,
    E: std::fmt::Display,
    W: FnOnce(hyper::body::Incoming, bool) -> B,
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    use http_body_util::BodyExt;
    let (mut stream, first) = EarlyStream::begin(&device, &sent);
    if !said(&tx, first, &Bytes::new()).await {
        return;
    }
    // A client that leaves closes the channel: noticed at once, not at the next silence, so
    // the pending reply (the backend connection) is dropped while the prefill runs.
    let reply = loop {
        tokio::select! {
            r = &mut pending => break r,
            () = tx.closed() => return,
            () = tokio::time::sleep(every) => {
                if !said(&tx, stream.silence(), &Bytes::new()).await {
                    return;
                }
            }
        }
    };
    let reply = match reply {
        Ok(r) => r,
        Err(e) => {
            said(&tx, stream.no_head(&e.to_string()), &Bytes::new()).await;
            return;
        }
    };
    stream.head(reply.status().as_u16());
    let event_stream = reply
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let mut body = wrap(reply.into_body(), event_stream);
    let silence = tokio::time::sleep(every);
    tokio::pin!(silence);
    loop {
        let say = tokio::select! {
            frame = body.frame() => {
                silence.as_mut().reset(tokio::time::Instant::now() + every);
                match frame {
                    None => (stream.end(), Bytes::new()),
                    Some(Err(_)) => (stream.broke(), Bytes::new()),
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => (stream.payload(&data), data),
                        Err(_) => continue,
                    },
                }
            }
            () = &mut silence => {
                silence.as_mut().reset(tokio::time::Instant::now() + every);
                (stream.silence(), Bytes::new())
            }
            () = tx.closed() => return,
        };
        if !said(&tx, say.0, &say.1).await {
            return;
        }
    }
}

/// Send what the early stream says as the client's frames (`fed`: the bytes just fed, for
/// [`Say::Pass`]). False when the reply is over: ended (the sender then drops, which ends the
/// body whole), cut (an error frame, which ends it without its last chunk), or the client gone.
async fn said(
    tx: &tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    say: Say,
    fed: &Bytes,
) -> bool {
    let item = match say {
        Say::Nothing => return true,
        Say::Pass => Ok(fed.clone()),
        Say::Comment => Ok(Bytes::from_static(COMMENT)),
        Say::Last(event) => {
            let _ = tx.send(Ok(Bytes::from(event))).await;
            return false;
        }
        Say::End => return false,
        Say::Cut => {
            let cut = std::io::Error::other("the backend's stream broke off");
            let _ = tx.send(Err(cut)).await;
            return false;
        }
    };
    tx.send(item).await.is_ok()
}
