//! serve's heap handed back to the kernel after work: the heap crate's [`Trimmer`] on a thread of
//! its own, told of each request by the request series. Under heaptrack serve's live heap is
//! level through a soak while its RSS steps up by megabytes (holes glibc keeps in its arenas'
//! heaps); with a trim at most every five seconds after requests it stays level. An idle serve
//! never trims.

use std::sync::LazyLock;

use onebit_heap::Trimmer;

/// A static because the heap is the process's: glibc's allocator has one set of arenas per
/// process, and every thread's frees leave their holes in it.
static TRIMMER: LazyLock<Trimmer> = LazyLock::new(Trimmer::default);

/// A request was answered (its allocations may have left holes).
pub fn worked() {
    TRIMMER.worked();
}

/// Start the thread that trims (once per serve; it lives as long as the process). Each trim
/// says, at debug level, what serve's anonymous memory is after it.
pub fn start() {
    let started = std::thread::Builder::new()
        .name("heap-trim".into())
        .spawn(|| {
            loop {
                std::thread::sleep(onebit_heap::EVERY);
                if TRIMMER.trim_if_due() {
                    tracing::debug!(
                        "heap trimmed: RssAnon {} KiB",
                        onebit_heap::rss_anon_kib().unwrap_or(0)
                    );
                }
            }
        });
    if let Err(e) = started {
        tracing::warn!("cannot start the heap trimmer ({e}); serve runs without it");
    }
}
