//! The AVX512-BF16 kernel of [`super::blocked`]: `vdpbf16ps` over a 12 x 32 tile of f32 sums
//! held in registers, the operands rounded to bf16 pairs while they are packed; and the
//! conversions, interleaves and 16 x 16 lane transposes that the AMX kernel's packing shares.

use std::arch::x86_64::*;

use super::{Blocking, Out, Tile, View, pair};

/// Rows of the micro-kernel.
const MR: usize = 12;
/// Columns of the micro-kernel (two vectors of 16 lanes).
const NR: usize = 32;
/// Pairs of the inner dimension per packed block.
const KC: usize = 256;

/// The kernel: a 12 x 32 tile of sums in registers.
pub struct Avx512;

impl Blocking for Avx512 {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = KC;
    const MC: usize = 8 * MR;
    const NC: usize = 32 * NR;

    /// Packed rows keep their `KC` stride, which the kernel's addressing takes as a
    /// constant.
    fn lhs_depth(_: usize) -> usize {
        KC
    }

    fn rhs_depth(kc: usize) -> usize {
        kc
    }

    /// Rows `i0..i0 + mc` and pairs `p0..p0 + kc` of `lhs` into `out`: `MR`-row panels, each
    /// row `KC` pairs long (rows past `mc` zero, a missing odd element zero).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
    unsafe fn pack_lhs(
        out: &mut [u32],
        lhs: &[f32],
        lv: View,
        i0: usize,
        mc: usize,
        p0: usize,
        kc: usize,
        k: usize,
    ) {
        let (k0, k1) = (2 * p0, k.min(2 * (p0 + kc)));
        for i in mc..mc.next_multiple_of(MR) {
            out[i * KC..i * KC + kc].fill(0);
        }
        if lv.cs == 1 {
            for i in 0..mc {
                let start = lv.offset + (i0 + i) * lv.rs;
                convert(&lhs[start + k0..start + k1], &mut out[i * KC..i * KC + kc]);
            }
        } else if lv.rs == 1 {
            // Rows are neighbours in memory (a transposed operand, as a weight gradient's
            // `dy^T`): 16 rows of two columns give 16 pairs, and 16 such columns of
            // pairs transpose into 16 packed rows (rows past `mc` zero, as the masked
            // loads leave them).
            let rows = mc.next_multiple_of(MR);
            // The pairs outside, the rows inside: each column is read along its length
            // (the rows outside and the pairs inside walked the block down its columns a
            // cache line at a time, a strided pass over memory the step had evicted).
            for q in (0..kc).step_by(16) {
                for i in (0..mc).step_by(16) {
                    let n = 16.min(mc - i);
                    let mut t = [0u32; 256];
                    for l in 0..16.min(kc - q) {
                        let (ke, ko) = (k0 + 2 * (q + l), k0 + 2 * (q + l) + 1);
                        let col = |kk: usize| {
                            if kk < k1 {
                                let s = lv.offset + (i0 + i) + kk * lv.cs;
                                &lhs[s..s + n]
                            } else {
                                &[][..]
                            }
                        };
                        interleave(col(ke), col(ko), &mut t[l * 16..(l + 1) * 16]);
                    }
                    // Row `i + r`, pairs `q..q + 16` (those past `kc` zero, inside the
                    // row's `KC`).
                    let at = i * KC + q;
                    if i + 16 <= rows {
                        transpose(&t, 16, &mut out[at..], KC);
                    } else {
                        let mut u = [0u32; 256];
                        transpose(&t, 16, &mut u, 16);
                        for r in 0..rows - i {
                            out[at + r * KC..at + r * KC + 16]
                                .copy_from_slice(&u[r * 16..(r + 1) * 16]);
                        }
                    }
                }
            }
        } else {
            // The inner dimension is strided, and so are the rows: walk the inner
            // dimension outside, so each step reads neighbouring rows.
            for p in 0..kc {
                let (ke, ko) = (k0 + 2 * p, k0 + 2 * p + 1);
                for i in 0..mc {
                    let at = |kk: usize| lhs[lv.offset + (i0 + i) * lv.rs + kk * lv.cs];
                    out[i * KC + p] = pair(at(ke), if ko < k { at(ko) } else { 0.0 });
                }
            }
        }
    }

    /// Columns `j0..j0 + nc` and pairs `p0..p0 + kc` of `rhs` into `out`: `NR`-column
    /// panels, each `kc` rows of `NR` pairs (columns past `nc` zero).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
    unsafe fn pack_rhs(
        out: &mut [u32],
        rhs: &[f32],
        rv: View,
        j0: usize,
        nc: usize,
        p0: usize,
        kc: usize,
    ) {
        let k = rv.rows;
        let panels = nc.div_ceil(NR);
        if rv.cs == 1 {
            // Rows of the inner dimension are contiguous: interleave two at a time, each pair
            // of rows read along its length, panel by panel (panels outside walked the
            // block down its rows `NR` columns at a time).
            for p in 0..kc {
                let ke = 2 * (p0 + p);
                for jp in 0..panels {
                    let (c0, cols) = (j0 + jp * NR, NR.min(nc - jp * NR));
                    let row = |kk: usize| {
                        let start = rv.offset + kk * rv.rs + c0;
                        &rhs[start..start + cols]
                    };
                    let odd = if ke + 1 < k { row(ke + 1) } else { &[][..] };
                    let at = jp * kc * NR + p * NR;
                    interleave(row(ke), odd, &mut out[at..at + NR]);
                }
            }
            return;
        }
        let mut col = [0u32; KC];
        for jp in 0..panels {
            let panel = &mut out[jp * kc * NR..(jp + 1) * kc * NR];
            let (c0, cols) = (j0 + jp * NR, NR.min(nc - jp * NR));
            for c in 0..NR {
                if c >= cols {
                    (0..kc).for_each(|p| panel[p * NR + c] = 0);
                    continue;
                }
                let base = rv.offset + (c0 + c) * rv.cs;
                if rv.rs == 1 {
                    let (k0, k1) = (2 * p0, k.min(2 * (p0 + kc)));
                    convert(&rhs[base + k0..base + k1], &mut col[..kc]);
                } else {
                    for (p, lane) in col[..kc].iter_mut().enumerate() {
                        let (ke, ko) = (2 * (p0 + p), 2 * (p0 + p) + 1);
                        let odd = if ko < k { rhs[base + ko * rv.rs] } else { 0.0 };
                        *lane = pair(rhs[base + ke * rv.rs], odd);
                    }
                }
                (0..kc).for_each(|p| panel[p * NR + c] = col[p]);
            }
        }
    }

    /// One `MR` x `NR` tile: `a` (`MR` rows of `KC` pairs) times `b` (`kc` rows of `NR`
    /// pairs), added into the destination's `tile` as `out = (out if acc) + beta * sum`.
    ///
    /// # Safety
    /// `out` addresses elements `(r, c)`, `r < tile.rows`, `c < tile.cols`, of `dst` through
    /// its strides, which no other thread writes; `a` and `b` hold `MR * KC` and `kc * NR`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
    unsafe fn kernel(a: &[u32], b: &[u32], kc: usize, out: Out, tile: Tile, acc: bool, beta: f32) {
        assert!(a.len() >= MR * KC && b.len() >= kc * NR && kc <= KC);
        let (a, b) = (a.as_ptr(), b.as_ptr());
        let mut sum = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kc {
            // SAFETY: `p < kc`, and the lengths are checked above.
            unsafe {
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
                for (r, s) in sum.iter_mut().enumerate() {
                    let x: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*a.add(r * KC + p) as i32));
                    s[0] = _mm512_dpbf16_ps(s[0], x, b0);
                    s[1] = _mm512_dpbf16_ps(s[1], x, b1);
                }
            }
        }
        let scale = _mm512_set1_ps(beta);
        for (r, s) in sum.iter().enumerate().take(tile.rows) {
            // SAFETY: row `r` of the tile is inside the destination (the contract).
            let row = unsafe { out.ptr.add(r * out.rs) };
            if out.cs == 1 {
                for (h, &v) in s.iter().enumerate() {
                    let n = tile.cols.saturating_sub(16 * h).min(16);
                    if n == 0 {
                        break;
                    }
                    let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
                    // SAFETY: the mask covers columns `16h..16h + n` of the tile.
                    unsafe {
                        let at = row.add(16 * h);
                        let old =
                            if acc { _mm512_maskz_loadu_ps(mask, at) } else { _mm512_setzero_ps() };
                        _mm512_mask_storeu_ps(at, mask, _mm512_fmadd_ps(scale, v, old));
                    }
                }
            } else {
                let mut lanes = [0f32; NR];
                // SAFETY: `lanes` holds two vectors.
                unsafe {
                    _mm512_storeu_ps(lanes.as_mut_ptr(), s[0]);
                    _mm512_storeu_ps(lanes.as_mut_ptr().add(16), s[1]);
                }
                for (c, &v) in lanes.iter().enumerate().take(tile.cols) {
                    // SAFETY: column `c` of the tile is inside the destination.
                    unsafe {
                        let at = row.add(c * out.cs);
                        let old = if acc { *at } else { 0.0 };
                        *at = beta.mul_add(v, old);
                    }
                }
            }
        }
    }
}

/// `src` (`2 * dst.len()` elements or fewer) as consecutive pairs into `dst` (zero past
/// the end of `src`).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
pub(in crate::kernels) fn convert(src: &[f32], dst: &mut [u32]) {
    let full = (src.len() / 32).min(dst.len() / 16);
    for (s, d) in src.chunks_exact(32).zip(dst.chunks_exact_mut(16)).take(full) {
        // SAFETY: `s` holds 32 floats and `d` 16 lanes; unaligned loads and stores.
        unsafe {
            let lo = _mm512_loadu_ps(s.as_ptr());
            let hi = _mm512_loadu_ps(s.as_ptr().add(16));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(d.as_mut_ptr().cast(), v);
        }
    }
    let at = |i: usize| src.get(i).copied().unwrap_or(0.0);
    for (p, lane) in dst.iter_mut().enumerate().skip(16 * full) {
        *lane = pair(at(2 * p), at(2 * p + 1));
    }
}

/// Lane `c` of `dst` (a multiple of 16 lanes) the pair `(even[c], odd[c])`, zero past
/// either's end.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
pub(in crate::kernels) fn interleave(even: &[f32], odd: &[f32], dst: &mut [u32]) {
    // Lane 2i of the result is bf16 element i of `even`, lane 2i + 1 element i of `odd`
    // (the converted vector holds `even` in its low 16 elements, `odd` in its high 16).
    let idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    for h in 0..dst.len() / 16 {
        let load = |s: &[f32]| {
            let n = s.len().saturating_sub(16 * h).min(16);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            // SAFETY: the mask covers only elements `16h..16h + n` of `s`.
            unsafe { _mm512_maskz_loadu_ps(mask, s.as_ptr().wrapping_add(16 * h)) }
        };
        // SAFETY: both are 512 bits of plain lanes.
        let v: __m512i = unsafe { std::mem::transmute(_mm512_cvtne2ps_pbh(load(odd), load(even))) };
        let v = _mm512_permutexvar_epi16(idx, v);
        // SAFETY: `dst` holds lanes `16h..16h + 16`.
        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(16 * h).cast(), v) };
    }
}

/// `dst[r * dst_rs + c] = src[c * src_rs + r]` for `r, c < 16`: a 16 x 16 transpose of
/// 32-bit lanes in registers (pairs within each 128-bit lane, then 4 x 4 blocks, then the
/// lanes themselves).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
pub(in crate::kernels) fn transpose(src: &[u32], src_rs: usize, dst: &mut [u32], dst_rs: usize) {
    assert!(src.len() >= 15 * src_rs + 16 && dst.len() >= 15 * dst_rs + 16);
    // SAFETY: row `i < 16` of `src` is inside it (checked above); unaligned loads.
    let r: [__m512i; 16] =
        std::array::from_fn(|i| unsafe { _mm512_loadu_si512(src.as_ptr().add(i * src_rs).cast()) });
    let a: [__m512i; 16] = std::array::from_fn(|i| {
        let (x, y) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 { _mm512_unpacklo_epi32(x, y) } else { _mm512_unpackhi_epi32(x, y) }
    });
    // `b[4g + j]`, 128-bit lane `l`: column `4l + j` of rows `4g..4g + 4`.
    let b: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, j) = (i / 4, i % 4);
        let (x, y) = (a[4 * g + j / 2], a[4 * g + 2 + j / 2]);
        if j % 2 == 0 { _mm512_unpacklo_epi64(x, y) } else { _mm512_unpackhi_epi64(x, y) }
    });
    for j in 0..4 {
        let c0 = _mm512_shuffle_i32x4::<0x44>(b[j], b[4 + j]);
        let c1 = _mm512_shuffle_i32x4::<0xee>(b[j], b[4 + j]);
        let d0 = _mm512_shuffle_i32x4::<0x44>(b[8 + j], b[12 + j]);
        let d1 = _mm512_shuffle_i32x4::<0xee>(b[8 + j], b[12 + j]);
        let rows = [
            _mm512_shuffle_i32x4::<0x88>(c0, d0),
            _mm512_shuffle_i32x4::<0xdd>(c0, d0),
            _mm512_shuffle_i32x4::<0x88>(c1, d1),
            _mm512_shuffle_i32x4::<0xdd>(c1, d1),
        ];
        for (l, v) in rows.into_iter().enumerate() {
            // SAFETY: row `4l + j` of `dst`, inside it (checked above).
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add((4 * l + j) * dst_rs).cast(), v) };
        }
    }
}
