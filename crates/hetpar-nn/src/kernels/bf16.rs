//! Matrix products of f32 matrices with their operands rounded to bf16 and the products
//! summed in f32: what `dtype = "bf16"` runs in the linear layers and the attention core
//! (f32 master weights and activations, bf16 multiplies, as mixed-precision training on
//! accelerators does).
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
pub(super) mod avx;

#[cfg(test)]
mod tests;
