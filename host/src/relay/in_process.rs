//! The seam for in-process routes ([`Target::InProcess`]): a request the route answers in
//! serve's own process rather than over a socket. No route table names one in this build;
//! the general engine dispatches the target here, so an in-process route is wired in this
//! one function.

use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::error::ApiError;
use crate::relay::App;
use crate::relay::plan::{Engine, RelayPlan, Target};

/// Answer a request whose plan targets an in-process route. Called by the general engine on
/// the connection's task; a route's blocking work belongs on a blocking thread.
pub async fn respond(
    app: &App,
    plan: &RelayPlan,
    parts: axum::http::request::Parts,
    _body: Bytes,
) -> Response {
    debug_assert_eq!(plan.target, Target::InProcess);
    let mut response = ApiError::BadGateway(format!(
        "the {} route named an in-process answer for {} {}, which this build does not have",
        app.device,
        parts.method,
        parts.uri.path()
    ))
    .into_response();
    // `onebit_requests_total` counts it under its own engine.
    response.extensions_mut().insert(Engine::InProcess);
    response
}
