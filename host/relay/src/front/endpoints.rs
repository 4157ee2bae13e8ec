//! serve's own routes (`/health`, `/v1/models` and `/models`, `/metrics`, and what a gateway asks
//! of a worker, `front::worker`) and the axum router that puts them beside the general engine's
//! relay, behind the browser guard.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Router, middleware};

use onebit_plugin_api::{Action, error_body};

use crate::App;
use crate::exchange::Record;
use crate::general::relay;
use crate::reply_loop::general::Relayed;
use crate::request_id::{self, RequestId};
use onebit_features::guard;
use onebit_metrics as metrics;
use onebit_metrics::requests::{Engine, PathClass};
use onebit_supervision::backends::health::Status;
use tracing::Instrument as _;

/// The router, apart from `main` so tests and benchmarks can build it.
pub fn router(app: Arc<App>) -> Router {
    let guard = app.settings.guard;
    let mut router = super::worker::routes(
        Router::new()
            .route("/health", get(health))
            .route("/v1/health", get(health)),
    );
    // A plan that relays the model list (llama-server's router mode, whose backend loads the
    // models it lists) gets its backend's; otherwise serve lists what it serves.
    let relayed = app
        .settings
        .rule_for("GET", "/v1/models")
        .is_some_and(|r| matches!(r.action, Action::Proxy { .. }));
    if !relayed {
        router = router
            .route("/v1/models", get(models))
            // llama-server's own name for the same list; `POST /models` and `DELETE /models`
            // go to the relay, which knows what the route does with them.
            .route("/models", get(models).fallback(relay));
    }
    if !app.metrics.backends.is_empty()
        || app
            .settings
            .rules
            .all()
            .iter()
            .any(|r| r.action == Action::InProcess)
    {
        // On every route that runs a child or answers in process.
        router = router.route("/metrics", get(scrape));
    }
    router
        .fallback(relay)
        .with_state(app.clone())
        // then the API key (after the guard: a foreign page learns nothing of it),
        .layer(middleware::from_fn_with_state(
            app.settings.api_key.clone(),
            guard::keyed,
        ))
        // then the user's CORS policy (a preflight is answered before the key, as llama-server does),
        .layer(middleware::from_fn_with_state(
            app.settings.cors.clone(),
            guard::cors_policy,
        ))
        // Every route, the fallback and 404s see the guard first,
        .layer(middleware::from_fn_with_state(
            (guard, app.settings.cors.clone()),
            guard::guard,
        ))
        // and every answer, refusals included, has its id and is counted and timed.
        .layer(middleware::from_fn_with_state(app, observed))
}

/// Each request of the general engine: its id (`relay::request_id`: in the request's
/// extensions for the relay, on its log lines through its span, on the reply), its count in
/// `onebit_requests_total` when its head is ready, under the engine the response names (an
/// in-process answer does) or `general`, and, when its reply body ends,
/// `onebit_request_duration_seconds` and its line (`ONEBIT_LOG=debug`): phase 8's
/// [`Record`], the same the fast engine's exchange keeps.
async fn observed(
    State(app): State<Arc<App>>,
    mut request: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    let began = std::time::Instant::now();
    let path = PathClass::of(request.uri().path());
    let id = RequestId::for_request(
        request
            .headers()
            .get_all(request_id::HEADER)
            .iter()
            .map(|v| v.as_bytes()),
    );
    request.extensions_mut().insert(id);
    let logged = Record::logged(request.method().as_str(), request.uri().path());
    let mut record = Record::new(&app, began, path, id, logged);
    let span = tracing::info_span!("request", request_id = %id);
    let mut response = next.run(request).instrument(span).await;
    let engine = response
        .extensions()
        .get::<Engine>()
        .copied()
        .unwrap_or(Engine::General);
    record.answered(response.status().as_u16(), engine);
    if let Some(relayed) = response.extensions().get::<Relayed>() {
        record.backend = Some(relayed.backend);
        record.added = relayed.added;
    }
    if let Ok(value) = HeaderValue::from_bytes(id.as_bytes()) {
        response.headers_mut().insert(request_id::HEADER, value);
    }
    response.map(|body| {
        axum::body::Body::new(EndedBody {
            inner: body,
            record,
        })
    })
}

/// A reply body that counts its bytes and carries its [`Record`], dropped with it (phase 8).
/// Its length and end are the inner body's, so hyper frames the reply as before (a whole reply
/// keeps its Content-Length).
struct EndedBody {
    inner: axum::body::Body,
    record: Record,
}

impl hyper::body::Body for EndedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.record.bytes += data.len() as u64;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A 503 health body: the OpenAI error body (`error_body`) with the specification's fields of
/// the health route beside it (`status`, and `reason` when the backend is down).
fn unavailable(fields: &[(&str, &str)], message: &str) -> String {
    let mut body: serde_json::Value =
        serde_json::from_str(&error_body(503, "unavailable_error", message)).unwrap_or_default();
    if let Some(object) = body.as_object_mut() {
        for (name, value) in fields {
            object.insert((*name).to_string(), serde_json::Value::from(*value));
        }
    }
    body.to_string()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    // Told to stop: a gateway's health check takes serve out of its rotation while the
    // requests in flight finish (`front::drain`).
    if app.traffic.draining() {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            unavailable(
                &[("status", "draining")],
                "1bit serve is stopping: it finishes the requests in flight; send new ones elsewhere",
            ),
        );
    }
    match app.status() {
        Status::Ready => json_response(StatusCode::OK, r#"{"status":"ok"}"#.to_string()),
        Status::Loading => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            unavailable(&[("status", "loading")], "Loading model"),
        ),
        Status::Down(reason) | Status::Failed(reason) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            unavailable(&[("status", "error"), ("reason", &reason)], &reason),
        ),
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let mut data = vec![serde_json::json!({
        "id": app.settings.served_name,
        "aliases": app.settings.aliases,
        "tags": app.settings.tags,
        "object": "model",
        "created": app.settings.created,
        "owned_by": "1bit",
        "device": app.settings.device,
    })];
    for side in &app.settings.side_models {
        data.push(serde_json::json!({
            "id": side.id,
            "object": "model",
            "created": app.settings.created,
            "owned_by": "1bit",
            "device": app.settings.device,
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

/// `GET /metrics`. File reads and the route's call run on blocking threads; the backend's
/// text is asked with a one-second limit and left out when it does not come.
pub async fn scrape(State(app): State<Arc<App>>) -> Response {
    if app.settings.metrics_off {
        // llama-server's answer without --metrics, word for word.
        return json_response(
            StatusCode::NOT_IMPLEMENTED,
            onebit_command::error::openai_error_body(
                StatusCode::NOT_IMPLEMENTED,
                "not_supported_error",
                "This server does not support metrics endpoint. Start it with `--metrics`",
            ),
        );
    }
    let sources = &app.metrics;
    let (state, root) = (sources.state.clone(), sources.sysfs_root.clone());
    let own = tokio::task::spawn_blocking(move || {
        (state.map(|s| s.counts()), metrics::read_machine(&root))
    });
    let route = app.route.route.clone();
    let route_text = tokio::task::spawn_blocking(move || route.metrics());
    let mut backend_texts = Vec::new();
    let mut relayed_headers = Vec::new();
    for (port, path) in &sources.backends {
        if let Some(path) = path {
            let reply = metrics::backend_reply(&app.probes, *port, path).await;
            if let Some((text, headers)) = reply {
                // The first backend's own reply headers (llama-server's
                // Process-Start-Time-Unix), as a scrape of llama-server itself gets them.
                if relayed_headers.is_empty() {
                    relayed_headers =
                        relayed_metrics_headers(&headers, app.settings.cors.is_some());
                }
                backend_texts.push(Some(text));
            }
        }
    }
    let (counts, machine) = own.await.unwrap_or_default();
    let mut body = metrics::render_own(
        (app.metrics.route_label, &app.settings.device),
        app.status() == Status::Ready,
        counts.as_ref(),
        &machine,
        &app.metrics.counters,
    );
    metrics::append(
        &mut body,
        &app.requests
            .render(app.traffic.in_flight(), app.traffic.spin_pauses()),
    );
    match route_text.await {
        Ok(Ok(text)) => metrics::append(&mut body, &text),
        Ok(Err(e)) => {
            let _ = writeln!(
                body,
                "# the {} route's metrics failed: {e}",
                app.settings.device
            );
        }
        Err(_) => {}
    }
    metrics::append(&mut body, &app.rpc_workers.render());
    if let Some(cache) = &app.prompt_cache {
        metrics::append(&mut body, &cache.render());
    }
    for text in backend_texts.into_iter().flatten() {
        metrics::append(&mut body, &text);
    }
    let mut response = (StatusCode::OK, body).into_response();
    for (name, value) in relayed_headers {
        response.headers_mut().insert(name, value);
    }
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(metrics::CONTENT_TYPE),
    );
    response
}

/// The headers of a backend's `/metrics` reply a client of llama-server would see: all but
/// framing, hop-by-hop, the content type (serve's text has its own) and what `plan::passes`
/// keeps from clients (CORS without a policy).
fn relayed_metrics_headers(
    headers: &axum::http::HeaderMap,
    cors: bool,
) -> Vec<(axum::http::HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            crate::plan::passes(crate::plan::Direction::Reply { cors }, name, &[])
                && !["content-type", "content-length", "date", "server"].contains(&name)
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::unavailable;

    #[test]
    fn a_503_health_body_is_the_error_body_with_the_status_and_reason_beside_it() {
        let body: serde_json::Value = serde_json::from_str(&unavailable(
            &[("status", "error"), ("reason", "llama-server exited")],
            "llama-server exited",
        ))
        .unwrap();
        assert_eq!(body["status"], "error");
        assert_eq!(body["reason"], "llama-server exited");
        assert_eq!(body["error"]["code"], 503);
        assert_eq!(body["error"]["type"], "unavailable_error");
        assert_eq!(body["error"]["message"], "llama-server exited");
        let loading: serde_json::Value =
            serde_json::from_str(&unavailable(&[("status", "loading")], "Loading model")).unwrap();
        assert_eq!(loading["status"], "loading");
        assert_eq!(loading["error"]["message"], "Loading model");
        assert!(loading.get("reason").is_none());
    }
}
