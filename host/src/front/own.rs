//! serve's own routes (`/health`, `/v1/models` and `/models`, `/metrics`) and the axum router that puts
//! them beside the general engine's relay, behind the browser guard.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Router, middleware};

use onebit_plugin_api::Action;

use crate::backends::health::Status;
use crate::guard;
use crate::metrics;
use crate::metrics::requests::{Engine, PathClass};
use crate::relay::App;
use crate::relay::general::relay;

/// The router, apart from `main` so tests and benchmarks can build it.
pub fn router(app: Arc<App>) -> Router {
    let guard = app.guard;
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        // llama-server's own name for the same list.
        .route("/models", get(models));
    if !app.metrics.backends.is_empty() || app.rules.iter().any(|r| r.action == Action::InProcess) {
        // On every route that runs a child or answers in process.
        router = router.route("/metrics", get(scrape));
    }
    router
        .fallback(relay)
        .with_state(app.clone())
        // then the API key (after the guard: a foreign page learns nothing of it),
        .layer(middleware::from_fn_with_state(
            app.api_key.clone(),
            guard::keyed,
        ))
        // Every route, the fallback and 404s see the guard first,
        .layer(middleware::from_fn_with_state(guard, guard::guard))
        // and every answer, refusals included, is counted.
        .layer(middleware::from_fn_with_state(app, counted))
}

/// Count each answer of the general engine in `onebit_requests_total` when its head is
/// ready, under the engine the response names (an in-process answer does) or `general`.
async fn counted(
    State(app): State<Arc<App>>,
    request: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    let path = PathClass::of(request.uri().path());
    let response = next.run(request).await;
    let engine = response
        .extensions()
        .get::<Engine>()
        .copied()
        .unwrap_or(Engine::General);
    app.requests.count(path, response.status().as_u16(), engine);
    response
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

/// `GET /metrics`. File reads and the route's call run on blocking threads; the backend's
/// text is asked with a one-second limit and left out when it does not come.
pub async fn scrape(State(app): State<Arc<App>>) -> Response {
    let sources = &app.metrics;
    let (state, root) = (sources.state.clone(), sources.sysfs_root.clone());
    let own = tokio::task::spawn_blocking(move || {
        (state.map(|s| s.counts()), metrics::read_machine(&root))
    });
    let route = app.route.route.clone();
    let route_text = tokio::task::spawn_blocking(move || route.metrics());
    let mut backend_texts = Vec::new();
    for (port, path) in &sources.backends {
        if let Some(path) = path {
            backend_texts.push(metrics::backend_text(&app.probes, *port, path).await);
        }
    }
    let (counts, machine) = own.await.unwrap_or_default();
    let mut body = metrics::render_own(
        &app.device,
        app.status() == Status::Ready,
        counts.as_ref(),
        &machine,
    );
    metrics::append(&mut body, &app.requests.render());
    match route_text.await {
        Ok(Ok(text)) => metrics::append(&mut body, &text),
        Ok(Err(e)) => {
            let _ = writeln!(body, "# the {} route's metrics failed: {e}", app.device);
        }
        Err(_) => {}
    }
    metrics::append(&mut body, &crate::rpc::watch::render());
    for text in backend_texts.into_iter().flatten() {
        metrics::append(&mut body, &text);
    }
    let mut response = (StatusCode::OK, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(metrics::CONTENT_TYPE),
    );
    response
}
