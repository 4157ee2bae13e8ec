//! The host's errors: how serve exits when it cannot go on, and the OpenAI-shaped replies a
//! client gets when a request cannot be served.

use std::fmt;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// serve's exit statuses, as the specification fixes them.
pub mod exit {
    /// Stopped cleanly.
    pub const OK: i32 = 0;
    /// A backend failed or hung.
    pub const BACKEND: i32 = 1;
    /// Bad usage.
    pub const USAGE: i32 = 2;
    /// The model does not fit.
    pub const NO_FIT: i32 = 3;
    /// `--print-backend` on a route that needs serve in the request path.
    pub const NEEDS_SERVE: i32 = 5;
}

/// Why serve stops: a one-line message (without the `1bit serve: ` prefix) and the exit status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal {
    pub code: i32,
    pub message: String,
}

impl Fatal {
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            code: exit::USAGE,
            message: message.into(),
        }
    }

    pub fn backend(message: impl Into<String>) -> Self {
        Self {
            code: exit::BACKEND,
            message: message.into(),
        }
    }
}

impl fmt::Display for Fatal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A request that serve answers itself with an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiError {
    /// The body is not a JSON object.
    BadJson(String),
    /// The body broke off before its end (the client's connection failed while sending it).
    BodyBroken(String),
    /// The request's path and query cannot be sent on to the backend.
    BadPath(String),
    /// The body is larger than the limit.
    TooLarge { limit: usize },
    /// A body with a Content-Type serve does not read as JSON.
    BadContentType(String),
    /// A route that takes a multipart upload got another Content-Type (empty: none).
    NotMultipart(String),
    /// The client sent its body too slowly.
    BodyTimeout { after: std::time::Duration },
    /// serve has an API key and the request sent none.
    NoKey,
    /// serve has an API key and the request sent another.
    WrongKey,
    /// More than one Host header (RFC 9112 3.2).
    SeveralHosts { count: usize },
    /// The guard: on a loopback bind, a Host header that does not name loopback (DNS rebinding).
    ForeignHost { host: String },
    /// The guard: a write whose Origin is neither loopback nor this server (a web page).
    CrossSite { origin: String },
    /// No route for this method and path.
    NotFound { method: String, path: String },
    /// The model is still loading, or its backend is down.
    Unavailable(String),
    /// Every place of `--max-generations` is taken: retry shortly, or elsewhere.
    Saturated { limit: usize },
    /// The backend did not answer.
    BadGateway(String),
    /// A route that answers in process failed before its reply's head (its own words).
    RouteFailed(String),
    /// The generation was still running when `--max-generation-s` ran out.
    GenerationDeadline { after: std::time::Duration },
}

impl ApiError {
    /// The error of a request that reached no answer from the backend; its 502 says "see
    /// serve's log", so the log gets the line (a warning: the client saw a failure).
    pub fn no_answer(device: &str, why: &str) -> ApiError {
        tracing::warn!("1bit serve: 502: the {device} backend did not answer ({why})");
        ApiError::BadGateway(format!(
            "the {device} backend did not answer ({why}); see serve's log"
        ))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadJson(_)
            | ApiError::BodyBroken(_)
            | ApiError::BadPath(_)
            | ApiError::SeveralHosts { .. } => StatusCode::BAD_REQUEST,
            ApiError::NoKey | ApiError::WrongKey => StatusCode::UNAUTHORIZED,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BadContentType(_) | ApiError::NotMultipart(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::ForeignHost { .. } | ApiError::CrossSite { .. } => StatusCode::FORBIDDEN,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Unavailable(_) | ApiError::Saturated { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::RouteFailed(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::GenerationDeadline { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The OpenAI error type.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::BadJson(_)
            | ApiError::BodyBroken(_)
            | ApiError::BadPath(_)
            | ApiError::SeveralHosts { .. }
            | ApiError::TooLarge { .. }
            | ApiError::BadContentType(_)
            | ApiError::NotMultipart(_)
            | ApiError::BodyTimeout { .. } => "invalid_request_error",
            ApiError::ForeignHost { .. } | ApiError::CrossSite { .. } => "permission_error",
            // llama-server's and Anthropic's type for a missing or wrong key.
            ApiError::NoKey | ApiError::WrongKey => "authentication_error",
            ApiError::NotFound { .. } => "not_found_error",
            ApiError::Unavailable(_) | ApiError::Saturated { .. } => "unavailable_error",
            ApiError::BadGateway(_)
            | ApiError::RouteFailed(_)
            | ApiError::GenerationDeadline { .. } => "server_error",
        }
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::BadJson(why) => {
                format!("the request body is not a JSON object ({why}); send a JSON object")
            }
            ApiError::BodyBroken(why) => {
                format!("the request body broke off before its end ({why}); send it again")
            }
            ApiError::BadPath(why) => format!(
                "the request path cannot be passed on ({why}); send a path of plain URL characters"
            ),
            ApiError::TooLarge { limit } => format!(
                "the request body is larger than {limit} bytes; send less, or raise ONEBIT_MAX_BODY_BYTES"
            ),
            ApiError::BadContentType(ct) => format!(
                "the request body is sent as {ct:?}, not JSON; send it with Content-Type: application/json"
            ),
            ApiError::NotMultipart(ct) if ct.is_empty() => "the request body has no Content-Type; send the file as multipart/form-data (curl -F file=@audio.wav)".to_string(),
            ApiError::NotMultipart(ct) => format!(
                "the request body is sent as {ct:?}, not as a multipart/form-data upload; send the file as multipart/form-data (curl -F file=@audio.wav)"
            ),
            ApiError::BodyTimeout { after } => format!(
                "the request body did not arrive within {} s; send it at once, or raise ONEBIT_BODY_READ_TIMEOUT_S",
                after.as_secs_f64()
            ),
            ApiError::NoKey => "no API key was sent; send it in an Authorization header as Bearer auth (Authorization: Bearer YOUR_KEY), the key serve was started with (--api-key)".to_string(),
            ApiError::WrongKey => "the API key sent is not serve's; send the key serve was started with (--api-key) as Authorization: Bearer YOUR_KEY".to_string(),
            ApiError::SeveralHosts { count } => format!(
                "the request has {count} Host headers; send exactly one (RFC 9112, section 3.2)"
            ),
            ApiError::ForeignHost { host } => format!(
                "the Host header does not name this server (Host: {host:?}); call it as localhost or 127.0.0.1, or bind --host 0.0.0.0 to serve other names"
            ),
            ApiError::CrossSite { origin } => format!(
                "cross-site requests are not allowed (Origin: {origin:?}); call the API from a program or from a page served by this host, not from another site"
            ),
            ApiError::NotFound { method, path } => {
                format!("{method} {path} is not served here")
            }
            ApiError::Saturated { limit } => format!(
                "serve has {limit} generations in flight, its limit (--max-generations {limit}); retry in a moment, or send it to another server"
            ),
            ApiError::GenerationDeadline { after } => format!(
                "the generation was still running after {} s, serve's limit (--max-generation-s); ask for fewer tokens, or raise the limit",
                after.as_secs()
            ),
            ApiError::Unavailable(why) | ApiError::BadGateway(why) | ApiError::RouteFailed(why) => {
                why.clone()
            }
        }
    }
}

/// The body of [`openai_error`].
pub fn openai_error_body(status: StatusCode, error_type: &str, message: &str) -> String {
    onebit_plugin_api::error_body(status.as_u16(), error_type, message)
}

/// `{"error":{"message","type","code"}}` with the given status.
pub fn openai_error(status: StatusCode, error_type: &str, message: &str) -> Response {
    let body = openai_error_body(status, error_type, message);
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = openai_error(self.status(), self.error_type(), &self.message());
        if matches!(self, ApiError::Saturated { .. }) {
            // A client or a gateway waits a second, or sends it to another server.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// An error and each of its sources, joined by ": " (hyper's own message says little without
/// its source). Called wherever a client error becomes a line or a reply.
pub fn error_chain(e: &dyn std::error::Error) -> String {
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
    fn errors_map_once_to_status_and_type() {
        let e = ApiError::BadJson("expected value at line 1 column 1".into());
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.error_type(), "invalid_request_error");
        assert_eq!(
            ApiError::BadGateway("x".into()).status(),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(ApiError::TooLarge { limit: 1 }.status().as_u16(), 413);
        let e = ApiError::ForeignHost {
            host: "evil.example".into(),
        };
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        assert!(
            e.message()
                .starts_with("the Host header does not name this server")
        );
        let e = ApiError::CrossSite {
            origin: "null".into(),
        };
        assert_eq!(e.error_type(), "permission_error");
        assert!(
            e.message()
                .starts_with("cross-site requests are not allowed")
        );
    }
}
