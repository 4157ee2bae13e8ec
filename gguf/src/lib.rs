//! Reads a GGUF model's header (metadata and tensor infos, never tensor data), sizes the
//! sequence memory llama.cpp allocates for it ([`memory`]), and writes header-only fixtures.
//!
//! The memory check runs before any backend starts and must answer in milliseconds for a
//! 100 GB model, so everything here reads through a small buffer and stops where the tensor
//! data begins. Every count and length in the file is checked against the bytes that remain
//! before anything is allocated for it, so a hostile or truncated file yields an [`Error`],
//! never a panic or a huge allocation.

#![forbid(unsafe_code)]

mod error;
mod header;
pub mod memory;
mod reader;
mod shards;
mod value;
pub mod writer;

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

pub use error::{Error, ErrorKind};
pub use header::{Header, Metadata, TensorInfo};
pub use shards::{model_files, model_size};
pub use value::{Array, Value, ValueType};

/// Reads the header of the GGUF file at `path` (for a split model, pass any shard; each shard
/// has its own header, and the first carries the model's metadata).
///
/// Blocking file I/O, a few KiB plus the size of the metadata (a tokenizer vocabulary can
/// make that a few MiB). Errors name the file as given and the offending byte.
pub fn read_header(path: &Path) -> Result<Header, Error> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|e| Error::io(name.clone(), "cannot open", e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io(name.clone(), "cannot stat", e))?
        .len();
    reader::parse(BufReader::new(file), len, &name, None)
}

/// Reads a header from any byte stream starting at the file's first byte. `len` is the
/// file's total size: no count or string may claim more than what is left of it. `name`
/// labels errors. Used by the fuzz target and by tests that build headers in memory.
pub fn read_header_from<R: Read>(reader: R, len: u64, name: &str) -> Result<Header, Error> {
    reader::parse(BufReader::new(reader), len, name, None)
}

/// Arrays longer than this are walked past by [`read_header_lean`].
pub const LEAN_ARRAY_LIMIT: u64 = 4096;

/// Like [`read_header`], but arrays of more than [`LEAN_ARRAY_LIMIT`] elements (a tokenizer's
/// vocabulary, scores and merges) are checked and walked past, kept as [`Array::Skipped`]
/// (type and length only). Per-layer arrays are far shorter and are kept. This is what the
/// memory check reads: it needs the model's shape, not its vocabulary, and must answer in
/// milliseconds.
pub fn read_header_lean(path: &Path) -> Result<Header, Error> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|e| Error::io(name.clone(), "cannot open", e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io(name.clone(), "cannot stat", e))?
        .len();
    reader::parse(
        BufReader::with_capacity(64 * 1024, file),
        len,
        &name,
        Some(LEAN_ARRAY_LIMIT),
    )
}

/// [`read_header_lean`] from any byte stream, as [`read_header_from`].
pub fn read_header_lean_from<R: Read>(reader: R, len: u64, name: &str) -> Result<Header, Error> {
    reader::parse(BufReader::new(reader), len, name, Some(LEAN_ARRAY_LIMIT))
}
