//! What crosses the boundary once serve runs: `start`'s input, the health probe and verdict,
//! a backend's stderr line and its verdict, and a request forwarded to the route and the
//! route's calls to its backends. Carried as JSON, like every type of `types`.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::types::Plan;

/// What the host passes to [`crate::DeviceRoute::start`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Started {
    /// The plan the host started.
    pub plan: Plan,
    /// The process id of each backend, in the plan's order.
    pub pids: Vec<u32>,
}

/// What the host's probes of the backends found, for [`crate::DeviceRoute::health`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HealthProbe {
    /// One entry per backend, in the plan's order.
    pub backends: Vec<BackendHealth>,
}

/// One backend's state as the host sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendHealth {
    /// It is running and answered its health route in time.
    pub ok: bool,
    /// Why not, when not ok.
    pub reason: String,
}

/// The route's verdict on health.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Health {
    /// The model is served: `/health` answers 200.
    pub ok: bool,
    /// Why not, when not ok; shown in `/health`'s body.
    pub reason: String,
}

impl Health {
    /// Healthy when every backend is; else the first backend's reason.
    pub fn from_probe(probe: &HealthProbe) -> Self {
        match probe.backends.iter().find(|b| !b.ok) {
            None => Health {
                ok: true,
                reason: String::new(),
            },
            Some(bad) => Health {
                ok: false,
                reason: bad.reason.clone(),
            },
        }
    }
}

/// One line a backend printed on stderr.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendLine {
    /// Which backend, by its index in the plan.
    pub backend: usize,
    /// The line as the backend printed it, without its newline.
    pub line: String,
}

/// What the host should do about a backend's line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LineVerdict {
    /// Lines serve prints on its stderr (without the `1bit serve: ` prefix).
    pub say: Vec<String>,
    /// Stop serve with status 1 for this reason (a lost GPU, a strict-placement abort).
    pub stop: Option<String>,
}

/// One request, as the route sees it in [`crate::DeviceRoute::forward`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ForwardRequest {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query, without its `?` (empty when there was none).
    pub query: String,
    /// The JSON body as text.
    pub body: String,
}

/// The route's decision for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Forward {
    /// Relay it to a backend, with this body instead of the client's when given.
    Proxy {
        /// The backend's index in the plan.
        backend: usize,
        /// The body to send instead of the client's.
        #[serde(default)]
        body: Option<String>,
        /// A line serve prints on stderr when the reply's first byte arrives, with
        /// `{first_byte_ms}` replaced by the milliseconds since serve asked the route.
        #[serde(default)]
        first_byte_line: Option<String>,
    },
    /// Answer it directly.
    Answer {
        /// The HTTP status.
        status: u16,
        /// The reply's `Content-Type`.
        content_type: String,
        /// The reply's body.
        body: String,
    },
}

/// A request the route asks the host to send to a backend (during `forward`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendRequest {
    /// The backend's index in the plan.
    pub backend: usize,
    /// `GET`, `POST`, ...
    pub method: String,
    /// Path and query.
    pub path: String,
    /// The JSON body, when there is one.
    pub body: Option<String>,
    /// Give up after this long; 0 means the host's default (30 s).
    pub timeout_ms: u64,
}

/// A backend's whole reply.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendReply {
    /// The HTTP status (a backend that does not answer is an error, not a reply).
    pub status: u16,
    /// The reply's body.
    pub body: String,
}
