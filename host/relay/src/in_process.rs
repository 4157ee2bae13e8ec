//! Requests the route answers itself (`Action::InProcess`, ABI 1.2): its `respond` runs on a
//! blocking thread and writes into a bounded sink whose other end is the client's reply body.
//!
//! The general engine calls [`respond`] for a request whose [`RelayPlan`] targets
//! [`Target::InProcess`], after its own checks (guard, key, body limits, JSON, status), so those
//! apply exactly as for a relayed request, and the plan's served-name rewrites with them. Backpressure: the
//! sink holds at most [`SINK_BUFFER_BYTES`] for the client, and the route's `send` blocks on it.
//! Cancellation: a client that leaves drops the body, which closes the channel: the route's
//! next (or blocked) `send` fails at once, and `client_gone` (ABI 1.5) says so without a send.
//! Stop: once serve's drain window ends (`Traffic::host_stopping`), every `send` fails with
//! [`HOST_STOPPING`] (a zero-length one too, so a route may ask; `client_gone` is true), and
//! the client's body is cut as on the relay. A failure or panic in the route is one line on
//! stderr, a 500 before the head, a cut-off stream after it. Each request's `respond` runs on
//! its own thread of tokio's blocking pool, so a route answers requests concurrently.

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use onebit_plugin_api::loader::{LoadedRoute, RespondError};
use onebit_plugin_api::{
    ForwardRequest, HOST_STOPPING, NOT_IN_PROCESS, ReplySink, SINK_BUFFER_BYTES, SINK_CHUNK_BYTES,
    SinkError,
};
use tokio::sync::{mpsc, oneshot};

use crate::App;
use crate::exchange::Exchange;
use crate::plan::{Engine, RelayPlan, Target};
use crate::reply_loop::general::Answer;
use crate::traffic::Traffic;
use onebit_command::error::ApiError;

/// How long a stream's cut-off waits behind the bytes before it (see `respond`).
const CUT_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// A body chunk, or the error that cuts the stream off.
type Chunk = Result<Bytes, std::io::Error>;

/// The error a route's `send` gets once the host is stopping.
fn stopping_error() -> SinkError {
    SinkError {
        message: HOST_STOPPING.to_string(),
    }
}

/// Answer one request through the route's `respond`. Called by the general engine on a
/// runtime thread with the request's plan, its head, its body (already read and checked) and
/// its exchange (admitted); the route runs on a blocking thread, and this returns once the
/// route sent its head (the body streams on) or finished without one. The answer is one
/// source of the reply loop's (`reply_loop::general`), which names the model, times the
/// chunks and ends the reply at the deadline as for a relayed one; it carries the exchange,
/// and is marked [`Engine::InProcess`] for `onebit_requests_total`.
pub async fn respond(
    app: &Arc<App>,
    plan: &RelayPlan,
    parts: &axum::http::request::Parts,
    body: Bytes,
    exchange: Exchange,
) -> Answer {
    debug_assert_eq!(plan.target, Target::InProcess);
    let mut response = through_sink(app, parts, body).await;
    response.extensions_mut().insert(Engine::InProcess);
    Answer {
        response,
        exchange: Some(exchange),
        relayed: None,
    }
}

/// The route's `respond` on a blocking thread, its sink's other end the reply's body.
async fn through_sink(app: &Arc<App>, parts: &axum::http::request::Parts, body: Bytes) -> Response {
    let request = ForwardRequest {
        method: parts.method.to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().unwrap_or("").to_string(),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let what = format!("{} {}", request.method, request.path);
    let (head_tx, head_rx) = oneshot::channel();
    let (body_tx, body_rx) = mpsc::channel::<Chunk>(SINK_BUFFER_BYTES / SINK_CHUNK_BYTES);
    let route = app.route.route.clone();
    let device = app.settings.device.clone();
    let traffic = app.traffic.clone();
    // The route's thread says its lines in the request's span (its id).
    let span = tracing::Span::current();
    let running = tokio::task::spawn_blocking(move || {
        span.in_scope(|| {
            run_route(
                &route,
                &device,
                &what,
                &request,
                (head_tx, body_tx, traffic),
            )
        })
    });

    let Ok(head) = head_rx.await else {
        // The route finished (or failed) before sending a head.
        let failure = match running.await {
            Ok(Ok(())) => format!("the {} route answered no reply head", app.settings.device),
            Ok(Err(Failure::Lacking)) => {
                return reply(StatusCode::NOT_IMPLEMENTED, NOT_IN_PROCESS.to_string());
            }
            Ok(Err(Failure::Said(message))) => message,
            Err(e) => format!("the {} route's thread failed: {e}", app.settings.device),
        };
        return ApiError::RouteFailed(failure).into_response();
    };

    let status = StatusCode::from_u16(head.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body_rx = body_rx;
    let mut cut: Option<(std::io::Error, std::pin::Pin<Box<tokio::time::Sleep>>)> = None;
    let stream = futures_util::stream::poll_fn(move |cx| {
        // A cut-off is held back a moment (CUT_DELAY): hyper cuts the connection at once and
        // would drop bytes of the reply it has not flushed yet (the head included); the client
        // must see them, then the cut.
        if let Some((_, delay)) = &mut cut {
            std::task::ready!(delay.as_mut().poll(cx));
            return std::task::Poll::Ready(cut.take().map(|(e, _)| Err(e)));
        }
        match body_rx.poll_recv(cx) {
            std::task::Poll::Ready(Some(Err(e))) => {
                let mut delay = Box::pin(tokio::time::sleep(CUT_DELAY));
                let _ = delay.as_mut().poll(cx);
                cut = Some((e, delay));
                std::task::Poll::Pending
            }
            other => other,
        }
    });
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = status;
    if let Ok(ct) = HeaderValue::from_str(&head.content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
}

fn reply(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Why the route gave no complete answer.
enum Failure {
    /// Built before ABI 1.2: the documented default answers.
    Lacking,
    /// The one line already said on stderr.
    Said(String),
}

/// On the blocking thread: call the route, and say a failure in one line. After the head, a
/// failure cuts the stream off (the client sees the body end early, not a clean end).
fn run_route(
    route: &LoadedRoute,
    device: &str,
    what: &str,
    request: &ForwardRequest,
    (head, body, traffic): (oneshot::Sender<Head>, mpsc::Sender<Chunk>, Arc<Traffic>),
) -> Result<(), Failure> {
    let mut sink = Sink {
        head: Some(head),
        body: Some(body),
        traffic,
    };
    match route.respond(request, &mut sink) {
        Ok(()) => Ok(()),
        Err(RespondError::Lacking) => Err(Failure::Lacking),
        Err(RespondError::Failed(_))
            if sink.traffic.stopping() || sink.body.as_ref().is_some_and(|b| b.is_closed()) =>
        {
            // The client left (or serve is stopping) and the route stopped, as it should:
            // nothing to report.
            Ok(())
        }
        Err(RespondError::Failed(why)) => {
            let line = format!("the {device} route failed to answer {what}: {why}");
            tracing::info!("1bit serve: {line}");
            if let Some(body) = sink.body.take() {
                let _ = body.blocking_send(Err(std::io::Error::other(line.clone())));
            }
            Err(Failure::Said(line))
        }
    }
}

/// The reply's head as the route sent it.
struct Head {
    status: u16,
    content_type: String,
}

/// The host's [`ReplySink`]: the head goes to the waiting handler, the body through the
/// bounded channel.
struct Sink {
    head: Option<oneshot::Sender<Head>>,
    body: Option<mpsc::Sender<Chunk>>,
    /// Every send fails with [`HOST_STOPPING`] once the drain window ended (`Traffic::stopping`).
    traffic: Arc<Traffic>,
}

fn gone() -> SinkError {
    SinkError {
        message: "the client is gone".to_string(),
    }
}

impl ReplySink for Sink {
    fn send_head(&mut self, status: u16, content_type: &str) -> Result<(), SinkError> {
        let head = self.head.take().ok_or_else(|| SinkError {
            message: "the reply's head was already sent".to_string(),
        })?;
        head.send(Head {
            status,
            content_type: content_type.to_string(),
        })
        .map_err(|_| gone())
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), SinkError> {
        if self.head.is_some() {
            return Err(SinkError {
                message: "send_head must come before send".to_string(),
            });
        }
        let body = self.body.as_ref().ok_or_else(|| SinkError {
            message: "the reply was already ended".to_string(),
        })?;
        if self.traffic.stopping() {
            return Err(stopping_error());
        }
        if body.is_closed() {
            return Err(gone());
        }
        for chunk in bytes.chunks(SINK_CHUNK_BYTES) {
            // Blocks while the buffer is full; fails once the client dropped the body.
            body.blocking_send(Ok(Bytes::copy_from_slice(chunk)))
                .map_err(|_| {
                    if self.traffic.stopping() {
                        stopping_error()
                    } else {
                        gone()
                    }
                })?;
        }
        Ok(())
    }

    fn end(&mut self) {
        self.body = None;
    }

    /// Gone once the client dropped the reply (hyper drops it when the client's connection
    /// ends, even while no bytes are sent), the reply was ended, or serve is stopping.
    fn client_gone(&self) -> bool {
        self.traffic.stopping() || self.body.as_ref().is_none_or(|b| b.is_closed())
    }
}
