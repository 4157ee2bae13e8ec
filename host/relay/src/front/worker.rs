//! What a gateway in front of several serves asks of each worker besides `/health` and
//! `/v1/models` (docs/fleet.md). SMG, the SGLang project's model gateway, reads a worker's
//! metadata at registration (`/get_server_info`, `/model_info`, falling back to
//! `/get_model_info`) and polls its load (`/v1/loads`). serve answers from what its
//! llama-server says (`/props`, `/slots`) and from its own count of generations in flight;
//! a figure neither knows is left out, never made up.
//!
//! `/version` and `/server_info` stay 404: SMG reads a 200 on the first as vLLM and on the
//! second as SGLang, and serve is neither, so it is registered as what it is, a generic
//! OpenAI-compatible worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use crate::App;
use onebit_supervision::backends::health::ProbeClient;

/// How long serve waits for its backend's `/props` or `/slots`.
const BACKEND_TIMEOUT: Duration = Duration::from_secs(1);

/// The routes, on serve's router.
pub fn routes(router: Router<Arc<App>>) -> Router<Arc<App>> {
    router
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/loads", get(loads))
}

/// The port of the backend that serves the model (backend 0).
fn backend_port(app: &App) -> Option<u16> {
    app.settings.ports.first().copied()
}

/// What the backend answered at `path`: its status and JSON body; None when it did not answer
/// within [`BACKEND_TIMEOUT`].
async fn backend_json(client: &ProbeClient, port: u16, path: &str) -> Option<(u16, Value)> {
    let request = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let call = async {
        let reply = client.request(request).await.ok()?;
        let status = reply.status().as_u16();
        let bytes = reply.into_body().collect().await.ok()?.to_bytes();
        Some((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    };
    tokio::time::timeout(BACKEND_TIMEOUT, call).await.ok()?
}

/// llama-server's `/props`, when it answers 200.
async fn props(app: &App) -> Option<Value> {
    let port = backend_port(app)?;
    match backend_json(&app.probes, port, "/props").await? {
        (200, props) => Some(props),
        _ => None,
    }
}

/// `GET /get_server_info`: the served name, serve's version and device, and from llama-server's
/// `/props` the model file, the context of one request (a slot's) and how many requests it runs
/// at once (its slots). SMG keeps them as the worker's labels (`max_running_requests` sizes its
/// capacity; `context_length` its model card).
async fn server_info(State(app): State<Arc<App>>) -> Response {
    let mut info = json!({
        "served_model_name": app.settings.served_name,
        "version": format!("1bit {}", env!("CARGO_PKG_VERSION")),
        "device": app.settings.device,
    });
    if let Some(props) = props(&app).await {
        let fields = [
            ("model_path", &props["model_path"]),
            (
                "context_length",
                &props["default_generation_settings"]["n_ctx"],
            ),
            ("max_running_requests", &props["total_slots"]),
            ("backend_build", &props["build_info"]),
        ];
        for (name, value) in fields {
            if !value.is_null() {
                info[name] = value.clone();
            }
        }
    }
    reply(StatusCode::OK, info.to_string())
}

/// `GET /model_info` (and SGLang's older `/get_model_info`): the model file, from `/props`.
async fn model_info(State(app): State<Arc<App>>) -> Response {
    let mut info = json!({});
    if let Some(path) = props(&app).await.map(|p| p["model_path"].clone())
        && !path.is_null()
    {
        info["model_path"] = path;
    }
    reply(StatusCode::OK, info.to_string())
}

/// `GET /v1/loads` in the schema SGLang's engines answer and SMG's load-aware policies read:
/// one rank, its running requests (llama-server's slots processing, from `/slots`), its waiting
/// ones (generations serve has in flight that no slot runs yet) and its slots. llama-server
/// does not say how full its KV cache is, so the token figures are left out. Read from
/// `/slots` rather than `/metrics`, whose every read restarts the window llama-server's
/// throughput gauges average over.
async fn loads(State(app): State<Arc<App>>) -> Response {
    let answer = match backend_port(&app) {
        Some(port) => backend_json(&app.probes, port, "/slots").await,
        None => Some((404, Value::Null)),
    };
    let slots = match answer {
        Some((200, Value::Array(slots))) => slots,
        // No such route (another engine, or llama-server run with --no-slots): never will be.
        Some((404 | 501, _)) => {
            return unanswerable(
                StatusCode::NOT_IMPLEMENTED,
                "not_supported_error",
                "this route's backend does not report its slots, so serve cannot say its load",
            );
        }
        _ => {
            return unanswerable(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                "the backend's /slots did not answer; try again",
            );
        }
    };
    let running = slots
        .iter()
        .filter(|s| s["is_processing"].as_bool() == Some(true))
        .count();
    let generations = app.generations.load(Ordering::Acquire);
    let waiting = generations.saturating_sub(running);
    let body = json!({
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "max_running_requests": slots.len(),
        }],
    });
    reply(StatusCode::OK, body.to_string())
}

/// An error reply in the OpenAI shape serve's own errors have.
fn unanswerable(status: StatusCode, kind: &str, message: &str) -> Response {
    reply(
        status,
        onebit_plugin_api::error_body(status.as_u16(), kind, message),
    )
}

/// A JSON reply.
fn reply(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
