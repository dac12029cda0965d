//! The copies the local backend makes between members' buffers, and into its pool's send
//! buffers.
//!
//! Small copies are `copy_from_slice` (the C library's `memcpy`). A copy of
//! [`STREAM_MIN`] bytes or more, on x86-64, is written with non-temporal stores: each
//! destination line goes to memory whole, without first being read into the cache and
//! without evicting what the cache holds, and the loop takes one line from each of four
//! consecutive pages in turn, so four streams are open at once. On the development VM
//! (Intel Xeon, 2 cores, both copying) `memcpy` ran at 6.7-7.1 GB/s per thread at 64 and
//! 128 MiB and 9-12 at 32 MiB, this loop at 11.4-14.2; at 16 MiB both ran at 14-15
//! (BENCHMARKS.md, "Large copies past the cache"). Below the threshold the destination
//! stays in the cache for whoever reads it next.
#![allow(unsafe_code)]

/// Copies of this many bytes or more are streamed past the caches (x86-64).
pub(crate) const STREAM_MIN: usize = 32 << 20;

/// `dst.copy_from_slice(src)`; see the module's docs for how large copies are written.
///
/// # Panics
/// If the lengths differ, as `copy_from_slice` does.
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy between buffers of different lengths");
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_MIN {
        // SAFETY: `dst` has `src.len()` writable bytes and, borrowed mutably, does not
        // overlap `src`.
        unsafe { stream::copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
        return;
    }
    dst.copy_from_slice(src);
}

/// `v`'s contents replaced by a copy of `src`, in `v`'s allocation where it holds them (a
/// pool's reused send buffer): `v.clear(); v.extend_from_slice(src)`, with a large copy
/// written as [`copy`] writes it, whatever `v` held before.
pub(crate) fn copy_to_vec(v: &mut Vec<u8>, src: &[u8]) {
    v.clear();
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN {
        v.reserve(src.len());
        // SAFETY: after `reserve` `v` has room for `src.len()` bytes; `stream::copy` writes
        // every one of them before `set_len` makes them `v`'s. `v`'s allocation is its own,
        // apart from `src` (which cannot borrow from `v` while `v` is borrowed mutably).
        unsafe {
            stream::copy(v.as_mut_ptr(), src.as_ptr(), src.len());
            v.set_len(src.len());
        }
        return;
    }
    v.extend_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod stream {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    use std::ptr::copy_nonoverlapping;

    /// A cache line.
    const LINE: usize = 64;
    /// A page, and the pages a pass interleaves.
    const PAGE: usize = 4096;
    const PAGES: usize = 4;

    /// `n` bytes from `s` to `d` through non-temporal stores: the bytes up to the first line
    /// boundary of `d` and the tail past the last whole group of [`PAGES`] pages as plain
    /// copies, the rest line by line, a line from each of the group's pages in turn. Every
    /// byte of `d` is written (it need not be initialized before). Uses SSE2 only, which
    /// every x86-64 CPU has.
    ///
    /// # Safety
    /// `s` must be valid for reading `n` bytes and `d` for writing `n` bytes, and the two
    /// ranges must not overlap.
    pub(super) unsafe fn copy(d: *mut u8, s: *const u8, n: usize) {
        let head = d.align_offset(LINE).min(n);
        let group = PAGES * PAGE;
        let body = (n - head) / group * group;
        // SAFETY: the caller's contract: every offset below stays under `n` (`head + body
        // <= n`, and each line `at + LINE <= body`), the ranges do not overlap, and
        // `d + head` is 64-byte aligned, so each line's stores are 16-byte aligned.
        unsafe {
            copy_nonoverlapping(s, d, head);
            let (d, s) = (d.add(head), s.add(head));
            for base in (0..body).step_by(group) {
                for off in (0..PAGE).step_by(LINE) {
                    for p in 0..PAGES {
                        let at = base + p * PAGE + off;
                        line(d.add(at), s.add(at));
                    }
                }
            }
            // The streamed stores are weakly ordered: fenced before any later store (the
            // release that tells the other members this copy is done) can be seen.
            _mm_sfence();
            copy_nonoverlapping(s.add(body), d.add(body), n - head - body);
        }
    }

    /// One line: four unaligned 16-byte loads from `s`, four non-temporal stores to `d`.
    ///
    /// # Safety
    /// `s` and `d` must each have 64 valid bytes, `d` writable, 16-byte aligned and apart
    /// from `s`'s.
    #[inline(always)]
    unsafe fn line(d: *mut u8, s: *const u8) {
        let (d, s) = (d.cast::<__m128i>(), s.cast::<__m128i>());
        // SAFETY: the caller's contract; SSE2 is part of x86-64.
        unsafe {
            let v = [
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            ];
            for (i, v) in v.into_iter().enumerate() {
                _mm_stream_si128(d.add(i), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{STREAM_MIN, copy};

    /// Every length and alignment around the threshold and the page groups gives the bytes
    /// `copy_from_slice` gives.
    #[test]
    fn copies_match_copy_from_slice() {
        let len = STREAM_MIN + 3 * 16384 + 100;
        let src: Vec<u8> = (0..len + 64).map(|i| (i * 31 + i / 977) as u8).collect();
        let mut dst = vec![0u8; len + 64];
        for n in [0, 1, 4095, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 17, len] {
            for (so, dof) in [(0, 0), (3, 0), (0, 5), (7, 63), (16, 32)] {
                dst.fill(0xEE);
                copy(&mut dst[dof..dof + n], &src[so..so + n]);
                assert!(dst[dof..dof + n] == src[so..so + n], "length {n}, offsets {so} {dof}");
                assert!(dst[..dof].iter().all(|&b| b == 0xEE), "wrote before the copy");
                assert!(dst[dof + n..].iter().all(|&b| b == 0xEE), "wrote past the copy");
            }
        }
        // Into a vector: empty, holding less, holding more, with room or without.
        for n in [0, 5, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 17] {
            for start in [Vec::new(), vec![0xEE; 3], vec![0xEE; len], Vec::with_capacity(len)] {
                let mut v = start;
                super::copy_to_vec(&mut v, &src[3..3 + n]);
                assert!(v == src[3..3 + n], "length {n}");
            }
        }
    }
}
