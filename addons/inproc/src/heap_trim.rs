//! Freed heap memory handed back to the kernel when the engine goes idle.
//!
//! glibc returns a freed block's pages to the kernel only when they sit at the top of an
//! arena's heap (or the block had a mapping of its own). Serve, its connections' buffers and
//! llama.cpp's own small allocations come and go on a dozen threads' arenas, and the holes
//! they leave in the middle of a heap stay resident: the soak's inproc phase saw RSS step up
//! by a few hundred KiB now and then for thousands of requests, with nothing leaked
//! (heaptrack). `malloc_trim(0)` walks every arena and gives back each whole free page with
//! `MADV_DONTNEED`; it takes about a millisecond for serve's heap. The engine thread calls it
//! between its steps (whether or not more work waits, so a busy engine trims too), at most
//! once per [`EVERY`] and only after work.
// `malloc_trim` is glibc's, called through C.
#![allow(unsafe_code)]

use std::time::{Duration, Instant};

/// The shortest time between two trims.
pub const EVERY: Duration = Duration::from_secs(5);

/// When the engine last trimmed, and whether it has run anything since.
pub struct HeapTrim {
    last: Instant,
    dirty: bool,
}

impl Default for HeapTrim {
    fn default() -> Self {
        HeapTrim {
            last: Instant::now(),
            dirty: false,
        }
    }
}

impl HeapTrim {
    /// The engine ran a request (its allocations may have left holes).
    pub fn ran(&mut self) {
        self.dirty = true;
    }

    /// Between two steps of the engine: trim when it ran something since the last trim and
    /// [`EVERY`] has passed. True when it trimmed.
    pub fn between_steps(&mut self) -> bool {
        if !self.dirty || self.last.elapsed() < EVERY {
            return false;
        }
        trim_now();
        self.last = Instant::now();
        self.dirty = false;
        true
    }
}

/// Give every arena's whole free pages back to the kernel.
pub fn trim_now() {
    // SAFETY: malloc_trim takes the allocator's own locks; it only releases pages that hold
    // no allocation, so no pointer anyone holds is affected.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rss_anon_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    #[test]
    fn a_trim_gives_back_pages_freed_in_the_middle_of_the_heap() {
        let _alone = crate::PROCESS_MEMORY_TESTS.lock();
        // 64 MiB of small blocks below the mmap threshold, all touched; then every block but
        // the last freed: the last one pins the heap's top, so without a trim the freed
        // pages below it stay resident.
        let blocks: Vec<Vec<u8>> = (0..16 * 1024).map(|_| vec![1u8; 4096]).collect();
        let mut blocks = blocks;
        let last = blocks.pop();
        drop(blocks);
        let before = rss_anon_kib();
        trim_now();
        let after = rss_anon_kib();
        drop(last);
        assert!(
            before.saturating_sub(after) > 32 * 1024,
            "RssAnon {before} KiB before the trim, {after} KiB after"
        );
    }

    #[test]
    fn it_trims_only_after_work_and_at_most_once_per_interval() {
        let mut trim = HeapTrim::default();
        assert!(!trim.between_steps(), "nothing ran");
        trim.ran();
        assert!(!trim.between_steps(), "within the interval");
        trim.last = Instant::now() - EVERY;
        assert!(trim.between_steps());
        assert!(!trim.between_steps(), "nothing ran since");
    }
}
