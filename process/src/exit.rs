//! The end of a process that may hold a loaded route's threads: [`exit`].

use std::io::Write;

/// End this process with `code` at once: Rust's stdout and stderr and C's stdio flushed, then
/// `_exit(2)`. C's `exit(3)` (which `std::process::exit` calls) would first run the handlers
/// registered with `atexit`, C++'s static destructors among them, while other threads still
/// run: a route's library (llama.cpp's CPU backend in the inproc add-on, a vendor's kernels)
/// may be mid-compute on the very state a destructor frees, and the process then dies of
/// SIGSEGV instead of exiting with `code` (seen: the inproc add-on cut at a stop on a starved
/// machine). The kernel closes every descriptor and ends every thread either way.
pub fn exit(code: i32) -> ! {
    let _ = std::io::stdout().lock().flush();
    let _ = std::io::stderr().lock().flush();
    crate::sys::flush_stdio_and_exit(code)
}
