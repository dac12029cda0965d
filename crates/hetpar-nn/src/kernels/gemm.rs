//! Strided matrix products over slices, on gemm's kernels (the ones candle's matmul runs,
//! AVX-512 where the CPU has it). The one call into gemm's `unsafe` entry point sits behind
//! bound and aliasing checks made here, so callers stay safe.
#![allow(unsafe_code)]

use gemm::Parallelism;

use super::Real;

/// The kernels gemm picks on this CPU, by name, as gemm itself decides at run time:
/// "AVX-512" where the CPU has AVX-512F (the `x86-v4` feature hetpar-nn turns on),
/// "AVX2+FMA" where it has FMA, else "scalar" (off x86-64: "native", gemm's pick for the
/// CPU).
pub fn path() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            "AVX-512"
        } else if std::arch::is_x86_feature_detected!("fma") {
            "AVX2+FMA"
        } else {
            "scalar"
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "native"
    }
}

/// Whether a product of `m x n` outputs over an inner dimension of `k` keeps its bits
/// whatever the operands' strides. gemm runs a product of at most 256 outputs whose
/// operands are both contiguous along the inner dimension on a kernel of its own (a
/// horizontal sum; a single row or column on a matrix-vector one), and one with `k` of 2
/// or less on an outer-product kernel, each summing in another order than its blocked
/// kernels; past those sizes the blocked kernels run, packing any layout to the same sums.
/// A caller that hands gemm a rearranged copy of an operand for speed does so only where
/// this holds.
pub fn layout_keeps_bits(m: usize, n: usize, k: usize) -> bool {
    m > 1 && n > 1 && m * n > 256 && k > 2
}

/// A matrix inside a slice: element `(r, c)` at `offset + r * rs + c * cs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// Index of element `(0, 0)`.
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

impl View {
    /// `rows x cols` with rows `rs` apart and unit column stride.
    pub fn rows(offset: usize, rows: usize, cols: usize, rs: usize) -> View {
        View { offset, rows, cols, rs, cs: 1 }
    }

    /// The transpose (the same elements).
    pub fn t(self) -> View {
        View { offset: self.offset, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }

    /// One past the last element (`offset` when empty), or `None` if that overflows.
    fn end(&self) -> Option<usize> {
        if self.rows == 0 || self.cols == 0 {
            return Some(self.offset);
        }
        self.offset
            .checked_add((self.rows - 1).checked_mul(self.rs)?)?
            .checked_add((self.cols - 1).checked_mul(self.cs)?)?
            .checked_add(1)
    }

    /// Whether distinct `(r, c)` name distinct elements (required of a destination).
    fn injective(&self) -> bool {
        let (r, c) = (self.rows, self.cols);
        if r == 0 || c == 0 {
            // No element at all (a linear with no outputs has a row stride of 0).
            return true;
        }
        let covers = |stride: usize, n: usize, other: usize| {
            n.checked_mul(other).is_some_and(|span| stride >= span)
        };
        r <= 1 && (c <= 1 || self.cs >= 1)
            || c <= 1 && self.rs >= 1
            || self.cs >= 1
                && self.rs >= 1
                && (covers(self.rs, c, self.cs) || covers(self.cs, r, self.rs))
    }

    /// Whether the view lies inside a slice of `len` elements, with strides that gemm's
    /// signed offsets can hold.
    fn inside(&self, len: usize) -> bool {
        let max = isize::MAX as usize;
        self.rs <= max && self.cs <= max && self.end().is_some_and(|e| e <= len)
    }
}

/// `dst = (dst if accumulate else 0) + beta * lhs @ rhs` over the views, on one thread.
///
/// # Panics
/// As [`matmul_on`].
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Real>(
    dst: &mut [T],
    dv: View,
    lhs: &[T],
    lv: View,
    rhs: &[T],
    rv: View,
    accumulate: bool,
    beta: T,
) {
    matmul_on(dst, dv, lhs, lv, rhs, rv, accumulate, beta, 1);
}

/// [`matmul`] on as many threads as candle's matmuls use (`RAYON_NUM_THREADS`, else every
/// core): for the products of whole layers.
#[allow(clippy::too_many_arguments)]
pub fn matmul_wide<T: Real>(
    dst: &mut [T],
    dv: View,
    lhs: &[T],
    lv: View,
    rhs: &[T],
    rv: View,
    accumulate: bool,
    beta: T,
) {
    let threads = super::threads();
    matmul_on(dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads);
}

/// A new matrix of `len` elements, `lhs @ rhs` written through `dv`, which must name every
/// element of it once (`dv.rows * dv.cols == len`): row-major, column-major or any other
/// such layout. gemm writes each element before reading it, without the zero fill a
/// `vec![0; len]` destination costs (a memset of the whole output, a few percent of a
/// layer's step).
/// Runs on as many threads as [`matmul_wide`].
///
/// # Panics
/// As [`matmul_on`], and if `dv` does not cover `len` elements.
pub fn matmul_new<T: Real>(
    len: usize,
    dv: View,
    lhs: &[T],
    lv: View,
    rhs: &[T],
    rv: View,
) -> Vec<T> {
    assert!(
        dv.rows.checked_mul(dv.cols) == Some(len),
        "matmul destination {dv:?} does not cover {len} elements"
    );
    let k = lv.cols;
    // A vector result goes through gemm's matrix-vector kernel, which views the destination
    // as a slice before writing it: zero-filled first, at no cost worth counting.
    if len == 0 || k == 0 || dv.rows <= 1 || dv.cols <= 1 {
        let mut dst = vec![T::zero(); len];
        matmul_wide(&mut dst, dv, lhs, lv, rhs, rv, false, T::ONE);
        return dst;
    }
    let mut dst: Vec<T> = Vec::with_capacity(len);
    check(len, dv, lhs.len(), lv, rhs.len(), rv);
    // SAFETY: as in `matmul_on`: the views lie inside their slices (the destination's
    // inside the `len` elements allocated) and the destination's is injective. With
    // `read_dst` false gemm's first pass over the inner dimension (its only one up to 512)
    // writes each of the `rows * cols` elements it names before any later pass reads them,
    // its threads joined in between; distinct and inside `len`, they are all `len` of
    // them, so every element is initialized before `set_len`. Matrix results only: a
    // vector takes the zero-filled path above.
    unsafe {
        gemm_raw(dst.as_mut_ptr(), dv, lhs, lv, rhs, rv, false, T::ONE, super::threads());
        dst.set_len(len);
    }
    dst
}

/// gemm's call on raw views, after [`check`].
///
/// # Safety
/// The views must have passed [`check`] against `dst`'s allocation, `lhs` and `rhs`; `dst`
/// must not overlap them; with `accumulate` every element `dv` names must be initialized.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<T: Real>(
    dst: *mut T,
    dv: View,
    lhs: &[T],
    lv: View,
    rhs: &[T],
    rv: View,
    accumulate: bool,
    beta: T,
    threads: usize,
) {
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    // SAFETY: the caller's contract; the offsets lie inside the slices (checked).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.add(dv.offset),
            dv.cs as isize,
            dv.rs as isize,
            accumulate,
            lhs.as_ptr().add(lv.offset),
            lv.cs as isize,
            lv.rs as isize,
            rhs.as_ptr().add(rv.offset),
            rv.cs as isize,
            rv.rs as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None },
        );
    }
}

/// Panics unless the shapes chain, every view lies inside its slice (of the lengths
/// given) and the destination's view names no element twice.
pub(super) fn check(dst: usize, dv: View, lhs: usize, lv: View, rhs: usize, rv: View) {
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    assert!(lv.rows == m && rv.cols == n && rv.rows == k, "matmul shapes {dv:?} {lv:?} {rv:?}");
    assert!(dv.inside(dst) && lv.inside(lhs) && rv.inside(rhs), "matmul view out of bounds");
    assert!(dv.injective(), "matmul destination {dv:?} aliases itself");
}

/// [`matmul`] on `threads` threads.
///
/// # Panics
/// If the shapes do not chain, a view leaves its slice, or `dst`'s view names an element
/// twice: the conditions under which gemm's pointer-based call is sound.
#[allow(clippy::too_many_arguments)]
pub fn matmul_on<T: Real>(
    dst: &mut [T],
    dv: View,
    lhs: &[T],
    lv: View,
    rhs: &[T],
    rv: View,
    accumulate: bool,
    beta: T,
    threads: usize,
) {
    check(dst.len(), dv, lhs.len(), lv, rhs.len(), rv);
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[dv.offset + r * dv.rs + c * dv.cs] = T::zero();
                }
            }
        }
        return;
    }
    // SAFETY: every element gemm touches lies inside its slice (checked above without
    // overflow: the last element of each view is in bounds, and every stride fits in an
    // isize, so the casts below keep it non-negative); `dst` is borrowed
    // mutably, so it cannot overlap `lhs` or `rhs`, and its view is injective, so no
    // element is written twice; gemm reads `dst` only when `accumulate` (read_dst), and
    // every element of the slices is initialized.
    unsafe { gemm_raw(dst.as_mut_ptr(), dv, lhs, lv, rhs, rv, accumulate, beta, threads) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f64], av: View, b: &[f64], bv: View) -> Vec<f64> {
        let mut out = vec![0.0; av.rows * bv.cols];
        for r in 0..av.rows {
            for c in 0..bv.cols {
                out[r * bv.cols + c] = (0..av.cols)
                    .map(|i| {
                        a[av.offset + r * av.rs + i * av.cs] * b[bv.offset + i * bv.rs + c * bv.cs]
                    })
                    .sum();
            }
        }
        out
    }

    #[test]
    fn strided_products_match_a_loop() {
        let a: Vec<f64> = (0..200).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..300).map(|i| (i as f64 * 0.11).cos()).collect();
        // A 5x7 block with row stride 9 at offset 3, times the transpose of a 4x7 block.
        let av = View::rows(3, 5, 7, 9);
        let bv = View::rows(10, 4, 7, 11).t();
        let want = naive(&a, av, &b, bv);
        let mut dst = vec![1.0; 5 * 4 * 2];
        let dv = View::rows(0, 5, 4, 8);
        matmul(&mut dst, dv, &a, av, &b, bv, true, 2.0);
        for r in 0..5 {
            for c in 0..4 {
                let got = dst[r * 8 + c];
                assert!((got - (1.0 + 2.0 * want[r * 4 + c])).abs() < 1e-12);
                assert_eq!(dst[r * 8 + 4 + c], 1.0, "outside the view untouched");
            }
        }
    }

    #[test]
    fn a_new_destination_gets_the_bits_of_a_zeroed_one() {
        let a: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..300).map(|i| (i as f32 * 0.11).cos()).collect();
        let (av, bv) = (View::rows(0, 9, 20, 20), View::rows(0, 13, 20, 20).t());
        let row_major = View::rows(0, 9, 13, 13);
        let column_major = View { offset: 0, rows: 9, cols: 13, rs: 1, cs: 9 };
        for dv in [row_major, column_major] {
            let mut want = vec![0.0f32; 9 * 13];
            matmul_wide(&mut want, dv, &a, av, &b, bv, false, 1.0);
            let got = matmul_new(9 * 13, dv, &a, av, &b, bv);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        // A vector result (one column) takes the zero-filled path, with the same bits.
        let mut want = vec![0.0f32; 9];
        let (dv, bv1) = (View::rows(0, 9, 1, 1), View::rows(0, 1, 20, 20).t());
        matmul_wide(&mut want, dv, &a, av, &b, bv1, false, 1.0);
        assert_eq!(matmul_new(9, dv, &a, av, &b, bv1), want);
        // No inner dimension: zeros.
        let got = matmul_new(
            6,
            View::rows(0, 2, 3, 3),
            &a,
            View::rows(0, 2, 0, 0),
            &b,
            View::rows(0, 0, 3, 3),
        );
        assert_eq!(got, vec![0.0; 6]);
    }

    #[test]
    #[should_panic(expected = "does not cover")]
    fn a_new_destination_its_view_does_not_cover_is_refused() {
        let a = vec![0.0f32; 16];
        matmul_new(
            5,
            View::rows(0, 2, 2, 2),
            &a,
            View::rows(0, 2, 2, 2),
            &a,
            View::rows(0, 2, 2, 2),
        );
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_view_past_its_slice_is_refused() {
        let a = vec![0.0f32; 10];
        let mut d = vec![0.0f32; 4];
        matmul(
            &mut d,
            View::rows(0, 2, 2, 2),
            &a,
            View::rows(0, 2, 3, 5),
            &a,
            View::rows(6, 3, 2, 2),
            false,
            1.0,
        );
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_stride_that_wraps_is_refused() {
        let a = vec![0.0f32; 4];
        let mut d = vec![0.0f32; 4];
        // (rows - 1) * rs + 1 wraps to 0 in unchecked arithmetic.
        let lv = View { offset: 0, rows: 2, cols: 1, rs: usize::MAX, cs: 1 };
        matmul(&mut d, View::rows(0, 2, 1, 1), &a, lv, &a, View::rows(0, 1, 1, 1), false, 1.0);
    }

    #[test]
    #[should_panic(expected = "aliases itself")]
    fn an_aliasing_destination_is_refused() {
        let a = vec![0.0f32; 16];
        let mut d = vec![0.0f32; 4];
        let dv = View { offset: 0, rows: 2, cols: 2, rs: 1, cs: 1 };
        matmul(&mut d, dv, &a, View::rows(0, 2, 2, 2), &a, View::rows(0, 2, 2, 2), false, 1.0);
    }

    #[test]
    fn an_empty_destination_with_a_zero_stride_is_a_no_op() {
        // A linear with no outputs: 3 rows of 0 columns, so a row stride of 0.
        let a = vec![1.0f32; 12];
        let mut d: Vec<f32> = Vec::new();
        matmul(
            &mut d,
            View::rows(0, 3, 0, 0),
            &a,
            View::rows(0, 3, 4, 4),
            &a,
            View::rows(0, 4, 0, 0),
            false,
            1.0,
        );
    }
}
