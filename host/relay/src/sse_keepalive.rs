//! SSE keep-alive: a streamed reply whose backend has been silent for `--sse-keepalive-s`
//! seconds (a long prefill, say) gets an SSE comment, `: keep-alive`, at an event boundary, so
//! a client that gives up on a silent stream (Lemonade 11.8's stall timer) keeps it. Both relay
//! engines use the one tracker here: the fast path on the raw bytes it relays, the general path
//! on hyper's body frames. A stream serve begins itself before its backend's head is
//! `early_stream`'s.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame};
use onebit_metrics::Counters;

use crate::wire;

/// The default of `--sse-keepalive-s`: well under every client window met (Lemonade 11.8.0's
/// 120 s stall, its later `global_timeout` of 600 s).
pub const DEFAULT_SECS: u64 = onebit_command::cli::SSE_KEEPALIVE_DEFAULT_S;

/// The comment sent: a line starting with `:` is ignored by every SSE parser.
pub const COMMENT: &[u8] = b": keep-alive\n\n";
/// The same, as one chunk of a chunked body (14 bytes = 0xe).
pub const COMMENT_CHUNK: &[u8] = b"e\r\n: keep-alive\n\n\r\n";

/// The head serve sends for a stream whose backend has not answered yet: the reply is then an
/// event stream whatever the backend says, in chunks.
pub const EARLY_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n";

/// How the bytes fed to an [`SseEdge`] are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// The event bytes themselves (hyper's frames, a body that ends at close).
    Payload,
    /// HTTP/1.1 chunked coding around them, as relayed byte for byte.
    Chunked,
}

/// Whether the stream relayed so far stands at an event boundary, where a comment may go:
/// nothing yet, or the events' bytes end with a blank line, and (chunked) no chunk is open.
/// Fed every byte the client gets, in order; never blocks.
#[derive(Debug)]
pub struct SseEdge {
    framing: Framing,
    /// Where a chunked stream's coding stands (wire.rs's decoder; unused for a payload).
    chunk: wire::Body,
    /// The chunked coding broke: no boundary from then on.
    broken: bool,
    /// The last three event bytes (a blank line is `\n\n` or `\n\r\n`).
    tail: [u8; 3],
    /// Where a comment sent is counted (`onebit_sse_keepalives`).
    sent: Counters,
}

impl SseEdge {
    pub fn new(framing: Framing, sent: &Counters) -> Self {
        SseEdge {
            framing,
            chunk: wire::Body::new(wire::Framing::Chunked),
            broken: false,
            tail: [b'\n'; 3],
            sent: sent.clone(),
        }
    }

    /// Count a comment the caller sent itself.
    pub fn count_comment(&self) {
        self.sent.keepalive_sent();
    }

    /// Feed bytes as relayed to the client.
    pub fn feed(&mut self, bytes: &[u8]) {
        match self.framing {
            Framing::Payload => self.payload(bytes),
            Framing::Chunked => self.dechunk(bytes),
        }
    }

    fn payload(&mut self, bytes: &[u8]) {
        keep_tail(&mut self.tail, bytes);
    }

    /// Follow chunked coding with the fast engine's own decoder, to know where events and
    /// chunks end; coding that breaks (the fast engine closes the connection then) leaves no
    /// boundary for a comment.
    fn dechunk(&mut self, bytes: &[u8]) {
        let tail = &mut self.tail;
        let fed = self.chunk.feed_data(bytes, |data| keep_tail(tail, data));
        if fed.is_none() {
            self.broken = true;
        }
    }

    /// Whether a comment may go now: between events, and (chunked) between chunks of an
    /// unfinished body.
    pub fn at_boundary(&self) -> bool {
        let blank = self.tail[1..] == *b"\n\n" || self.tail == *b"\n\r\n";
        match self.framing {
            Framing::Payload => blank,
            Framing::Chunked => blank && !self.broken && self.chunk.between_chunks(),
        }
    }

    /// The comment in this stream's framing, counted as sent. Call only `at_boundary`.
    pub fn comment(&self) -> &'static [u8] {
        self.count_comment();
        match self.framing {
            Framing::Payload => COMMENT,
            Framing::Chunked => COMMENT_CHUNK,
        }
    }
}

/// Keep the last three bytes of what was `seen` so far in `tail`.
fn keep_tail(tail: &mut [u8; 3], seen: &[u8]) {
    for &b in &seen[seen.len().saturating_sub(3)..] {
        *tail = [tail[1], tail[2], b];
    }
}

/// A streamed reply body (hyper frames, the event bytes) that yields a `: keep-alive` frame
/// whenever the inner body has been silent for `every` and stands at an event boundary. Polled
/// by hyper on the connection's task.
pub struct KeepAliveBody<B> {
    inner: B,
    every: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    edge: SseEdge,
}

impl<B> KeepAliveBody<B> {
    pub fn new(inner: B, every: Duration, sent: &Counters) -> Self {
        KeepAliveBody {
            inner,
            every,
            timer: Box::pin(tokio::time::sleep(every)),
            edge: SseEdge::new(Framing::Payload, sent),
        }
    }
}

impl<B> HttpBody for KeepAliveBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
                    if let Some(data) = data {
                        this.edge.feed(data);
                    }
                    let deadline = tokio::time::Instant::now() + this.every;
                    this.timer.as_mut().reset(deadline);
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                if this.timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let deadline = tokio::time::Instant::now() + this.every;
                this.timer.as_mut().reset(deadline);
                // Polled once more so the timer is registered again.
                let _ = this.timer.as_mut().poll(cx);
                if this.edge.at_boundary() {
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                        this.edge.comment(),
                    )))))
                } else {
                    Poll::Pending
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        // Comments may be added: an exact size would no longer hold.
        let mut hint = hyper::body::SizeHint::new();
        hint.set_lower(self.inner.size_hint().lower());
        hint
    }
}

/// What came first while waiting for a streamed reply's head: the head, or `every` of silence.
pub enum Waited<F: Future> {
    Arrived(F::Output),
    Silent(Pin<Box<F>>),
}

/// Wait for a reply's head; with `every` (a streamed generation, keep-alive on), wait only
/// that long, then hand the still-pending reply back so serve can start the stream itself.
/// Called by the general path on the request's task.
pub async fn wait_head<F: Future>(reply: F, every: Option<Duration>) -> Waited<F> {
    let Some(every) = every else {
        return Waited::Arrived(reply.await);
    };
    let mut reply = Box::pin(reply);
    tokio::select! {
        r = &mut reply => Waited::Arrived(r),
        () = tokio::time::sleep(every) => Waited::Silent(reply),
    }
}

/// A reply's body with comments in its silences of `every` (a streamed generation, keep-alive
/// on), counted in `sent`; else as it is. Called by the general path.
pub fn during<B>(body: B, every: Option<Duration>, sent: &Counters) -> axum::body::Body
where
    B: HttpBody<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match every {
        Some(every) => axum::body::Body::new(KeepAliveBody::new(body, every, sent)),
        None => axum::body::Body::new(body),
    }
}

#[cfg(test)]
#[path = "sse_keepalive_tests.rs"]
mod tests;
