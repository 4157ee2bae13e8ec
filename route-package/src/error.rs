//! The one error of this crate: a line that says what is wrong and what to do instead.

use std::fmt;

/// Why a package could not be made, checked, installed or removed. Prints as one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageError {
    line: String,
}

impl PackageError {
    /// An error whose whole text is `line` (already one line: what is wrong; what to do).
    pub fn new(line: impl Into<String>) -> PackageError {
        let line: String = line.into();
        PackageError {
            line: line.replace('\n', " "),
        }
    }

    /// An I/O error on `path` while doing `doing` (`reading`, `copying`).
    pub fn io(doing: &str, path: &std::path::Path, e: &std::io::Error) -> PackageError {
        PackageError::new(format!("{doing} {}: {e}", path.display()))
    }
}

impl fmt::Display for PackageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.line)
    }
}

impl std::error::Error for PackageError {}
