//! bf16 products on AMX tiles (Intel's Advanced Matrix Extensions, Sapphire Rapids and
//! later): `tdpbf16ps` multiplies a 16 x 32 tile of bf16 values by a 32 x 16 one and adds
//! the 16 x 16 results into a tile of f32 sums, 16,384 floating-point operations in one
//! instruction. Where the CPU has AMX-BF16 and Linux lets this process use the tile
//! registers, [`super::bf16::matmul_on`] and [`super::bf16::matmul_new`] run here. The operands are rounded to bf16 while
//! they are packed, as on the AVX512-BF16 path, so both multiply the same bf16 values and
//! sum in f32; they differ only in the order of those sums.
//!
//! The loops around the micro-kernel are the AVX512-BF16 kernel's ([`super::bf16`]'s
//! `blocked`: `NC` columns of the right operand and `KC` pairs of the inner dimension
//! packed once and shared, blocks of 128 rows of the left operand packed per thread), with
//! both operands packed tile by tile: each 16 x 16 block of pairs is 1 KiB, contiguous and
//! 64-byte aligned, so a tile load reads whole cache lines in one stream (a tile load
//! across cache lines runs 4-5 times slower). The micro-kernel keeps a 32 x 32 block of
//! sums in four tiles and uses the other four for two tiles of each operand; tiles are not
//! renamed, so each step's loads are issued as soon as the products before them have read
//! the tile they overwrite.
#![allow(unsafe_code)]

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::bf16::avx::transpose;
use super::bf16::{Blocking, Out, Tile, avx, blocked, pair};
use super::gemm::View;

/// Rows of a tile, and pairs (32-bit lanes) per tile row.
const TILE: usize = 16;
/// Lanes of one tile.
const BLOCK: usize = TILE * TILE;
/// Rows of the micro-kernel (two tiles).
const MR: usize = 2 * TILE;
/// Columns of the micro-kernel (two tiles).
const NR: usize = 2 * TILE;
/// Pairs of the inner dimension per packed block (a multiple of `TILE`).
const KC: usize = 256;
/// Columns per packed block of the right operand.
const NC: usize = 32 * NR;

/// Whether this process multiplies on AMX tiles: the CPU has AMX-TILE, AMX-BF16 and the
/// AVX512-BF16 the packing uses, and can save tile state (XSAVE), and Linux granted this
/// process the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once; a kernel without
/// AMX support refuses).
pub fn available() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| super::bf16::native() && cpu_has_amx() && permitted())
}

fn cpu_has_amx() -> bool {
    if __cpuid(0).eax < 0xd {
        return false;
    }
    let features = __cpuid_count(7, 0).edx;
    // AMX-BF16 (bit 22) and AMX-TILE (bit 24); XTILECFG and XTILEDATA (bits 17, 18) among
    // the state components the CPU can save.
    let saved = __cpuid_count(0xd, 0).eax;
    features >> 22 & 1 == 1 && features >> 24 & 1 == 1 && saved >> 17 & 3 == 3
}

/// Asks Linux for the tile data state, which it gives a process only on request.
#[cfg(target_os = "linux")]
fn permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a system call with integer arguments that changes only this process's
    // permissions; it fails (non-zero) where the kernel has no AMX support.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn permitted() -> bool {
    false
}

/// The tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): eight tiles of 16
/// rows of 64 bytes.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: Config = {
    let mut c = Config {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row: [0; 16],
        rows: [0; 16],
    };
    let mut t = 0;
    while t < 8 {
        c.bytes_per_row[t] = (TILE * 4) as u16;
        c.rows[t] = TILE as u8;
        t += 1;
    }
    c
};

/// Where pair `p` of row (or column) `i` of a packed block lies: panels of `MR` rows, each
/// `kp / TILE` steps of two tiles (rows `0..16` and `16..32` of the panel), each tile 16
/// rows of 16 pairs.
fn packed(i: usize, p: usize, kp: usize) -> usize {
    (i / MR) * MR * kp
        + (p / TILE) * 2 * BLOCK
        + (i % MR / TILE) * BLOCK
        + (i % TILE) * TILE
        + p % TILE
}

/// See [`super::bf16::matmul_on`].
///
/// # Safety
/// [`available`]; as [`super::bf16::blocked`] asks of its views and `dst`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
pub unsafe fn run(
    dst: *mut f32,
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    accumulate: bool,
    beta: f32,
    threads: usize,
) {
    // SAFETY: the caller's contract (the transposed views name the same elements).
    unsafe {
        if transposed_is_cheaper(dv, lv, rv) {
            blocked::<Amx>(dst, dv.t(), rhs, rv.t(), lhs, lv.t(), accumulate, beta, threads)
        } else {
            blocked::<Amx>(dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads)
        }
    }
}

/// The kernel: a 32 x 32 block of sums in four tiles.
struct Amx;

impl Blocking for Amx {
    const MR: usize = MR;
    const NR: usize = NR;
    const KC: usize = KC;
    const MC: usize = 4 * MR;
    const NC: usize = NC;

    /// Whole tiles: `kc` pairs padded with zeros to a multiple of 16.
    fn lhs_depth(kc: usize) -> usize {
        kc.next_multiple_of(TILE)
    }

    fn rhs_depth(kc: usize) -> usize {
        kc.next_multiple_of(TILE)
    }

    /// Rows `i0..i0 + mc` and pairs `p0..p0 + kc` of `lhs`, tile by tile (rows past `mc`, and
    /// pairs past `kc` up to a multiple of 16, zero; a missing odd element zero).
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
        let kp = kc.next_multiple_of(TILE);
        let (k0, k1) = (2 * p0, k.min(2 * (p0 + kc)));
        let rows = mc.next_multiple_of(MR);
        if lv.cs == 1 {
            for i in 0..rows {
                for q in (0..kp).step_by(TILE) {
                    let s = k0 + 2 * q;
                    let src = if i < mc && s < k1 {
                        let start = lv.offset + (i0 + i) * lv.rs;
                        &lhs[start + s..start + k1.min(s + 2 * TILE)]
                    } else {
                        &[][..]
                    };
                    let at = packed(i, q, kp);
                    avx::convert(src, &mut out[at..at + TILE]);
                }
            }
        } else if lv.rs == 1 {
            // Rows are neighbours in memory (a transposed operand): read 16 rows of two
            // columns at a time, which gives a column of pairs, and transpose 16 of them;
            // each column read along its length.
            for q in (0..kp).step_by(TILE) {
                for i in (0..rows).step_by(TILE) {
                    let n = TILE.min(mc.saturating_sub(i));
                    let mut t = [0u32; BLOCK];
                    for l in 0..TILE {
                        let (ke, ko) = (k0 + 2 * (q + l), k0 + 2 * (q + l) + 1);
                        let col = |kk: usize| {
                            if kk < k1 && n > 0 {
                                let s = lv.offset + (i0 + i) + kk * lv.cs;
                                &lhs[s..s + n]
                            } else {
                                &[][..]
                            }
                        };
                        avx::interleave(col(ke), col(ko), &mut t[l * TILE..(l + 1) * TILE]);
                    }
                    let at = packed(i, q, kp);
                    transpose(&t, TILE, &mut out[at..at + BLOCK], TILE);
                }
            }
        } else {
            for i in 0..rows {
                for p in 0..kp {
                    let (ke, ko) = (k0 + 2 * p, k0 + 2 * p + 1);
                    let at = |kk: usize| {
                        if i < mc && kk < k1 {
                            lhs[lv.offset + (i0 + i) * lv.rs + kk * lv.cs]
                        } else {
                            0.0
                        }
                    };
                    out[packed(i, p, kp)] = pair(at(ke), at(ko));
                }
            }
        }
    }

    /// Columns `j0..j0 + nc` and pairs `p0..p0 + kc` of `rhs`, tile by tile: tile rows are
    /// pairs, tile lanes columns (columns past `nc`, and pairs past `kc` up to a multiple of
    /// 16, zero).
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
        let kp = kc.next_multiple_of(TILE);
        let k = rv.rows;
        let (k0, k1) = (2 * p0, k.min(2 * (p0 + kc)));
        let cols = nc.next_multiple_of(NR);
        if rv.cs == 1 {
            // Rows of the inner dimension are contiguous: interleave two at a time, each
            // pair of rows read along its length.
            for p in 0..kp {
                let (ke, ko) = (k0 + 2 * p, k0 + 2 * p + 1);
                for c in (0..cols).step_by(TILE) {
                    let n = TILE.min(nc.saturating_sub(c));
                    let row = |kk: usize| {
                        if kk < k1 && n > 0 {
                            let s = rv.offset + kk * rv.rs + j0 + c;
                            &rhs[s..s + n]
                        } else {
                            &[][..]
                        }
                    };
                    let at = rhs_at(c, p, kp);
                    avx::interleave(row(ke), row(ko), &mut out[at..at + TILE]);
                }
            }
        } else if rv.rs == 1 {
            // Columns are contiguous along the inner dimension (a transposed operand): convert
            // 16 columns of 16 pairs and transpose them.
            for c in (0..cols).step_by(TILE) {
                let n = TILE.min(nc.saturating_sub(c));
                for q in (0..kp).step_by(TILE) {
                    let mut t = [0u32; BLOCK];
                    let s = k0 + 2 * q;
                    for (j, lanes) in t.chunks_exact_mut(TILE).enumerate().take(n) {
                        if s < k1 {
                            let base = rv.offset + (j0 + c + j) * rv.cs;
                            avx::convert(&rhs[base + s..base + k1.min(s + 2 * TILE)], lanes);
                        }
                    }
                    let at = rhs_at(c, q, kp);
                    transpose(&t, TILE, &mut out[at..at + BLOCK], TILE);
                }
            }
        } else {
            for c in 0..cols {
                for p in 0..kp {
                    let (ke, ko) = (k0 + 2 * p, k0 + 2 * p + 1);
                    let at = |kk: usize| {
                        if c < nc && kk < k1 {
                            rhs[rv.offset + kk * rv.rs + (j0 + c) * rv.cs]
                        } else {
                            0.0
                        }
                    };
                    out[rhs_at(c, p, kp) + c % TILE] = pair(at(ke), at(ko));
                }
            }
        }
    }

    unsafe fn begin() {
        // SAFETY: the CPU has AMX and this process the tile state (`available`, which
        // `run`'s caller holds); the configuration is a valid palette-1 layout.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
    }

    unsafe fn end() {
        // SAFETY: as `begin`; leaves the tile state as it was before it.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    unsafe fn kernel(a: &[u32], b: &[u32], kc: usize, out: Out, tile: Tile, acc: bool, beta: f32) {
        // SAFETY: the caller's contract.
        unsafe { kernel(a, b, kc.next_multiple_of(TILE), out, tile, acc, beta) }
    }
}

/// Whether to compute the product's transpose, `rhs^T lhs^T` into `dv^T`, instead. Each
/// sum multiplies the same pairs in the same order either way, so the bits do not change;
/// the cost does. An operand whose inner dimension is strided is transposed while it is
/// packed (the left operand once per block of `NC` columns), and a destination that is not
/// row-major takes its sums through a transpose (once per block of `KC` pairs), where the
/// other cases read and write contiguous runs (and whole tiles go straight to a row-major
/// destination). This counts the elements transposed each way and picks the fewer; at a
/// tie, the row-major destination.
fn transposed_is_cheaper(dv: View, lv: View, rv: View) -> bool {
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    let steps = k.div_ceil(2 * KC);
    let cost = |(l_cs, r_cs, d_cs): (usize, usize, usize), (m, n): (usize, usize)| {
        usize::from(l_cs != 1) * m * k * n.div_ceil(NC)
            + usize::from(r_cs != 1) * k * n
            + usize::from(d_cs != 1) * m * n * steps
    };
    let here = cost((lv.cs, rv.cs, dv.cs), (m, n));
    let there = cost((rv.rs, lv.rs, dv.rs), (n, m));
    there < here || there == here && dv.cs != 1
}

/// Where the 16 lanes of pair `p` for columns `c - c % 16 ..` of a packed right operand
/// start: tile rows are pairs, lanes columns.
fn rhs_at(c: usize, p: usize, kp: usize) -> usize {
    (c / NR) * NR * kp + (p / TILE) * 2 * BLOCK + (c % NR / TILE) * BLOCK + (p % TILE) * TILE
}

/// The tile products of one `MR` x `NR` block over `kp` pairs: `a` (`MR` rows) times `b`
/// (`NR` columns), added into the sums in tiles 0-3 (rows 0-15 by columns 0-15 and 16-31,
/// then rows 16-31). Each step's tile loads are issued as soon as the products before them
/// have read the tile they overwrite, since tiles are not renamed.
///
/// # Safety
/// Tiles configured as [`CONFIG`] on this thread; `a` and `b` hold `MR * kp` and `NR * kp`
/// lanes, 64-byte aligned; `kp` a positive multiple of `TILE`.
#[inline(always)]
unsafe fn products(a: &[u32], b: &[u32], kp: usize) {
    debug_assert!(kp > 0 && kp.is_multiple_of(TILE) && a.len() >= MR * kp && b.len() >= NR * kp);
    // SAFETY: the caller's contract; step `q` reads lanes `2 * BLOCK * q..2 * BLOCK * (q + 1)`
    // of each.
    unsafe {
        asm!(
            "tileloadd tmm4, [{a} + {s}]",
            "tileloadd tmm6, [{b} + {s}]",
            "tileloadd tmm5, [{a} + {s} + 1024]",
            "tileloadd tmm7, [{b} + {s} + 1024]",
            "dec {n}",
            "jz 3f",
            "2:",
            "add {a}, 2048",
            "add {b}, 2048",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm4, [{a} + {s}]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tileloadd tmm6, [{b} + {s}]",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "tileloadd tmm5, [{a} + {s} + 1024]",
            "tileloadd tmm7, [{b} + {s} + 1024]",
            "dec {n}",
            "jnz 2b",
            "3:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a = inout(reg) a.as_ptr() => _,
            b = inout(reg) b.as_ptr() => _,
            n = inout(reg) kp / TILE => _,
            s = in(reg) TILE * 4,
            options(nostack, readonly),
        );
    }
}

/// One `MR` x `NR` block: `a` (`MR` rows of `kp` pairs) times `b` (`kp` pairs of `NR`
/// columns), added into the destination's `tile` as `out = (out if acc) + beta * sum`.
///
/// # Safety
/// Tiles configured as [`CONFIG`] on this thread; `a` and `b` as [`products`] takes them;
/// `out` addresses elements `(r, c)`, `r < tile.rows`, `c < tile.cols`, of `dst` through
/// its strides, which no other thread writes. Without `acc` every path below stores each
/// of those elements and reads none (the [`Blocking::kernel`] promise).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
unsafe fn kernel(a: &[u32], b: &[u32], kp: usize, out: Out, tile: Tile, acc: bool, beta: f32) {
    assert!(kp > 0 && kp.is_multiple_of(TILE) && a.len() >= MR * kp && b.len() >= NR * kp);
    // Every block's sums start from zero, so an element gets the same bits by every path
    // below (and by the product's transpose): the first block's sums are the element, later
    // blocks' are added to it.
    if !acc && out.cs == 1 && beta == 1.0 && tile.rows == MR && tile.cols == NR {
        // A whole block of a row-major destination: the tiles go straight to it.
        let rs = out.rs * 4;
        let (c0, c2) = (out.ptr, out.ptr.wrapping_add(TILE * out.rs));
        // SAFETY: rows 0-31 and columns 0-31 of the block are elements of the destination.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            products(a, b, kp);
            asm!(
                "tilestored [{c0} + {rs}], tmm0",
                "tilestored [{c0} + {rs} + 64], tmm1",
                "tilestored [{c2} + {rs}], tmm2",
                "tilestored [{c2} + {rs} + 64], tmm3",
                c0 = in(reg) c0, c2 = in(reg) c2, rs = in(reg) rs,
                options(nostack),
            );
        }
        return;
    }
    #[repr(C, align(64))]
    struct Sums([u32; MR * NR]);
    let mut sums = Sums([0; MR * NR]);
    // SAFETY: the contract; the sums are stored into `sums`, rows `NR` lanes apart.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        products(a, b, kp);
        asm!(
            "tilestored [{c} + {cs}], tmm0",
            "tilestored [{c} + {cs} + 64], tmm1",
            "tilestored [{c} + {cs} + 2048], tmm2",
            "tilestored [{c} + {cs} + 2112], tmm3",
            c = in(reg) sums.0.as_mut_ptr(),
            cs = in(reg) NR * 4,
            options(nostack),
        );
    }
    if out.cs == 1 {
        for r in 0..tile.rows {
            // SAFETY: row `r` of the tile is inside the destination (the contract), its
            // first `tile.cols` elements contiguous.
            unsafe { add_run(out.ptr.add(r * out.rs), &sums.0[r * NR..], tile.cols, acc, beta) };
        }
    } else if out.rs == 1 {
        // A column-major destination: columns of the sums are its runs.
        let mut cols = Sums([0; MR * NR]);
        for (r, c) in [(0, 0), (0, TILE), (TILE, 0), (TILE, TILE)] {
            transpose(&sums.0[r * NR + c..], NR, &mut cols.0[c * MR + r..], MR);
        }
        for c in 0..tile.cols {
            // SAFETY: column `c` of the tile is inside the destination, its first
            // `tile.rows` elements contiguous.
            unsafe { add_run(out.ptr.add(c * out.cs), &cols.0[c * MR..], tile.rows, acc, beta) };
        }
    } else {
        for r in 0..tile.rows {
            for c in 0..tile.cols {
                // SAFETY: element `(r, c)` of the tile is inside the destination.
                unsafe {
                    let at = out.ptr.add(r * out.rs + c * out.cs);
                    let v = f32::from_bits(sums.0[r * NR + c]);
                    *at = if acc { beta.mul_add(v, *at) } else { beta * v };
                }
            }
        }
    }
}

/// `at[i] = (at[i] if acc) + beta * sums[i]` for `i < n` (at most 32; without `acc`, `at`
/// is stored and not read), `sums` the bits of
/// f32 sums.
///
/// # Safety
/// `at..at + n` are elements of the destination no other thread writes.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
unsafe fn add_run(at: *mut f32, sums: &[u32], n: usize, acc: bool, beta: f32) {
    assert!(n <= 2 * TILE && sums.len() >= n);
    let scale = _mm512_set1_ps(beta);
    for h in 0..n.div_ceil(TILE) {
        let lanes = (n - TILE * h).min(TILE);
        let mask: __mmask16 = if lanes == TILE { 0xffff } else { (1u16 << lanes) - 1 };
        // SAFETY: the mask covers elements `16h..16h + lanes` of both (the contract and the
        // length checked above).
        unsafe {
            let (at, s) = (at.add(TILE * h), sums.as_ptr().add(TILE * h).cast::<f32>());
            let v = _mm512_maskz_loadu_ps(mask, s);
            let new = if acc {
                _mm512_fmadd_ps(scale, v, _mm512_maskz_loadu_ps(mask, at))
            } else {
                // The product alone (a sum of -0 stays -0, as a tile store writes it).
                _mm512_mul_ps(scale, v)
            };
            _mm512_mask_storeu_ps(at, mask, new);
        }
    }
}
