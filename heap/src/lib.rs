//! Freed heap memory handed back to the kernel, for serve and the routes that share its
//! process (the inproc add-on).
//!
//! glibc gives a freed block's pages back only when they sit at the top of an arena's heap
//! (or the block had a mapping of its own). Serve's connections, requests and buffers come
//! and go on a dozen threads' arenas, and the holes they leave in the middle of a heap stay
//! resident: under heaptrack serve's live heap stays level for a twenty-minute soak while its
//! RSS steps up by megabytes. `malloc_trim(0)` walks every arena and gives each whole free
//! page back with `MADV_DONTNEED`; for serve's heap it takes about a millisecond.
//!
//! [`Trimmer`] decides when: at most once per [`EVERY`], and only after work since the last
//! trim, so an idle serve never wakes the allocator. [`tune`], called once before any thread
//! starts, keeps fewer holes from being made: two arenas rather than one per thread (memory a
//! thread freed serves the next thread's request), and a fixed mmap threshold, so a request's
//! large buffer (a body of hundreds of KiB) is its own mapping, unmapped when freed, instead of
//! raising glibc's threshold and landing in the middle of an arena. In the soak the two
//! together kept serve's RSS within a few hundred KiB where the trim alone still drifted.
//! A crate of its own, not part of plugin-api's ABI: each library that links it has its own
//! copy, and a trim or a setting by any of them covers the whole process.

// `malloc_trim` is glibc's, called through C.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The shortest time between two trims.
pub const EVERY: Duration = Duration::from_secs(5);

/// At most this many malloc arenas ([`tune`]).
pub const ARENAS: i32 = 2;

/// A block this large or larger gets a mapping of its own ([`tune`]): glibc's initial
/// threshold, held there.
pub const OWN_MAPPING_BYTES: i32 = 128 * 1024;

/// Set the allocator for a long-running server: [`ARENAS`] arenas and a fixed mmap threshold
/// of [`OWN_MAPPING_BYTES`]. Call it first thing in `main`, before any thread starts. A
/// setting the user gave glibc in the environment (`MALLOC_ARENA_MAX`,
/// `MALLOC_MMAP_THRESHOLD_`) is left as given.
pub fn tune() {
    let unset = |var: &str| std::env::var_os(var).is_none();
    // SAFETY: mallopt only changes the allocator's parameters, under its own lock.
    unsafe {
        if unset("MALLOC_ARENA_MAX") {
            libc::mallopt(libc::M_ARENA_MAX, ARENAS);
        }
        if unset("MALLOC_MMAP_THRESHOLD_") {
            libc::mallopt(libc::M_MMAP_THRESHOLD, OWN_MAPPING_BYTES);
        }
    }
}

/// Give every arena's whole free pages back to the kernel.
pub fn trim() {
    // SAFETY: malloc_trim takes the allocator's own locks and releases only pages that hold
    // no allocation, so no pointer anyone holds is affected.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// This process's anonymous resident memory (`RssAnon` in /proc/self/status), in KiB: what
/// a trim gives back is taken from it.
pub fn rss_anon_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// When the process last trimmed, and whether it has worked since. Shared by the threads that
/// work (they call [`Trimmer::worked`]) and the one that trims.
pub struct Trimmer {
    last: std::sync::Mutex<Instant>,
    dirty: AtomicBool,
}

impl Default for Trimmer {
    fn default() -> Self {
        Trimmer {
            last: std::sync::Mutex::new(Instant::now()),
            dirty: AtomicBool::new(false),
        }
    }
}

impl Trimmer {
    /// Something ran whose allocations may have left holes (a request, an engine step).
    pub fn worked(&self) {
        if !self.dirty.load(Ordering::Relaxed) {
            self.dirty.store(true, Ordering::Relaxed);
        }
    }

    /// Trim when work was done since the last trim and [`EVERY`] has passed; true when it
    /// trimmed. Call it between steps of a loop, or every [`EVERY`] from a thread of its own.
    pub fn trim_if_due(&self) -> bool {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if last.elapsed() < EVERY || !self.dirty.swap(false, Ordering::Relaxed) {
            return false;
        }
        trim();
        *last = Instant::now();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that count this process's memory, so one's blocks do not land in
    /// another's count.
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_trim_gives_back_pages_freed_in_the_middle_of_the_heap() {
        let _alone = ALONE.lock();
        // 64 MiB of small blocks below the mmap threshold, all touched; then every block but
        // the last freed: the last one pins the heap's top, so without a trim the freed pages
        // below it stay resident.
        let mut blocks: Vec<Vec<u8>> = (0..16 * 1024).map(|_| vec![1u8; 4096]).collect();
        let last = blocks.pop();
        drop(blocks);
        let before = rss_anon_kib().expect("RssAnon");
        trim();
        let after = rss_anon_kib().expect("RssAnon");
        drop(last);
        assert!(
            before.saturating_sub(after) > 32 * 1024,
            "RssAnon {before} KiB before the trim, {after} KiB after"
        );
    }

    /// Blocks with mappings of their own (glibc's count).
    fn own_mappings() -> usize {
        // SAFETY: mallinfo2 reads the allocator's statistics.
        unsafe { libc::mallinfo2() }.hblks
    }

    #[test]
    fn after_tune_a_large_freed_block_does_not_move_the_mmap_threshold() {
        let _alone = ALONE.lock();
        tune();
        // Untuned, glibc raises its threshold to the size of a freed mapped block, and the
        // next block of 200 KiB comes from an arena's heap.
        drop(std::hint::black_box(vec![1u8; 4 << 20]));
        let before = own_mappings();
        let block = std::hint::black_box(vec![1u8; 200 * 1024]);
        let during = own_mappings();
        drop(block);
        assert_eq!(
            during,
            before + 1,
            "a 200 KiB block after a 4 MiB one was freed is not a mapping of its own"
        );
    }

    #[test]
    fn it_trims_only_after_work_and_at_most_once_per_interval() {
        let trimmer = Trimmer::default();
        *trimmer.last.lock().unwrap() = Instant::now() - EVERY;
        assert!(!trimmer.trim_if_due(), "nothing ran");
        trimmer.worked();
        assert!(trimmer.trim_if_due());
        trimmer.worked();
        assert!(!trimmer.trim_if_due(), "within the interval");
        *trimmer.last.lock().unwrap() = Instant::now() - EVERY;
        assert!(trimmer.trim_if_due());
        assert!(!trimmer.trim_if_due(), "nothing ran since");
    }
}
