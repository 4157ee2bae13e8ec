//! The HTTP side: shared state and the one dispatcher (record, loading gate, triggers, routing).
//! The small routes live in `routes`, generation in `generate`, slots in `slots`.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State as AxumState};
use axum::http::{HeaderValue, Method, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Value, json};

use crate::close_after_stream::{self, StreamEnd};
use crate::config::Config;
use crate::generate::{self, Api};
use crate::slots;

#[path = "routes.rs"]
mod routes;
use routes::{apply_template, detokenize, embeddings, metrics, models, props, rerank, tokenize};

/// Largest request body read; larger ones get 413.
const MAX_BODY: usize = 256 << 20;

/// State shared by every request. Fields are atomics or short-held std mutexes: no await while
/// locked, so no handler blocks another for longer than a memcpy.
pub struct State {
    pub cfg: Config,
    /// The port actually bound (differs from `cfg.port` when that was 0).
    pub port: u16,
    /// Set once `FAKE_LOAD_MS` has passed; until then every route answers 503.
    pub ready: AtomicBool,
    /// Set by `fake_hang`: the main loop is wedged, so `/slots`, `/metrics`, slot actions and new
    /// generations never answer, while `/health` still does.
    pub hung: AtomicBool,
    /// Set by `fake_health_hang`: the health route never answers.
    pub health_hung: AtomicBool,
    /// Generations in flight (`is_processing`, `llamacpp:requests_processing`).
    pub processing: AtomicUsize,
    /// `FAKE_SLOTS`' places, when it limits the generations run at once.
    pub gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Generations waiting for a place (`llamacpp:requests_deferred`).
    pub deferred: AtomicUsize,
    pub slot: Mutex<slots::Slot>,
    /// Words seen by `/tokenize`, so `/detokenize` can give them back.
    pub vocab: Mutex<HashMap<u32, String>>,
    pub counters: Counters,
    record: Option<Mutex<File>>,
    next_id: AtomicU64,
    /// Requests answered, for `FAKE_CLOSE_EVERY`.
    answered: AtomicU64,
    pub started_unix: u64,
}

/// Totals behind `/metrics`.
#[derive(Default)]
pub struct Counters {
    pub prompt_tokens: AtomicU64,
    pub prompt_us: AtomicU64,
    pub predicted_tokens: AtomicU64,
    pub predicted_us: AtomicU64,
    pub n_decode: AtomicU64,
}

impl State {
    /// Called once from `main` before serving; opens (creates) the record file.
    pub fn new(cfg: Config, port: u16) -> Result<Self, String> {
        let record = match &cfg.record {
            Some(path) => Some(Mutex::new(
                File::options()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("error: FAKE_RECORD={}: {e}", path.display()))?,
            )),
            None => None,
        };
        let gate = (cfg.slots > 0).then(|| Arc::new(tokio::sync::Semaphore::new(cfg.slots)));
        Ok(Self {
            cfg,
            port,
            ready: AtomicBool::new(false),
            hung: AtomicBool::new(false),
            health_hung: AtomicBool::new(false),
            processing: AtomicUsize::new(0),
            gate,
            deferred: AtomicUsize::new(0),
            slot: Mutex::new(slots::Slot::default()),
            vocab: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            record,
            next_id: AtomicU64::new(1),
            answered: AtomicU64::new(0),
            started_unix: unix_now().as_secs(),
        })
    }

    /// A fresh number for reply ids and task ids.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks a generation in flight until the guard drops (with the response or its stream),
    /// once it has one of `FAKE_SLOTS`' places (counted as deferred while it waits).
    pub async fn busy(self: &Arc<Self>) -> Busy {
        let place = match &self.gate {
            Some(gate) => {
                self.deferred.fetch_add(1, Ordering::Relaxed);
                let waiting = Deferred(Arc::clone(self));
                let place = Arc::clone(gate).acquire_owned().await.ok();
                drop(waiting);
                place
            }
            None => None,
        };
        self.processing.fetch_add(1, Ordering::Relaxed);
        Busy {
            st: Arc::clone(self),
            _place: place,
        }
    }

    /// The slots `/props` and `/slots` report: `FAKE_SLOTS`, else one.
    pub fn total_slots(&self) -> usize {
        self.cfg.slots.max(1)
    }

    /// Appends one JSON line for a request; a blocking write, but short and only with `FAKE_RECORD`.
    fn record(&self, parts: &Parts, body: &Bytes) {
        let Some(file) = &self.record else { return };
        let mut headers = serde_json::Map::new();
        for (name, value) in &parts.headers {
            let value = String::from_utf8_lossy(value.as_bytes());
            match headers.get_mut(name.as_str()) {
                Some(Value::String(prev)) => {
                    prev.push_str(", ");
                    prev.push_str(&value);
                }
                _ => {
                    headers.insert(name.as_str().to_owned(), Value::from(value.into_owned()));
                }
            }
        }
        let line = json!({
            "method": parts.method.as_str(),
            "path": parts.uri.path(),
            "query": parts.uri.query().unwrap_or(""),
            "headers": headers,
            "body": String::from_utf8_lossy(body),
        });
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = file.write_all(&bytes).and_then(|()| file.flush()) {
            log!("fake-backend: FAKE_RECORD write failed: {e}");
        }
    }
}

/// Counts one generation in flight, holding its place (released with it); see [`State::busy`].
pub struct Busy {
    st: Arc<State>,
    _place: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Counts one generation waiting for a place, until it has one or its client left.
struct Deferred(Arc<State>);

impl Drop for Deferred {
    fn drop(&mut self) {
        self.0.deferred.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.st.processing.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Time since the epoch on CLOCK_REALTIME.
pub fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Never answers: what a wedged llama-server does.
pub async fn hang() -> Response {
    std::future::pending().await
}

/// The special words a request body may carry.
#[derive(Default, Clone, Copy)]
pub struct Triggers {
    pub hang: bool,
    pub exit: bool,
    pub health_hang: bool,
    pub slow: Option<Duration>,
    pub status: Option<StatusCode>,
}

impl Triggers {
    fn scan(body: &[u8]) -> Self {
        let text = String::from_utf8_lossy(body);
        if !text.contains("fake_") {
            return Self::default();
        }
        Self {
            hang: text.contains("fake_hang"),
            exit: text.contains("fake_exit"),
            health_hang: text.contains("fake_health_hang"),
            slow: number_after(&text, "fake_slow_ms=").map(Duration::from_millis),
            status: number_after(&text, "fake_status=")
                .and_then(|n| u16::try_from(n).ok())
                .and_then(|n| StatusCode::from_u16(n).ok()),
        }
    }
}

fn number_after(text: &str, key: &str) -> Option<u64> {
    let rest = &text[text.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The kinds of llama-server's OpenAI-style errors, each with its HTTP status.
#[derive(Clone, Copy)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    Server,
    NotSupported,
    Unavailable,
}

impl ErrorKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request_error",
            Self::Authentication => "authentication_error",
            Self::Permission => "permission_error",
            Self::NotFound => "not_found_error",
            Self::Server => "server_error",
            Self::NotSupported => "not_supported_error",
            Self::Unavailable => "unavailable_error",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Self::InvalidRequest => StatusCode::BAD_REQUEST,
            Self::Authentication => StatusCode::UNAUTHORIZED,
            Self::Permission => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::Server => StatusCode::INTERNAL_SERVER_ERROR,
            Self::NotSupported => StatusCode::NOT_IMPLEMENTED,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn for_status(status: StatusCode) -> Self {
        match status.as_u16() {
            401 => Self::Authentication,
            403 => Self::Permission,
            404 => Self::NotFound,
            501 => Self::NotSupported,
            503 => Self::Unavailable,
            s if s >= 500 => Self::Server,
            _ => Self::InvalidRequest,
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    n_prompt_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    n_ctx: Option<u32>,
}

/// The one place an error becomes a response: `{"error":{"message","type","code"}}`.
pub fn error(kind: ErrorKind, message: &str) -> Response {
    error_with_status(kind.status(), kind, message)
}

fn error_with_status(status: StatusCode, kind: ErrorKind, message: &str) -> Response {
    let body = ErrorBody {
        error: ErrorDetail {
            message,
            kind: kind.as_str(),
            code: status.as_u16(),
            n_prompt_tokens: None,
            n_ctx: None,
        },
    };
    (status, axum::Json(body)).into_response()
}

/// llama-server's 400 for a prompt longer than the slot's context.
pub fn exceeds_context(n_prompt_tokens: usize, n_ctx: u32) -> Response {
    let body = ErrorBody {
        error: ErrorDetail {
            message: "the request exceeds the available context size, try increasing it",
            kind: "exceed_context_size_error",
            code: 400,
            n_prompt_tokens: Some(n_prompt_tokens),
            n_ctx: Some(n_ctx),
        },
    };
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

fn not_found() -> Response {
    error(ErrorKind::NotFound, "File Not Found")
}

/// The router: everything goes through [`dispatch`], which matches paths itself so that the
/// recording, the loading gate and the 404 shape cover every request alike.
pub fn app(state: Arc<State>) -> Router {
    Router::new().fallback(dispatch).with_state(state)
}

async fn dispatch(AxumState(st): AxumState<Arc<State>>, req: Request) -> Response {
    // Present only under `FAKE_CLOSE_AFTER_STREAM_MS`: the connection's own accept loop put it.
    let stream_end = req.extensions().get::<Arc<StreamEnd>>().cloned();
    let mut response = answer(&st, req).await;
    let every = st.cfg.close_every;
    if every > 0 && (st.answered.fetch_add(1, Ordering::AcqRel) + 1) % every == 0 {
        // hyper closes the connection after a reply that says so.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    match stream_end {
        Some(end) => close_after_stream::mark_end(response, end),
        None => response,
    }
}

async fn answer(st: &Arc<State>, req: Request) -> Response {
    let st = st.clone();
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return error_with_status(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorKind::InvalidRequest,
                "request body too large or unreadable",
            );
        }
    };
    st.record(&parts, &body);
    if !st.ready.load(Ordering::Acquire) {
        return error(ErrorKind::Unavailable, "Loading model");
    }

    let triggers = Triggers::scan(&body);
    if triggers.exit {
        log!(
            "fake-backend: fake_exit in {} {}; exiting now",
            parts.method,
            parts.uri.path()
        );
        crate::exit_now(st.cfg.exit);
    }
    if triggers.health_hang {
        log!("fake-backend: fake_health_hang: the health route stops answering");
        st.health_hung.store(true, Ordering::Release);
    }
    if let Some(status) = triggers.status {
        // With fake_slow_ms too, the refusal comes after the wait: a long prefill that then
        // fails (a stream serve already answered 200 to keep alive).
        if let Some(delay) = triggers.slow {
            tokio::time::sleep(delay).await;
        }
        let message = format!("fake_status={} requested", status.as_u16());
        return error_with_status(status, ErrorKind::for_status(status), &message);
    }
    if triggers.hang && !st.hung.swap(true, Ordering::AcqRel) {
        log!(
            "fake-backend: fake_hang in {} {}: the main loop is now wedged (/slots stops answering)",
            parts.method,
            parts.uri.path()
        );
    }

    let api = if parts.method == Method::POST {
        generation_api(&st, parts.uri.path())
    } else {
        None
    };
    if let Some(api) = api {
        return generate::handle(&st, api, &body, triggers).await;
    }
    if triggers.hang {
        return hang().await;
    }
    if let Some(delay) = triggers.slow {
        tokio::time::sleep(delay).await;
    }
    if st.cfg.ds4 {
        route_ds4(&st, &parts).await
    } else {
        route_llama(&st, &parts, &body).await
    }
}

/// Which generation API a POST path is, on the active route set.
fn generation_api(st: &State, path: &str) -> Option<Api> {
    if st.cfg.ds4 {
        return match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/completions" => Some(Api::Completion),
            _ => None,
        };
    }
    match path {
        "/v1/chat/completions" | "/chat/completions" => Some(Api::Chat),
        "/v1/completions" => Some(Api::Completion),
        "/completion" | "/completions" => Some(Api::Native),
        "/v1/responses" | "/responses" => Some(Api::Responses),
        _ => None,
    }
}

/// DwarfStar's ds4-server: `GET /v1/models` is its health route; nothing llama.cpp-specific.
async fn route_ds4(st: &State, parts: &Parts) -> Response {
    match (&parts.method, parts.uri.path()) {
        (&Method::GET, "/v1/models") => {
            if st.health_hung.load(Ordering::Acquire) {
                return hang().await;
            }
            models(st)
        }
        _ => not_found(),
    }
}

async fn route_llama(st: &Arc<State>, parts: &Parts, body: &Bytes) -> Response {
    let path = parts.uri.path();
    match parts.method {
        Method::GET => match path {
            "/health" | "/v1/health" => {
                if st.health_hung.load(Ordering::Acquire) {
                    return hang().await;
                }
                axum::Json(json!({"status": "ok"})).into_response()
            }
            "/v1/models" | "/models" => models(st),
            "/props" => props(st),
            "/slots" => slots::list(st, parts.uri.query()).await,
            "/metrics" => metrics(st).await,
            _ => not_found(),
        },
        Method::POST => {
            if let Some(id) = path.strip_prefix("/slots/") {
                return slots::action(st, id, parts.uri.query(), body).await;
            }
            let Ok(json) = serde_json::from_slice::<Value>(body) else {
                return match path {
                    "/tokenize" | "/detokenize" | "/apply-template" | "/v1/embeddings"
                    | "/rerank" | "/reranking" | "/v1/rerank" | "/v1/reranking" => {
                        error(ErrorKind::InvalidRequest, "request body is not valid JSON")
                    }
                    _ => not_found(),
                };
            };
            match path {
                "/tools" => tool_call(st, &json).await,
                "/tokenize" => tokenize(st, &json),
                "/detokenize" => detokenize(st, &json),
                "/apply-template" => apply_template(&json),
                "/v1/embeddings" => embeddings(st, &json).await,
                "/rerank" | "/reranking" | "/v1/rerank" | "/v1/reranking" => {
                    rerank(st, &json).await
                }
                _ => not_found(),
            }
        }
        _ => not_found(),
    }
}

/// A tool call, as llama-server's `POST /tools` takes it (`{"tool", "params"}`): its result
/// after `FAKE_TOOL_MS`.
async fn tool_call(st: &State, json: &Value) -> Response {
    tokio::time::sleep(st.cfg.tool_call).await;
    axum::Json(json!({"result": {"tool": json.get("tool"), "params": json.get("params")}}))
        .into_response()
}
