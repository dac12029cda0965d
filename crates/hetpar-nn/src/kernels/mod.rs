//! Fused CPU kernels as candle custom ops, each with its backward: attention that skips
//! masked blocks ([`attention`]), RMSNorm, LayerNorm, the exact GELU, RoPE, SwiGLU and the
//! bias add ([`pointwise`]), and the linear product ([`linear`]); and AdamW's update in
//! place ([`adam`]); and products with bf16 operands and f32 sums ([`bf16`], on AMX tiles
//! where the CPU has them, [`amx`]), which the linear product runs under `dtype = "bf16"`.
//! They replace chains of small tensor ops (and the copies between them, and the
//! zero-filled gradient candle's backward adds into at each node) on the training path;
//! the unfused compositions they replace stay in [`reference`], and the tests hold each
//! kernel to them at the parity tolerances (f32 1e-5, f64 1e-10, relative).
//!
//! Kernels run on contiguous f32 or f64 CPU storage and combine in a fixed order, so a
//! result never depends on timing or on the thread count. Attention's block products run on
//! one thread per rank; the linear products split over [`threads`]: the rank's share of the
//! machine's threads when ranks share it ([`share_threads`]), else as many as candle's
//! matmuls (`RAYON_NUM_THREADS`, or the physical cores).

pub mod adam;
#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod attention;
pub mod bf16;
pub mod block;
pub mod experts;
pub mod gemm;
pub mod linear;
pub mod pointwise;
pub mod reference;
pub mod simd;
pub mod sink;
pub(crate) mod written;

use std::cell::Cell;

use candle_core::{CpuStorage, Error, Layout, Storage, Tensor, WithDType};

use linear::Matmul;

pub(crate) type CResult<T> = candle_core::Result<T>;

thread_local! {
    /// This thread's share of the machine's threads ([`share_threads`]); 0 when unset.
    static SHARE: Cell<usize> = const { Cell::new(0) };
}

/// Threads the products this thread runs split over: its share ([`share_threads`]), else
/// candle's count (`RAYON_NUM_THREADS`, or the machine's physical cores).
pub fn threads() -> usize {
    match SHARE.get() {
        0 => candle_core::utils::get_num_threads(),
        n => n,
    }
}

/// Each rank's share of candle's threads when `ranks` ranks compute on this machine at
/// once: `max(1, threads / ranks)`.
pub fn share_of(ranks: usize) -> usize {
    (candle_core::utils::get_num_threads() / ranks.max(1)).max(1)
}

/// Gives the products this thread runs its share of candle's threads ([`share_of`]), for
/// when `ranks` ranks compute on this machine at once (the local backend's rank threads, or
/// the MPI processes of one host), and returns it. Without a share, each rank splits every
/// product over all the cores while the other ranks compute on them too: the demo's three
/// ranks on two cores spent a fifth of their time in the kernel, switching 7,000 times a
/// step, and ran 60 steps in 20-23 s instead of 12-16 (BENCHMARKS.md).
pub fn share_threads(ranks: usize) -> usize {
    let share = share_of(ranks);
    SHARE.set(share);
    share
}

/// The float types the kernels run in.
pub trait Real: WithDType + hetpar_comm::Element + std::ops::Neg<Output = Self> {
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// Negative infinity.
    const NEG_INF: Self;
    /// `e^self`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// The larger (either, if equal).
    fn larger(self, other: Self) -> Self;
    /// `e^x` of every element, in place: in f32 [`exp_f32`], [`LANES`] at a time through
    /// [`exp_f32_lanes`]; in f64 the library's.
    fn exp_in_place(xs: &mut [Self]);
    /// [`Self::exp_in_place`] as a step whose products multiply `how` takes it: under bf16
    /// products ([`Matmul::Bf16`]), whose next product rounds its operands to 8 bits anyway,
    /// f32 evaluates it in f32 ([`exp_f32_fast_lanes`]); otherwise, and in f64, as
    /// [`Self::exp_in_place`].
    #[inline(always)]
    fn exp_in_place_as(xs: &mut [Self], _how: Matmul) {
        Self::exp_in_place(xs);
    }
    /// [`bf16::matmul_new`] (bf16 operands, f32 sums, into a new matrix of `len` elements)
    /// where `Self` is f32; an error in f64, which has no bf16 compute.
    fn bf16_product(
        len: usize,
        dv: gemm::View,
        lhs: &[Self],
        lv: gemm::View,
        rhs: &[Self],
        rv: gemm::View,
        threads: usize,
    ) -> CResult<Vec<Self>>;
    /// [`bf16::matmul_on`] on one thread (bf16 operands, f32 sums, into `dst`) where `Self`
    /// is f32; an error in f64.
    #[allow(clippy::too_many_arguments)]
    fn bf16_product_into(
        dst: &mut [Self],
        dv: gemm::View,
        lhs: &[Self],
        lv: gemm::View,
        rhs: &[Self],
        rv: gemm::View,
        accumulate: bool,
        beta: Self,
    ) -> CResult<()>;
}

/// The error of a bf16 product asked of f64 tensors.
fn no_bf16<T>() -> CResult<T> {
    Err(Error::Msg(
        "bf16 products take f32 tensors, not f64 (bf16 compute keeps f32 weights)".into(),
    ))
}

impl Real for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn larger(self, other: f64) -> f64 {
        f64::max(self, other)
    }
    #[inline(always)]
    fn exp_in_place(xs: &mut [f64]) {
        for x in xs {
            *x = x.exp();
        }
    }
    fn bf16_product(
        _: usize,
        _: gemm::View,
        _: &[f64],
        _: gemm::View,
        _: &[f64],
        _: gemm::View,
        _: usize,
    ) -> CResult<Vec<f64>> {
        no_bf16()
    }
    fn bf16_product_into(
        _: &mut [f64],
        _: gemm::View,
        _: &[f64],
        _: gemm::View,
        _: &[f64],
        _: gemm::View,
        _: bool,
        _: f64,
    ) -> CResult<()> {
        no_bf16()
    }
}

impl Real for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> f32 {
        exp_f32(self)
    }
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn larger(self, other: f32) -> f32 {
        f32::max(self, other)
    }
    #[inline(always)]
    fn exp_in_place(xs: &mut [f32]) {
        Self::exp_in_place_as(xs, Matmul::Native);
    }
    #[inline(always)]
    fn exp_in_place_as(xs: &mut [f32], how: Matmul) {
        exp_lanes_in_place(xs, how);
    }
    fn bf16_product(
        len: usize,
        dv: gemm::View,
        lhs: &[f32],
        lv: gemm::View,
        rhs: &[f32],
        rv: gemm::View,
        threads: usize,
    ) -> CResult<Vec<f32>> {
        Ok(bf16::matmul_new(len, dv, lhs, lv, rhs, rv, threads))
    }
    fn bf16_product_into(
        dst: &mut [f32],
        dv: gemm::View,
        lhs: &[f32],
        lv: gemm::View,
        rhs: &[f32],
        rv: gemm::View,
        accumulate: bool,
        beta: f32,
    ) -> CResult<()> {
        bf16::matmul_on(dst, dv, lhs, lv, rhs, rv, accumulate, beta, 1);
        Ok(())
    }
}

/// Inputs that [`exp_f32_lanes`] and [`normal_cdf_f32_lanes`] take at once in the
/// kernels' loops: four AVX-512 vectors of f64.
pub const LANES: usize = 32;

/// `e^x` of every element of `xs` in place, [`LANES`] at a time, the tail one at a time:
/// [`exp_f32_lanes`], or [`exp_f32_fast_lanes`] under bf16 products (the same bits as one at
/// a time). The choice is a branch per chunk, not a function passed in: a function passed
/// as a value is called out of line, compiled for the baseline target, where its
/// `mul_add`s are library calls.
#[inline(always)]
fn exp_lanes_in_place(xs: &mut [f32], how: Matmul) {
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        let c: &mut [f32; LANES] = c.try_into().expect("chunks of LANES");
        *c = match how {
            Matmul::Native => exp_f32_lanes(*c),
            Matmul::Bf16 => exp_f32_fast_lanes(*c),
        };
    }
    for x in chunks.into_remainder() {
        *x = match how {
            Matmul::Native => exp_f32(*x),
            Matmul::Bf16 => exp_f32_fast(*x),
        };
    }
}

/// `e^x` in f32 without a branch (so loops over it vectorize), computed in f64 and rounded
/// once: `x = n ln 2 + r` with `n` rounded to nearest and `|r| <= ln 2 / 2`, `e^r` by its
/// Taylor series to `r^9` (truncation below 3e-10 relative), `2^n` assembled in the
/// exponent bits. The f64 result is within 3e-10 of `e^x`, so the one rounding to f32 gives
/// the correctly rounded value but in rare near-ties, as the C library's `expf` does; a
/// cheaper f32 polynomial off by up to 2 ulp made results differ between layouts several
/// times more (an input's rounding jitter turned into a jumpier output). 0 below `-87.3`
/// (where f32 turns subnormal; `-inf` included), `+inf` above `88.7`; NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    exp_f32_lanes([x])[0]
}

/// [`exp_f32`] of `N` inputs, each step taken over every lane before the next (see
/// [`normal_cdf_f32_lanes`]): the same bits, lane by lane, as `N` calls.
#[inline(always)]
pub fn exp_f32_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    let mut c = [0.0f64; N];
    for j in 0..N {
        c[j] = (x[j] as f64).clamp(-88.0, 89.0);
    }
    let e = exp_f64_core(c);
    let mut out = [0.0f32; N];
    for j in 0..N {
        let y = e[j] as f32;
        let y = if x[j] < -87.3 { 0.0 } else { y };
        let y = if x[j] > 88.7 { f32::INFINITY } else { y };
        out[j] = if x[j].is_nan() { x[j] } else { y };
    }
    out
}

/// `e^c` for each `c` in `[-88, 89]` within 3e-10 relative, without a branch (see
/// [`exp_f32`]). Every multiply-add is fused (`mul_add`: one rounding, the same on every
/// path), which halves the instructions of the polynomial; over every f32 input `exp_f32`
/// rounds differently from the unfused form at 2 (near-ties, 1 ulp apart).
#[inline(always)]
fn exp_f64_core<const N: usize>(c: [f64; N]) -> [f64; N] {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2: f64 = std::f64::consts::LN_2;
    // 1.5 * 2^52: adding and subtracting it rounds to the nearest integer.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    const TAYLOR: [f64; 9] = [
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    let (mut n, mut r) = ([0.0f64; N], [0.0f64; N]);
    for j in 0..N {
        n[j] = c[j].mul_add(LOG2E, ROUND) - ROUND;
        r[j] = (-n[j]).mul_add(LN2, c[j]);
    }
    let mut p = [1.0f64 / 362_880.0; N];
    for k in TAYLOR {
        for j in 0..N {
            p[j] = p[j].mul_add(r[j], k);
        }
    }
    // 2^n from the bits of `n + 1023` held as an integer in the low mantissa bits of
    // `n + 1023 + 2^52` (integer lane operations vectorize where a float-to-int conversion
    // of f64 does not, below AVX-512).
    const SHIFT: f64 = 4_503_599_627_370_496.0;
    for j in 0..N {
        let biased = (n[j] + (1023.0 + SHIFT)).to_bits() - SHIFT.to_bits();
        p[j] *= f64::from_bits(biased << 52);
    }
    p
}

/// The coefficients of `erfcc`'s Chebyshev fit (Numerical Recipes), highest first: the
/// first, then the rest down to the constant term.
const ERFCC_TOP: f64 = 0.170_872_77;
const ERFCC: [f64; 9] = [
    -0.822_152_23,
    1.488_515_87,
    -1.135_203_98,
    0.278_868_07,
    -0.186_288_06,
    0.096_784_18,
    0.374_091_96,
    1.000_023_68,
    -1.265_512_23,
];
/// [`ERFCC`] rounded to f32.
const ERFCC_F32: [f32; 9] = {
    let mut out = [0.0f32; 9];
    let mut i = 0;
    while i < 9 {
        out[i] = ERFCC[i] as f32;
        i += 1;
    }
    out
};

/// Where [`normal_cdf_f32`] takes its central polynomial: `|x|` at most this.
const CDF_CENTRAL: f32 = 3.5;

/// `g(u)` with `Phi(x) = 1/2 + x g(x^2)` for `x^2` in `[0, 3.5^2]`, the constant term
/// first: the interpolant of degree 16 at the Chebyshev nodes in `u`, computed in 50-digit
/// arithmetic and rounded to f64. Evaluated in f64, it is within 8e-11 of `Phi` relative
/// over `[-3.5, 3.5]` (checked against a 50-digit `Phi` every 1e-4 there), where `Phi` is at
/// least 2.3e-4: far below half an f32 ulp (6e-8), so rounding it to f32 is correct but
/// within 1e-10 of a tie.
const CDF_CENTRAL_POLY: [f64; 17] = [
    0.398_942_280_401_426_1,
    -0.066_490_380_066_594_4,
    0.009_973_557_007_590_486,
    -0.001_187_328_207_850_555_9,
    0.000_115_434_675_050_199_77,
    -9.444_643_663_309_804e-6,
    6.659_609_943_299_748e-7,
    -4.122_280_189_222_046e-8,
    2.272_231_375_450_204_8e-9,
    -1.126_890_176_744_085_8e-10,
    5.052_077_533_587_318e-12,
    -2.036_056_926_852_891_4e-13,
    7.206_418_431_675_515e-15,
    -2.133_370_750_734_725_5e-16,
    4.863_412_018_298_252e-18,
    -7.426_209_451_135_503e-20,
    5.586_229_954_239_765e-22,
];

/// The standard normal CDF `Phi(x)` in f32, evaluated in f64 and rounded once, by the
/// value of `x` alone (never by its neighbours in a vector):
/// - For `|x| <= 3.5` (nearly every input of a GELU), `1/2 + x g(x^2)` with `g` a
///   polynomial ([`CDF_CENTRAL_POLY`]): correctly rounded but within 1e-10 of a tie, and no
///   exponential or quotient; some twenty vector operations per eight inputs.
/// - Beyond, `erfc(-x / sqrt 2) / 2`, erfc by the Chebyshev fit of Press et al.
///   (Numerical Recipes, `erfcc`; relative error below 1.2e-7 everywhere, so within two ulp).
///   Through erfc, the lower tail keeps its relative accuracy (`1 + erf(x)` would lose it);
///   0 where `Phi` is subnormal in f32 (below `x = -13.1`). The fit's `t = 1 / (1 + a/2)` is
///   the f32 quotient refined by two Newton steps in f64 (an f64 division costs several times
///   more where it vectorizes at all) and its multiply-adds are fused.
#[inline(always)]
pub fn normal_cdf_f32(x: f32) -> f32 {
    normal_cdf_f32_lanes([x])[0]
}

/// [`normal_cdf_f32`] of `N` inputs, each step taken over every lane before the next (one
/// input's evaluation is a chain of dependent operations; over [`LANES`] lanes each step is
/// four independent vector operations side by side, and the polynomial's two halves make it
/// eight). Every lane takes the central polynomial; where any lane lies beyond it, the whole
/// vector takes the tail's form too and each such lane keeps that. Each lane's result is
/// that of the one-input form: the same bits.
#[inline(always)]
pub fn normal_cdf_f32_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    let mut out = normal_cdf_central_lanes(x);
    if any_off_centre(&x) {
        let tail = normal_cdf_tail_lanes(x);
        for j in 0..N {
            if off_centre(x[j]) {
                out[j] = tail[j];
            }
        }
    }
    out
}

/// Whether `x` lies beyond the central polynomials' range: `!(|x| <= 3.5)`, not `|x| > 3.5`,
/// so NaN takes the other form (as before the polynomials).
#[inline(always)]
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn off_centre(x: f32) -> bool {
    !(x.abs() <= CDF_CENTRAL)
}

/// Whether any lane is [`off_centre`]: an OR over the lanes with no early exit, so it
/// vectorizes (`contains` or a fold over a mask cost 5-15% of the GELU here).
#[inline(always)]
fn any_off_centre<const N: usize>(x: &[f32; N]) -> bool {
    let mut any = false;
    for &v in x {
        any |= off_centre(v);
    }
    any
}

/// `1/2 + x g(x^2)` ([`CDF_CENTRAL_POLY`]) in f64, rounded once: `Phi(x)` for `|x| <= 3.5`.
#[inline(always)]
fn normal_cdf_central_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    let p = half_plus_odd_lanes(x, &CDF_CENTRAL_POLY);
    let mut out = [0.0f32; N];
    for j in 0..N {
        out[j] = p[j] as f32;
    }
    out
}

/// `1/2 + x p(x^2)` in f64 for `p` the polynomial `c` (constant term first), as its even and
/// odd halves in `x^4`: two independent chains of multiply-adds.
#[inline(always)]
fn half_plus_odd_lanes<const N: usize>(x: [f32; N], c: &[f64; 17]) -> [f64; N] {
    let (mut u, mut u2) = ([0.0f64; N], [0.0f64; N]);
    for j in 0..N {
        let v = x[j] as f64;
        u[j] = v * v;
        u2[j] = u[j] * u[j];
    }
    let (mut even, mut odd) = ([c[16]; N], [c[15]; N]);
    for k in (0..8).rev() {
        for j in 0..N {
            even[j] = even[j].mul_add(u2[j], c[2 * k]);
            if k > 0 {
                odd[j] = odd[j].mul_add(u2[j], c[2 * k - 1]);
            }
        }
    }
    let mut out = [0.0f64; N];
    for j in 0..N {
        let p = odd[j].mul_add(u[j], even[j]);
        out[j] = (x[j] as f64).mul_add(p, 0.5);
    }
    out
}

/// `h(u)` with `Phi(x) + x phi(x) = 1/2 + x h(x^2)` (the GELU's slope) for `x^2` in
/// `[0, 3.5^2]`, the constant term first: as [`CDF_CENTRAL_POLY`], the interpolant of degree 16
/// at the Chebyshev nodes in `u`. Evaluated in f64, the slope is within 6e-13 of the true
/// one over `[-3.5, 3.5]` (and within 2e-10 relative where it is above 1e-3; it crosses 0
/// near `x = -0.75`).
const GELU_SLOPE_POLY: [f64; 17] = [
    0.797_884_560_802_661,
    -0.265_961_520_257_971_43,
    0.059_841_341_984_328_81,
    -0.009_498_625_486_964_316,
    0.001_154_346_485_789_416,
    -0.000_113_335_483_460_810_85,
    9.323_310_768_012_004e-6,
    -6.595_060_640_167_09e-7,
    4.088_297_616_316_572e-8,
    -2.250_127_844_788_257_3e-9,
    1.105_767_572_934_099_1e-10,
    -4.821_632_289_495_009e-12,
    1.820_100_317_148_842e-13,
    -5.662_261_763_510_464e-15,
    1.338_415_941_012_180_9e-16,
    -2.096_501_533_182_388_2e-18,
    1.605_263_007_228_856_6e-20,
];

/// The exact GELU's backward `dy (Phi(x) + x phi(x))` in f32, from the pre-activation `x`,
/// the forward's output `y = x Phi(x)` and the output's gradient `dy`, by the value of `x`
/// alone:
/// - For `|x| <= 3.5`, the slope `1/2 + x h(x^2)` ([`GELU_SLOPE_POLY`]) and its product with
///   `dy` in f64, then rounded to f32: no exponential and no quotient. Within half an f32
///   ulp of `dy` times the true slope plus the polynomial's 6e-13 of `|dy|` (which counts
///   only where the slope is near 0: about `x = -0.75`).
/// - Beyond, in f32 arithmetic: `Phi` read off the output as `y / x` (within an ulp or two
///   of it) and `phi` through [`exp_f32`].
#[inline(always)]
pub fn gelu_backward_f32(x: f32, y: f32, dy: f32) -> f32 {
    gelu_backward_f32_lanes([x], [y], [dy])[0]
}

/// [`gelu_backward_f32`] of `N` inputs, each step over every lane before the next; as in
/// [`normal_cdf_f32_lanes`], a vector with a lane beyond the central range takes the other
/// form too, for those lanes only: each lane's result is that of the one-input form.
#[inline(always)]
pub fn gelu_backward_f32_lanes<const N: usize>(x: [f32; N], y: [f32; N], dy: [f32; N]) -> [f32; N] {
    let slope = half_plus_odd_lanes(x, &GELU_SLOPE_POLY);
    let mut out = [0.0f32; N];
    for j in 0..N {
        out[j] = ((dy[j] as f64) * slope[j]) as f32;
    }
    if any_off_centre(&x) {
        let pdf = (1.0 / (2.0 * std::f64::consts::PI).sqrt()) as f32;
        let mut e = [0.0f32; N];
        for j in 0..N {
            e[j] = -(x[j] * x[j]) * 0.5;
        }
        let e = exp_f32_lanes(e);
        for j in 0..N {
            if off_centre(x[j]) {
                let (v, g) = (x[j], dy[j]);
                let cdf = if v.abs() < 1e-30 { 0.5 } else { y[j] / v };
                out[j] = g * (cdf + v * pdf * e[j]);
            }
        }
    }
    out
}

/// `erfc(-x / sqrt 2) / 2` through the `erfcc` fit (see [`normal_cdf_f32`]): `Phi(x)` beyond
/// the central polynomial, in f64 and rounded once.
#[inline(always)]
fn normal_cdf_tail_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    let (mut z, mut a, mut t) = ([0.0f64; N], [0.0f64; N], [0.0f64; N]);
    for j in 0..N {
        z[j] = -(x[j] as f64) * std::f64::consts::FRAC_1_SQRT_2;
        a[j] = z[j].abs().min(9.5);
        let d = 0.5f64.mul_add(a[j], 1.0);
        // d in [1, 5.75]: d rounded to f32 and the f32 quotient leave t0 within about
        // 2^-23; each Newton step squares the relative error, so two reach the limit of f64.
        let t0 = f64::from(1.0f32 / d as f32);
        let t1 = t0.mul_add((-d).mul_add(t0, 1.0), t0);
        t[j] = t1.mul_add((-d).mul_add(t1, 1.0), t1);
    }
    let mut p = [ERFCC_TOP; N];
    for k in ERFCC {
        for j in 0..N {
            p[j] = p[j].mul_add(t[j], k);
        }
    }
    for j in 0..N {
        p[j] = (-a[j]).mul_add(a[j], p[j]);
    }
    let e = exp_f64_core(p);
    let mut out = [0.0f32; N];
    for j in 0..N {
        // Past 9.3 erfc is subnormal in f32: 0.
        let erfc_a = if a[j] > 9.3 { 0.0 } else { t[j] * e[j] };
        let erfc = if z[j] >= 0.0 { erfc_a } else { 2.0 - erfc_a };
        out[j] = (0.5 * erfc) as f32;
    }
    out
}

/// `e^x` in f32 arithmetic, for steps whose products are bf16 ([`Matmul::Bf16`]): within
/// an ulp of `e^x` (0.91 the worst over every 97th f32 of the range), where [`exp_f32`]
/// rounds an f64 value correctly; sixteen lanes to an AVX-512 vector instead of eight, and
/// fewer steps. `x = n ln 2 + r` with `n` rounded to nearest, `ln 2` in two parts whose first
/// has trailing zeros (so `n` times it is exact and `r` loses nothing), `e^r` by its Taylor
/// series to `r^7` (truncation below 8e-9 relative), `2^n` assembled in the exponent bits.
/// The same edges as [`exp_f32`]: 0 below `-87.3`, `+inf` above `88.7`, NaN stays NaN.
#[inline(always)]
pub fn exp_f32_fast(x: f32) -> f32 {
    exp_f32_fast_lanes([x])[0]
}

/// [`exp_f32_fast`] of `N` inputs, each step over every lane before the next: the same bits,
/// lane by lane, as `N` calls.
#[inline(always)]
pub fn exp_f32_fast_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    let mut c = [0.0f32; N];
    for j in 0..N {
        c[j] = x[j].clamp(-87.5, 88.75);
    }
    let e = exp_f32_core(c, [0.0; N]);
    let mut out = [0.0f32; N];
    for j in 0..N {
        let y = if x[j] < -87.3 { 0.0 } else { e[j] };
        let y = if x[j] > 88.7 { f32::INFINITY } else { y };
        out[j] = if x[j].is_nan() { x[j] } else { y };
    }
    out
}

/// `e^(big + small)` in f32 arithmetic, `big + small` in `[-87.5, 88.75]` and `small` at
/// most a few units (see [`exp_f32_fast`]); every multiply-add fused. `n` comes from the
/// rounded sum, `r = big - n ln 2 + small` from the parts: `big - n LN2_HI` is exact (both
/// terms within a factor two of each other past a few units), so a large exponent given
/// as an exact `big` (the CDF's `-x^2 / 2`) loses nothing to the sum's rounding. `2^n` for
/// `n = 128` (above `88.37`) is `2 * 2^127`.
#[inline(always)]
fn exp_f32_core<const N: usize>(big: [f32; N], small: [f32; N]) -> [f32; N] {
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 = LN2_HI + LN2_LO, LN2_HI with 15 significant bits (FreeBSD's `expf`), so `n`
    // times it is exact for |n| < 512.
    const LN2_HI: f32 = 6.931_457_5e-1;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const TAYLOR: [f32; 7] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
    let (mut n, mut r) = ([0.0f32; N], [0.0f32; N]);
    for j in 0..N {
        n[j] = (big[j] + small[j]).mul_add(std::f32::consts::LOG2_E, ROUND) - ROUND;
        r[j] = (-n[j]).mul_add(LN2_HI, big[j]) + small[j];
        r[j] = (-n[j]).mul_add(LN2_LO, r[j]);
    }
    let mut p = [1.0f32 / 5_040.0; N];
    for k in TAYLOR {
        for j in 0..N {
            p[j] = p[j].mul_add(r[j], k);
        }
    }
    // 2^n from the bits of `n + 127` held as an integer in the low mantissa bits of
    // `n + 127 + 2^23`; `n` at most 127 there, the last doubling apart.
    const SHIFT: f32 = 8_388_608.0;
    for j in 0..N {
        let top = n[j] > 127.5;
        let m = if top { n[j] - 1.0 } else { n[j] };
        let biased = (m + (127.0 + SHIFT)).to_bits() - SHIFT.to_bits();
        p[j] *= f32::from_bits(biased << 23);
        p[j] *= if top { 2.0 } else { 1.0 };
    }
    p
}

/// The standard normal CDF in f32 arithmetic, for steps whose products are bf16
/// ([`Matmul::Bf16`]): the tail fit of [`normal_cdf_f32`] (Numerical Recipes' `erfcc`,
/// 1.2e-7 relative) over the whole range, with its quotient, polynomial and exponential
/// ([`exp_f32_core`]) in f32: within 8 ulp (6.5 the worst over every 97th f32 in
/// `[-13, 6]`, against the f64-evaluated form's half an ulp in `[-3.5, 3.5]` and 2.2
/// beyond). The
/// exponent `-a^2 = -x^2 / 2` is taken as the exact `x^2` of a fused multiply-add split
/// in two, so the lower tail keeps its relative accuracy; 0 from where `Phi` falls a
/// little below f32's normal range (about `x = -13.1`; subnormal a short way above).
#[inline(always)]
pub fn normal_cdf_f32_fast(x: f32) -> f32 {
    normal_cdf_f32_fast_lanes([x])[0]
}

/// [`normal_cdf_f32_fast`] of `N` inputs, each step over every lane before the next: the
/// same bits, lane by lane, as `N` calls.
#[inline(always)]
pub fn normal_cdf_f32_fast_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    let (mut t, mut big, mut lo) = ([0.0f32; N], [0.0f32; N], [0.0f32; N]);
    for j in 0..N {
        // |x| up to 13.5, about 9.5 sqrt(2) (past it Phi is 0 or 1 in f32).
        let v = x[j].abs().min(13.5);
        let a = v * std::f32::consts::FRAC_1_SQRT_2;
        t[j] = 1.0 / 0.5f32.mul_add(a, 1.0);
        // -a^2 = -v^2 / 2 = big + lo exactly: big the rounded product, lo its error.
        let hi = v * v;
        (big[j], lo[j]) = (-0.5 * hi, -0.5 * v.mul_add(v, -hi));
    }
    let mut p = [ERFCC_TOP as f32; N];
    for k in ERFCC_F32 {
        for j in 0..N {
            p[j] = p[j].mul_add(t[j], k);
        }
    }
    let mut small = [0.0f32; N];
    for j in 0..N {
        small[j] = p[j] + lo[j];
        // The exponent at least -87.5 (the result is 0 below -87.3, below).
        big[j] = big[j].max(-87.5 - small[j]);
    }
    let e = exp_f32_core(big, small);
    let mut out = [0.0f32; N];
    for j in 0..N {
        let erfc_a = if big[j] + small[j] < -87.3 { 0.0 } else { t[j] * e[j] };
        // Phi(x) = erfc(-x / sqrt 2) / 2: the upper tail as 1 - erfc(a) / 2.
        let erfc = if x[j] <= 0.0 { erfc_a } else { 2.0 - erfc_a };
        out[j] = if x[j].is_nan() { x[j] } else { 0.5 * erfc };
    }
    out
}

/// `sum a_i b_i` with eight partial sums, so the loop vectorizes (a fixed order all the
/// same: the result never depends on timing).
#[inline(always)]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = T::ZERO;
    for (x, y) in ra.iter().zip(rb) {
        tail += *x * *y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `sum f(a_i)` with eight partial sums (see [`dot`]).
#[inline(always)]
pub(crate) fn sum_map<T: Real>(a: &[T], f: impl Fn(T) -> T) -> T {
    let mut acc = [T::ZERO; 8];
    let c = a.chunks_exact(8);
    let tail = c.remainder().iter().fold(T::ZERO, |s, &x| s + f(x));
    for x in c {
        for l in 0..8 {
            acc[l] += f(x[l]);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `sum a_i` with eight partial sums (see [`dot`]).
#[inline(always)]
pub(crate) fn sum<T: Real>(a: &[T]) -> T {
    sum_map(a, |x| x)
}

/// The largest element (`-inf` for none; NaN ignored, as [`Real::larger`] does) with eight
/// running maxima, so the loop vectorizes: the maximum of a set, so the same in any order.
#[inline(always)]
pub(crate) fn max<T: Real>(a: &[T]) -> T {
    let mut acc = [T::NEG_INF; 8];
    let c = a.chunks_exact(8);
    let tail = c.remainder().iter().fold(T::NEG_INF, |s, &x| s.larger(x));
    for x in c {
        for l in 0..8 {
            acc[l] = acc[l].larger(x[l]);
        }
    }
    let m = (acc[0].larger(acc[4]).larger(acc[1].larger(acc[5])))
        .larger(acc[2].larger(acc[6]).larger(acc[3].larger(acc[7])));
    m.larger(tail)
}

/// The contiguous elements behind a CPU tensor storage and its layout.
pub(crate) fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, op: &str) -> CResult<&'a [T]> {
    let all = s.as_slice::<T>()?;
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| Error::Msg(format!("{op} needs a contiguous input")))?;
    Ok(&all[a..b])
}

/// A tensor's contiguous elements, read under its storage lock (for a backward, whose
/// arguments arrive as tensors).
pub(crate) fn with_data<T: WithDType, R>(
    t: &Tensor,
    op: &str,
    f: impl FnOnce(&[T]) -> CResult<R>,
) -> CResult<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(slice::<T>(s, layout, op)?),
        _ => Err(Error::Msg(format!("{op} runs on the CPU only"))),
    }
}

/// Runs `$body` with `$t` the element type of CPU storage `$s` (f32 or f64).
macro_rules! by_real {
    ($s:expr, $op:expr, |$t:ident| $body:expr) => {
        match $s {
            candle_core::CpuStorage::F32(_) => {
                type $t = f32;
                $body
            }
            candle_core::CpuStorage::F64(_) => {
                type $t = f64;
                $body
            }
            other => Err(candle_core::Error::Msg(format!(
                "{} runs in f32 and f64, not {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            ))),
        }
    };
}
pub(crate) use by_real;

/// Runs `$body` (a `CResult`) with `$t` the element type named by `$dtype` (f32 or f64),
/// for a backward, whose arguments arrive as tensors.
macro_rules! by_real_dtype {
    ($dtype:expr, $op:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            other => {
                Err(candle_core::Error::Msg(format!("{} runs in f32 and f64, not {other:?}", $op)))
            }
        }
    };
}
pub(crate) use by_real_dtype;

/// The state a node's forward keeps for its backward, locked; `op` names the node in the
/// error a panic's poisoning gives.
pub(crate) fn saved_state<'a, S>(
    state: &'a std::sync::Mutex<S>,
    op: &str,
) -> CResult<std::sync::MutexGuard<'a, S>> {
    state.lock().map_err(|_| Error::Msg(format!("{op}: a panic poisoned the saved state")))
}

/// A buffer a node's forward keeps for its backward, as a flat tensor.
pub(crate) fn kept<T: Real>(v: Vec<T>) -> CResult<Tensor> {
    let n = v.len();
    Tensor::from_vec(v, n, &candle_core::Device::Cpu)
}

/// A node whose one input is `x` and whose second argument only anchors it in the graph
/// (the experts, the attention block, the MLP): its backward maps the output's gradient to
/// `x`'s on slices.
pub(crate) trait Anchored {
    /// The op's name in errors.
    const NAME: &'static str;

    /// `x`'s gradient from `x` (of `shape`) and the output's gradient `dy`.
    fn input_grad<T: pointwise::NormalCdf>(
        &self,
        x: &[T],
        shape: &candle_core::Shape,
        dy: &[T],
    ) -> CResult<Vec<T>>;

    /// The custom op's backward: `x`'s gradient, none for the anchor.
    fn anchored_bwd(&self, x: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let dx = by_real_dtype!(x.dtype(), Self::NAME, |T| {
            let dx = with_data::<T, _>(x, Self::NAME, |xd| {
                with_data::<T, _>(&grad, Self::NAME, |gd| self.input_grad(xd, x.shape(), gd))
            })?;
            Tensor::from_vec(dx, x.shape(), x.device())
        })?;
        Ok((Some(dx), None))
    }
}

#[cfg(test)]
mod tests {
    use super::{
        CDF_CENTRAL, LANES, Matmul, Real, dot, exp_f32, exp_f32_fast, exp_f32_fast_lanes,
        exp_f32_lanes, gelu_backward_f32, gelu_backward_f32_lanes, max, normal_cdf_f32,
        normal_cdf_f32_fast, normal_cdf_f32_fast_lanes, normal_cdf_f32_lanes, share_of,
        share_threads, simd, sum, sum_map, threads,
    };

    #[test]
    fn a_share_of_the_threads_holds_on_its_own_thread_only() {
        let all = candle_core::utils::get_num_threads();
        assert_eq!(share_of(1), all);
        assert_eq!(share_of(0), all, "no ranks counts as one");
        assert_eq!(share_of(all + 1), 1, "more ranks than threads: one each");
        assert_eq!(share_of(2), (all / 2).max(1));
        std::thread::spawn(move || {
            assert_eq!(threads(), all, "unset: candle's count");
            assert_eq!(share_threads(all + 1), 1);
            assert_eq!(threads(), 1);
            std::thread::spawn(move || assert_eq!(threads(), all, "another thread: unset"))
                .join()
                .expect("thread");
        })
        .join()
        .expect("thread");
    }

    /// Rows of every length up to two chunks and a tail, with NaN, infinities, signed zeros
    /// and ordinary values at varied places.
    fn rows() -> Vec<Vec<f32>> {
        let pool =
            [1.5f32, -2.25, f32::NAN, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 3.0e-3, -7.0];
        let mut out = Vec::new();
        for len in 0..=17 {
            for shift in 0..pool.len() {
                out.push((0..len).map(|i| pool[(i * 5 + shift) % pool.len()]).collect());
                // Finite rows too, where the sums are finite.
                out.push((0..len).map(|i| ((i + shift) as f32 * 0.37).sin() * 4.0).collect());
            }
        }
        out
    }

    #[test]
    fn the_lane_maximum_is_the_left_fold_of_the_larger() {
        for row in rows() {
            let want = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.larger(b));
            let got = max(&row);
            // Equal as values (a zero's sign may differ, as `larger` allows); never NaN.
            assert!(got == want && !got.is_nan(), "{row:?}: {got} against {want}");
        }
    }

    #[test]
    fn the_reductions_give_the_same_bits_on_both_paths() {
        for row in rows() {
            let other: Vec<f32> = row.iter().rev().copied().collect();
            let run = || {
                (
                    max(&row),
                    sum(&row),
                    dot(&row, &other),
                    sum_map(&row, |x| x * x),
                    sum_map(&row, |x| x),
                )
            };
            let (wide, plain) = (simd::fast!(run()), run());
            let bits = |r: (f32, f32, f32, f32, f32)| {
                [r.0.to_bits(), r.1.to_bits(), r.2.to_bits(), r.3.to_bits(), r.4.to_bits()]
            };
            assert_eq!(bits(wide), bits(plain), "{row:?}");
            // `sum` is `sum_map` of the identity.
            assert_eq!(plain.1.to_bits(), plain.4.to_bits(), "{row:?}");
            if row.iter().all(|x| x.is_finite()) {
                let exact: f64 = row.iter().map(|&x| x as f64).sum();
                let scale: f64 = row.iter().map(|&x| (x as f64).abs()).sum();
                assert!((plain.1 as f64 - exact).abs() <= 1e-6 * scale.max(1.0), "{row:?}");
            }
        }
    }

    /// The four functions (the exponential and the CDF, f64- and f32-evaluated) of `xs` in
    /// lanes of [`LANES`], as bits.
    #[inline(always)]
    fn in_lanes(xs: &[f32]) -> Vec<[u32; 4]> {
        let mut out = Vec::with_capacity(xs.len());
        for c in xs.chunks(LANES) {
            let mut lanes = [0.0f32; LANES];
            lanes[..c.len()].copy_from_slice(c);
            let (e, p) = (exp_f32_lanes(lanes), normal_cdf_f32_lanes(lanes));
            let (fe, fp) = (exp_f32_fast_lanes(lanes), normal_cdf_f32_fast_lanes(lanes));
            out.extend((0..c.len()).map(|j| [e[j], p[j], fe[j], fp[j]].map(f32::to_bits)));
        }
        out
    }

    #[test]
    fn lanes_give_the_bits_of_one_input_at_a_time() {
        let mut xs: Vec<f32> = (0..20_000).map(|i| (i as f32 - 10_000.0) * 0.0119).collect();
        xs.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -87.3,
            -87.31,
            88.7,
            88.71,
            -0.0,
            0.0,
            9.3 * std::f32::consts::SQRT_2,
            -13.1,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
        ]);
        let one = |x: f32| {
            [exp_f32(x), normal_cdf_f32(x), exp_f32_fast(x), normal_cdf_f32_fast(x)]
                .map(f32::to_bits)
        };
        let want: Vec<[u32; 4]> = xs.iter().map(|&x| one(x)).collect();
        assert_eq!(in_lanes(&xs), want, "the baseline path");
        assert_eq!(simd::fast!(in_lanes(&xs)), want, "the dispatched (widest) path");
        let exps = want.iter().map(|w| w[0]).collect::<Vec<_>>();
        let mut ys = xs.clone();
        f32::exp_in_place(&mut ys);
        assert_eq!(ys.iter().map(|y| y.to_bits()).collect::<Vec<_>>(), exps, "exp_in_place");
        let mut ys = xs.clone();
        simd::fast!(f32::exp_in_place(&mut ys));
        let wide = ys.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        assert_eq!(wide, exps, "exp_in_place on the dispatched path");
        // Under bf16 products, the f32-evaluated form, chunks and tail alike.
        let fast = want.iter().map(|w| w[2]).collect::<Vec<_>>();
        let mut ys = xs.clone();
        simd::fast!(f32::exp_in_place_as(&mut ys, Matmul::Bf16));
        let got = ys.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
        assert_eq!(got, fast, "exp_in_place_as under bf16 products");
    }

    #[test]
    fn the_normal_cdf_rounds_correctly_in_the_centre_and_keeps_its_tails() {
        let (mut x, mut n, mut off) = (-13.0f32, 0, 0);
        while x <= 6.0 {
            let want = 0.5 * candle_core::cpu::erf::erfc_f64(-(x as f64) / 2f64.sqrt());
            let got = normal_cdf_f32(x);
            if want < f32::MIN_POSITIVE as f64 {
                assert!((got as f64) < f32::MIN_POSITIVE as f64, "Phi({x}) = {got}, want {want}");
            } else if x.abs() <= CDF_CENTRAL {
                // The central polynomial: within half an ulp but in near-ties.
                let u = ulps(got, want);
                assert!(u <= 0.5001, "Phi({x}) = {got}, want {want}: {u} ulp");
                off += usize::from(got != want as f32);
                n += 1;
            } else {
                // The tail's fit, 1.2e-7, plus half an ulp from the rounding, relative.
                assert!(
                    (got as f64 - want).abs() <= 1.9e-7 * want,
                    "Phi({x}) = {got}, want {want}"
                );
            }
            x += 0.000_77;
        }
        assert!(n > 9_000 && off * 1000 < n, "{off} of {n} not correctly rounded");
        // Either side of the central range's edge, and its edges.
        for x in [CDF_CENTRAL, -CDF_CENTRAL] {
            for y in [x, f32::from_bits(x.to_bits() + 1), f32::from_bits(x.to_bits() - 1)] {
                let want = 0.5 * candle_core::cpu::erf::erfc_f64(-(y as f64) / 2f64.sqrt());
                let got = normal_cdf_f32(y) as f64;
                assert!((got - want).abs() <= 1.9e-7 * want, "Phi({y}) = {got}, want {want}");
            }
        }
        assert_eq!(normal_cdf_f32(-20.0), 0.0);
        assert_eq!(normal_cdf_f32(20.0), 1.0);
        assert_eq!(normal_cdf_f32(0.0), 0.5);
        assert_eq!(normal_cdf_f32(-0.0), 0.5);
    }

    /// The lanes of a vector with one input beyond the central range take the tail's form
    /// there and the polynomial elsewhere: each the bits of its input alone.
    #[test]
    fn a_lane_beyond_the_centre_leaves_its_neighbours_alone() {
        let mut xs: [f32; LANES] = std::array::from_fn(|i| i as f32 * 0.21 - 3.3);
        let alone = xs.map(normal_cdf_f32);
        assert_eq!(normal_cdf_f32_lanes(xs), alone);
        xs[5] = -7.25;
        let mixed = normal_cdf_f32_lanes(xs);
        assert_eq!(mixed[5], normal_cdf_f32(-7.25));
        for j in (0..LANES).filter(|&j| j != 5) {
            assert_eq!(mixed[j], alone[j], "lane {j}");
        }
    }

    /// The GELU's slope `Phi(x) + x phi(x)` in f64 (candle's erfc and f64's exp).
    fn gelu_slope(x: f64) -> f64 {
        let pdf = (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
        0.5 * candle_core::cpu::erf::erfc_f64(-x / 2f64.sqrt()) + x * pdf
    }

    #[test]
    fn the_gelu_backward_rounds_correctly_in_the_centre() {
        let (mut x, mut n, mut off) = (-CDF_CENTRAL, 0, 0);
        while x <= CDF_CENTRAL {
            let y = x * normal_cdf_f32(x);
            for dy in [1.0f32, -0.37, 3.1e-3] {
                let want = dy as f64 * gelu_slope(x as f64);
                let got = gelu_backward_f32(x, y, dy);
                // Half an ulp from the one rounding and the polynomial's 6e-13 of the slope
                // (which counts where the slope is small: near x = -0.75 and -3.5).
                let err = (got as f64 - want).abs();
                let ulp = 2f64.powi(want.abs().log2().floor() as i32 - 23);
                assert!(
                    err <= 0.5 * ulp + 6e-13 * dy.abs() as f64,
                    "gelu'({x}) dy {dy} = {got}, want {want}: {} ulp",
                    err / ulp
                );
                off += usize::from(got != want as f32);
                n += 1;
            }
            x += 0.000_31;
        }
        assert!(n > 60_000 && off * 1000 < n, "{off} of {n} not correctly rounded");
    }

    /// Beyond the central range, the slope from the forward's output and `exp_f32`; a lane
    /// there leaves the others of its vector alone.
    #[test]
    fn the_gelu_backward_beyond_the_centre_reads_phi_off_the_output() {
        let pdf = (1.0 / (2.0 * std::f64::consts::PI).sqrt()) as f32;
        for x in [-13.5f32, -7.25, -3.5000002, 3.5000002, 5.0, 9.0] {
            let (y, dy) = (x * normal_cdf_f32(x), 0.75f32);
            let want = dy * (y / x + x * pdf * exp_f32(-(x * x) * 0.5));
            assert_eq!(gelu_backward_f32(x, y, dy), want, "gelu'({x})");
            // Within the tail fit's 2e-7 of the true slope.
            let exact = dy as f64 * gelu_slope(x as f64);
            assert!((want as f64 - exact).abs() <= 4e-7 * exact.abs().max(1e-30), "{x}");
        }
        assert!(gelu_backward_f32(f32::NAN, f32::NAN, 1.0).is_nan());
        let mut xs: [f32; LANES] = std::array::from_fn(|i| i as f32 * 0.21 - 3.3);
        let ys = xs.map(|x| x * normal_cdf_f32(x));
        let gs: [f32; LANES] = std::array::from_fn(|i| 1.0 - i as f32 * 0.05);
        let alone: Vec<f32> = (0..LANES).map(|j| gelu_backward_f32(xs[j], ys[j], gs[j])).collect();
        assert_eq!(gelu_backward_f32_lanes(xs, ys, gs).to_vec(), alone);
        xs[9] = -7.25;
        let mixed = gelu_backward_f32_lanes(xs, ys, gs);
        assert_eq!(mixed[9], gelu_backward_f32(-7.25, ys[9], gs[9]));
        for j in (0..LANES).filter(|&j| j != 9) {
            assert_eq!(mixed[j], alone[j], "lane {j}");
        }
    }

    /// The GELU kernel over several parts of [`super::written::PART`], lanes of both forms
    /// mixed in its vectors and a tail past the last whole vector: every element the bits
    /// of the one-input forms, on the baseline and the dispatched path.
    #[test]
    fn the_gelu_kernel_gives_the_one_input_bits_across_parts() {
        use super::pointwise::GeluOp;
        let n = 3 * super::written::PART + 45;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1801) as f32 * 0.01 - 9.0).collect();
        let dy: Vec<f32> = (0..n).map(|i| 1.0 - (i % 13) as f32 * 0.17).collect();
        let y: Vec<f32> = x.iter().map(|&v| v * normal_cdf_f32(v)).collect();
        let want: Vec<u32> =
            (0..n).map(|i| gelu_backward_f32(x[i], y[i], dy[i]).to_bits()).collect();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert!(x.iter().any(|v| v.abs() > CDF_CENTRAL) && x.iter().any(|v| v.abs() < 1.0));
        assert_eq!(bits(GeluOp::forward(&x, Matmul::Native)), bits(y.clone()), "forward");
        assert_eq!(bits(simd::fast!(GeluOp::forward(&x, Matmul::Native))), bits(y.clone()));
        assert_eq!(bits(GeluOp::backward(&x, &y, &dy, Matmul::Native)), want, "backward");
        let wide = simd::fast!(GeluOp::backward(&x, &y, &dy, Matmul::Native));
        assert_eq!(bits(wide), want, "backward on the dispatched path");
    }

    #[test]
    fn the_exp_rounds_correctly_and_is_exact_at_the_edges() {
        let (mut x, mut n, mut off) = (-87.3f32, 0, 0);
        while x <= 88.7 {
            let want = (x as f64).exp();
            let got = exp_f32(x);
            // Within half an ulp of the f64 value but in near-ties.
            let ulp = (f32::from_bits(got.to_bits() + 1) - got) as f64;
            assert!((got as f64 - want).abs() <= 0.5001 * ulp, "exp({x}) = {got}, want {want}");
            off += usize::from(got != want as f32);
            n += 1;
            x += 0.000_913;
        }
        assert!(off * 1000 < n, "{off} of {n} not correctly rounded");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
    }
    /// `got`'s distance from `want` in units of f32's spacing at `want` (`2^(e - 23)` for
    /// `want` in `[2^e, 2^(e + 1))`).
    fn ulps(got: f32, want: f64) -> f64 {
        let spacing = 2f64.powi(want.abs().log2().floor() as i32 - 23);
        (got as f64 - want).abs() / spacing
    }

    #[test]
    fn the_f32_evaluated_exp_is_within_an_ulp_with_the_same_edges() {
        let (mut x, mut worst) = (-87.3f32, 0.0f64);
        while x <= 88.7 {
            let u = ulps(exp_f32_fast(x), (x as f64).exp());
            assert!(u <= 1.0, "exp({x}) = {}, {u} ulp", exp_f32_fast(x));
            worst = worst.max(u);
            x += 0.000_913;
        }
        // Not correctly rounded everywhere (that is `exp_f32`'s part): some input is more
        // than half an ulp off (0.85 here, 0.91 over every 97th f32 of the range). A check
        // that this is the f32-evaluated form, which fails if it ever rounds correctly.
        assert!(worst > 0.5, "worst {worst} ulp");
        for x in [f32::NEG_INFINITY, -100.0, -87.31, 0.0, 88.71, 100.0, f32::INFINITY] {
            assert_eq!(exp_f32_fast(x), exp_f32(x), "exp({x})");
        }
        assert!(exp_f32_fast(f32::NAN).is_nan());
    }

    #[test]
    fn the_f32_evaluated_normal_cdf_is_within_eight_ulp_and_keeps_its_tails() {
        let (mut x, mut worst) = (-13.0f32, 0.0f64);
        while x <= 6.0 {
            let want = 0.5 * candle_core::cpu::erf::erfc_f64(-(x as f64) / 2f64.sqrt());
            let got = normal_cdf_f32_fast(x);
            if want < f32::MIN_POSITIVE as f64 {
                assert!((got as f64) < f32::MIN_POSITIVE as f64, "Phi({x}) = {got}");
            } else {
                let u = ulps(got, want);
                worst = worst.max(u);
                assert!(u <= 8.0, "Phi({x}) = {got}, want {want}: {u} ulp");
            }
            x += 0.000_77;
        }
        // 5.2 ulp here, 6.5 over every 97th f32 of the range (just below 0, where Phi is
        // just below 1/2 and its spacing half that above); the f64-evaluated form's 0.5
        // within 3.5 of 0 and 2.2 beyond. As for the exponential, a check that this is the
        // f32-evaluated form.
        assert!(worst > 2.0, "worst {worst} ulp");
        for x in [-20.0f32, 20.0, 0.0, f32::NEG_INFINITY, f32::INFINITY] {
            assert_eq!(normal_cdf_f32_fast(x), normal_cdf_f32(x), "Phi({x})");
        }
        assert!(normal_cdf_f32_fast(f32::NAN).is_nan());
    }
}
