//! A pool of byte buffers. Fresh large allocations cost a page fault per 4 KiB on first
//! touch, which dominates copying at the message sizes training moves; the backends'
//! buffers of their own (the local backend's buffered sends, the MPI backend's all-to-all
//! results and partial sums) are reused instead.

use std::sync::Mutex;

/// Buffers kept for reuse at most.
const MAX_BUFFERS: usize = 64;

/// A shared pool of reusable byte buffers.
#[derive(Debug, Default)]
pub struct BufferPool {
    bufs: Mutex<Vec<Vec<u8>>>,
}

impl BufferPool {
    /// An empty pool.
    pub fn new() -> BufferPool {
        BufferPool::default()
    }

    /// A buffer of exactly `len` initialized bytes (contents unspecified), reused when a free
    /// one is large enough. Its capacity is never zero, so its address is a real allocation.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let mut v = self.reuse(len);
        if v.len() >= len {
            v.truncate(len);
        } else {
            v.resize(len, 0);
        }
        v
    }

    /// A copy of `data` in a reused buffer (written once: no zero fill, no regrowth), made
    /// as the local backend copies ([`crate::local`]'s `copy.rs`: streamed past the caches
    /// from 32 MiB).
    pub fn copy_of(&self, data: &[u8]) -> Vec<u8> {
        let mut v = self.reuse(data.len());
        crate::local::copy::copy_to_vec(&mut v, data);
        v
    }

    /// The smallest free buffer holding at least `cap` bytes (contents as left), or a new
    /// one.
    fn reuse(&self, cap: usize) -> Vec<u8> {
        let mut bufs = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        let best = bufs
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= cap)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => bufs.swap_remove(i),
            None => Vec::with_capacity(cap.max(1)),
        }
    }

    /// Returns a buffer for reuse.
    pub fn give(&self, v: Vec<u8>) {
        if v.capacity() == 0 {
            return;
        }
        let mut bufs = self.bufs.lock().unwrap_or_else(|e| e.into_inner());
        if bufs.len() < MAX_BUFFERS {
            bufs.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_sized() {
        let pool = BufferPool::new();
        let a = pool.copy_of(&[1, 2, 3]);
        assert_eq!(a, [1, 2, 3]);
        pool.give(a);
        let b = pool.take(2);
        assert_eq!(b.len(), 2);
        assert!(b.capacity() >= 3);
        let c = pool.take(0);
        assert!(c.capacity() >= 1, "never the dangling address of an empty Vec");
    }

    #[test]
    fn a_copy_reuses_a_buffer_that_holds_it() {
        let pool = BufferPool::new();
        pool.give(Vec::with_capacity(16));
        let big = pool.copy_of(&[7; 4096]);
        let at = big.as_ptr();
        pool.give(big);
        // The small buffer stays; the copy lands in the big one, without regrowing.
        let again = pool.copy_of(&[9; 4000]);
        assert_eq!((again.as_ptr(), again.len(), again[3999]), (at, 4000, 9));
        // Past the streaming threshold, into a new buffer and then into the same one after a
        // small copy has shortened it.
        pool.give(again);
        let n = crate::local::copy::STREAM_MIN + 77;
        let big: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let first = pool.copy_of(&big);
        let at = first.as_ptr();
        assert!(first == big);
        pool.give(first);
        let small: Vec<u8> = (0..5000).map(|i| (i % 13) as u8).collect();
        let shortened = pool.copy_of(&small);
        assert!(shortened == small && shortened.as_ptr() == at);
        pool.give(shortened);
        let second = pool.copy_of(&big[1..]);
        assert!(second == big[1..] && second.as_ptr() == at);
    }
}
