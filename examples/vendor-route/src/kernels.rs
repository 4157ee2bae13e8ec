//! The Acme kernels library, `libacme_kernels.so.1`, loaded at run time: the one module of the
//! route that calls C.
//!
//! The route is never linked against the kernels: `plan` only finds the file, and `start` loads
//! it here with `libloading`, resolves every symbol the route uses (a missing one fails start in
//! one line), and checks the library's version. The rest of the route calls the safe methods of
//! [`Kernels`].

// The FFI boundary: loading the library and calling the functions acme_kernels.h declares.
// Each unsafe block says why it is sound.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::path::{Path, PathBuf};

use libloading::Library;

/// The kernels library's file name, which is also its SONAME.
pub const KERNELS_FILE: &str = "libacme_kernels.so.1";

/// The kernels version this route is built for; `start` refuses any other.
pub const KERNELS_VERSION: &str = "1.0.3";

/// `const char *acme_kernels_version(void)`.
type VersionFn = unsafe extern "C" fn() -> *const c_char;
/// `int acme_generate(const char *prompt, unsigned step, char *out, unsigned out_len)`.
type GenerateFn = unsafe extern "C" fn(*const c_char, c_uint, *mut c_char, c_uint) -> c_int;
/// `unsigned long long acme_device_total_bytes(void)`.
type TotalBytesFn = unsafe extern "C" fn() -> c_ulonglong;

/// The loaded kernels: the library and the functions the route calls. The library stays loaded
/// as long as this value lives, which keeps the function pointers valid.
pub struct Kernels {
    /// The file it was loaded from.
    path: PathBuf,
    /// `acme_generate`.
    generate: GenerateFn,
    /// `acme_device_total_bytes`.
    total_bytes: TotalBytesFn,
    /// Held, never called directly: the functions above point into it.
    _library: Library,
}

impl Kernels {
    /// Load the library at `path`, resolve its symbols and check that its version is
    /// [`KERNELS_VERSION`]. Blocks while the dynamic loader maps it. The error is one line
    /// naming the file and saying what to do.
    pub fn load(path: &Path) -> Result<Kernels, String> {
        // SAFETY: loading runs the library's initialisers: libacme_kernels has none of its own
        // (acme_kernels.c), and the file is the one `plan` chose (in a package, one whose sha256
        // the host checked against the manifest).
        let library = unsafe { Library::new(path) }.map_err(|e| {
            format!(
                "{}: cannot load the Acme kernels: {e}; reinstall the acme package",
                path.display()
            )
        })?;
        let version: VersionFn = symbol(&library, path, b"acme_kernels_version\0")?;
        let generate: GenerateFn = symbol(&library, path, b"acme_generate\0")?;
        let total_bytes: TotalBytesFn = symbol(&library, path, b"acme_device_total_bytes\0")?;
        // SAFETY: `version` is acme_kernels_version, which takes nothing and returns a static
        // NUL-terminated string or, from a broken build, NULL (checked below).
        let found = unsafe { version() };
        let found = if found.is_null() {
            "none".to_string()
        } else {
            // SAFETY: not NULL, and acme_kernels.h promises a static NUL-terminated string.
            unsafe { CStr::from_ptr(found) }
                .to_string_lossy()
                .into_owned()
        };
        if found != KERNELS_VERSION {
            return Err(format!(
                "{}: the Acme kernels are version {found}, but the acme route needs {KERNELS_VERSION}; install the {KERNELS_FILE} of version {KERNELS_VERSION} that this route ships with",
                path.display()
            ));
        }
        Ok(Kernels {
            path: path.to_path_buf(),
            generate,
            total_bytes,
            _library: library,
        })
    }

    /// The file the kernels were loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token number `step` (from 0) of the reply to `prompt`, or None when the reply is
    /// complete. Pure and quick; any thread (the kernels keep no state between calls). The error
    /// says which call failed and how.
    pub fn token(&self, prompt: &CStr, step: u32) -> Result<Option<String>, String> {
        // The token and its NUL always fit in the prompt's length plus two (acme_kernels.h).
        let mut out = vec![0u8; prompt.to_bytes().len() + 2];
        let out_len = c_uint::try_from(out.len()).map_err(|_| {
            format!(
                "the prompt's {} bytes are too long for the Acme kernels",
                out.len()
            )
        })?;
        // SAFETY: `generate` is acme_generate. `prompt` is NUL-terminated and outlives the call;
        // `out` holds `out_len` writable bytes, of which the function writes at most `out_len`;
        // it keeps neither pointer after it returns.
        let written =
            unsafe { (self.generate)(prompt.as_ptr(), step, out.as_mut_ptr().cast(), out_len) };
        match usize::try_from(written) {
            Ok(0) => Ok(None),
            Ok(n) if n < out.len() => {
                out.truncate(n);
                Ok(Some(String::from_utf8_lossy(&out).into_owned()))
            }
            Ok(n) => Err(format!(
                "acme_generate wrote {n} bytes into a buffer of {out_len} at step {step}"
            )),
            Err(_) => Err(format!(
                "acme_generate failed with {written} at step {step}"
            )),
        }
    }

    /// The size of the device's own memory, as the kernels report it.
    pub fn device_total_bytes(&self) -> u64 {
        // SAFETY: `total_bytes` is acme_device_total_bytes, which takes nothing and returns a
        // number.
        unsafe { (self.total_bytes)() }
    }
}

/// The function `name` (NUL-terminated) of `library`, as the fn pointer type `T` that
/// acme_kernels.h declares for it; a missing symbol is one line naming the file.
fn symbol<T: Copy>(library: &Library, path: &Path, name: &[u8]) -> Result<T, String> {
    // SAFETY: each caller gives as `T` the exact signature acme_kernels.h declares for `name`,
    // and the pointer copied out is used only while `library` stays loaded (Kernels holds both).
    let found = unsafe { library.get::<T>(name) };
    found.map(|symbol| *symbol).map_err(|e| {
        let name = String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned();
        format!(
            "{}: the Acme kernels lack {name} ({e}); install the {KERNELS_FILE} of version {KERNELS_VERSION}",
            path.display()
        )
    })
}
