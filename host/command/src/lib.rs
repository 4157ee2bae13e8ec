//! What serve was told and how it fails: the command line ([`cli`]: serve's flags;
//! [`llama_server_cli`]: llama-server's, read as serve's), what serve knows of the model before
//! planning ([`model`]), its lines ([`log`]), and its errors ([`error`]: the exit codes, the
//! OpenAI-shaped replies). The bottom of the host's crates: it uses none of them.
#![forbid(unsafe_code)]

pub mod cli;
pub mod error;
pub mod llama_server_cli;
pub mod log;
pub mod model;
