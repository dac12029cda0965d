//! Runs a kernel's loops compiled for the widest vectors the CPU has. The build targets
//! baseline x86-64 (SSE2), where the compiler vectorizes f32 loops four lanes wide and
//! leaves f64 loops that convert to integers (the exponent trick of `exp`) scalar; compiled
//! for AVX-512 the same source runs sixteen lanes wide, for AVX2 eight. The loops' results
//! are the same on every path: nothing is reassociated, and a multiply-add is fused only
//! where the source says so (`mul_add`, one rounding on every path: an FMA instruction on
//! the AVX2 and AVX-512 paths, a call of `fma` from Rust's compiler-builtins on the
//! baseline path, correct but many times slower). Rust contracts no other float
//! expression. Matrix products are another matter: gemm picks its AVX-512, AVX2 or scalar
//! kernels and its block sizes at run time, so products (candle's and the kernels') may
//! round differently on another CPU.
#![allow(unsafe_code)]

/// Whether this CPU runs the AVX-512 path.
#[cfg(target_arch = "x86_64")]
pub fn avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
}

/// Whether this CPU runs the AVX-512 path (never off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn avx512() -> bool {
    false
}

/// Whether this CPU runs the AVX2 path (AVX2 and FMA, no AVX-512).
#[cfg(target_arch = "x86_64")]
pub fn avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Whether this CPU runs the AVX2 path (never off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn avx2() -> bool {
    false
}

/// The path the kernels' loops take on this CPU, by name: "AVX-512", "AVX2+FMA" or
/// "baseline" (the build's own target: SSE2 on x86-64).
pub fn path() -> &'static str {
    if avx512() {
        "AVX-512"
    } else if avx2() {
        "AVX2+FMA"
    } else {
        "baseline"
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")]
fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `f()`, inlined into a function compiled for AVX-512 when the CPU has it, else for AVX2
/// and FMA when it has those (the kernels' exponentials and normal CDF fuse their
/// multiply-adds, which the baseline target leaves to a library call). Call it through
/// `fast!`, which marks the closure `#[inline(always)]`: the compiler may otherwise keep
/// a large closure out of line, compiled for the baseline (the attention backward ran
/// there, on SSE registers, 20-30% slower).
#[inline(always)]
pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU reports every feature the function is compiled for.
        return unsafe { with_avx512(f) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as above.
        return unsafe { with_avx2(f) };
    }
    f()
}

/// `fast!(expr)`: `expr` evaluated by [`dispatch`], compiled for AVX-512 or AVX2 where the
/// CPU has it, through a closure that is always inlined.
macro_rules! fast {
    ($body:expr) => {
        $crate::kernels::simd::dispatch(
            #[inline(always)]
            || $body,
        )
    };
}
pub(crate) use fast;

#[cfg(test)]
mod tests {
    use crate::kernels::{exp_f32, exp_f32_fast, normal_cdf_f32, normal_cdf_f32_fast};

    /// `exp_f32` and `normal_cdf_f32` of every input, and their f32-evaluated forms, as
    /// bits (a plain loop: a `collect` would run out of line, on the baseline path whatever
    /// the caller's).
    #[inline(always)]
    fn run(xs: &[f32]) -> Vec<[u32; 4]> {
        let mut out = vec![[0; 4]; xs.len()];
        for (o, &x) in out.iter_mut().zip(xs) {
            let e = x.min(80.0);
            *o = [exp_f32(e), normal_cdf_f32(x), exp_f32_fast(e), normal_cdf_f32_fast(x)]
                .map(f32::to_bits);
        }
        out
    }

    #[test]
    fn every_path_gives_the_same_bits() {
        let xs: Vec<f32> = (0..10_000).map(|i| (i as f32 - 5_000.0) * 0.0173).collect();
        let plain = run(&xs);
        assert_eq!(super::fast!(run(&xs)), plain, "the dispatched path");
        #[cfg(target_arch = "x86_64")]
        {
            if super::avx2() {
                // SAFETY: the CPU has AVX2 and FMA.
                let avx2 = unsafe {
                    super::with_avx2(
                        #[inline(always)]
                        || run(&xs),
                    )
                };
                assert_eq!(avx2, plain, "the AVX2 path");
            }
            if super::avx512() {
                // SAFETY: the CPU has every feature of the AVX-512 path.
                let wide = unsafe {
                    super::with_avx512(
                        #[inline(always)]
                        || run(&xs),
                    )
                };
                assert_eq!(wide, plain, "the AVX-512 path");
            }
        }
    }
}
