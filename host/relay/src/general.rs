//! The general engine: the axum handler that relays, by its [`RelayPlan`], every request the
//! fast engine does not carry: the route's table answers, route forwards (`forward` on a
//! blocking thread), in-process routes, `--pm`'s tool loop (`Target::ToolLoop`), a backend
//! `--laya` picks by conversation from the body, and the body's rewrites (`--precise`, Claude
//! Code's attribution line); and every refusal. Whatever answers an admitted request is one
//! source of its reply, carried through the reply loop's phases (`reply_loop::general`).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::Full;
use onebit_plugin_api::{BodyKind, Forward, ForwardRequest};
use tracing::Instrument as _;

use crate::App;
use crate::exchange::{Exchange, FirstByte};
use crate::plan::{self, DeviceChoice, Direction, Engine, HandedPlan, RelayPlan, Target};
use crate::reply_loop::ReplyPhases;
use crate::reply_loop::general::{Answer, Source};
use crate::request_id::RequestId;
use crate::{in_process, pool};
use onebit_command::error::{ApiError, error_chain};
use onebit_metrics::requests::PathClass;

/// The axum fallback: relay a request by its [`RelayPlan`], the one the fast engine handed
/// over with it ([`HandedPlan`]) or made here from the head. Runs on the connection's task; the
/// route's `forward` goes to a blocking thread. Its steps: the plan and the body read and
/// checked, with the plan's body rewrites ([`planned`]), the admission, then the reply's
/// source ([`admitted`]: the backend chosen by [`backend_for`], the request sent) through the
/// reply loop.
pub async fn relay(State(app): State<Arc<App>>, mut request: Request) -> Response {
    // serve's added time runs from here to the response handed to hyper, less the backend's
    // own time (`metrics::requests`).
    let began = Instant::now();
    let path = PathClass::of(request.uri().path());
    let mut exchange = Exchange::begin(&app, Engine::General, path, began);
    let decided = request.extensions_mut().remove::<HandedPlan>();
    let id = request
        .extensions()
        .get::<RequestId>()
        .copied()
        .unwrap_or_else(RequestId::made);
    let (parts, body) = request.into_parts();
    let (plan, body) = match planned(&app, decided, &parts, body).await {
        Ok(planned) => planned,
        Err(response) => return response,
    };
    if let Err(refused) = exchange.admit(&plan) {
        return refused.into_response();
    }
    // From here every way out is one source of the reply, whose phases (the served name,
    // comments in silences, the deadline, the clocks) are the reply loop's.
    let phases = ReplyPhases::new(&app.replies, &plan, exchange.deadline());
    let engine = match plan.target {
        Target::InProcess => Engine::InProcess,
        _ => Engine::General,
    };
    // The route's lines say the request's id, even once serve began the reply itself.
    let span = tracing::Span::current();
    let source: Source = Box::pin(admitted(app, plan, parts, body, exchange, id).instrument(span));
    crate::reply_loop::general::answer(phases, source, engine).await
}

/// An admitted request's way out: its slot prepared, its backend chosen (or the in-process
/// route, the tool loop, the route's own answer), the request sent and its reply's head
/// awaited. Owns all it needs: serve's early stream may go on waiting for it.
async fn admitted(
    app: Arc<App>,
    plan: RelayPlan,
    parts: axum::http::request::Parts,
    body: Bytes,
    mut exchange: Exchange,
    id: RequestId,
) -> Answer {
    let body = exchange
        .prepare(&plan, (parts.method.as_str(), parts.uri.path()), body)
        .await;
    let chosen = match backend_for(&app, &plan, &parts, body).await {
        Destination::Backend(chosen) => chosen,
        Destination::InProcess(body) => {
            return in_process::respond(&app, &plan, &parts, body, exchange).await;
        }
        Destination::Answered(response) => return response.into(),
    };
    let Some(port) = app.settings.ports.get(chosen.backend).copied() else {
        return ApiError::BadGateway(format!(
            "the route named backend {}, which it did not start",
            chosen.backend
        ))
        .into_response()
        .into();
    };
    exchange.sending(
        &plan,
        parts.method.as_str(),
        parts.uri.path(),
        chosen.backend,
        chosen.body.len(),
    );
    exchange.on_first_byte(chosen.on_first_byte);
    let upstream = match upstream_request(parts, port, chosen.body, &id) {
        Ok(r) => r,
        Err(e) => return e.into_response().into(),
    };
    let sent_at = Instant::now();
    let reply = match pool::send(&app.client, upstream).await {
        Ok(reply) => reply,
        Err(e) => {
            return ApiError::no_answer(&app.settings.device, &error_chain(&e))
                .into_response()
                .into();
        }
    };
    let backend_time = sent_at.elapsed();
    let (mut reply_parts, reply_body) = reply.into_parts();
    plan::filter(
        Direction::Reply {
            cors: app.settings.cors.is_some(),
        },
        &mut reply_parts.headers,
    );
    if let DeviceChoice::Chosen(why) = &plan.device_choice {
        reply_parts.headers.insert("x-1bit-route", why.clone());
    }
    Answer {
        response: Response::from_parts(reply_parts, Body::new(reply_body)),
        exchange: Some(exchange),
        relayed: Some((chosen.backend, backend_time)),
    }
}

/// The request's plan (the one handed over, or made here from the head), and its body read
/// and checked by the rule's kind, with the plan's own rewrites (`--laya`'s device,
/// `--precise`, Claude Code's attribution line dropped) applied. Err: the answer (a refusal, or the table's own answer).
async fn planned(
    app: &Arc<App>,
    decided: Option<HandedPlan>,
    parts: &axum::http::request::Parts,
    body: Body,
) -> Result<(RelayPlan, Bytes), Response> {
    let (plan, body_checked) = match decided {
        Some(decided) => (decided.plan, decided.body_checked),
        None => match RelayPlan::for_head(app, parts.method.as_str(), parts.uri.path()) {
            Ok(plan) => (plan, false),
            Err(e) => return Err(e.into_response()),
        },
    };
    if let Target::Answer {
        status,
        content_type,
        body,
    } = &plan.target
    {
        return Err(route_answer(*status, content_type, body.clone()));
    }

    // The rule's kind says whether a body is read and relayed (none for a GET's).
    let has_body = plan.body != BodyKind::None;
    let body = if has_body {
        match read_body(app, plan.body, &parts.headers, body).await {
            Ok(bytes) => bytes,
            Err(e) => return Err(e.into_response()),
        }
    } else {
        Bytes::new()
    };
    let plan = if has_body && !body_checked {
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .map(|v| v.as_bytes());
        match plan::check_body(plan.body, content_type, &body) {
            Ok(streamed) => plan.with_body(app, streamed, &body),
            Err(e) => return Err(e.into_response()),
        }
    } else {
        plan
    };

    Ok(plan.placed(app, body).await)
}

/// Where a planned request goes.
enum Destination {
    /// To a backend over its socket.
    Backend(ToBackend),
    /// To the route in serve's process, with the body.
    InProcess(Bytes),
    /// Nowhere: answered (by the route's forward, the tool loop, or a refusal).
    Answered(Response),
}

/// The backend a request goes to, the body it gets (the route's rewrite, or the client's),
/// and, for a route's forward, what its first byte does.
struct ToBackend {
    backend: usize,
    body: Bytes,
    on_first_byte: Option<FirstByte>,
}

/// The backend for a planned request: the plan's, the route's forward (asked at run time), or
/// none (in process, the tool loop, an answer).
async fn backend_for(
    app: &Arc<App>,
    plan: &RelayPlan,
    parts: &axum::http::request::Parts,
    body: Bytes,
) -> Destination {
    // For a route that asks to, its forwards take turns: the turn is held from asking the
    // route until the backend's first byte (dropped with `on_first_byte`, or on any error).
    match &plan.target {
        Target::Backend(backend) => Destination::Backend(ToBackend {
            backend: *backend,
            body,
            on_first_byte: None,
        }),
        Target::AskRoute => {
            let turn = if app.settings.serialize_forwards {
                Some(app.forward_turn.clone().lock_owned().await)
            } else {
                None
            };
            let asked_at = std::time::Instant::now();
            match ask_route(app, &parts.method, &parts.uri, &body).await {
                Ok(Forward::Proxy {
                    backend,
                    body: rewritten,
                    first_byte_line,
                }) => Destination::Backend(ToBackend {
                    backend,
                    body: rewritten.map(Bytes::from).unwrap_or(body),
                    on_first_byte: Some(FirstByte {
                        asked_at,
                        line: first_byte_line,
                        _turn: turn,
                        span: tracing::Span::current(),
                    }),
                }),
                Ok(Forward::Answer {
                    status,
                    content_type,
                    body,
                }) => Destination::Answered(route_answer(status, &content_type, body)),
                Err(e) => Destination::Answered(e.into_response()),
            }
        }
        Target::InProcess => Destination::InProcess(body),
        Target::Answer {
            status,
            content_type,
            body,
        } => Destination::Answered(route_answer(*status, content_type, body.clone())),
        Target::ToolLoop(backend) => {
            Destination::Answered(crate::exchange::tool_loop(app, *backend, body).await)
        }
    }
}

/// The route's own answer (its table's, or its forward's): `status`, `content_type`, `body`.
fn route_answer(status: u16, content_type: &str, body: String) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, body).into_response();
    if let Ok(ct) = HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
}

/// Read a request body of `kind`: refuse a Content-Type the kind does not take (a form that
/// is not JSON, for a JSON body), a declared length over the limit (before reading a byte), a
/// body that grows past it (the read stops there) and one that takes longer than the body
/// timeout. Called by `relay` before anything reaches a backend; [`plan::check_body`] then
/// checks what was read.
async fn read_body(
    app: &App,
    kind: BodyKind,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, ApiError> {
    plan::check_content_type(
        kind,
        headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes()),
    )?;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > app.settings.body_limit as u64) {
        return Err(ApiError::TooLarge {
            limit: app.settings.body_limit,
        });
    }
    let bytes = match tokio::time::timeout(
        app.settings.body_timeout,
        axum::body::to_bytes(body, app.settings.body_limit),
    )
    .await
    {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) => return Err(body_error(e, app.settings.body_limit)),
        Err(_) => {
            return Err(ApiError::BodyTimeout {
                after: app.settings.body_timeout,
            });
        }
    };
    Ok(bytes)
}

fn body_error(e: axum::Error, limit: usize) -> ApiError {
    let too_large = std::error::Error::source(&e)
        .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
        || e.to_string().contains("length limit");
    if too_large {
        ApiError::TooLarge { limit }
    } else {
        ApiError::BodyBroken(error_chain(&e))
    }
}

/// The request to the backend on `port`: the client's method, path, query and headers (moved,
/// not copied: the hot path builds no second header map) that pass `headers::passes`
/// upstream; hyper writes Host and Content-Length, as `headers::upstream_head` does for the
/// fast engine.
fn upstream_request(
    parts: axum::http::request::Parts,
    port: u16,
    body: Bytes,
    id: &RequestId,
) -> Result<hyper::Request<Full<Bytes>>, ApiError> {
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let target: Uri = format!("http://127.0.0.1:{port}{path_and_query}")
        .parse()
        .map_err(|e: axum::http::uri::InvalidUri| ApiError::BadPath(e.to_string()))?;
    let mut request = hyper::Request::new(Full::new(body));
    *request.method_mut() = parts.method;
    *request.uri_mut() = target;
    let headers = request.headers_mut();
    *headers = parts.headers;
    plan::filter(Direction::Upstream, headers);
    if let Ok(value) = HeaderValue::from_bytes(id.as_bytes()) {
        headers.insert(crate::request_id::HEADER, value);
    }
    Ok(request)
}

/// Ask the route what to do with a request, on a blocking thread.
async fn ask_route(
    app: &Arc<App>,
    method: &Method,
    uri: &Uri,
    body: &Bytes,
) -> Result<Forward, ApiError> {
    let request = ForwardRequest {
        method: method.to_string(),
        path: uri.path().to_string(),
        query: uri.query().unwrap_or("").to_string(),
        body: String::from_utf8_lossy(body).into_owned(),
    };
    let route = app.route.clone();
    tokio::task::spawn_blocking(move || route.forward(&request))
        .await
        .map_err(|e| ApiError::BadGateway(format!("the route's forward did not finish: {e}")))?
        .map_err(|e| ApiError::BadGateway(format!("the route could not forward the request: {e}")))
}
