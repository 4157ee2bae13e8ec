//! The general engine's driver of a reply's phases ([`ReplyPhases`]): every way a request
//! the general engine admitted is answered (a backend relayed through hyper, an in-process
//! route's sink, `--pm`'s tool loop, a route's forward) is a [`Source`], a future of its
//! [`Answer`]; [`answer`] waits for it beside the phases' wake-up, and the body hyper writes
//! is [`Phased`], which feeds the phases each frame and each wake-up and sends what they say.
//! Dropping the body (the client left, the reply ended) drops the source and the request's
//! exchange with it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse as _, Response};
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::{Body as HttpBody, Frame};
use onebit_command::error::error_chain;
use tokio::time::Instant;

use super::{ReplyPhases, Say};
use crate::exchange::Exchange;
use crate::plan::Engine;
use crate::sse_keepalive::COMMENT;

/// What the general engine tells the request's log line about a relayed request: its backend
/// and serve's added time. Rides on the response's extensions.
#[derive(Clone, Copy, Debug)]
pub struct Relayed {
    pub backend: usize,
    pub added: Duration,
}

/// What a source answers: the response (its head, and its body as it comes), the request's
/// exchange when the source held it until now, and for a relayed reply its backend and the
/// backend's time so far (serve's added time is the rest).
pub struct Answer {
    pub response: Response,
    pub exchange: Option<Exchange>,
    pub relayed: Option<(usize, Duration)>,
}

impl From<Response> for Answer {
    /// A response that is all there is (a refusal, a route's answer).
    fn from(response: Response) -> Answer {
        Answer {
            response,
            exchange: None,
            relayed: None,
        }
    }
}

/// Whatever answers an admitted request: owns what it needs, so the early stream can keep
/// waiting for it after the handler returned.
pub type Source = Pin<Box<dyn Future<Output = Answer> + Send>>;

/// The response to an admitted request: `source`'s, through `phases`. While its head is due,
/// the phases may begin the client's reply themselves (the early stream) or end it (504).
pub async fn answer(mut phases: ReplyPhases, mut source: Source, engine: Engine) -> Response {
    let timer = tokio::time::sleep_until(Instant::now());
    tokio::pin!(timer);
    let answer = loop {
        let wake = phases.wake_at();
        if let Some(at) = wake {
            timer.as_mut().reset(at);
        }
        tokio::select! {
            answer = &mut source => break answer,
            () = timer.as_mut(), if wake.is_some() => match phases.woke() {
                Say::Early => return early(phases, source, engine),
                Say::Refuse(error) => return error.into_response(),
                _ => {}
            },
        }
    };
    headed(phases, answer).await
}

/// The source's head came before serve began the reply: passed on (the body [`Phased`]), or,
/// for a whole reply the phases rename, the body collected first.
async fn headed(mut phases: ReplyPhases, answer: Answer) -> Response {
    let (mut parts, mut body, content_type, relayed) = opened(&mut phases, answer);
    let collecting = std::time::Instant::now();
    if let Say::Head = phases.head(parts.status.as_u16(), &content_type) {
        if phases.rewrites() {
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        relayed_noted(&mut phases, &mut parts, relayed, Duration::ZERO);
        return Response::from_parts(parts, Body::new(Phased::passing(phases, body)));
    }
    // The whole reply, then its head (the phases name the model in it).
    let timer = tokio::time::sleep_until(Instant::now());
    tokio::pin!(timer);
    loop {
        let wake = phases.wake_at();
        if let Some(at) = wake {
            timer.as_mut().reset(at);
        }
        let say = tokio::select! {
            frame = body.frame() => match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        phases.arrived(data.len());
                        phases.payload(&data)
                    }
                    Err(_) => Say::Nothing,
                },
                Some(Err(e)) => phases.broke(&error_chain(&e)),
                None => phases.end(),
            },
            () = timer.as_mut(), if wake.is_some() => phases.woke(),
        };
        match say {
            Say::Whole(bytes) => {
                parts.headers.remove(header::CONTENT_LENGTH);
                relayed_noted(&mut phases, &mut parts, relayed, collecting.elapsed());
                return Response::from_parts(parts, Body::from(bytes));
            }
            Say::Refuse(error) => return error.into_response(),
            _ if phases.over() => return Response::from_parts(parts, Body::empty()),
            _ => {}
        }
    }
}

/// A source's answer opened: its exchange handed to the phases; its head's parts, its body,
/// its Content-Type, and for a relayed reply its backend and the backend's time.
fn opened(
    phases: &mut ReplyPhases,
    answer: Answer,
) -> (
    axum::http::response::Parts,
    Body,
    Vec<u8>,
    Option<(usize, Duration)>,
) {
    let Answer {
        response,
        exchange,
        relayed,
    } = answer;
    if let Some(exchange) = exchange {
        phases.holds(exchange);
    }
    let (parts, body) = response.into_parts();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.as_bytes().to_vec())
        .unwrap_or_default();
    (parts, body, content_type, relayed)
}

/// A relayed reply's head goes out: serve's added time recorded, and the log line told.
fn relayed_noted(
    phases: &mut ReplyPhases,
    parts: &mut axum::http::response::Parts,
    relayed: Option<(usize, Duration)>,
    more_backend_time: Duration,
) {
    let Some((backend, backend_time)) = relayed else {
        return;
    };
    if let Some(exchange) = phases.exchange() {
        let added = exchange.head_written(backend_time + more_backend_time);
        parts.extensions.insert(Relayed { backend, added });
    }
}

/// serve's own event-stream head: the source's answer comes inside the body.
fn early(phases: ReplyPhases, source: Source, engine: Engine) -> Response {
    let body = Phased {
        phases,
        pending: Some(source),
        inner: None,
        queued: Some(Bytes::from_static(COMMENT)),
        done: false,
        timer: Box::pin(tokio::time::sleep_until(Instant::now())),
        timer_at: None,
    };
    let mut response = Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::new(body))
        .unwrap_or_default();
    response.extensions_mut().insert(engine);
    response
}

/// The reply body hyper writes: the source's (after its answer, when serve began the reply
/// itself) fed frame by frame to the phases, and the phases woken when they asked; what they
/// say is what the client gets.
pub struct Phased {
    phases: ReplyPhases,
    /// The source, while its answer is due (the early stream).
    pending: Option<Source>,
    inner: Option<Body>,
    /// A frame to send before anything else (the early stream's first comment, or a last one).
    queued: Option<Bytes>,
    /// The reply is over once `queued` is out.
    done: bool,
    timer: Pin<Box<tokio::time::Sleep>>,
    timer_at: Option<Instant>,
}

impl Phased {
    fn passing(phases: ReplyPhases, body: Body) -> Phased {
        Phased {
            phases,
            pending: None,
            inner: Some(body),
            queued: None,
            done: false,
            timer: Box::pin(tokio::time::sleep_until(Instant::now())),
            timer_at: None,
        }
    }

    /// The source's answer, after serve's own head: its status and body go to the phases.
    fn answered(&mut self, answer: Answer) {
        let (parts, body, content_type, relayed) = opened(&mut self.phases, answer);
        if let (Some((_, backend_time)), Some(exchange)) = (relayed, self.phases.exchange()) {
            exchange.head_written(backend_time);
        }
        self.phases.head(parts.status.as_u16(), &content_type);
        self.inner = Some(body);
    }

    /// What the phases said, as the next frame (None: nothing to send now).
    fn said(&mut self, say: Say, fed: Option<Bytes>) -> Option<Poll<Option<FrameResult>>> {
        let data = |bytes: Bytes| Some(Poll::Ready(Some(Ok(Frame::data(bytes)))));
        match say {
            Say::Nothing | Say::Head => None,
            Say::Pass => fed.and_then(data),
            Say::Send(bytes) => data(bytes),
            Say::Comment | Say::Early => data(Bytes::from_static(COMMENT)),
            Say::Whole(bytes) | Say::End(bytes) => self.last(bytes),
            Say::Last(event) => self.last(Bytes::from(event)),
            Say::Cut | Say::Refuse(_) => {
                self.finish();
                let cut = std::io::Error::other("the reply was cut off");
                Some(Poll::Ready(Some(Err(axum::Error::new(cut)))))
            }
        }
    }

    /// These bytes end the reply.
    fn last(&mut self, bytes: Bytes) -> Option<Poll<Option<FrameResult>>> {
        self.finish();
        if bytes.is_empty() {
            Some(Poll::Ready(None))
        } else {
            Some(Poll::Ready(Some(Ok(Frame::data(bytes)))))
        }
    }

    /// The reply is over: the source and the request's holdings are let go now, not when
    /// hyper drops the body.
    fn finish(&mut self) {
        self.done = true;
        self.pending = None;
        self.inner = None;
        self.phases.exchange = None;
    }
}

type FrameResult = Result<Frame<Bytes>, axum::Error>;

impl HttpBody for Phased {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<FrameResult>> {
        let this = self.get_mut();
        loop {
            if let Some(bytes) = this.queued.take() {
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(pending) = &mut this.pending {
                if let Poll::Ready(answer) = pending.as_mut().poll(cx) {
                    this.pending = None;
                    this.answered(answer);
                    continue;
                }
            } else if let Some(inner) = &mut this.inner
                && let Poll::Ready(frame) = Pin::new(inner).poll_frame(cx)
            {
                let said = match frame {
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => {
                            this.phases.arrived(data.len());
                            let say = this.phases.payload(&data);
                            this.said(say, Some(data))
                        }
                        Err(_) => None,
                    },
                    Some(Err(e)) => {
                        let say = this.phases.broke(&e.to_string());
                        this.said(say, None)
                    }
                    None => {
                        let say = this.phases.end();
                        this.said(say, None)
                    }
                };
                match said {
                    Some(poll) => return poll,
                    None => continue,
                }
            }
            let Some(at) = this.phases.wake_at() else {
                return Poll::Pending;
            };
            if this.timer_at != Some(at) {
                this.timer.as_mut().reset(at);
                this.timer_at = Some(at);
            }
            if this.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.timer_at = None;
            let say = this.phases.woke();
            if let Some(poll) = this.said(say, None) {
                return poll;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.queued.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match &self.inner {
            // Comments or a last event may be added: an exact size would no longer hold.
            Some(inner) if self.phases.wake_at().is_none() && !self.phases.rewrites() => {
                inner.size_hint()
            }
            Some(inner) => {
                let mut hint = hyper::body::SizeHint::new();
                hint.set_lower(inner.size_hint().lower());
                hint
            }
            None if self.done && self.queued.is_none() => hyper::body::SizeHint::with_exact(0),
            None => hyper::body::SizeHint::new(),
        }
    }
}
