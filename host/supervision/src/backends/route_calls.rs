//! Calls into the chosen route from async code, and the host services a route may use.

use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use onebit_plugin_api::loader::{HostBackend, LoadedRoute, host_api};
use onebit_plugin_api::{BackendReply, BackendRequest, Forward, ForwardRequest};

use crate::backends::health::ProbeClient as BackendClient;

/// The chosen route, shared by the handlers.
#[derive(Clone, Debug)]
pub struct RouteCalls {
    pub route: LoadedRoute,
}

impl RouteCalls {
    /// [`onebit_plugin_api::DeviceRoute::forward`]; blocks, so call it on a blocking thread.
    pub fn forward(&self, request: &ForwardRequest) -> Result<Forward, String> {
        self.route.forward(request, host_api::<Host>())
    }
}

/// What a route's blocking calls into the host need: the runtime, the client, the backends.
struct HostContext {
    runtime: tokio::runtime::Handle,
    client: BackendClient,
    ports: Vec<u16>,
}

/// A static because the ABI makes it one: a route calls the host's services through a plain
/// function (`HostBackend::backend_request`, an `extern "C"` entry with no context argument),
/// so what that call needs is found here, set once when the backends are known.
static HOST: OnceLock<HostContext> = OnceLock::new();

/// Make the host services available to the route (once, when the backends are known).
pub fn install_host_services(
    runtime: tokio::runtime::Handle,
    client: BackendClient,
    ports: Vec<u16>,
) {
    let _ = HOST.set(HostContext {
        runtime,
        client,
        ports,
    });
}

/// The host services, as the plugin API calls them.
struct Host;

impl HostBackend for Host {
    fn backend_request(request: &BackendRequest) -> Result<BackendReply, String> {
        send(request)
    }
}

fn send(request: &BackendRequest) -> Result<BackendReply, String> {
    let host = HOST.get().ok_or("the backends are not running yet")?;
    let port = *host
        .ports
        .get(request.backend)
        .ok_or_else(|| format!("there is no backend {}", request.backend))?;
    let uri = format!("http://127.0.0.1:{port}{}", request.path);
    let body = request.body.clone().map(Bytes::from).unwrap_or_default();
    let http = hyper::Request::builder()
        .method(request.method.as_str())
        .uri(uri)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("bad backend request: {e}"))?;
    let timeout = match request.timeout_ms {
        0 => Duration::from_secs(30),
        ms => Duration::from_millis(ms),
    };
    let client = host.client.clone();
    host.runtime.block_on(async move {
        let call = async {
            let reply = client.request(http).await.map_err(|e| e.to_string())?;
            let status = reply.status().as_u16();
            let bytes = reply
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok(BackendReply {
                status,
                body: String::from_utf8_lossy(&bytes).into_owned(),
            })
        };
        tokio::time::timeout(timeout, call).await.map_err(|_| {
            format!(
                "the backend did not answer within {} ms",
                timeout.as_millis()
            )
        })?
    })
}
