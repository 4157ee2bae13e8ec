//! The backends' lives ([`backends`]: spawning through `onebit_process`, health, the progress
//! watchdog, the stop; the route's host services), the memory check that refuses a load before
//! anything starts ([`admission`]), llama.cpp's RPC workers ([`rpc`]), the run folder
//! ([`run_dir`]) and the heap's trim after work ([`heap_trim`]). Uses only `onebit-command`.
#![forbid(unsafe_code)]

pub mod admission;
pub mod backends;
pub mod heap_trim;
pub mod rpc;
pub mod run_dir;
