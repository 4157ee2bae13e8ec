//! The DeviceRoute ABI of 1bit serve: what a device route implements and how the host loads it.
//!
//! A route is a `cdylib` that implements [`DeviceRoute`] and exports it with [`export_route!`].
//! The host finds route files at run time, checks their ABI version (semver: same major, the
//! route's minor not newer than the host's) and abi_stable's layout check before it calls
//! anything, and then talks to the route through [`RouteModRef`].
//!
//! Every value that crosses the boundary is JSON text in an `RString`, described by the serde
//! types in [`types`]. New optional fields are added with `#[serde(default)]`, so a route built
//! against an older minor still reads and writes what a newer host expects. New operations are
//! appended to [`RouteMod`] after its last prefix field (a minor bump), so an older route simply
//! lacks them and the host falls back to the documented default.
//!
//! `unsafe` is allowed in this crate only where abi_stable needs it (this root, whose derives
//! write unsafe accessors, [`export`], `loader`, `legacy`); [`types`] forbids it.
//!
//! This crate is the ABI and nothing else. The one way the host, a route and a program they
//! start start a process (it dies with its starter) is the crate onebit-process, linked as
//! ordinary Rust code: its changes bump no ABI version.

// abi_stable's derives and macros for the root module below write unsafe code.
#![allow(unsafe_code)]

pub mod calls;
pub mod rules;
pub mod types;

#[cfg(feature = "host")]
pub mod loader;

#[cfg(feature = "host")]
mod legacy;

#[doc(hidden)]
pub mod export;

use std::ffi::c_void;

use abi_stable::{
    StableAbi, declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{RResult, RSlice, RStr, RString},
};

pub use calls::*;
pub use rules::*;
pub use types::*;

/// This crate's version, which is the ABI version a route built against it reports.
pub const ABI_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What a device route does. The host calls each method as documented; a route keeps whatever
/// state it needs behind `&self` (one instance per process, created on first use with
/// `Default`).
///
/// Every method runs on a plain OS thread owned by the host, never on an async executor
/// thread, so a method may block; the per-method notes say how long it should take.
/// A panic inside a method is caught at the boundary and reported as an error.
pub trait DeviceRoute: Default + Send + Sync + 'static {
    /// Who the route is. Called once when the host loads the route (`1bit plugins` too).
    /// Must not block.
    fn info(&self) -> RouteInfo;

    /// How strongly the route claims the model for `--device auto` (0 = not at all).
    /// Called once per route before planning, with the same request `plan` would get.
    /// Pure and quick: read the request, look at files, but start nothing.
    fn claim(&self, request: &PlanRequest) -> Claim {
        let _ = request;
        Claim::none()
    }

    /// What to run for this model and these options, or why not.
    /// Called once before anything starts, and alone for `--print-backend` and `--mem-check`.
    /// Pure: the same request gives the same plan; it starts nothing and writes nothing.
    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal>;

    /// Route-specific start-up, after the host spawned the plan's backends and saw them ready.
    /// May block (the NPU route loads its kernels here). An error ends serve with status 1.
    fn start(&self, started: &Started) -> Result<(), RouteError> {
        let _ = started;
        Ok(())
    }

    /// The route's view of its health, given what the host's probes of the backends found.
    /// Called by the host's health monitor on a blocking thread, up to four times a second.
    /// Must not block.
    fn health(&self, probe: &HealthProbe) -> Health {
        Health::from_probe(probe)
    }

    /// One line a backend printed on stderr (without its newline), in order, per backend.
    /// Called on the host's stderr reader thread for that backend; keep it quick. Return a
    /// verdict to print a line of serve's own or to stop serve (a lost GPU, say).
    fn on_backend_line(&self, line: &BackendLine) -> LineVerdict {
        let _ = line;
        LineVerdict::default()
    }

    /// Decide what to do with one request. Called only for requests whose rule's action is
    /// [`Action::AskRoute`], on a blocking thread, once per matching request; it may take as long as the request's
    /// own work (a prefill, say) and may call the backends through `host`.
    fn forward(&self, request: &ForwardRequest, host: &dyn HostServices) -> Forward {
        let _ = (request, host);
        Forward::Proxy {
            backend: 0,
            body: None,
            first_byte_line: None,
        }
    }

    /// The route's own Prometheus series, as exposition text the host appends to serve's own.
    /// Called by `GET /metrics` on a blocking thread; must not block for long.
    fn metrics(&self) -> String {
        String::new()
    }

    /// Answer one request in process (ABI 1.2): called only for a rule whose action is
    /// [`Action::InProcess`], on a blocking thread the host owns for this request, after the
    /// host applied the guard, the body limits and the JSON checks. Send the reply through
    /// `sink`: [`ReplySink::send_head`] once, then [`ReplySink::send`] as often as needed
    /// (it blocks while the client reads slowly, and fails once the client is gone: stop
    /// then), then [`ReplySink::end`] (or just return). May take as long as the reply.
    /// Between long steps that send nothing (a prefill), ask [`ReplySink::client_gone`]
    /// (1.5) and stop when it is true.
    ///
    /// The host calls `respond` concurrently: once per request, each call on a thread of its
    /// own, so calls for different requests overlap and the route serializes what it cannot
    /// share.
    ///
    /// An error (or a panic) before the head becomes a 500 naming it; after the head, the
    /// stream is cut off. Default: a 501 saying the route does not answer in process, which is
    /// also what the host answers for a route built before 1.2.
    fn respond(
        &self,
        request: &ForwardRequest,
        sink: &mut dyn ReplySink,
    ) -> Result<(), RouteError> {
        let _ = request;
        sink.send_head(501, "application/json")
            .and_then(|()| sink.send(NOT_IN_PROCESS.as_bytes()))
            .map_err(|e| RouteError::new(e.message))
    }
}

/// The OpenAI-shaped error body, `{"error":{"code","message","type"}}`, that serve answers
/// with and a route's own refusals should use (an [`Action::Answer`] rule's body, a `respond`
/// that refuses a request): `code` is the HTTP status, `error_type` OpenAI's (or llama-server's)
/// type such as `invalid_request_error` or `not_supported_error`, `message` one line saying what
/// was wrong and what to do instead. Pure; any thread.
pub fn error_body(code: u16, error_type: &str, message: &str) -> String {
    serde_json::json!({"error": {"code": code, "message": message, "type": error_type}}).to_string()
}

/// The body of the default [`DeviceRoute::respond`] answer (status 501): what [`error_body`]
/// builds for it, written out so a route can use it in a `const` (a unit test holds the two
/// equal).
pub const NOT_IN_PROCESS: &str = r#"{"error":{"message":"this route does not answer requests in process","type":"not_implemented_error","code":501}}"#;

/// Where [`DeviceRoute::respond`] writes its reply: the host's, valid for that call only.
///
/// The host keeps at most [`SINK_BUFFER_BYTES`] of a reply waiting for the client; a `send`
/// that would exceed it blocks until the client has read enough. So a route that produces
/// faster than the client reads is slowed to the client's pace instead of growing memory.
pub trait ReplySink {
    /// The reply's status and Content-Type. Call once, before any `send`.
    fn send_head(&mut self, status: u16, content_type: &str) -> Result<(), SinkError>;
    /// Bytes of the body (a whole body, or SSE events as they are made). Blocks while the
    /// buffer is full; an error means the client is gone (or `end` was called): stop answering.
    fn send(&mut self, bytes: &[u8]) -> Result<(), SinkError>;
    /// The reply is complete. Returning from `respond` ends it too.
    fn end(&mut self);
    /// Whether the client is gone (or the host is stopping, [`HOST_STOPPING`]), asked without
    /// sending (ABI 1.5): once true, every `send` fails. A route that computes long before its
    /// next `send` (a prefill) asks between steps and stops when it is true. Quick and
    /// non-blocking. The default (a sink of a route's own tests, say) is never gone.
    fn client_gone(&self) -> bool {
        false
    }
}

/// How much of a reply the host holds for a slow client before [`ReplySink::send`] blocks:
/// 16 chunks of at most 16 KiB (the socket's own buffers come on top).
pub const SINK_BUFFER_BYTES: usize = 16 * SINK_CHUNK_BYTES;
/// The host splits a larger `send` into chunks of this size.
pub const SINK_CHUNK_BYTES: usize = 16 * 1024;

/// The message of the [`SinkError`] every [`ReplySink::send`] returns once the host is
/// stopping and the drain window (`--drain-s`) has ended: the request is being cut, as if the
/// client had left. A zero-length `send` is a cheap way to ask (it fails then, and only then or
/// when the client is gone). Hosts before this text failed the same sends with the client's
/// message; a route that only stops on any error needs no change.
pub const HOST_STOPPING: &str = "the host is stopping";

/// Why a [`ReplySink`] call failed: the client went away, the host is stopping
/// ([`HOST_STOPPING`]), or the reply was already ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkError {
    /// What happened, one line ([`HOST_STOPPING`] when the host is stopping).
    pub message: String,
}

impl std::fmt::Display for SinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SinkError {}

/// The host's [`ReplySink`] as it crosses the boundary: an opaque handle and the functions
/// that take it. Valid only during the `respond` call it was passed to.
#[repr(C)]
#[derive(StableAbi)]
pub struct SinkApi {
    /// The host's sink; only the functions below look inside it.
    pub handle: *mut c_void,
    /// [`ReplySink::send_head`].
    pub send_head: extern "C" fn(*mut c_void, u16, RStr<'_>) -> RResult<(), RString>,
    /// [`ReplySink::send`].
    pub send: extern "C" fn(*mut c_void, RSlice<'_, u8>) -> RResult<(), RString>,
    /// [`ReplySink::end`].
    pub end: extern "C" fn(*mut c_void),
    /// 1.5: [`ReplySink::client_gone`].
    pub client_gone: extern "C" fn(*mut c_void) -> bool,
}

/// What the panic says that `1bit plugins check` asks a route's export layer for (ABI 1.5):
/// the check's `respond` input carries `"onebit_check_panic": true`, which serve never sends,
/// and the export layer (this crate's code inside the route library) panics with this message
/// at the route's first sink call (or, if it makes none, when it returns). The panic unwinds
/// through the route's own `respond`, so the check proves the boundary contains it (a route
/// built with `panic = "abort"` would kill serve) and that the route answers again after it,
/// without the route shipping a panic trigger of its own.
pub const CHECK_PANIC_MESSAGE: &str = "1bit plugins check asked the route to panic";

/// What the host lets a route do during [`DeviceRoute::forward`]: blocking calls that the
/// host performs with its own runtime.
pub trait HostServices {
    /// Send one HTTP request to a backend of the plan and wait for its whole reply.
    fn backend_request(&self, request: &BackendRequest) -> Result<BackendReply, String>;
}

/// The host's services as they cross the boundary.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct HostApi {
    /// [`HostServices::backend_request`]: a [`BackendRequest`] as JSON in, a
    /// [`BackendReply`] as JSON out.
    pub backend_request: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
}

/// The root module every route file exports: one function per operation, each taking and
/// returning JSON. Fields after the last prefix field may be missing in older routes: their
/// accessors return `None`, and the host uses the operation's documented default.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = RouteModRef)))]
pub struct RouteMod {
    /// [`DeviceRoute::info`] → [`RouteInfo`].
    pub info: extern "C" fn() -> RResult<RString, RString>,
    /// [`DeviceRoute::claim`]: [`PlanRequest`] → [`Claim`].
    pub claim: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
    /// [`DeviceRoute::plan`]: [`PlanRequest`] → [`PlanOutcome`].
    pub plan: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
    /// [`DeviceRoute::start`]: [`Started`] → `null`.
    pub start: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
    /// [`DeviceRoute::health`]: [`HealthProbe`] → [`Health`].
    pub health: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
    /// [`DeviceRoute::on_backend_line`]: [`BackendLine`] → [`LineVerdict`]; an empty
    /// string means the default verdict, so the common case allocates nothing.
    pub on_backend_line: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
    /// [`DeviceRoute::forward`]: [`ForwardRequest`] → [`Forward`].
    pub forward: extern "C" fn(RStr<'_>, HostApi) -> RResult<RString, RString>,
    /// [`DeviceRoute::metrics`] → exposition text (not JSON).
    #[sabi(last_prefix_field)]
    pub metrics: extern "C" fn() -> RResult<RString, RString>,
    /// 1.2: [`DeviceRoute::respond`]: [`ForwardRequest`] and the host's sink → `""`. From
    /// 1.5 the sink has `client_gone` (a 1.2-1.4 route is given the sink as its minor defined
    /// it), and the input may say `"onebit_check_panic": true`, which only `1bit plugins check`
    /// sends: the route's export layer then panics at the route's first sink call (see
    /// [`CHECK_PANIC_MESSAGE`]).
    pub respond: extern "C" fn(RStr<'_>, SinkApi) -> RResult<RString, RString>,
}

impl RootModule for RouteModRef {
    declare_root_module_statics! {RouteModRef}
    const BASE_NAME: &'static str = "onebit_route";
    const NAME: &'static str = "onebit_route";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// Export a [`DeviceRoute`] implementation as this cdylib's root module.
///
/// ```ignore
/// #[derive(Default)]
/// struct MyRoute;
/// impl onebit_plugin_api::DeviceRoute for MyRoute { /* ... */ }
/// onebit_plugin_api::export_route!(MyRoute);
/// ```
///
/// It places one static with a fixed symbol name in the library (the header the host looks
/// up), which is an unsafe attribute: a route crate uses `#![deny(unsafe_code)]` rather than
/// `forbid`, so that this one item may allow it.
#[macro_export]
macro_rules! export_route {
    ($route:ty) => {
        #[allow(unsafe_code)]
        #[unsafe(export_name = $crate::__root_module_loader_name!())]
        /// The route's header, which the host looks up by name when it loads the library.
        pub static ONEBIT_ROUTE_LIB_HEADER: $crate::export::LibHeader =
            $crate::export::lib_header::<$route>();
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_respond_body_is_the_error_body_builders() {
        let built: serde_json::Value = serde_json::from_str(&error_body(
            501,
            "not_implemented_error",
            "this route does not answer requests in process",
        ))
        .unwrap();
        let written: serde_json::Value = serde_json::from_str(NOT_IN_PROCESS).unwrap();
        assert_eq!(built, written);
    }
}
