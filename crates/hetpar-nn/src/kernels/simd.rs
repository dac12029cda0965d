//! Runs a kernel's loops compiled for AVX-512 where the CPU has it. The build targets
//! baseline x86-64 (SSE2), where the compiler vectorizes f32 loops four lanes wide and
//! leaves f64 loops that convert to integers (the exponent trick of `exp`) scalar; compiled
//! for AVX-512 the same source runs sixteen lanes wide. The loops' results are the same on
//! both paths: nothing is reassociated and no multiply-add is fused (Rust contracts no
//! float expression). Matrix products are another matter: gemm picks its AVX-512, AVX2 or
//! scalar kernels and its block sizes at run time, so products (candle's and the kernels')
//! may round differently on another CPU.
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")]
fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `f()`, inlined into a function compiled for AVX-512 when the CPU has it. Call it through
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
    f()
}

/// `fast!(expr)`: `expr` evaluated by [`dispatch`], compiled for AVX-512 where the CPU has
/// it, through a closure that is always inlined.
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
    use crate::kernels::{exp_f32, normal_cdf_f32};

    #[test]
    fn both_paths_give_the_same_bits() {
        let xs: Vec<f32> = (0..10_000).map(|i| (i as f32 - 5_000.0) * 0.0173).collect();
        let run =
            || xs.iter().map(|&x| (exp_f32(x.min(80.0)), normal_cdf_f32(x))).collect::<Vec<_>>();
        let (wide, plain) = (super::fast!(run()), run());
        assert!(
            wide.iter()
                .zip(&plain)
                .all(|(a, b)| a.0.to_bits() == b.0.to_bits() && a.1.to_bits() == b.1.to_bits())
        );
    }
}
