//! The binary's allocator: mimalloc, with large blocks staggered across cache sets.
//!
//! mimalloc (v3, as `libmimalloc-sys` builds it) carves its arenas into 64 KiB slices and
//! starts the pages of large blocks on them, so every tensor of 256 KiB or more starts at
//! the same address modulo 64 KiB. An element-wise pass over several such tensors (AdamW
//! reads four and writes three) then touches the same cache sets in every one of them at
//! once, and the L2 cache evicts lines the prefetcher has just brought in: on the Intel VM
//! of BENCHMARKS.md, AdamW over 4M parameters took 10 ms under mimalloc against 5.5 ms
//! under glibc's malloc (whose large blocks come from `mmap` at varied addresses). Here
//! each large block is moved forward by one of 32 offsets, 17 cache lines apart, picked
//! by a hash of the address mimalloc gave it: blocks at different addresses start in
//! different sets but by chance (one in 32 for a pair), whatever order they were
//! allocated in.
//!
//! Freed pages stay committed ([`keep_freed_pages`]): by default mimalloc hands pages of
//! freed blocks back to the OS after a delay (`purge_delay`, 1 s in v3), so a block not
//! reused within it (every tensor of a step longer than that) faulted its pages in again,
//! each zeroed by the kernel: the ViT row of `hetpar bench nn --dtype f64` (1.45 s a step)
//! took 34,065 page faults in 5 steps against 561 with the pages kept, and 60 steps of the
//! demo 41-48 s against 26.6 s (BENCHMARKS.md).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};

/// `mi_option_purge_delay`: the option before `mi_option_use_numa_nodes` in the enum of
/// the mimalloc `libmimalloc-sys` builds (v3, and v2 alike), for which the crate names no
/// constant; a test holds the index to the defaults around it.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = libmimalloc_sys::mi_option_use_numa_nodes - 1;

/// Keeps the pages of freed blocks committed for reuse rather than handing them back to
/// the OS (mimalloc's `purge_delay` of -1), unless the environment set the delay
/// (`MIMALLOC_PURGE_DELAY`, in any case, or its old name `MIMALLOC_RESET_DELAY`): the
/// process holds its peak footprint, which a training run reaches in its first step. Call
/// it first in `main`, before any other thread starts: mimalloc's options are plain stores.
pub fn keep_freed_pages() {
    // SAFETY: a store to mimalloc's option table (a default, which an environment setting
    // read at start-up keeps precedence over), made before any other thread exists.
    unsafe { libmimalloc_sys::mi_option_set_default(PURGE_DELAY, -1) };
}

/// Blocks of this size or more are staggered.
const LARGE: usize = 256 << 10;
/// The offsets are multiples of this: 17 cache lines, so the offsets spread over sets of
/// every cache level (and over 34 KiB of the 64 KiB that repeat).
const STEP: usize = 17 * 64;
/// The number of distinct offsets (a power of two).
const COLORS: usize = 32;
/// The alignment of a staggered block (a cache line; blocks asking for more are not
/// staggered).
const LINE: usize = 64;

/// mimalloc, with blocks of [`LARGE`] bytes or more placed at staggered offsets.
pub struct Staggered;

impl Staggered {
    /// Whether a block of `layout` is staggered.
    fn staggers(layout: Layout) -> bool {
        layout.size() >= LARGE && layout.align() <= LINE
    }

    /// The block mimalloc holds for a staggered block of `layout`: room for the largest
    /// offset in front of it (the offset is at least one line, so the offset's word fits
    /// there). None where that size is past what a layout can hold: the allocation fails.
    fn outer(layout: Layout) -> Option<Layout> {
        let size = layout.size().checked_add(LINE + (COLORS - 1) * STEP)?;
        Layout::from_size_align(size, LINE).ok()
    }

    /// The staggered block inside mimalloc's block `base` (null stays null).
    unsafe fn place(base: *mut u8) -> *mut u8 {
        if base.is_null() {
            return base;
        }
        // Fibonacci hashing of the address's bits above the 64 KiB that repeat.
        let color = ((base as usize >> 16).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 59) % COLORS;
        let offset = LINE + color * STEP;
        unsafe {
            let block = base.add(offset);
            block.cast::<usize>().sub(1).write(offset);
            block
        }
    }
}

// SAFETY: every block comes from mimalloc; a staggered block is mimalloc's block of
// `outer(layout)` moved forward by `offset` (a multiple of LINE, at least LINE, at most
// the padding of `outer`), so it lies inside that block, is aligned to LINE (and so to
// the layout's alignment, which is at most LINE), and has `layout.size()` bytes after it.
// The offset is kept in the word in front of the block, inside the padding (8-aligned,
// since the block is), and read back to find mimalloc's block when the block is freed.
// Whether a block is staggered depends only on its size and alignment, which the caller
// passes again to `dealloc` and `realloc`. Nothing here panics: a size past the largest
// layout gives null, as the allocator's contract asks.
unsafe impl GlobalAlloc for Staggered {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !Self::staggers(layout) {
            return unsafe { mimalloc::MiMalloc.alloc(layout) };
        }
        let Some(outer) = Self::outer(layout) else { return std::ptr::null_mut() };
        unsafe { Self::place(mimalloc::MiMalloc.alloc(outer)) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !Self::staggers(layout) {
            return unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        }
        let Some(outer) = Self::outer(layout) else { return std::ptr::null_mut() };
        unsafe { Self::place(mimalloc::MiMalloc.alloc_zeroed(outer)) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !Self::staggers(layout) {
            return unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) };
        }
        // A staggered block was allocated with this layout, so its outer layout exists.
        let Some(outer) = Self::outer(layout) else { return };
        unsafe {
            let offset = ptr.cast::<usize>().sub(1).read();
            mimalloc::MiMalloc.dealloc(ptr.sub(offset), outer);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` with `layout.align()` is a valid layout.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !Self::staggers(layout) && !Self::staggers(new) {
            return unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) };
        }
        let moved = unsafe { self.alloc(new) };
        if !moved.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        moved
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn blocks_keep_their_bytes_and_alignment_across_sizes() {
        let a = Staggered;
        for (size, align) in [(24, 8), (LARGE - 1, 4), (LARGE, 4), (3 << 20, 64), (LARGE, 4096)] {
            let l = Layout::from_size_align(size, align).unwrap();
            unsafe {
                let p = a.alloc(l);
                assert!(!p.is_null() && (p as usize).is_multiple_of(align), "{size} {align}");
                for i in [0, size / 2, size - 1] {
                    p.add(i).write((i % 251) as u8);
                }
                // Grow past the threshold and shrink below it, bytes kept.
                let q = a.realloc(p, l, size * 2);
                let l2 = Layout::from_size_align(size * 2, align).unwrap();
                assert!((q as usize).is_multiple_of(align));
                for i in [0, size / 2, size - 1] {
                    assert_eq!(q.add(i).read(), (i % 251) as u8, "{size} {align} grown");
                }
                let r = a.realloc(q, l2, 16);
                assert_eq!(r.read(), 0);
                a.dealloc(r, Layout::from_size_align(16, align).unwrap());
                let z = a.alloc_zeroed(l);
                assert!((0..size).step_by(4093).all(|i| z.add(i).read() == 0));
                a.dealloc(z, l);
            }
        }
    }

    #[test]
    fn large_blocks_start_in_different_sets() {
        // Under mimalloc alone all of them start at one address modulo 64 KiB; 16 blocks
        // hashed to 32 offsets land on about 12 (on 3 or fewer once in 10^12).
        let a = Staggered;
        let l = Layout::from_size_align(1 << 20, 4).unwrap();
        let blocks: Vec<*mut u8> = (0..16).map(|_| unsafe { a.alloc(l) }).collect();
        let mut starts: Vec<usize> = blocks.iter().map(|&p| p as usize % (64 << 10)).collect();
        starts.sort();
        starts.dedup();
        assert!(starts.len() >= 4, "{starts:?}");
        for p in blocks {
            unsafe { a.dealloc(p, l) };
        }
    }

    #[test]
    fn the_purge_delay_index_names_the_purge_delay() {
        // Its v3 default (1000 ms) between the deprecated eager-commit delay's (1) and the
        // NUMA nodes' (0); unless the environment set any of them (mimalloc reads names in
        // any case).
        if std::env::vars_os()
            .any(|(k, _)| k.to_string_lossy().to_ascii_uppercase().starts_with("MIMALLOC_"))
        {
            return;
        }
        let get = |o| unsafe { libmimalloc_sys::mi_option_get(o) };
        assert_eq!((get(PURGE_DELAY - 1), get(PURGE_DELAY), get(PURGE_DELAY + 1)), (1, 1000, 0));
    }

    #[test]
    fn a_size_past_the_largest_layout_gives_null() {
        let l = Layout::from_size_align(isize::MAX as usize - 63, 64).unwrap();
        assert!(unsafe { Staggered.alloc(l) }.is_null());
        assert!(unsafe { Staggered.alloc_zeroed(l) }.is_null());
    }
}
