//! The host side of the boundary: opening a route file, checking its ABI, and calling it.
//!
//! Only the host enables this (feature `host`). A route library, once loaded, is never
//! unloaded: its functions may be running on any thread until the process ends.

// Unsafe is allowed here alone in this crate: the host side of the FFI boundary: loading libraries and calling through them.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use abi_stable::library::{LibraryError, lib_header_from_path};
use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RStr, RString};
use semver::Version;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::calls::*;
use crate::types::*;
use crate::{ABI_VERSION, HostApi, ReplySink, RouteModRef, SinkApi};

/// Why a route file was not loaded. Each variant prints as one line naming the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// The file is not a library, or exports no 1bit route.
    NotARoute {
        /// The file.
        file: PathBuf,
        /// What the dynamic loader or the symbol lookup said.
        why: String,
    },
    /// Built against an ABI this host cannot call.
    AbiMismatch {
        /// The file.
        file: PathBuf,
        /// The ABI version the route was built against.
        route_abi: String,
        /// This host's ABI version.
        host_abi: String,
    },
    /// The ABI versions agree but the types do not (a route built from a modified API).
    Layout {
        /// The file.
        file: PathBuf,
        /// Which type's layout differs.
        why: String,
    },
    /// The route failed to describe itself.
    Info {
        /// The file.
        file: PathBuf,
        /// The route's error, or why its description does not decode.
        why: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotARoute { file, why } => {
                write!(f, "{}: not a 1bit route ({why})", file.display())
            }
            LoadError::AbiMismatch {
                file,
                route_abi,
                host_abi,
            } => write!(
                f,
                "{}: built against route ABI {route_abi}, but this 1bit has ABI {host_abi}; rebuild the route against onebit-plugin-api {}",
                file.display(),
                compatible_range(host_abi)
            ),
            LoadError::Layout { file, why } => write!(
                f,
                "{}: its route ABI types do not match this 1bit's ({why}); rebuild the route against this onebit-plugin-api",
                file.display()
            ),
            LoadError::Info { file, why } => {
                write!(
                    f,
                    "{}: the route failed to describe itself: {why}",
                    file.display()
                )
            }
        }
    }
}

impl std::error::Error for LoadError {}

fn compatible_range(host_abi: &str) -> String {
    match Version::parse(host_abi) {
        Ok(v) => format!("{}.0 to {}.{}", v.major, v.major, v.minor),
        Err(_) => host_abi.to_string(),
    }
}

/// Whether a route built against `route` can be called by a host of ABI `host`: the same
/// major, and the route's minor no newer than the host's (a newer minor may rely on
/// operations or fields this host does not have).
pub fn abi_compatible(route: &Version, host: &Version) -> bool {
    route.major == host.major && route.minor <= host.minor
}

/// A route file that passed every check.
#[derive(Clone)]
pub struct LoadedRoute {
    /// The library it was loaded from.
    pub file: PathBuf,
    /// The ABI version it was built against.
    pub abi_version: String,
    /// What the route says of itself (name, version, the architectures it claims).
    pub info: RouteInfo,
    /// The package the route was loaded from, as the host checked it (set by the host after
    /// [`load`]); passed to the route in every [`PlanRequest`] (1.8).
    pub package: Option<PackageFacts>,
    module: Ops,
}

type JsonOp = extern "C" fn(RStr<'_>) -> RResult<RString, RString>;
type TextOp = extern "C" fn() -> RResult<RString, RString>;
type ForwardOp = extern "C" fn(RStr<'_>, HostApi) -> RResult<RString, RString>;
type RespondOp = extern "C" fn(RStr<'_>, SinkApi) -> RResult<RString, RString>;
type RespondOpV1_2 =
    extern "C" fn(RStr<'_>, crate::legacy::v1_2::SinkApi) -> RResult<RString, RString>;

/// A route's `respond`, by the sink its minor takes.
#[derive(Clone, Copy)]
enum Respond {
    /// 1.2 to 1.4: the sink without `client_gone`.
    V1_2(RespondOpV1_2),
    /// 1.5 on.
    Current(RespondOp),
}

/// The route's operations, whatever minor it was built against; `None` for an operation its
/// minor did not have (the caller uses the documented default).
#[derive(Clone, Copy)]
struct Ops {
    info: TextOp,
    claim: JsonOp,
    plan: JsonOp,
    start: JsonOp,
    health: JsonOp,
    on_backend_line: JsonOp,
    forward: ForwardOp,
    metrics: TextOp,
    respond: Option<Respond>,
}

impl From<RouteModRef> for Ops {
    fn from(m: RouteModRef) -> Self {
        Ops {
            info: m.info(),
            claim: m.claim(),
            plan: m.plan(),
            start: m.start(),
            health: m.health(),
            on_backend_line: m.on_backend_line(),
            forward: m.forward(),
            metrics: m.metrics(),
            respond: m.respond().map(Respond::Current),
        }
    }
}

impl From<crate::legacy::v1_2::RouteModRef> for Ops {
    fn from(m: crate::legacy::v1_2::RouteModRef) -> Self {
        Ops {
            info: m.info(),
            claim: m.claim(),
            plan: m.plan(),
            start: m.start(),
            health: m.health(),
            on_backend_line: m.on_backend_line(),
            forward: m.forward(),
            metrics: m.metrics(),
            respond: m.respond().map(Respond::V1_2),
        }
    }
}

impl From<crate::legacy::v1_0::RouteModRef> for Ops {
    fn from(m: crate::legacy::v1_0::RouteModRef) -> Self {
        Ops {
            info: m.info(),
            claim: m.claim(),
            plan: m.plan(),
            start: m.start(),
            health: m.health(),
            on_backend_line: m.on_backend_line(),
            forward: m.forward(),
            metrics: m.metrics(),
            respond: None,
        }
    }
}

impl fmt::Debug for LoadedRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedRoute")
            .field("file", &self.file)
            .field("abi_version", &self.abi_version)
            .field("info", &self.info)
            .finish()
    }
}

/// Open `file`, check its ABI version and layout, and ask it who it is. Nothing of the route
/// runs before both checks pass.
pub fn load(file: &Path) -> Result<LoadedRoute, LoadError> {
    let header = lib_header_from_path(file).map_err(|e| LoadError::NotARoute {
        file: file.to_path_buf(),
        why: one_line(&e),
    })?;
    let route_abi = header.version_strings().version.as_str().to_string();
    let host_abi = ABI_VERSION.to_string();
    let compatible = match (Version::parse(&route_abi), Version::parse(&host_abi)) {
        (Ok(route), Ok(host)) => abi_compatible(&route, &host),
        _ => false,
    };
    if !compatible {
        return Err(LoadError::AbiMismatch {
            file: file.to_path_buf(),
            route_abi,
            host_abi,
        });
    }
    // abi_stable's own version rule (the library's minor at least the loader's) is the
    // opposite of ours, so only its layout check is used; and since it also refuses a module
    // with fewer operations than the loader's, a route of an older minor is checked against
    // the module as its minor defined it.
    let layout_error = |e: LibraryError| LoadError::Layout {
        file: file.to_path_buf(),
        why: one_line(&e),
    };
    let module: Ops = match Version::parse(&route_abi) {
        Ok(v) if v.major == 1 && v.minor < 2 => header
            .check_layout::<crate::legacy::v1_0::RouteModRef>()
            .map_err(layout_error)?
            .into(),
        Ok(v) if v.major == 1 && v.minor < 5 => header
            .check_layout::<crate::legacy::v1_2::RouteModRef>()
            .map_err(layout_error)?
            .into(),
        _ => header
            .check_layout::<RouteModRef>()
            .map_err(layout_error)?
            .into(),
    };
    let mut route = LoadedRoute {
        file: file.to_path_buf(),
        abi_version: route_abi,
        info: RouteInfo::default(),
        package: None,
        module,
    };
    route.info = decode_reply((route.module.info)()).map_err(|why| LoadError::Info {
        file: file.to_path_buf(),
        why,
    })?;
    if route.info.name.is_empty() {
        return Err(LoadError::Info {
            file: file.to_path_buf(),
            why: "it has no name".to_string(),
        });
    }
    Ok(route)
}

fn one_line(e: &LibraryError) -> String {
    let text = e.to_string();
    let mut line = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if line.len() > 300 {
        let mut end = 300;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push_str("...");
    }
    line
}

fn decode_reply<T: DeserializeOwned>(reply: RResult<RString, RString>) -> Result<T, String> {
    match reply {
        ROk(text) => serde_json::from_str(text.as_str())
            .map_err(|e| format!("the route's reply was not understood: {e}")),
        RErr(message) => Err(message.into_string()),
    }
}

fn encode<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("ABI types always encode")
}

/// Calls into the route. Each may block as the operation's documentation says; call them
/// from a thread that may block.
impl LoadedRoute {
    /// [`crate::DeviceRoute::claim`]: whether the route serves this model under `--device auto`.
    pub fn claim(&self, request: &PlanRequest) -> Result<Claim, String> {
        let request = self.own_request(request);
        decode_reply((self.module.claim)(RStr::from_str(&encode(&request))))
    }

    /// [`crate::DeviceRoute::plan`]: the backends to start and the rules for requests.
    pub fn plan(&self, request: &PlanRequest) -> Result<PlanOutcome, String> {
        let request = self.own_request(request);
        decode_reply((self.module.plan)(RStr::from_str(&encode(&request))))
    }

    /// `request` as this route is given it: with the folder its library was loaded from and
    /// its package (1.8). Pure.
    pub fn own_request(&self, request: &PlanRequest) -> PlanRequest {
        let dir = self.file.parent().unwrap_or(Path::new("."));
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        PlanRequest {
            route_dir: dir.to_string_lossy().into_owned(),
            package: self.package.clone(),
            ..request.clone()
        }
    }

    /// [`crate::DeviceRoute::start`]: the plan's backends are running (or, in process, load).
    pub fn start(&self, started: &Started) -> Result<(), String> {
        match (self.module.start)(RStr::from_str(&encode(started))) {
            ROk(_) => Ok(()),
            RErr(message) => Err(message.into_string()),
        }
    }

    /// [`crate::DeviceRoute::health`]: the route's verdict on what the host's probes found.
    pub fn health(&self, probe: &HealthProbe) -> Result<Health, String> {
        decode_reply((self.module.health)(RStr::from_str(&encode(probe))))
    }

    /// [`crate::DeviceRoute::on_backend_line`]: what to do about a line a backend printed.
    pub fn on_backend_line(&self, line: &BackendLine) -> Result<LineVerdict, String> {
        match (self.module.on_backend_line)(RStr::from_str(&encode(line))) {
            ROk(text) if text.is_empty() => Ok(LineVerdict::default()),
            reply => decode_reply(reply),
        }
    }

    /// [`crate::DeviceRoute::forward`]: relay a request, or answer it.
    pub fn forward(&self, request: &ForwardRequest, host: HostApi) -> Result<Forward, String> {
        decode_reply((self.module.forward)(
            RStr::from_str(&encode(request)),
            host,
        ))
    }

    /// [`crate::DeviceRoute::metrics`]: the route's own Prometheus text.
    pub fn metrics(&self) -> Result<String, String> {
        match (self.module.metrics)() {
            ROk(text) => Ok(text.into_string()),
            RErr(message) => Err(message.into_string()),
        }
    }

    /// Whether the route has the in-process operation (built against 1.2 or later).
    pub fn can_respond(&self) -> bool {
        self.module.respond.is_some()
    }

    /// [`crate::DeviceRoute::respond`]: the route writes its reply into `sink`, which it may
    /// use only until this returns. Blocks as long as the route answers.
    pub fn respond(
        &self,
        request: &ForwardRequest,
        sink: &mut dyn ReplySink,
    ) -> Result<(), RespondError> {
        self.call_respond(&encode(request), sink)
    }

    /// [`LoadedRoute::respond`] with `"onebit_check_panic": true` in its input: a route of 1.5
    /// or later panics at its first sink call ([`crate::CHECK_PANIC_MESSAGE`]), inside its
    /// own `respond`; an older one answers as usual. For `1bit plugins check` alone.
    pub fn respond_asked_to_panic(
        &self,
        request: &ForwardRequest,
        sink: &mut dyn ReplySink,
    ) -> Result<(), RespondError> {
        let mut input = serde_json::to_value(request).expect("ABI types always encode");
        input["onebit_check_panic"] = true.into();
        self.call_respond(&input.to_string(), sink)
    }

    /// Whether the route's export layer can be asked to panic (built against 1.5 or later).
    pub fn can_be_asked_to_panic(&self) -> bool {
        matches!(self.module.respond, Some(Respond::Current(_)))
    }

    fn call_respond(&self, input: &str, sink: &mut dyn ReplySink) -> Result<(), RespondError> {
        let respond = self.module.respond.ok_or(RespondError::Lacking)?;
        let mut held: &mut dyn ReplySink = sink;
        let handle = (&mut held as *mut &mut dyn ReplySink).cast::<c_void>();
        let input = RStr::from_str(input);
        let reply = match respond {
            Respond::Current(respond) => respond(
                input,
                SinkApi {
                    handle,
                    send_head: sink_send_head,
                    send: sink_send,
                    end: sink_end,
                    client_gone: sink_client_gone,
                },
            ),
            Respond::V1_2(respond) => respond(
                input,
                crate::legacy::v1_2::SinkApi {
                    handle,
                    send_head: sink_send_head,
                    send: sink_send,
                    end: sink_end,
                },
            ),
        };
        match reply {
            ROk(_) => Ok(()),
            RErr(message) => Err(RespondError::Failed(message.into_string())),
        }
    }
}

/// Why [`LoadedRoute::respond`] gave no complete answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespondError {
    /// The route was built before ABI 1.2 and has no `respond`: the host answers with the
    /// documented default (501, [`crate::NOT_IN_PROCESS`]).
    Lacking,
    /// The route returned an error or panicked (the message says which).
    Failed(String),
}

impl fmt::Display for RespondError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RespondError::Lacking => {
                f.write_str("the route has no respond operation (built before route ABI 1.2)")
            }
            RespondError::Failed(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for RespondError {}

/// Call `f` with the sink behind a [`SinkApi`] handle; `None` when `f` panicked.
///
/// # Safety
///
/// `handle` must be the `&mut &mut dyn ReplySink` that [`LoadedRoute::call_respond`] built on
/// its own stack, and the call must come while that `respond` call runs, on its thread (the
/// route gets the `SinkApi` by value for that call alone, documented as valid for it only), so
/// that the reference is live and nothing else uses it meanwhile.
unsafe fn with_sink<T>(handle: *mut c_void, f: impl FnOnce(&mut dyn ReplySink) -> T) -> Option<T> {
    // SAFETY: the caller guarantees `handle` is a live, unaliased `&mut &mut dyn ReplySink`.
    let sink: &mut &mut dyn ReplySink = unsafe { &mut *handle.cast::<&mut dyn ReplySink>() };
    catch_unwind(AssertUnwindSafe(|| f(&mut **sink))).ok()
}

// The four functions below are the `SinkApi` the route calls back; `with_sink`'s contract holds
// because the route may call them only during the `respond` call that handed it the handle.

extern "C" fn sink_send_head(
    handle: *mut c_void,
    status: u16,
    content_type: RStr<'_>,
) -> RResult<(), RString> {
    // SAFETY: `handle` comes from `call_respond`, during its call (see `with_sink`).
    match unsafe { with_sink(handle, |s| s.send_head(status, content_type.as_str())) } {
        Some(Ok(())) => ROk(()),
        Some(Err(e)) => RErr(e.message.into()),
        None => RErr("the host failed to take the reply's head".into()),
    }
}

extern "C" fn sink_send(handle: *mut c_void, bytes: RSlice<'_, u8>) -> RResult<(), RString> {
    // SAFETY: `handle` comes from `call_respond`, during its call (see `with_sink`).
    match unsafe { with_sink(handle, |s| s.send(bytes.as_slice())) } {
        Some(Ok(())) => ROk(()),
        Some(Err(e)) => RErr(e.message.into()),
        None => RErr("the host failed to take the reply's bytes".into()),
    }
}

extern "C" fn sink_end(handle: *mut c_void) {
    // SAFETY: `handle` comes from `call_respond`, during its call (see `with_sink`).
    let _ = unsafe { with_sink(handle, |s| s.end()) };
}

extern "C" fn sink_client_gone(handle: *mut c_void) -> bool {
    // SAFETY: `handle` comes from `call_respond`, during its call (see `with_sink`). A host
    // sink that panics answers "gone": the route stops rather than computing for nobody.
    unsafe { with_sink(handle, |s| s.client_gone()) }.unwrap_or(true)
}

/// The host's side of [`crate::HostServices`]: what it does when a route asks for a backend
/// request during `forward`. Called on the route's blocking thread.
pub trait HostBackend {
    /// Send `request` to the backend it names and return its whole reply, or one line saying
    /// why there is none (unreachable, timed out).
    fn backend_request(request: &BackendRequest) -> Result<BackendReply, String>;
}

/// The [`HostApi`] a host passes to [`LoadedRoute::forward`], backed by `H`.
pub fn host_api<H: HostBackend>() -> HostApi {
    HostApi {
        backend_request: backend_request_ffi::<H>,
    }
}

extern "C" fn backend_request_ffi<H: HostBackend>(input: RStr<'_>) -> RResult<RString, RString> {
    let call = || -> Result<String, String> {
        let request: BackendRequest = serde_json::from_str(input.as_str())
            .map_err(|e| format!("the host could not read the backend request: {e}"))?;
        let reply = H::backend_request(&request)?;
        Ok(encode(&reply))
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(Ok(text)) => ROk(text.into()),
        Ok(Err(message)) => RErr(message.into()),
        Err(_) => RErr(
            "the host panicked serving a backend request"
                .to_string()
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_major_and_older_or_equal_minor_is_compatible() {
        let host = Version::new(1, 2, 0);
        assert!(abi_compatible(&Version::new(1, 0, 0), &host));
        assert!(abi_compatible(&Version::new(1, 2, 7), &host));
        assert!(!abi_compatible(&Version::new(1, 3, 0), &host));
        assert!(!abi_compatible(&Version::new(2, 0, 0), &host));
        assert!(!abi_compatible(&Version::new(0, 2, 0), &host));
    }

    #[test]
    fn mismatch_is_one_line_naming_file_and_both_versions() {
        let e = LoadError::AbiMismatch {
            file: PathBuf::from("/x/libonebit_route_npu.so"),
            route_abi: "2.0.0".into(),
            host_abi: "1.0.0".into(),
        };
        let text = e.to_string();
        assert_eq!(text.lines().count(), 1);
        assert!(text.contains("/x/libonebit_route_npu.so"));
        assert!(text.contains("2.0.0") && text.contains("1.0.0"));
    }
}
