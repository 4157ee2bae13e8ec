//! Who may call serve, judged before routing. The browser guard refuses the requests a web page
//! could make to a local serve (DNS rebinding through the Host header, cross-site writes
//! through Origin) and a request naming its host twice; the API key (`key`, with `--api-key`)
//! keeps out callers without it.
//!
//! The rules are in `docs/security.md` and in [`rules`], a pure function the fuzz target and
//! the unit tests call directly; this file is the axum middleware around both. The relay's crate
//! is above this one: both relay engines call [`check`] and the key themselves.

pub mod cors;
pub mod key;
mod rules;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

pub use rules::{Guard, Refusal, Seen};

use onebit_command::error::ApiError;

impl From<key::KeyRefusal> for ApiError {
    fn from(r: key::KeyRefusal) -> ApiError {
        match r {
            key::KeyRefusal::Missing => ApiError::NoKey,
            key::KeyRefusal::Wrong => ApiError::WrongKey,
        }
    }
}

/// The axum middleware of the API key, inside the guard: every request but `/health` and
/// those already [`GuardPassed`] must carry serve's key. Runs on the connection's task.
pub async fn keyed(
    State(key): State<Option<key::ApiKey>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &key
        && request.extensions().get::<GuardPassed>().is_none()
        && !key::open_path(request.uri().path())
        && let Err(refusal) = key.admits(
            one_value(request.headers(), header::AUTHORIZATION),
            one_value(request.headers(), X_API_KEY),
        )
    {
        return ApiError::from(refusal).into_response();
    }
    next.run(request).await
}

/// `X-Api-Key`, the header Anthropic's clients carry their key in (llama-server reads it too).
pub const X_API_KEY: &str = "x-api-key";

/// The one value of a key header (`Authorization`, `X-Api-Key`); two of them count as a wrong
/// key, as on the fast engine.
fn one_value(headers: &HeaderMap, name: impl header::AsHeaderName) -> Option<&[u8]> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(one), None) => Some(one.as_bytes()),
        (Some(_), Some(_)) => Some(b""),
        _ => None,
    }
}

/// Decide one request: the rules (`rules::check`), with the Origins the user's CORS policy
/// allows (`--cors-origins`) set aside, so a write from an origin the user named passes as a
/// loopback one does. Both relay engines call it on the connection's task; no allocation
/// without a policy.
pub fn check(guard: Guard, cors: Option<&cors::Cors>, seen: &Seen<'_>) -> Result<(), Refusal> {
    let verdict = rules::check(guard, seen);
    match (verdict, cors) {
        (Err(Refusal::CrossSite(_)), Some(policy)) => {
            let foreign: Vec<&[u8]> = seen
                .origins
                .iter()
                .copied()
                .filter(|o| !policy.allows(o))
                .collect();
            rules::check(
                guard,
                &Seen {
                    origins: &foreign,
                    ..*seen
                },
            )
        }
        (verdict, _) => verdict,
    }
}

/// The axum middleware of the user's CORS policy, between the guard and the key (a browser's
/// preflight carries no key): with a policy, an `OPTIONS` request is answered here as
/// llama-server answers it (200, empty, the `Access-Control-*` headers), and every other answer
/// gets `Access-Control-Allow-Origin` when it has none (serve's own routes; a relayed reply
/// carries its backend's, which has the same flags). Without one it does nothing. Runs on the
/// connection's task.
pub async fn cors_policy(
    State(policy): State<Option<Arc<cors::Cors>>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(policy) = policy else {
        return next.run(request).await;
    };
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let allow_origin = policy
        .allow_origin(origin.as_deref())
        .and_then(|v| header::HeaderValue::from_str(&v).ok());
    let mut response = if request.method() == Method::OPTIONS {
        let mut preflight = ([(header::CONTENT_TYPE, "text/html")], String::new()).into_response();
        for (name, value) in policy.preflight() {
            if let Ok(value) = header::HeaderValue::from_str(&value) {
                preflight.headers_mut().insert(name, value);
            }
        }
        preflight
    } else {
        next.run(request).await
    };
    if let Some(value) = allow_origin {
        response
            .headers_mut()
            .entry(header::ACCESS_CONTROL_ALLOW_ORIGIN)
            .or_insert(value);
    }
    response
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        match r {
            Refusal::SeveralHosts(count) => ApiError::SeveralHosts { count },
            Refusal::ForeignHost(host) => ApiError::ForeignHost { host },
            Refusal::CrossSite(origin) => ApiError::CrossSite { origin },
        }
    }
}

/// Marks a request [`check`] (and the API key, when serve has one) already passed: the fast
/// engine judged it before handing it to the general engine, so the middleware does not
/// judge it again.
#[derive(Clone, Copy, Debug)]
pub struct GuardPassed;

/// The axum middleware: [`check`] on every request not already [`GuardPassed`], before routing.
/// Runs on the connection's task; never blocks.
pub async fn guard(
    State((guard, cors)): State<(Guard, Option<Arc<cors::Cors>>)>,
    request: Request,
    next: Next,
) -> Response {
    if request.extensions().get::<GuardPassed>().is_some() {
        return next.run(request).await;
    }
    let verdict = verdict(
        (guard, cors.as_deref()),
        request.method(),
        request.uri(),
        request.headers(),
    );
    match verdict {
        Ok(()) => next.run(request).await,
        Err(refusal) => ApiError::from(refusal).into_response(),
    }
}

fn verdict(
    (guard, cors): (Guard, Option<&cors::Cors>),
    method: &Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
) -> Result<(), Refusal> {
    // Every value, however many: the rules refuse a second Host and judge each Origin. Few
    // headers: a small array on the stack, no allocation on the accepted path.
    let mut hosts: [&[u8]; 2] = [b""; 2];
    let mut n_hosts = 0;
    for value in headers.get_all(header::HOST) {
        if n_hosts == hosts.len() {
            return Err(Refusal::SeveralHosts(
                headers.get_all(header::HOST).iter().count(),
            ));
        }
        hosts[n_hosts] = value.as_bytes();
        n_hosts += 1;
    }
    let origins: Vec<&[u8]> = headers
        .get_all(header::ORIGIN)
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    check(
        guard,
        cors,
        &Seen {
            method: method.as_str().as_bytes(),
            hosts: &hosts[..n_hosts],
            authority: uri.authority().map(|a| a.as_str().as_bytes()),
            origins: &origins,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz corpus as a regression suite on stable: every input keeps the fuzz invariants and
    /// gets the verdict its name says.
    #[test]
    fn the_fuzz_corpus_is_decided_as_its_names_say() {
        // Each corpus file's verdict, by name: the fuzz invariants hold for all, and these
        // named cases keep their answers.
        let accepted = [
            "lan-post-own-origin",
            "loop-get-localhost",
            "loop-options-foreign",
            "loop-post-loopback-origin",
            "loop-v6-full",
        ];
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/guard");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("the corpus directory exists") {
            let path = entry.expect("a corpus entry").path();
            let data = std::fs::read(&path).expect("readable");
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let verdict = rules::fuzz_one(&data);
            assert_eq!(
                verdict.is_ok(),
                accepted.contains(&name.as_str()),
                "{name}: {verdict:?}"
            );
            seen += 1;
        }
        assert!(seen >= 10, "only {seen} corpus files in {}", dir.display());
    }
}
