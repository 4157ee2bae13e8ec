//! Who may call serve, judged before routing. The browser guard refuses the requests a web page
//! could make to a local serve (DNS rebinding through the Host header, cross-site writes
//! through Origin) and a request naming its host twice; the API key (`key`, with `--api-key`)
//! keeps out callers without it.
//!
//! The rules are in `docs/security.md` and in [`rules`], a pure function the fuzz target and
//! the unit tests call directly; this file is the axum middleware around both. This room sits
//! below the relay: both relay engines call [`check`] and the key themselves.

pub mod key;
mod rules;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

pub use rules::{Guard, Refusal, Seen, check};

use crate::error::ApiError;

impl From<key::KeyRefusal> for ApiError {
    fn from(r: key::KeyRefusal) -> ApiError {
        match r {
            key::KeyRefusal::Missing => ApiError::NoKey,
            key::KeyRefusal::Wrong => ApiError::WrongKey,
        }
    }
}

/// The axum middleware of the API key, inside the guard: every request but `/health` and
/// those already [`Judged`] must carry serve's key. Runs on the connection's task.
pub async fn keyed(
    State(key): State<Option<key::ApiKey>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &key
        && request.extensions().get::<Judged>().is_none()
        && !key::open_path(request.uri().path())
        && let Err(refusal) = key.admits(authorization(request.headers()))
    {
        return ApiError::from(refusal).into_response();
    }
    next.run(request).await
}

/// The one `Authorization` value of a request; two of them count as a wrong key, as on the
/// fast engine.
fn authorization(headers: &HeaderMap) -> Option<&[u8]> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    match (values.next(), values.next()) {
        (Some(one), None) => Some(one.as_bytes()),
        (Some(_), Some(_)) => Some(b""),
        _ => None,
    }
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
pub struct Judged;

/// The axum middleware: [`check`] on every request not already [`Judged`], before routing.
/// Runs on the connection's task; never blocks.
pub async fn guard(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    if request.extensions().get::<Judged>().is_some() {
        return next.run(request).await;
    }
    let verdict = verdict(guard, request.method(), request.uri(), request.headers());
    match verdict {
        Ok(()) => next.run(request).await,
        Err(refusal) => ApiError::from(refusal).into_response(),
    }
}

fn verdict(
    guard: Guard,
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
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/guard");
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
