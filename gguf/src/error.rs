//! The crate's one error type: which file, at which byte, and what is wrong with it; or, for
//! the memory estimate, which setting cannot work.

use std::fmt;
use std::io;

/// What kind of problem an [`Error`] reports, for callers that branch on it (tests, the
/// memory check deciding between "not a model" and "broken download").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file could not be opened or read.
    Io,
    /// The file ends before the header does.
    Truncated,
    /// The first four bytes are not "GGUF".
    NotGguf,
    /// A GGUF version other than 2 or 3.
    UnsupportedVersion,
    /// A count (tensors, keys, array elements) that the rest of the file cannot hold.
    AbsurdCount,
    /// A string longer than what is left of the file.
    StringTooLong,
    /// A value type code outside 0..=12.
    UnknownValueType,
    /// An array whose elements are arrays; llama.cpp refuses those, so this reader does too.
    NestedArray,
    /// Something else the format forbids (duplicate key, negative dimension, bad alignment...).
    Malformed,
    /// A shard of a split model is missing.
    MissingShard,
    /// A metadata key holds a value of the wrong type, shape or range for what the caller asked.
    Metadata,
    /// A metadata key llama.cpp requires to load the model is absent.
    MissingKey,
    /// The settings a caller asked the memory estimate for cannot work whatever the file
    /// holds (an unknown KV cache type, a context too small for its sequences).
    Settings,
}

/// An error reading a GGUF file, displayed as `<file>: byte <offset>: <what is wrong>`
/// (or `<file>: <what is wrong>` when no byte applies, or `<what is wrong>` when no file
/// does: [`ErrorKind::Settings`]), in one line a user can act on.
#[derive(Debug)]
pub struct Error {
    file: Option<String>,
    offset: Option<u64>,
    kind: ErrorKind,
    message: String,
    source: Option<io::Error>,
}

impl Error {
    pub(crate) fn new(
        file: impl Into<String>,
        offset: Option<u64>,
        kind: ErrorKind,
        message: impl Into<String>,
    ) -> Error {
        Error {
            file: Some(file.into()),
            offset,
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn io(file: impl Into<String>, what: &str, err: io::Error) -> Error {
        Error {
            file: Some(file.into()),
            offset: None,
            kind: ErrorKind::Io,
            message: format!("{what}: {err}"),
            source: Some(err),
        }
    }

    /// Settings that cannot work, about no file: [`ErrorKind::Settings`].
    pub(crate) fn settings(message: impl Into<String>) -> Error {
        Error {
            file: None,
            offset: None,
            kind: ErrorKind::Settings,
            message: message.into(),
            source: None,
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The file as the caller named it, when the error is about one.
    pub fn file(&self) -> Option<&str> {
        self.file.as_deref()
    }

    /// The byte where the offending item starts, when there is one.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// What is wrong, without the file and offset prefix.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, self.offset) {
            (Some(file), Some(offset)) => write!(f, "{file}: byte {offset}: {}", self.message),
            (Some(file), None) => write!(f, "{file}: {}", self.message),
            (None, _) => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
