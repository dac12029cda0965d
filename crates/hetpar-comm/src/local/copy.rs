//! The copies the local backend makes between members' buffers.
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
        stream::copy(dst, src);
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod stream {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// A cache line.
    const LINE: usize = 64;
    /// A page, and the pages a pass interleaves.
    const PAGE: usize = 4096;
    const PAGES: usize = 4;

    /// [`super::copy`] of equal-length buffers through non-temporal stores: the bytes up to
    /// the first line boundary of `dst` and the tail past the last whole group of
    /// [`PAGES`] pages by `copy_from_slice`, the rest line by line, a line from each of the
    /// group's pages in turn. Uses SSE2 only, which every x86-64 CPU has.
    pub(super) fn copy(dst: &mut [u8], src: &[u8]) {
        debug_assert_eq!(dst.len(), src.len());
        let n = dst.len();
        let head = dst.as_ptr().align_offset(LINE).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let group = PAGES * PAGE;
        let body = (n - head) / group * group;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        for base in (0..body).step_by(group) {
            for off in (0..PAGE).step_by(LINE) {
                for p in 0..PAGES {
                    let at = base + p * PAGE + off;
                    // SAFETY: `at + LINE <= body <= n - head`, so the line lies inside both
                    // slices past `head`; `d + at` is 64-byte aligned (`d` is, and `at` is
                    // a multiple of LINE), as the stores require 16; `dst` is borrowed
                    // mutably, so the two do not overlap.
                    unsafe { line(d.add(at), s.add(at)) };
                }
            }
        }
        // The streamed stores are weakly ordered: fenced before any later store (the
        // release that tells the other members this copy is done) can be seen.
        // SAFETY: SSE is part of x86-64.
        unsafe { _mm_sfence() };
        dst[head + body..].copy_from_slice(&src[head + body..]);
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
    }
}
