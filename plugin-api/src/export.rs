//! The route side of the boundary: turns a [`DeviceRoute`] into a [`RouteMod`] of JSON functions.
//!
//! Used only through [`crate::export_route!`]. Each function decodes its JSON input, calls the
//! route, encodes the result, and catches any panic so it never unwinds into the host. While a
//! route operation runs, the library's panic hook stays silent (a cdylib has its own copy of
//! std, so this hook is the route's alone): the user sees serve's one line about the panic,
//! not Rust's message and backtrace before it.

// Unsafe is allowed here alone in this crate: the route side of the FFI boundary: abi_stable headers and raw sink pointers.
#![allow(unsafe_code)]

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Once, OnceLock};

pub use abi_stable::library::LibHeader;
use abi_stable::library::{__call_root_module_loader, CheckTypeLayout, RootModuleResult};
use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{RErr, ROk, RResult, RSlice, RStr, RString};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::calls::{BackendReply, BackendRequest};
use crate::types::PlanOutcome;
use crate::{
    DeviceRoute, HostApi, HostServices, LineVerdict, ReplySink, RouteMod, RouteModRef, SinkApi,
    SinkError,
};

/// The one route instance of this library (a cdylib exports exactly one route).
static INSTANCE: OnceLock<Box<dyn Any + Send + Sync>> = OnceLock::new();

fn route<R: DeviceRoute>() -> &'static R {
    INSTANCE
        .get_or_init(|| Box::new(R::default()))
        .downcast_ref::<R>()
        .expect("a route library exports exactly one DeviceRoute type")
}

/// Build the root module for route type `R`.
pub fn route_module<R: DeviceRoute>() -> RouteModRef {
    RouteMod {
        info: info::<R>,
        claim: claim::<R>,
        plan: plan::<R>,
        start: start::<R>,
        health: health::<R>,
        on_backend_line: on_backend_line::<R>,
        forward: forward::<R>,
        metrics: metrics::<R>,
        respond: respond::<R>,
    }
    .leak_into_prefix()
}

thread_local! {
    /// Whether this thread is inside a route operation, where a panic is caught and reported.
    static IN_OPERATION: Cell<bool> = const { Cell::new(false) };
}

/// Silence the panic hook inside route operations; elsewhere (a thread the route started
/// itself) Rust's own hook still speaks.
fn quiet_panics() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_OPERATION.with(Cell::get) {
                previous(info);
            }
        }));
    });
}

/// Run `f`, turning a panic into an error naming the operation.
fn guarded(op: &str, f: impl FnOnce() -> Result<String, String>) -> RResult<RString, RString> {
    quiet_panics();
    let outer = IN_OPERATION.with(|q| q.replace(true));
    let outcome = catch_unwind(AssertUnwindSafe(f));
    IN_OPERATION.with(|q| q.set(outer));
    match outcome {
        Ok(Ok(text)) => ROk(text.into()),
        Ok(Err(message)) => RErr(message.into()),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".to_string());
            RErr(format!("the route panicked in {op}: {what}").into())
        }
    }
}

fn decode<T: DeserializeOwned>(op: &str, input: RStr<'_>) -> Result<T, String> {
    serde_json::from_str(input.as_str())
        .map_err(|e| format!("the route could not read the host's {op} input: {e}"))
}

fn encode<T: Serialize>(value: &T) -> Result<String, String> {
    serde_json::to_string(value).map_err(|e| format!("the route could not encode its reply: {e}"))
}

extern "C" fn info<R: DeviceRoute>() -> RResult<RString, RString> {
    guarded("info", || encode(&route::<R>().info()))
}

extern "C" fn claim<R: DeviceRoute>(input: RStr<'_>) -> RResult<RString, RString> {
    guarded("claim", || {
        encode(&route::<R>().claim(&decode("claim", input)?))
    })
}

extern "C" fn plan<R: DeviceRoute>(input: RStr<'_>) -> RResult<RString, RString> {
    guarded("plan", || {
        let outcome = match route::<R>().plan(&decode("plan", input)?) {
            Ok(plan) => PlanOutcome::Plan(plan),
            Err(refusal) => PlanOutcome::Refused(refusal),
        };
        encode(&outcome)
    })
}

extern "C" fn start<R: DeviceRoute>(input: RStr<'_>) -> RResult<RString, RString> {
    guarded("start", || {
        route::<R>()
            .start(&decode("start", input)?)
            .map_err(|e| e.message)?;
        Ok("null".to_string())
    })
}

extern "C" fn health<R: DeviceRoute>(input: RStr<'_>) -> RResult<RString, RString> {
    guarded("health", || {
        encode(&route::<R>().health(&decode("health", input)?))
    })
}

extern "C" fn on_backend_line<R: DeviceRoute>(input: RStr<'_>) -> RResult<RString, RString> {
    guarded("on_backend_line", || {
        let verdict = route::<R>().on_backend_line(&decode("on_backend_line", input)?);
        if verdict == LineVerdict::default() {
            Ok(String::new())
        } else {
            encode(&verdict)
        }
    })
}

/// The host's services, seen from the route.
struct HostCalls(HostApi);

impl HostServices for HostCalls {
    fn backend_request(&self, request: &BackendRequest) -> Result<BackendReply, String> {
        let input = encode(request)?;
        match (self.0.backend_request)(RStr::from_str(&input)) {
            ROk(text) => serde_json::from_str(text.as_str())
                .map_err(|e| format!("the host's backend reply was not understood: {e}")),
            RErr(message) => Err(message.into_string()),
        }
    }
}

extern "C" fn forward<R: DeviceRoute>(input: RStr<'_>, host: HostApi) -> RResult<RString, RString> {
    guarded("forward", || {
        let decision = route::<R>().forward(&decode("forward", input)?, &HostCalls(host));
        encode(&decision)
    })
}

extern "C" fn metrics<R: DeviceRoute>() -> RResult<RString, RString> {
    guarded("metrics", || Ok(route::<R>().metrics()))
}

/// The host's sink, seen from the route. When `1bit plugins check` asked for a panic
/// ([`crate::CHECK_PANIC_MESSAGE`]), the route's first call panics, inside its own `respond`.
struct SinkCalls {
    api: SinkApi,
    panic_asked: Cell<bool>,
}

impl SinkCalls {
    fn panic_if_asked(&self) {
        if self.panic_asked.replace(false) {
            panic!("{}", crate::CHECK_PANIC_MESSAGE);
        }
    }
}

fn sink_result(reply: RResult<(), RString>) -> Result<(), SinkError> {
    reply.into_result().map_err(|message| SinkError {
        message: message.into_string(),
    })
}

impl ReplySink for SinkCalls {
    fn send_head(&mut self, status: u16, content_type: &str) -> Result<(), SinkError> {
        self.panic_if_asked();
        sink_result((self.api.send_head)(
            self.api.handle,
            status,
            RStr::from_str(content_type),
        ))
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), SinkError> {
        self.panic_if_asked();
        sink_result((self.api.send)(self.api.handle, RSlice::from_slice(bytes)))
    }

    fn end(&mut self) {
        self.panic_if_asked();
        (self.api.end)(self.api.handle)
    }

    fn client_gone(&self) -> bool {
        self.panic_if_asked();
        (self.api.client_gone)(self.api.handle)
    }
}

/// `respond`'s input: the request, and whether `1bit plugins check` asks for a panic (a key
/// serve never sends; a route before 1.5 ignores it).
#[derive(serde::Deserialize)]
struct RespondInput {
    #[serde(flatten)]
    request: crate::ForwardRequest,
    #[serde(default)]
    onebit_check_panic: bool,
}

extern "C" fn respond<R: DeviceRoute>(input: RStr<'_>, sink: SinkApi) -> RResult<RString, RString> {
    guarded("respond", || {
        let input: RespondInput = decode("respond", input)?;
        let mut sink = SinkCalls {
            api: sink,
            panic_asked: Cell::new(input.onebit_check_panic),
        };
        let answered = route::<R>()
            .respond(&input.request, &mut sink)
            .map_err(|e| e.message);
        // A route that made no sink call is asked to panic as it returns.
        sink.panic_if_asked();
        answered?;
        Ok(String::new())
    })
}

/// The symbol abi_stable looks up in a library; spelled out because an export attribute takes
/// only a literal (checked against abi_stable's own constant in the tests below).
#[doc(hidden)]
#[macro_export]
macro_rules! __root_module_loader_name {
    () => {
        "_1as_0lib_1header_0root_bmodule_bloader"
    };
}

/// The library header a route exports: abi_stable's layout constants for [`RouteModRef`] and
/// the constructor that builds the module for route type `R`.
pub const fn lib_header<R: DeviceRoute>() -> LibHeader {
    // SAFETY: the constructor returns a `RouteModRef`, the type whose layout constants the
    // header carries, which is what `from_constructor` requires.
    unsafe { LibHeader::from_constructor::<RouteModRef>(construct::<R>, CheckTypeLayout::Yes) }
}

extern "C" fn construct<R: DeviceRoute>() -> RootModuleResult {
    __call_root_module_loader(route_module::<R>)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_exported_symbol_is_the_one_abi_stable_loads() {
        assert_eq!(
            crate::__root_module_loader_name!(),
            abi_stable::library::ROOT_MODULE_LOADER_NAME
        );
    }

    #[test]
    fn a_panic_becomes_an_error_naming_the_operation() {
        let reply = super::guarded("plan", || panic!("boom"));
        let message = reply.into_result().unwrap_err();
        assert_eq!(message.as_str(), "the route panicked in plan: boom");
    }
}
