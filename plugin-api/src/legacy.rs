//! The root module as routes built against ABI 1.0-1.4 export it, for the loader's layout
//! check of such a route (and the sink a 1.2-1.4 route takes).
//!
//! abi_stable's layout check refuses a library whose prefix type has fewer fields than the
//! loader's (its rule: a library is never older than its loader), but this ABI promises that a
//! route of an older minor loads into a newer host. So the loader checks an older route against
//! the module as that minor defined it (same name, same fields), and fills the operations that
//! minor lacked with their documented defaults.

// Unsafe is allowed here alone in this crate: the older minors' root modules, declared with abi_stable's macros.
#![allow(unsafe_code)]

use abi_stable::{
    StableAbi, declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{RResult, RStr, RString},
};

use crate::HostApi;

/// ABI 1.2 to 1.4: nine operations, `respond` taking the sink without `client_gone`.
pub mod v1_2 {
    use std::ffi::c_void;

    use abi_stable::std_types::RSlice;

    use super::*;

    /// [`crate::SinkApi`] as 1.2 defined it: no `client_gone`. The name must stay `SinkApi`.
    #[repr(C)]
    #[derive(StableAbi)]
    pub struct SinkApi {
        pub handle: *mut c_void,
        pub send_head: extern "C" fn(*mut c_void, u16, RStr<'_>) -> RResult<(), RString>,
        pub send: extern "C" fn(*mut c_void, RSlice<'_, u8>) -> RResult<(), RString>,
        pub end: extern "C" fn(*mut c_void),
    }

    /// [`crate::RouteMod`] with 1.2's sink; the name must stay `RouteMod`.
    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = RouteModRef)))]
    pub struct RouteMod {
        pub info: extern "C" fn() -> RResult<RString, RString>,
        pub claim: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub plan: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub start: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub health: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub on_backend_line: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub forward: extern "C" fn(RStr<'_>, HostApi) -> RResult<RString, RString>,
        #[sabi(last_prefix_field)]
        pub metrics: extern "C" fn() -> RResult<RString, RString>,
        pub respond: extern "C" fn(RStr<'_>, SinkApi) -> RResult<RString, RString>,
    }

    impl RootModule for RouteModRef {
        declare_root_module_statics! {RouteModRef}
        const BASE_NAME: &'static str = "onebit_route";
        const NAME: &'static str = "onebit_route";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }
}

/// ABI 1.0 and 1.1: eight operations, `respond` not yet among them.
pub mod v1_0 {
    use super::*;

    /// [`crate::RouteMod`] without `respond`; the name must stay `RouteMod`, since the layout
    /// check compares names.
    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = RouteModRef)))]
    pub struct RouteMod {
        pub info: extern "C" fn() -> RResult<RString, RString>,
        pub claim: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub plan: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub start: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub health: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub on_backend_line: extern "C" fn(RStr<'_>) -> RResult<RString, RString>,
        pub forward: extern "C" fn(RStr<'_>, HostApi) -> RResult<RString, RString>,
        #[sabi(last_prefix_field)]
        pub metrics: extern "C" fn() -> RResult<RString, RString>,
    }

    impl RootModule for RouteModRef {
        declare_root_module_statics! {RouteModRef}
        const BASE_NAME: &'static str = "onebit_route";
        const NAME: &'static str = "onebit_route";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }
}
