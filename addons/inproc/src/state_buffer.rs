//! The prompt cache's copies of slot states, each in pages of its own rather than on the heap.
//!
//! Each is an anonymous `mmap`. A state is a megabyte or more, and the cache keeps, evicts and
//! restores them all the time. From the heap, glibc serves such blocks from the engine thread's
//! arena once the first one is freed (its mmap threshold rises to the largest block freed), and
//! blocks of varying size coming and going there leave holes the arena keeps: serve's RSS crept
//! up for thousands of requests after warm-up (the soak's inproc phase). In pages of their own,
//! a state's memory goes back to the kernel the moment it is dropped.
// `mmap`, `munmap` and `mincore` are C calls; the bytes are read through the mapping's pointer.
#![allow(unsafe_code)]

use std::ptr::NonNull;

/// A fixed-size, zero-filled byte buffer in its own anonymous mapping.
pub struct StateBuffer {
    pages: NonNull<u8>,
    mapped: usize,
    len: usize,
}

// SAFETY: the buffer owns its mapping outright (no aliasing), as a Vec<u8> owns its block.
unsafe impl Send for StateBuffer {}

impl StateBuffer {
    /// `len` zero bytes (a fresh anonymous mapping is zero-filled); None when `len` is 0 or the
    /// kernel refuses the mapping.
    pub fn zeroed(len: usize) -> Option<StateBuffer> {
        if len == 0 {
            return None;
        }
        // SAFETY: an anonymous private mapping of `len` bytes at an address the kernel picks;
        // the result is checked before use.
        let pages = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if pages == libc::MAP_FAILED {
            return None;
        }
        Some(StateBuffer {
            pages: NonNull::new(pages.cast())?,
            mapped: len,
            len,
        })
    }

    /// Keep only the first `len` bytes (a copy that wrote fewer than it was given room for).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pages.as_ptr()
    }
}

impl std::ops::Deref for StateBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping holds `mapped` >= `len` readable bytes for the buffer's life.
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr(), self.len) }
    }
}

impl Drop for StateBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `zeroed`, of that length, unmapped once.
        unsafe {
            libc::munmap(self.pages.as_ptr().cast(), self.mapped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StateBuffer;

    #[test]
    fn a_buffer_is_zeroed_writable_and_keeps_what_it_is_cut_to() {
        let mut buffer = StateBuffer::zeroed(3 << 20).expect("mapped");
        assert_eq!(buffer.len(), 3 << 20);
        assert!(buffer.iter().all(|&b| b == 0));
        // SAFETY: within the mapping (a test).
        unsafe { *buffer.as_mut_ptr().add(10) = 7 };
        buffer.truncate(11);
        assert_eq!(&buffer[..], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7]);
        assert!(StateBuffer::zeroed(0).is_none());
    }

    /// Pages of `len` bytes at `start` the kernel holds in memory, or None when the range is
    /// not mapped (mincore's ENOMEM). Per mapping, so other tests' allocations in this process
    /// cannot move it, as they move the process's RssAnon.
    fn resident_pages(start: *mut u8, len: usize) -> Option<usize> {
        let mut vec = vec![0u8; len.div_ceil(4096)];
        // SAFETY: (a test) mincore only reads the page tables of the range and writes `vec`,
        // which has one byte per page.
        let rc = unsafe { libc::mincore(start.cast(), len, vec.as_mut_ptr()) };
        (rc == 0).then(|| vec.iter().filter(|&&b| b & 1 == 1).count())
    }

    #[test]
    fn a_dropped_buffer_goes_back_to_the_kernel() {
        let len = 64 << 20;
        let mut buffer = StateBuffer::zeroed(len).expect("mapped");
        let start = buffer.as_mut_ptr();
        assert_eq!(
            resident_pages(start, len),
            Some(0),
            "a fresh mapping holds no pages"
        );
        for page in (0..len).step_by(4096) {
            // SAFETY: within the mapping (a test).
            unsafe { *start.add(page) = 1 };
        }
        assert_eq!(resident_pages(start, len), Some(len / 4096));
        drop(buffer);
        assert_eq!(
            resident_pages(start, len),
            None,
            "the dropped buffer's range is still mapped"
        );
    }
}
