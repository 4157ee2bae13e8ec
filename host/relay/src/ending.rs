//! How a request ends before its reply does, in one place: the generation deadline
//! (`--max-generation-s`), a client that leaves, serve stopping, the watchdog's verdict.
//!
//! Every one ends the request the same way: the loop that waits for the reply stops waiting,
//! which drops what it waited on (the backend connection, so the engine stops generating; an
//! in-process route's channel, so its next `send` fails and `client_gone` says so; `--pm`'s
//! rounds), and then drops the request's [`Exchange`](crate::exchange::Exchange), which
//! releases what the request holds and writes its record once. What the client is told
//! depends only on how far its reply got: a reply not yet begun gets an error reply
//! (`ApiError`'s one shape), a stream of events under way one last error event
//! (`early_stream::error_event`'s shape), a reply cut mid-event its connection closed.
//!
//! The loops that wait, and where each of these ends them:
//!
//! | loop | deadline | client leaves | serve stops | watchdog |
//! |---|---|---|---|---|
//! | fast: the reply head (`fast::send`) | [`Deadline::passed`] | its write fails | drain, then close | backend restarted: read fails |
//! | fast: the body (`fast::relay_reply`) | [`Deadline::passed`] | its read or write fails | as above | as above |
//! | fast: the early stream (`fast::early`) | [`Deadline::passed`] | its write fails | as above | as above |
//! | general: every way out (`general::relay`) | [`bounded`]: the head by a timeout, the body by [`Bounded`] | hyper drops the body | as above | as above |
//! | general: the early stream's task (`general_early`) | its body, [`Bounded`] | the channel closes (noticed at once) | as above | as above |
//!
//! A new timer or cancellation that acts during a request is written here, as the deadline is:
//! a value the exchange holds from admission, a future each loop waits on beside its reads, and
//! the reply's end in the shapes above.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::{IntoResponse as _, Response};
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame};
use onebit_command::error::ApiError;
use onebit_metrics::Counters;
use tokio::time::Instant;

use crate::sse_keepalive::{Framing, SseEdge};

/// A generation's deadline (`--max-generation-s`): made by `Exchange::admit` for a
/// generation when serve has one, and carried by every loop that waits for its reply.
#[derive(Clone, Debug)]
pub struct Deadline {
    at: Instant,
    after: Duration,
    counted: Counters,
}

impl Deadline {
    /// A deadline `after` from now, counted in `counted` when it ends a request.
    pub fn new(after: Duration, counted: &Counters) -> Deadline {
        Deadline {
            at: Instant::now() + after,
            after,
            counted: counted.clone(),
        }
    }

    /// When it passes.
    pub fn at(&self) -> Instant {
        self.at
    }

    /// Resolves when `deadline` passes; never without one. Cancel-safe: a loop waits on it
    /// beside its reads in a `select!`.
    pub async fn passed(deadline: Option<&Deadline>) {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.at).await,
            None => std::future::pending().await,
        }
    }

    /// The error a reply not yet begun gets (504). The caller counts the end ([`Deadline::ended`]).
    pub fn error(&self) -> ApiError {
        ApiError::GenerationDeadline { after: self.after }
    }

    /// The last event of a stream of events under way. The caller counts the end.
    pub fn event(&self) -> Vec<u8> {
        let error = ApiError::GenerationDeadline { after: self.after };
        let body = onebit_command::error::openai_error_body(
            error.status(),
            error.error_type(),
            &error.message(),
        );
        crate::early_stream::error_event(error.status().as_u16(), body.as_bytes())
    }

    /// The deadline ended a request: counted (`onebit_generation_deadlines_total`) and said,
    /// once per request, by the loop that ended it.
    pub fn ended(&self) {
        self.counted.deadline_passed();
        tracing::info!(
            "1bit serve: a generation was ended by --max-generation-s {}",
            self.after.as_secs()
        );
    }
}

/// The general engine's every way out, bounded by the request's deadline: `answering` (the
/// relayed reply, the in-process answer, the tool loop, a route's forward) must give its head
/// before the deadline, or is dropped (which drops what it waited on) for a 504; the body of
/// the response it gives is then [`Bounded`]. Without a deadline, `answering` as it is.
pub async fn bounded(
    deadline: Option<Deadline>,
    answering: impl std::future::Future<Output = Response>,
) -> Response {
    let Some(deadline) = deadline else {
        return answering.await;
    };
    match tokio::time::timeout_at(deadline.at, answering).await {
        Ok(response) => {
            let event_stream = response
                .headers()
                .get(axum::http::header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            let (parts, body) = response.into_parts();
            let body = Bounded {
                inner: Some(body),
                timer: Box::pin(tokio::time::sleep_until(deadline.at)),
                edge: event_stream.then(|| SseEdge::new(Framing::Payload, &deadline.counted)),
                deadline,
            };
            Response::from_parts(parts, axum::body::Body::new(body))
        }
        Err(_) => {
            deadline.ended();
            deadline.error().into_response()
        }
    }
}

/// A reply body that ends at its deadline: an event stream at an event boundary gets one last
/// error event, anything else is cut (an error frame: the client sees no clean end). The
/// inner body is dropped then, with what it holds (the backend connection, the exchange).
/// Polled by hyper on the connection's task.
pub struct Bounded {
    inner: Option<axum::body::Body>,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// Where an event stream's events stand (None: not an event stream).
    edge: Option<SseEdge>,
    deadline: Deadline,
}

impl HttpBody for Bounded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(frame) = Pin::new(inner).poll_frame(cx) {
            if let (Some(edge), Some(Ok(frame))) = (&mut this.edge, &frame)
                && let Some(data) = frame.data_ref()
            {
                edge.feed(data);
            }
            if frame.is_none() {
                this.inner = None;
            }
            return Poll::Ready(frame);
        }
        std::task::ready!(this.timer.as_mut().poll(cx));
        this.inner = None;
        this.deadline.ended();
        Poll::Ready(match &this.edge {
            Some(edge) if edge.at_boundary() => {
                Some(Ok(Frame::data(Bytes::from(this.deadline.event()))))
            }
            _ => Some(Err(axum::Error::new(std::io::Error::other(
                "the generation's deadline passed mid-reply",
            )))),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match &self.inner {
            // An event may be added: an exact size would no longer hold.
            Some(inner) if self.edge.is_some() => {
                let mut hint = hyper::body::SizeHint::new();
                hint.set_lower(inner.size_hint().lower());
                hint
            }
            Some(inner) => inner.size_hint(),
            None => hyper::body::SizeHint::with_exact(0),
        }
    }
}
