//! Matrix products of f32 matrices with their operands rounded to bf16 and the products
//! summed in f32: what `dtype = "bf16"` runs in the linear layers (f32 master weights and
//! activations, bf16 multiplies, as mixed-precision training on accelerators does).
//!
//! Where the CPU has AVX512-BF16 the product runs on `vdpbf16ps`, which multiplies pairs of
//! bf16 values and adds both products into an f32 lane: twice the multiply-adds of an f32
//! FMA per instruction. The operands are rounded while they are packed for the kernel
//! (nearest even, as `vcvtne2ps2bf16` does, with subnormals going to zero), so no bf16 copy
//! of a weight or an activation outlives the product. Elsewhere the same rounded operands
//! go through gemm's f32 kernels ([`super::gemm`]): a product of two bf16 values is exact in
//! f32, so both paths compute the same products and differ only in the order and rounding
//! of the f32 sums (and `vdpbf16ps` flushes subnormal sums to zero).
//!
//! Where the CPU also has AMX-BF16 (and Linux grants this process the tile registers) the
//! product runs on AMX tiles instead ([`super::amx`]), from operands rounded the same way.
//!
//! Blocking follows the usual layout of a GEMM (Goto and van de Geijn 2008), in one driver
//! ([`blocked`]) for both kernels: `NC` columns of the right operand at a time, `KC` pairs
//! of the inner dimension, packed once and shared; `MC` rows of the left operand packed per
//! thread; a micro-kernel of `MR` x `NR` f32 sums, held in vector registers (AVX512-BF16)
//! or in tiles (AMX).
#![allow(unsafe_code)]

use super::gemm::{self, View};

/// Which kernel runs the bf16 products on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AMX tiles (`tdpbf16ps`), with the operands packed on AVX512-BF16.
    Amx,
    /// AVX512-BF16 (`vdpbf16ps`) in registers.
    Avx512Bf16,
    /// bf16-rounded f32 operands through gemm's f32 kernels.
    Fallback,
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kernel::Amx => "AMX-BF16 tiles",
            Kernel::Avx512Bf16 => "AVX512-BF16",
            Kernel::Fallback => "no AVX512-BF16 here: bf16-rounded operands through f32 gemm",
        })
    }
}

/// The fastest kernel this CPU (and OS) runs: the one [`matmul_on`] takes.
pub fn kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if super::amx::available() {
        return Kernel::Amx;
    }
    if native() { Kernel::Avx512Bf16 } else { Kernel::Fallback }
}

/// Whether this CPU multiplies bf16 on its own instructions (AVX512-BF16); elsewhere the
/// products run on bf16-rounded f32 operands through gemm.
pub fn native() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The bf16 bits of `x`: nearest even, NaN stays (quiet) NaN, subnormals go to a zero of
/// their sign (what `vcvtne2ps2bf16` gives).
#[inline(always)]
pub fn bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7f80_0000 == 0 {
        return (u >> 16) as u16 & 0x8000;
    }
    half::bf16::from_f32(x).to_bits()
}

/// `x` rounded to bf16 and widened back (exactly) to f32.
#[inline(always)]
pub fn round(x: f32) -> f32 {
    f32::from_bits(u32::from(bits(x)) << 16)
}

/// Two consecutive elements of the inner dimension as one 32-bit lane: the even one in the
/// low half (the order `vdpbf16ps` pairs them in).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(super) fn pair(even: f32, odd: f32) -> u32 {
    u32::from(bits(even)) | (u32::from(bits(odd)) << 16)
}

/// `dst = (dst if accumulate else 0) + beta * bf16(lhs) @ bf16(rhs)`, summed in f32, on
/// `threads` threads.
///
/// # Panics
/// As [`gemm::matmul_on`]: if the shapes do not chain, a view leaves its slice, or `dst`'s
/// view names an element twice.
#[allow(clippy::too_many_arguments)]
pub fn matmul_on(
    dst: &mut [f32],
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    accumulate: bool,
    beta: f32,
    threads: usize,
) {
    matmul_with(kernel(), dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads);
}

/// [`matmul_on`] on the kernel named (the tests and benchmarks compare them).
///
/// # Panics
/// As [`matmul_on`], and if this machine cannot run `kernel` (see [`kernel`]).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    kernel: Kernel,
    dst: &mut [f32],
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    accumulate: bool,
    beta: f32,
    threads: usize,
) {
    gemm::check(dst.len(), dv, lhs.len(), lv, rhs.len(), rv);
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    if m == 0 || n == 0 || k == 0 {
        // Nothing to multiply: gemm's handling of the empty cases (zeroing when not
        // accumulating).
        return gemm::matmul_on(dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads);
    }
    if kernel == Kernel::Fallback {
        return fallback(dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads);
    }
    // SAFETY: `check` above holds the views inside their slices (the destination's inside
    // `dst`, which this borrow holds) and the destination injective; none is empty.
    unsafe { on_native(kernel, dst.as_mut_ptr(), dv, lhs, lv, rhs, rv, accumulate, beta, threads) }
}

/// A new matrix of `len` elements, `bf16(lhs) @ bf16(rhs)` summed in f32 and written
/// through `dv`, which must name every element of it once (row-major, column-major or any
/// other such layout), on `threads` threads: [`matmul_on`] into a new destination without
/// the zero fill of a `vec![0.0; len]` first. Not accumulating, the kernels store every
/// element of the destination in their first block of the inner dimension and read none
/// before (a pass over megabytes per product: 6% of the ViT's bf16 step under `perf`).
///
/// # Panics
/// As [`matmul_on`], and if `dv` does not cover `len` elements.
pub fn matmul_new(
    len: usize,
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    threads: usize,
) -> Vec<f32> {
    matmul_new_with(kernel(), len, dv, lhs, lv, rhs, rv, threads)
}

/// [`matmul_new`] on the kernel named.
///
/// # Panics
/// As [`matmul_new`], and if this machine cannot run `kernel` (see [`kernel`]).
#[allow(clippy::too_many_arguments)]
pub fn matmul_new_with(
    kernel: Kernel,
    len: usize,
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    threads: usize,
) -> Vec<f32> {
    assert!(
        dv.rows.checked_mul(dv.cols) == Some(len),
        "matmul destination {dv:?} does not cover {len} elements"
    );
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    if m == 0 || n == 0 || k == 0 || kernel == Kernel::Fallback {
        // Nothing to multiply, or gemm's kernels on rounded copies: a zeroed destination.
        let mut dst = vec![0.0; len];
        matmul_with(kernel, &mut dst, dv, lhs, lv, rhs, rv, false, 1.0, threads);
        return dst;
    }
    gemm::check(len, dv, lhs.len(), lv, rhs.len(), rv);
    let mut dst: Vec<f32> = Vec::with_capacity(len);
    // SAFETY: `check` holds the views inside their slices (the destination's inside the
    // `len` elements allocated) and the destination injective; none is empty. Not
    // accumulating, [`blocked`] runs its first block of the inner dimension (`p0 == 0`)
    // over every micro-tile of the destination, its threads joined before the next block,
    // and the kernels store each element of a tile without reading it when `acc` is false
    // (which it is only in that first block); so the `rows * cols` elements `dv` names,
    // distinct and inside `len` and so all `len` of them, are written before any read and
    // before `set_len`.
    unsafe {
        on_native(kernel, dst.as_mut_ptr(), dv, lhs, lv, rhs, rv, false, 1.0, threads);
        dst.set_len(len);
    }
    dst
}

/// The product on this machine's own bf16 instructions (AMX tiles or AVX512-BF16).
///
/// # Safety
/// As [`blocked`] asks of `dst` and the views.
///
/// # Panics
/// If `kernel` is the fallback, or this machine cannot run it.
#[allow(clippy::too_many_arguments)]
unsafe fn on_native(
    kernel: Kernel,
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
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Amx => {
            assert!(super::amx::available(), "this machine has no AMX-BF16 tiles");
            // SAFETY: the CPU has AMX and AVX512-BF16 and this process the tile state; the
            // views as the caller's contract says.
            unsafe { super::amx::run(dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads) }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Bf16 => {
            assert!(native(), "this CPU has no AVX512-BF16");
            // SAFETY: the CPU has every feature the kernels are compiled for; the views as
            // the caller's contract says.
            unsafe { blocked::<avx::Avx512>(dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Amx | Kernel::Avx512Bf16 => {
            let _ = (dst, dv, lhs, lv, rhs, rv, accumulate, beta, threads);
            panic!("{kernel} needs an x86-64 CPU")
        }
        Kernel::Fallback => panic!("the fallback multiplies through gemm, on a slice"),
    }
}

/// The product on bf16-rounded copies of the operands, through gemm's f32 kernels.
#[allow(clippy::too_many_arguments)]
fn fallback(
    dst: &mut [f32],
    dv: View,
    lhs: &[f32],
    lv: View,
    rhs: &[f32],
    rv: View,
    accumulate: bool,
    beta: f32,
    threads: usize,
) {
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    let rounded = |s: &[f32], v: View| {
        let mut out = Vec::with_capacity(v.rows * v.cols);
        for r in 0..v.rows {
            out.extend((0..v.cols).map(|c| round(s[v.offset + r * v.rs + c * v.cs])));
        }
        out
    };
    let (a, b) = (rounded(lhs, lv), rounded(rhs, rv));
    gemm::matmul_on(
        dst,
        dv,
        &a,
        View::rows(0, m, k, k),
        &b,
        View::rows(0, k, n, n),
        accumulate,
        beta,
        threads,
    );
}

/// The destination, shared by the threads: each writes rows no other thread writes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Out {
    pub(super) ptr: *mut f32,
    pub(super) rs: usize,
    pub(super) cs: usize,
}
// SAFETY: threads write disjoint rows of an injective view (see [`blocked`]).
#[cfg(target_arch = "x86_64")]
unsafe impl Send for Out {}
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for Out {}

#[cfg(target_arch = "x86_64")]
impl Out {
    /// The destination from element `(r, c)` on (taking `self` whole, so a closure
    /// captures the `Send` wrapper rather than its raw pointer).
    ///
    /// # Safety
    /// `(r, c)` is an element of the destination's view.
    pub(super) unsafe fn at(self, r: usize, c: usize) -> Out {
        // SAFETY: the caller's contract.
        Out { ptr: unsafe { self.ptr.add(r * self.rs + c * self.cs) }, ..self }
    }
}

/// The rows and columns of a micro-tile that lie inside the destination.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Tile {
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// A blocked kernel (Goto and van de Geijn): its micro-tile and block sizes, how it packs
/// each operand, and its micro-kernel; [`blocked`] runs the loops around them.
#[cfg(target_arch = "x86_64")]
pub(super) trait Blocking {
    /// Rows of the micro-kernel.
    const MR: usize;
    /// Columns of the micro-kernel.
    const NR: usize;
    /// Pairs of the inner dimension per packed block.
    const KC: usize;
    /// Rows per packed block of the left operand (a multiple of `MR`).
    const MC: usize;
    /// Columns per packed block of the right operand (a multiple of `NR`).
    const NC: usize;

    /// Lanes a packed row of the left operand takes for a block of `kc` pairs.
    fn lhs_depth(kc: usize) -> usize;

    /// Lanes a packed column of the right operand takes for a block of `kc` pairs.
    fn rhs_depth(kc: usize) -> usize;

    /// Rows `i0..i0 + mc` and pairs `p0..p0 + kc` of `lhs` into `out`, `MR`-row panels of
    /// `MR * lhs_depth(kc)` lanes (rows past `mc` zero).
    ///
    /// # Safety
    /// The CPU has the kernel's features; `lv` lies inside `lhs`, `k` its columns.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pack_lhs(
        out: &mut [u32],
        lhs: &[f32],
        lv: View,
        i0: usize,
        mc: usize,
        p0: usize,
        kc: usize,
        k: usize,
    );

    /// Columns `j0..j0 + nc` and pairs `p0..p0 + kc` of `rhs` into `out`, `NR`-column
    /// panels of `NR * rhs_depth(kc)` lanes (columns past `nc` zero).
    ///
    /// # Safety
    /// The CPU has the kernel's features; `rv` lies inside `rhs`.
    unsafe fn pack_rhs(
        out: &mut [u32],
        rhs: &[f32],
        rv: View,
        j0: usize,
        nc: usize,
        p0: usize,
        kc: usize,
    );

    /// Readies this thread for [`Self::kernel`] ([`Self::end`] undoes it).
    ///
    /// # Safety
    /// The CPU has the kernel's features.
    unsafe fn begin() {}

    /// Undoes [`Self::begin`].
    ///
    /// # Safety
    /// As [`Self::begin`], on the thread that called it.
    unsafe fn end() {}

    /// One micro-tile: panel `a` times panel `b` (a block of `kc` pairs), added into the
    /// destination's `tile` as `out = (out if acc) + beta * sum`. Without `acc` it stores
    /// every element of the tile and reads none of them ([`matmul_new`] hands the kernels
    /// uninitialized memory on that promise).
    ///
    /// # Safety
    /// Between [`Self::begin`] and [`Self::end`] on this thread; `a` and `b` the panels
    /// the packing gave; `out` addresses elements `(r, c)`, `r < tile.rows`,
    /// `c < tile.cols`, of the destination through its strides, which no other thread
    /// writes.
    unsafe fn kernel(a: &[u32], b: &[u32], kc: usize, out: Out, tile: Tile, acc: bool, beta: f32);
}

/// `dst = (dst if accumulate else 0) + beta * bf16(lhs) @ bf16(rhs)` by `B`'s blocking:
/// for each block of `NC` columns and `KC` pairs, the right operand packed once and
/// shared, and `MC`-row blocks of the left operand packed and multiplied on `threads`
/// threads (block `i` on thread `i % threads`; a sum does not depend on the count). Not
/// accumulating, the first block of pairs runs over every micro-tile, its threads joined
/// before the next block, with `acc` false (the only block that has it so), so every
/// element `dv` names is stored before any is read.
///
/// # Safety
/// The CPU has `B`'s features; `dst` is valid for reads and writes of every element `dv`
/// names, initialized where accumulating; the other views lie inside their slices, the
/// shapes chain, none is empty, and `dv` is injective and overlaps neither operand.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn blocked<B: Blocking>(
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
    let (m, n, k) = (dv.rows, dv.cols, lv.cols);
    let pairs = k.div_ceil(2);
    // SAFETY (for the pointer arithmetic of the kernel): `dv.offset` is an element of the
    // destination (the contract; `dv` is not empty).
    let out = Out { ptr: unsafe { dst.add(dv.offset) }, rs: dv.rs, cs: dv.cs };
    let blocks = m.div_ceil(B::MC);
    let threads = threads.clamp(1, blocks);
    // The right operand's buffer, then one for the left operand per thread, for every
    // block: this thread's from its earlier products.
    let widest = B::KC.min(pairs);
    let bpack_len = B::NC.min(n.next_multiple_of(B::NR)) * B::rhs_depth(widest);
    let apack_len = B::MC.min(m.next_multiple_of(B::MR)) * B::lhs_depth(widest);
    let mut stores = Packs::take(bpack_len, apack_len, threads);
    let (bstore, astores) = stores.0.split_first_mut().expect("Packs::take gives 1 + threads");
    let bpack = as_lanes(bstore);
    let astores = &mut astores[..threads];
    for j0 in (0..n).step_by(B::NC) {
        let nc = B::NC.min(n - j0);
        for p0 in (0..pairs).step_by(B::KC) {
            let kc = B::KC.min(pairs - p0);
            let (ad, bd) = (B::lhs_depth(kc), B::rhs_depth(kc));
            let bpack = &mut bpack[..nc.next_multiple_of(B::NR) * bd];
            // SAFETY: the CPU has `B`'s features; `rv` lies inside `rhs`.
            unsafe { B::pack_rhs(bpack, rhs, rv, j0, nc, p0, kc) };
            let bpack = &*bpack;
            // Later blocks of the inner dimension add to what the first wrote.
            let acc = accumulate || p0 > 0;
            let rows = |first: usize, astore: &mut [Line]| {
                let apack = as_lanes(astore);
                // SAFETY: the CPU has `B`'s features; `end` below on this thread.
                unsafe { B::begin() };
                for blk in (first..blocks).step_by(threads) {
                    let i0 = blk * B::MC;
                    let mc = B::MC.min(m - i0);
                    let apack = &mut apack[..mc.next_multiple_of(B::MR) * ad];
                    // SAFETY: as `pack_rhs` above.
                    unsafe { B::pack_lhs(apack, lhs, lv, i0, mc, p0, kc, k) };
                    for jp in 0..nc.div_ceil(B::NR) {
                        let b = &bpack[jp * B::NR * bd..(jp + 1) * B::NR * bd];
                        let cols = B::NR.min(nc - jp * B::NR);
                        for ip in 0..mc.div_ceil(B::MR) {
                            let a = &apack[ip * B::MR * ad..(ip + 1) * B::MR * ad];
                            let (r0, c0) = (i0 + ip * B::MR, j0 + jp * B::NR);
                            // SAFETY: `(r0, c0)` is an element of `dv`, inside `dst`.
                            let here = unsafe { out.at(r0, c0) };
                            let tile = Tile { rows: B::MR.min(mc - ip * B::MR), cols };
                            // SAFETY: the tile's elements are elements of `dv`, in rows no
                            // other thread writes; between `begin` and `end`.
                            unsafe { B::kernel(a, b, kc, here, tile, acc, beta) };
                        }
                    }
                }
                // SAFETY: `begin` above, on this thread.
                unsafe { B::end() };
            };
            if threads == 1 {
                rows(0, &mut astores[0]);
            } else {
                let rows = &rows;
                rayon::scope(|s| {
                    for (t, astore) in astores.iter_mut().enumerate() {
                        s.spawn(move |_| rows(t, astore));
                    }
                });
            }
        }
    }
    stores.keep();
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The packing buffers of this thread's last product, for its next one.
    static PACKS: std::cell::RefCell<Vec<Vec<Line>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Packing buffers for one product: [`blocked`] packs into the right operand's buffer and
/// one of the left operand's per thread. They are taken from this thread's previous product
/// and handed back after, grown where a product needs more (and then zeroed there) and never
/// shrunk: a fresh zeroed allocation per product cost a memset of up to a megabyte each
/// time, some 2% of the ViT's bf16 step. Every lane a kernel reads is written by the
/// packing first (its panels' padding included), so what a buffer held before never
/// reaches a sum. A nested product on this thread (a rayon task stolen while this one
/// waits) finds none here and allocates its own.
#[cfg(target_arch = "x86_64")]
struct Packs(Vec<Vec<Line>>);

#[cfg(target_arch = "x86_64")]
impl Packs {
    /// `1 + threads` buffers: the first of `bpack` lanes or more, the others of `apack`.
    fn take(bpack: usize, apack: usize, threads: usize) -> Packs {
        let mut stores = PACKS.with(|p| std::mem::take(&mut *p.borrow_mut()));
        if stores.len() < 1 + threads {
            stores.resize_with(1 + threads, Vec::new);
        }
        for (i, store) in stores.iter_mut().take(1 + threads).enumerate() {
            let want = if i == 0 { bpack } else { apack }.div_ceil(16);
            if store.len() < want {
                store.resize(want, Line([0; 16]));
            }
        }
        Packs(stores)
    }

    /// Hands the buffers back to this thread for its next product.
    fn keep(self) {
        PACKS.with(|p| *p.borrow_mut() = self.0);
    }
}

/// One cache line of packed lanes: packed operands live in these, so every packed row
/// starts on a line (an AMX tile load across cache lines runs several times slower).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct Line([u32; 16]);

/// The lanes of `store` as one slice.
#[cfg(target_arch = "x86_64")]
fn as_lanes(store: &mut [Line]) -> &mut [u32] {
    // SAFETY: `Line` is 16 u32 with no padding (its size, 64 bytes, is theirs).
    unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr().cast(), store.len() * 16) }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx {
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
                for i in (0..mc).step_by(16) {
                    let n = 16.min(mc - i);
                    for q in (0..kc).step_by(16) {
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
            for jp in 0..nc.div_ceil(NR) {
                let panel = &mut out[jp * kc * NR..(jp + 1) * kc * NR];
                let (c0, cols) = (j0 + jp * NR, NR.min(nc - jp * NR));
                if rv.cs == 1 {
                    // Rows of the inner dimension are contiguous: interleave two at a time.
                    let row = |kk: usize| {
                        let start = rv.offset + kk * rv.rs + c0;
                        &rhs[start..start + cols]
                    };
                    for p in 0..kc {
                        let ke = 2 * (p0 + p);
                        let odd = if ke + 1 < k { row(ke + 1) } else { &[][..] };
                        interleave(row(ke), odd, &mut panel[p * NR..(p + 1) * NR]);
                    }
                } else {
                    let mut col = [0u32; KC];
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
        }

        /// One `MR` x `NR` tile: `a` (`MR` rows of `KC` pairs) times `b` (`kc` rows of `NR`
        /// pairs), added into the destination's `tile` as `out = (out if acc) + beta * sum`.
        ///
        /// # Safety
        /// `out` addresses elements `(r, c)`, `r < tile.rows`, `c < tile.cols`, of `dst` through
        /// its strides, which no other thread writes; `a` and `b` hold `MR * KC` and `kc * NR`.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
        unsafe fn kernel(
            a: &[u32],
            b: &[u32],
            kc: usize,
            out: Out,
            tile: Tile,
            acc: bool,
            beta: f32,
        ) {
            assert!(a.len() >= MR * KC && b.len() >= kc * NR && kc <= KC);
            let (a, b) = (a.as_ptr(), b.as_ptr());
            let mut sum = [[_mm512_setzero_ps(); 2]; MR];
            for p in 0..kc {
                // SAFETY: `p < kc`, and the lengths are checked above.
                unsafe {
                    let b0: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
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
                            let old = if acc {
                                _mm512_maskz_loadu_ps(mask, at)
                            } else {
                                _mm512_setzero_ps()
                            };
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
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        for h in 0..dst.len() / 16 {
            let load = |s: &[f32]| {
                let n = s.len().saturating_sub(16 * h).min(16);
                let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
                // SAFETY: the mask covers only elements `16h..16h + n` of `s`.
                unsafe { _mm512_maskz_loadu_ps(mask, s.as_ptr().wrapping_add(16 * h)) }
            };
            // SAFETY: both are 512 bits of plain lanes.
            let v: __m512i =
                unsafe { std::mem::transmute(_mm512_cvtne2ps_pbh(load(odd), load(even))) };
            let v = _mm512_permutexvar_epi16(idx, v);
            // SAFETY: `dst` holds lanes `16h..16h + 16`.
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(16 * h).cast(), v) };
        }
    }

    /// `dst[r * dst_rs + c] = src[c * src_rs + r]` for `r, c < 16`: a 16 x 16 transpose of
    /// 32-bit lanes in registers (pairs within each 128-bit lane, then 4 x 4 blocks, then the
    /// lanes themselves).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
    pub(in crate::kernels) fn transpose(
        src: &[u32],
        src_rs: usize,
        dst: &mut [u32],
        dst_rs: usize,
    ) {
        assert!(src.len() >= 15 * src_rs + 16 && dst.len() >= 15 * dst_rs + 16);
        // SAFETY: row `i < 16` of `src` is inside it (checked above); unaligned loads.
        let r: [__m512i; 16] = std::array::from_fn(|i| unsafe {
            _mm512_loadu_si512(src.as_ptr().add(i * src_rs).cast())
        });
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
                unsafe {
                    _mm512_storeu_si512(dst.as_mut_ptr().add((4 * l + j) * dst_rs).cast(), v)
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(m, n, k)`: single elements, edges of the micro-tiles (AVX512-BF16 12 x 32, AMX
    /// 32 x 32 over 16 pairs) and of the blocks (96 or 128 rows, 1024 columns, 512 of the
    /// inner dimension), odd inner lengths.
    const SHAPES: [(usize, usize, usize); 11] = [
        (1, 1, 1),
        (3, 5, 7),
        (13, 33, 2),
        (12, 32, 512),
        (32, 32, 32),
        (97, 65, 513),
        (25, 1030, 37),
        (5, 3, 1101),
        (200, 48, 64),
        (1, 70, 300),
        (129, 17, 45),
    ];

    /// Every kernel this machine runs (the fallback runs everywhere).
    fn kernels_here() -> Vec<Kernel> {
        let mut here = vec![Kernel::Fallback];
        if native() {
            here.push(Kernel::Avx512Bf16);
        }
        if kernel() == Kernel::Amx {
            here.push(Kernel::Amx);
        }
        here
    }

    /// A matrix of `rows x cols` inside a longer slice, by `layout`: 0 row-major with
    /// padded rows, 1 column-major (the transpose of one), 2 neither stride 1.
    fn matrix(rows: usize, cols: usize, layout: usize, seed: usize) -> (Vec<f32>, View) {
        let data: Vec<f32> = (0..(rows + 1) * (2 * cols + 3) + 5)
            .map(|i| ((i * 7 + seed) as f32 * 0.173).sin())
            .collect();
        let v = match layout {
            0 => View::rows(3, rows, cols, cols + 2),
            1 => View::rows(2, cols, rows, rows + 1).t(),
            _ => View { offset: 1, rows, cols, rs: 2 * cols + 3, cs: 2 },
        };
        (data, v)
    }

    fn at(s: &[f32], v: View, r: usize, c: usize) -> f32 {
        s[v.offset + r * v.rs + c * v.cs]
    }

    /// Runs `kernel` on every shape and operand layout and checks each element against the f64
    /// product of the rounded operands, within the bound of f32 summation: `k + 2` units of
    /// f32 rounding (2^-24) of the sum of the products' magnitudes (and of the old value).
    fn holds(kernel: Kernel) {
        for (case, &(m, n, k)) in SHAPES.iter().enumerate() {
            for layout in 0..9 {
                let (a, av) = matrix(m, k, layout % 3, case);
                let (b, bv) = matrix(k, n, layout / 3, case + 11);
                // A destination with padded rows (0), a column-major one (1), one with
                // neither stride 1 (2).
                let configs =
                    [(false, 1.0, 1, 0), (true, 0.5, 2, 1), (true, 1.0, 1, 0), (false, 0.5, 1, 2)];
                for (accumulate, beta, threads, dlayout) in configs {
                    let dv = match dlayout {
                        0 => View::rows(1, m, n, n + 1),
                        1 => View::rows(1, n, m, m + 1).t(),
                        _ => View { offset: 1, rows: m, cols: n, rs: 2 * n + 1, cs: 2 },
                    };
                    let len = 2 + 2 * (m + 1) * (n + 1);
                    let mut dst: Vec<f32> = (0..len).map(|i| i as f32 * 0.01).collect();
                    let old = dst.clone();
                    matmul_with(kernel, &mut dst, dv, &a, av, &b, bv, accumulate, beta, threads);
                    let mut seen = vec![false; len];
                    for r in 0..m {
                        for c in 0..n {
                            let (mut want, mut mag) = (0f64, 0f64);
                            for i in 0..k {
                                let p =
                                    round(at(&a, av, r, i)) as f64 * round(at(&b, bv, i, c)) as f64;
                                want += p;
                                mag += p.abs();
                            }
                            let here = dv.offset + r * dv.rs + c * dv.cs;
                            seen[here] = true;
                            let prev = if accumulate { old[here] as f64 } else { 0.0 };
                            let want = prev + beta as f64 * want;
                            let bound =
                                (k + 2) as f64 * 2f64.powi(-24) * (mag + prev.abs()) + 1e-30;
                            let got = dst[here] as f64;
                            assert!(
                                (got - want).abs() <= bound,
                                "{kernel:?} ({m}, {n}, {k}) layout {layout} at ({r}, {c}): {got} against {want}"
                            );
                        }
                    }
                    for (i, seen) in seen.into_iter().enumerate() {
                        assert!(
                            seen || dst[i] == old[i],
                            "{kernel:?} ({m}, {n}, {k}): {i} is outside"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_here_matches_the_rounded_operands_in_f64() {
        for kernel in kernels_here() {
            holds(kernel);
        }
    }

    #[test]
    fn every_destination_layout_gets_the_same_bits() {
        // Several blocks of the inner dimension, whole and partial micro-tiles, each operand
        // layout pair, written and accumulated: a kernel may run a product as itself or as
        // its transpose, and take whole tiles another way than partial ones, but every
        // element's sum is the same.
        let (m, n, k) = (70, 64, 530);
        for (la, lb) in [(0, 1), (1, 0), (0, 0), (2, 2)] {
            let (a, av) = matrix(m, k, la, 1);
            let (b, bv) = matrix(k, n, lb, 2);
            for kernel in kernels_here() {
                for accumulate in [false, true] {
                    let views = [
                        View::rows(0, m, n, n),
                        View::rows(0, n, m, m).t(),
                        View { offset: 1, rows: m, cols: n, rs: 2 * n + 1, cs: 2 },
                    ];
                    let got: Vec<Vec<u32>> = views
                        .iter()
                        .map(|&dv| {
                            let at = |r: usize, c: usize| dv.offset + r * dv.rs + c * dv.cs;
                            let mut d = vec![f32::NAN; 2 + 2 * m * (n + 1)];
                            for r in 0..m {
                                for c in 0..n {
                                    d[at(r, c)] = ((r * 7 + c * 3) as f32 * 0.31).cos();
                                }
                            }
                            matmul_with(kernel, &mut d, dv, &a, av, &b, bv, accumulate, 1.0, 1);
                            (0..m * n).map(|i| d[at(i / n, i % n)].to_bits()).collect()
                        })
                        .collect();
                    for (i, g) in got.iter().enumerate().skip(1) {
                        assert!(g == &got[0], "{kernel:?} layouts {la}/{lb}: destination {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_new_destination_gets_the_bits_of_a_zeroed_one() {
        // Whole and partial micro-tiles, one and several blocks of the inner dimension, one
        // and two threads, row- and column-major destinations, each kernel here; the
        // memory handed back first holds NaNs, so an element the kernels skipped shows.
        let shapes = [(70, 64, 530), (13, 33, 37), (129, 17, 45), (129, 17, 530), (1, 70, 300)];
        for (m, n, k) in shapes.into_iter().chain([(32, 32, 32)]) {
            let (a, av) = matrix(m, k, 0, 3);
            let (b, bv) = matrix(k, n, 1, 4);
            for kernel in kernels_here() {
                for threads in [1, 2] {
                    for dv in [View::rows(0, m, n, n), View::rows(0, n, m, m).t()] {
                        let mut want = vec![0.0; m * n];
                        matmul_with(kernel, &mut want, dv, &a, av, &b, bv, false, 1.0, threads);
                        drop(std::hint::black_box(vec![f32::NAN; m * n]));
                        let got = matmul_new_with(kernel, m * n, dv, &a, av, &b, bv, threads);
                        let differs = (0..m * n).find(|&i| got[i].to_bits() != want[i].to_bits());
                        assert!(
                            differs.is_none(),
                            "{kernel:?} ({m}, {n}, {k}) {dv:?}, {threads} threads: element {}: {} \
                             against {}",
                            differs.unwrap_or(0),
                            got[differs.unwrap_or(0)],
                            want[differs.unwrap_or(0)]
                        );
                    }
                }
            }
        }
        // Nothing to multiply: zeros.
        let (a, av) = matrix(3, 0, 0, 1);
        let (b, bv) = matrix(0, 4, 0, 2);
        assert_eq!(matmul_new(12, View::rows(0, 3, 4, 4), &a, av, &b, bv, 1), vec![0.0; 12]);
    }

    #[test]
    fn the_packing_buffers_kept_between_products_leak_nothing() {
        // A product of NaNs leaves NaN lanes all over this thread's packing buffers; a
        // smaller product after it (partial tiles, an odd inner length, each operand
        // layout) must read none of them: every lane a kernel reads is packed anew, its
        // panels' padding included, or a NaN would reach a sum.
        let (m, n, k) = (129, 70, 530);
        let (nan_a, nan_b) = (vec![f32::NAN; m * k], vec![f32::NAN; k * n]);
        for kernel in kernels_here() {
            for layout in 0..9 {
                let mut d = vec![0.0; m * n];
                let (av, bv) = (View::rows(0, m, k, k), View::rows(0, k, n, n));
                matmul_with(
                    kernel,
                    &mut d,
                    View::rows(0, m, n, n),
                    &nan_a,
                    av,
                    &nan_b,
                    bv,
                    false,
                    1.0,
                    1,
                );
                let (a, av) = matrix(13, 37, layout % 3, 1);
                let (b, bv) = matrix(37, 33, layout / 3, 2);
                for dv in [View::rows(0, 13, 33, 33), View::rows(0, 33, 13, 13).t()] {
                    let got = matmul_new_with(kernel, 13 * 33, dv, &a, av, &b, bv, 1);
                    let mut want = vec![0.0; 13 * 33];
                    matmul_with(Kernel::Fallback, &mut want, dv, &a, av, &b, bv, false, 1.0, 1);
                    let far = |g: f32, w: f32| (g - w).abs() > 1e-4 || g.is_nan();
                    let bad = got.iter().zip(&want).position(|(&g, &w)| far(g, w));
                    assert!(bad.is_none(), "{kernel:?} layout {layout} {dv:?}: element {bad:?}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "does not cover")]
    fn a_new_destination_its_view_does_not_cover_is_refused() {
        let (a, av) = matrix(3, 5, 0, 1);
        let (b, bv) = matrix(5, 4, 0, 2);
        let _ = matmul_new(13, View::rows(0, 3, 4, 4), &a, av, &b, bv, 1);
    }

    #[test]
    fn every_operand_layout_packs_the_same_bits() {
        // The same values row-major, column-major (packed through 16 x 16 transposes on
        // the vector kernels) and with neither stride 1 (one pair at a time): partial
        // blocks of rows and of the inner dimension, an odd inner length, subnormals
        // (flushed) and ties of the rounding among them.
        for (m, n, k) in [(70, 40, 530), (13, 33, 37), (129, 17, 45)] {
            let value = |r: usize, i: usize| match (r * 31 + i * 17) % 23 {
                0 => f32::from_bits(0x0000_1234),
                1 => f32::from_bits(0x3f80_8000),
                2 => -f32::from_bits(0x3f81_8000),
                _ => ((r * 13 + i * 7) as f32 * 0.173).sin(),
            };
            let (b, bv) = matrix(k, n, 0, 5);
            for kernel in kernels_here() {
                let got: Vec<Vec<u32>> = (0..3)
                    .map(|layout| {
                        let (mut a, av) = matrix(m, k, layout, 6);
                        for r in 0..m {
                            for i in 0..k {
                                a[av.offset + r * av.rs + i * av.cs] = value(r, i);
                            }
                        }
                        let mut d = vec![0f32; m * n];
                        let dv = View::rows(0, m, n, n);
                        matmul_with(kernel, &mut d, dv, &a, av, &b, bv, false, 1.0, 1);
                        d.iter().map(|x| x.to_bits()).collect()
                    })
                    .collect();
                assert!(got[1] == got[0], "{kernel:?} ({m}, {n}, {k}): column-major");
                assert!(got[2] == got[0], "{kernel:?} ({m}, {n}, {k}): strided");
            }
        }
    }

    #[test]
    fn threads_do_not_change_the_bits() {
        let (m, n, k) = (300, 70, 600);
        let (a, av) = matrix(m, k, 0, 3);
        let (b, bv) = matrix(k, n, 0, 4);
        for kernel in kernels_here() {
            let run = |threads| {
                let mut d = vec![0f32; m * n];
                let dv = View::rows(0, m, n, n);
                matmul_with(kernel, &mut d, dv, &a, av, &b, bv, false, 1.0, threads);
                d.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(run(1), run(3), "{kernel:?}");
        }
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_view_past_its_slice_is_refused() {
        let a = vec![0.0f32; 10];
        let mut d = vec![0.0f32; 4];
        let (dv, lv, rv) = (View::rows(0, 2, 2, 2), View::rows(0, 2, 3, 5), View::rows(6, 3, 2, 2));
        matmul_on(&mut d, dv, &a, lv, &a, rv, false, 1.0, 1);
    }

    #[test]
    fn rounding_is_nearest_even_and_flushes_subnormals() {
        assert_eq!(bits(1.0), 0x3f80);
        assert_eq!(bits(f32::from_bits(0x3f80_8000)), 0x3f80, "a tie to the even neighbour");
        assert_eq!(bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bits(1e-39), 0);
        assert_eq!(bits(-1e-39), 0x8000);
        assert_eq!(bits(f32::MIN_POSITIVE), 0x0080);
        assert!(round(f32::NAN).is_nan());
        assert_eq!(round(f32::INFINITY), f32::INFINITY);
        assert_eq!(round(f32::MAX), f32::INFINITY, "rounds up past the largest bf16");
    }
}
