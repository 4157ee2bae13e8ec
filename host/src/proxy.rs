//! The HTTP front: serve's own routes (/health, /v1/models) and the relay of everything the
//! route's table names to its backend, streamed through unchanged.

use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Router, middleware};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use onebit_plugin_api::{Action, Forward, ForwardRequest, Rule};
use serde::Deserialize;

use crate::busy_poll::{BusyPollStream, InFlight, Side};
use crate::error::ApiError;
use crate::guard::{self, Guard};
use crate::metrics;
use crate::route_calls::RouteCalls;
use crate::sse_keepalive;
use crate::watchdog::{Ticket, Watchdog};

/// The pooled client toward the backends.
pub type BackendClient = Client<BackendConnector, Full<Bytes>>;

/// A request body larger than this is refused with 413 (base64 images make chats large);
/// `ONEBIT_MAX_BODY_BYTES` changes it.
pub const DEFAULT_BODY_LIMIT: usize = 64 * 1024 * 1024;
/// A request body must have arrived whole within this long; `ONEBIT_BODY_READ_TIMEOUT_S`
/// changes it. At the default limit this asks for about 0.5 MiB/s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(120);

/// The general path's client toward the backends: its sockets busy-poll for replies.
pub fn backend_client() -> BackendClient {
    client(true)
}

/// The client of serve's own calls to its backends (health, metrics, the route's host
/// services): these are not relayed requests, and never busy-poll.
pub fn probe_client() -> BackendClient {
    client(false)
}

fn client(polls: bool) -> BackendClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(BackendConnector {
            http: connector,
            polls,
        })
}

/// hyper-util's TCP connector, handing out [`BusyPollStream`]s (`busy_poll`).
#[derive(Clone)]
pub struct BackendConnector {
    http: HttpConnector,
    polls: bool,
}

type ConnectError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for BackendConnector {
    type Response = TokioIo<BusyPollStream>;
    type Error = ConnectError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, ConnectError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), ConnectError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.http.call(uri);
        let polls = self.polls;
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            Ok(TokioIo::new(if polls {
                BusyPollStream::new(tcp, Side::Backend)
            } else {
                BusyPollStream::plain(tcp, Side::Backend)
            }))
        })
    }
}

/// Whether the model can take requests, as `/health` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The backends are starting.
    Loading,
    /// Every backend answers its own health route.
    Ready,
    /// A backend is down, hung or gone; the reason says which.
    Down(String),
    /// serve is stopping for this reason (a backend exited, the watchdog fired, a lost GPU);
    /// unlike `Down`, the health monitor never clears it.
    Failed(String),
}

/// What the handlers share.
pub struct App {
    pub served_name: String,
    pub device: String,
    /// Unix time serve started, for `/v1/models`.
    pub created: u64,
    pub rules: Vec<Rule>,
    /// The loopback port of each backend, in the plan's order.
    pub ports: Vec<u16>,
    pub status: RwLock<Status>,
    /// The general path's client (busy-polling).
    pub client: BackendClient,
    /// serve's own calls to the backends: metrics scrapes (and, in `serve`, health and the
    /// route's host services).
    pub probes: BackendClient,
    pub body_limit: usize,
    /// Models served beside the main one, for `/v1/models`.
    pub side_models: Vec<onebit_plugin_api::SideModel>,
    /// The plan asked that streamed events carry the served name (`Plan::rename_in_streams`).
    pub rename_in_streams: bool,
    /// `--precise` (or `ONEBIT_PRECISE=1`): chats and completions go with `cache_prompt` false.
    pub precise: bool,
    /// The route asked that its forwards take turns (`Plan::serialize_forwards`).
    pub serialize_forwards: bool,
    /// The turn, when they do.
    pub forward_turn: Arc<tokio::sync::Mutex<()>>,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
    /// The browser guard, applied before routing.
    pub guard: Guard,
    pub route: RouteCalls,
    /// The progress watchdog, set once the backends run (never, with `--watchdog 0`).
    pub watchdog: OnceLock<Arc<Watchdog>>,
    /// What `/metrics` reads besides the status.
    pub metrics: metrics::Sources,
    /// The fast path's idle backend connections (`fast_path`).
    pub pool: crate::fast_path::BackendPool,
}

impl App {
    pub fn status(&self) -> Status {
        self.status
            .read()
            .map(|s| s.clone())
            .unwrap_or(Status::Loading)
    }

    pub fn set_status(&self, status: Status) {
        if let Ok(mut s) = self.status.write() {
            *s = status;
        }
    }

    fn rule(&self, method: &Method, path: &str) -> Option<&Rule> {
        self.rule_for(method.as_str(), path)
    }

    /// The route's rule for a request, the first that matches in the plan's order.
    pub fn rule_for(&self, method: &str, path: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| {
            r.method.eq_ignore_ascii_case(method)
                && match r.path.strip_suffix('*') {
                    Some(prefix) => path.starts_with(prefix),
                    None => r.path == path,
                }
        })
    }
}

/// The router, apart from `main` so tests and benchmarks can build it.
pub fn router(app: Arc<App>) -> Router {
    let guard = app.guard;
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models));
    if !app.metrics.backends.is_empty() {
        // On every route that runs a child.
        router = router.route("/metrics", get(metrics::scrape));
    }
    router
        .fallback(relay)
        .with_state(app)
        // Outermost: every route, the fallback and 404s see the guard first.
        .layer(middleware::from_fn_with_state(guard, guard::guard))
}

async fn health(State(app): State<Arc<App>>) -> Response {
    match app.status() {
        Status::Ready => json_response(StatusCode::OK, r#"{"status":"ok"}"#.to_string()),
        Status::Loading => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "loading", "error": {
                "message": "Loading model", "type": "unavailable_error", "code": 503}})
            .to_string(),
        ),
        Status::Down(reason) | Status::Failed(reason) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "error", "reason": reason, "error": {
                "message": reason, "type": "unavailable_error", "code": 503}})
            .to_string(),
        ),
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let mut data = vec![serde_json::json!({
        "id": app.served_name,
        "object": "model",
        "created": app.created,
        "owned_by": "1bit",
        "device": app.device,
    })];
    for side in &app.side_models {
        data.push(serde_json::json!({
            "id": side.id,
            "object": "model",
            "created": app.created,
            "owned_by": "1bit",
            "device": app.device,
            "role": side.role,
        }));
    }
    let body = serde_json::json!({"object": "list", "data": data});
    json_response(StatusCode::OK, body.to_string())
}

fn json_response(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Only the one field serve needs from a request body; serde still checks the whole body is
/// well-formed JSON and an object, without building it.
#[derive(Deserialize)]
pub struct RequestShape {
    #[serde(default)]
    pub stream: Option<bool>,
}

async fn relay(State(app): State<Arc<App>>, request: Request) -> Response {
    let in_flight = InFlight::begin();
    let (parts, body) = request.into_parts();
    let Some(rule) = app.rule(&parts.method, parts.uri.path()) else {
        return ApiError::NotFound {
            method: parts.method.to_string(),
            path: parts.uri.path().to_string(),
        }
        .into_response();
    };
    if let Action::Answer {
        status,
        content_type,
        body,
    } = &rule.action
    {
        return answer(*status, content_type, body.clone());
    }
    match app.status() {
        Status::Ready => {}
        Status::Loading => {
            return ApiError::Unavailable(
                "the model is loading; retry when /health answers 200".into(),
            )
            .into_response();
        }
        Status::Down(reason) | Status::Failed(reason) => {
            return ApiError::Unavailable(reason).into_response();
        }
    }

    let has_body = parts.method != Method::GET && parts.method != Method::HEAD;
    let body = if has_body {
        match read_json_body(&app, &parts.headers, body).await {
            Ok(bytes) => bytes,
            Err(e) => return e.into_response(),
        }
    } else {
        Bytes::new()
    };
    let mut streamed = false;
    if has_body {
        match serde_json::from_slice::<RequestShape>(&body) {
            Ok(shape) => streamed = shape.stream.unwrap_or(false),
            Err(e) => return ApiError::BadJson(e.to_string()).into_response(),
        }
    }

    // --precise: every chat and completion is prefilled whole, as a cold run is.
    let body = if app.precise && rule.inference {
        without_prompt_cache(body)
    } else {
        body
    };

    // For a route that asks to, its forwards take turns: the turn is held from asking the
    // route until the backend's first byte (dropped with `on_first_byte`, or on any error).
    let mut on_first_byte: Option<FirstByte> = None;
    let (backend, body) = match &rule.action {
        Action::Proxy { backend } => (*backend, body),
        Action::AskRoute => {
            let turn = if app.serialize_forwards {
                Some(app.forward_turn.clone().lock_owned().await)
            } else {
                None
            };
            let asked_at = std::time::Instant::now();
            match ask_route(&app, &parts.method, &parts.uri, &body).await {
                Ok(Forward::Proxy {
                    backend,
                    body: rewritten,
                    first_byte_line,
                }) => {
                    on_first_byte = Some(FirstByte {
                        asked_at,
                        line: first_byte_line,
                        _turn: turn,
                    });
                    (backend, rewritten.map(Bytes::from).unwrap_or(body))
                }
                Ok(Forward::Answer {
                    status,
                    content_type,
                    body,
                }) => return answer(status, &content_type, body),
                Err(e) => return e.into_response(),
            }
        }
        Action::Answer { .. } => unreachable!("answered above"),
    };
    let Some(port) = app.ports.get(backend).copied() else {
        return ApiError::BadGateway(format!(
            "the route named backend {backend}, which it did not start"
        ))
        .into_response();
    };

    // An inference request is watched from before it is sent: waiting for the reply's head
    // counts against it too.
    let ticket = match app.watchdog.get() {
        Some(dog) if rule.inference => Some(dog.track(
            parts.method.as_str(),
            parts.uri.path(),
            streamed,
            backend,
            body.len(),
        )),
        _ => None,
    };
    let upstream = match upstream_request(parts, port, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let pending = app.client.request(upstream);
    let reply = match sse_keepalive::wait_head(pending, rule.inference && streamed).await {
        sse_keepalive::Waited::Arrived(Ok(reply)) => reply,
        sse_keepalive::Waited::Arrived(Err(e)) => {
            return no_answer(&app.device, &error_chain(&e)).into_response();
        }
        sse_keepalive::Waited::Silent(pending) => {
            let wrap = move |body| watched(body, ticket, on_first_byte, in_flight);
            return sse_keepalive::early_stream(pending, wrap, app.device.clone());
        }
    };
    let (mut reply_parts, reply_body) = reply.into_parts();
    strip_hop_headers(&mut reply_parts.headers);
    strip_cors_headers(&mut reply_parts.headers);
    let reply_body = watched(reply_body, ticket, on_first_byte, in_flight);
    let json_reply = reply_parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if rule.inference && !streamed && json_reply {
        // A whole JSON reply: name the model as serve serves it.
        let bytes = match reply_body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                return ApiError::BadGateway(format!(
                    "the {} backend broke off its reply ({})",
                    app.device,
                    error_chain(&e)
                ))
                .into_response();
            }
        };
        let bytes = with_model_name(bytes, &app.served_name);
        reply_parts.headers.remove(header::CONTENT_LENGTH);
        return Response::from_parts(reply_parts, Body::from(bytes));
    }
    // Streamed as it arrives: dropping this response (a client that went away) drops the
    // upstream body, which closes the backend connection, and the engine stops generating.
    if app.rename_in_streams && rule.inference && streamed {
        // The engine cannot be told the served name (ds4-server has no alias): name it in
        // every event as it passes.
        let mut events = SseRenamer::new(app.served_name.clone());
        let renamed = reply_body.map_frame(move |frame| match frame.into_data() {
            Ok(data) => hyper::body::Frame::data(events.feed(&data)),
            Err(frame) => frame,
        });
        return Response::from_parts(reply_parts, sse_keepalive::during(renamed, true));
    }
    // Comments go only into an event stream (a streamed request's error reply is JSON).
    let event_stream = reply_parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    Response::from_parts(
        reply_parts,
        sse_keepalive::during(reply_body, rule.inference && streamed && event_stream),
    )
}

/// Rewrites the `model` field of each SSE `data:` event to the served name, event by event:
/// complete lines go out as they arrive, a partial line waits for the rest of it.
struct SseRenamer {
    served: String,
    partial: Vec<u8>,
}

impl SseRenamer {
    fn new(served: String) -> Self {
        SseRenamer {
            served,
            partial: Vec::new(),
        }
    }

    fn feed(&mut self, data: &[u8]) -> Bytes {
        self.partial.extend_from_slice(data);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Bytes::new();
        };
        let rest = self.partial.split_off(end + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        let mut out = Vec::with_capacity(complete.len() + 16);
        for line in complete.split_inclusive(|b| *b == b'\n') {
            match line.strip_prefix(b"data: ") {
                Some(json) if json.starts_with(b"{") => {
                    let body = json.strip_suffix(b"\n").unwrap_or(json);
                    let body = body.strip_suffix(b"\r").unwrap_or(body);
                    let renamed = with_model_name(Bytes::copy_from_slice(body), &self.served);
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&renamed);
                    out.push(b'\n');
                }
                _ => out.extend_from_slice(line),
            }
        }
        Bytes::from(out)
    }
}

/// What happens when a route-forwarded reply's first byte arrives: the route's line is said,
/// and the forward turn (if held) is released.
struct FirstByte {
    asked_at: std::time::Instant,
    line: Option<String>,
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl FirstByte {
    fn arrived(self) {
        if let Some(line) = self.line {
            let ms = format!("{:.1}", self.asked_at.elapsed().as_secs_f64() * 1000.0);
            eprintln!("{}", line.replace("{first_byte_ms}", &ms));
        }
    }
}

/// The backend's reply body, stamping the request's watchdog ticket with every frame (the
/// reply's head counts as progress too). The ticket and the in-flight count ride on the body,
/// so the request stops being watched and counted when the body is dropped: finished, or the
/// client left.
fn watched(
    body: hyper::body::Incoming,
    ticket: Option<Ticket>,
    first_byte: Option<FirstByte>,
    in_flight: InFlight,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error> {
    if let Some(ticket) = &ticket {
        ticket.progress(0);
    }
    let mut first_byte = first_byte;
    body.map_frame(move |frame| {
        let _counted = &in_flight;
        if let Some(data) = frame.data_ref() {
            if let Some(ticket) = &ticket {
                ticket.progress(data.len());
            }
            if let Some(first) = first_byte.take() {
                first.arrived();
            }
        }
        frame
    })
    .boxed_unsync()
}

fn answer(status: u16, content_type: &str, body: String) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, body).into_response();
    if let Ok(ct) = HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
}

/// Read a request body that must be JSON: refuse a non-JSON Content-Type, a declared length
/// over the limit (before reading a byte), a body that grows past it (the read stops there),
/// one that takes longer than the body timeout, and invalid UTF-8. Called by `relay` before
/// anything reaches a backend.
async fn read_json_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE)
        && !json_content_type(ct.as_bytes())
    {
        return Err(ApiError::BadContentType(
            String::from_utf8_lossy(ct.as_bytes())
                .chars()
                .take(100)
                .collect(),
        ));
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > app.body_limit as u64) {
        return Err(ApiError::TooLarge {
            limit: app.body_limit,
        });
    }
    let bytes =
        match tokio::time::timeout(app.body_timeout, axum::body::to_bytes(body, app.body_limit))
            .await
        {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) => return Err(body_error(e, app.body_limit)),
            Err(_) => {
                return Err(ApiError::BodyTimeout {
                    after: app.body_timeout,
                });
            }
        };
    if let Err(e) = std::str::from_utf8(&bytes) {
        return Err(ApiError::BadJson(format!("it is not UTF-8: {e}")));
    }
    Ok(bytes)
}

/// Content types serve reads as JSON: `application/json` and `+json` types (any parameters),
/// and `application/x-www-form-urlencoded`, which `curl -d` sends for a JSON body. A browser
/// form's other types (`text/plain`, `multipart/form-data`) are refused; see docs/security.md.
pub fn json_content_type(value: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(value) else {
        return false;
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence.eq_ignore_ascii_case("application/x-www-form-urlencoded")
        || essence
            .get(..12)
            .is_some_and(|p| p.eq_ignore_ascii_case("application/"))
            && essence
                .get(essence.len().saturating_sub(5)..)
                .is_some_and(|s| s.eq_ignore_ascii_case("+json"))
}

fn body_error(e: axum::Error, limit: usize) -> ApiError {
    let too_large = std::error::Error::source(&e)
        .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
        || e.to_string().contains("length limit");
    if too_large {
        ApiError::TooLarge { limit }
    } else {
        ApiError::BadJson(format!("the body could not be read: {e}"))
    }
}

/// Headers that belong to one connection, not to the message (lowercase, as `http` keeps
/// names); both relay paths drop them.
const HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether a header (any case) belongs to one connection, not to the message.
pub fn is_hop_header(name: &str) -> bool {
    HOP_HEADERS.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// Whether a header (any case) is a CORS header. llama-server answers any Origin with
/// `Access-Control-Allow-Origin` (and credentials), which would let any web page read the
/// replies it can make a browser request; serve sends no CORS headers at all
/// (docs/security.md).
pub fn is_cors_header(name: &str) -> bool {
    name.get(..15)
        .is_some_and(|p| p.eq_ignore_ascii_case("access-control-"))
}

/// The error of a request that reached no answer from the backend.
pub fn no_answer(device: &str, why: &str) -> ApiError {
    ApiError::BadGateway(format!(
        "the {device} backend did not answer ({why}); see serve's log"
    ))
}

fn strip_hop_headers(headers: &mut HeaderMap) {
    for name in HOP_HEADERS {
        headers.remove(name);
    }
}

fn strip_cors_headers(headers: &mut HeaderMap) {
    let cors: Vec<header::HeaderName> = headers
        .keys()
        .filter(|name| is_cors_header(name.as_str()))
        .cloned()
        .collect();
    for name in cors {
        headers.remove(name);
    }
}

/// The request to the backend on `port`: the client's method, path, query and headers (moved,
/// not copied: the hot path builds no second header map), less Host, Content-Length (hyper sets
/// both) and the hop-by-hop headers.
fn upstream_request(
    parts: axum::http::request::Parts,
    port: u16,
    body: Bytes,
) -> Result<hyper::Request<Full<Bytes>>, ApiError> {
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let target: Uri = format!("http://127.0.0.1:{port}{path_and_query}")
        .parse()
        .map_err(|e| ApiError::BadJson(format!("the request path is not valid: {e}")))?;
    let mut request = hyper::Request::new(Full::new(body));
    *request.method_mut() = parts.method;
    *request.uri_mut() = target;
    let headers = request.headers_mut();
    *headers = parts.headers;
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    strip_hop_headers(headers);
    Ok(request)
}

/// The request body with `cache_prompt` false, so the backend reuses no cached prefix.
fn without_prompt_cache(body: Bytes) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    match value.as_object_mut() {
        Some(object) => {
            object.insert("cache_prompt".to_string(), serde_json::Value::Bool(false));
            serde_json::to_vec(&value).map(Bytes::from).unwrap_or(body)
        }
        None => body,
    }
}

/// Put `served` in a JSON object reply's `model` field; anything else is left as it came.
fn with_model_name(bytes: Bytes, served: &str) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return bytes;
    };
    match value.get_mut("model") {
        Some(serde_json::Value::String(model)) if model != served => {
            *model = served.to_string();
            serde_json::to_vec(&value).map(Bytes::from).unwrap_or(bytes)
        }
        _ => bytes,
    }
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

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reply_model_becomes_the_served_name_and_other_bytes_pass() {
        let out = with_model_name(Bytes::from_static(br#"{"model":"x.gguf","n":1}"#), "smol");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], "smol");
        assert_eq!(v["n"], 1);
        let same = Bytes::from_static(br#"{"model":"smol"}"#);
        assert_eq!(with_model_name(same.clone(), "smol"), same);
        let text = Bytes::from_static(b"not json");
        assert_eq!(with_model_name(text.clone(), "smol"), text);
    }

    #[test]
    fn cors_headers_are_stripped_from_replies() {
        let mut headers = HeaderMap::new();
        headers.insert("access-control-allow-origin", HeaderValue::from_static("*"));
        headers.insert(
            "access-control-allow-credentials",
            HeaderValue::from_static("true"),
        );
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        strip_cors_headers(&mut headers);
        assert_eq!(headers.len(), 1);
    }

    #[test]
    fn json_content_types() {
        for yes in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/x-www-form-urlencoded",
            "application/vnd.api+json",
        ] {
            assert!(json_content_type(yes.as_bytes()), "{yes}");
        }
        for no in [
            "text/plain",
            "multipart/form-data; boundary=x",
            "application/xml",
            "",
            "+json",
        ] {
            assert!(!json_content_type(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn streamed_events_get_the_served_name_even_when_split_across_frames() {
        let mut r = SseRenamer::new("smol".into());
        let first = r.feed(b"data: {\"model\":\"ds4\",\"n\":1}\n\ndata: {\"mo");
        assert_eq!(&first[..], b"data: {\"model\":\"smol\",\"n\":1}\n\n");
        let second = r.feed(b"del\":\"ds4\"}\n\ndata: [DONE]\n\n");
        assert_eq!(
            &second[..],
            b"data: {\"model\":\"smol\"}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn request_shape_accepts_objects_only() {
        assert!(serde_json::from_slice::<RequestShape>(br#"{"stream":true,"x":[1]}"#).is_ok());
        assert!(serde_json::from_slice::<RequestShape>(b"[1,2]").is_err());
        assert!(serde_json::from_slice::<RequestShape>(b"{bad").is_err());
        assert!(serde_json::from_slice::<RequestShape>(b"").is_err());
    }
}
