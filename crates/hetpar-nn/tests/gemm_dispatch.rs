//! candle's matmul on whichever kernels gemm picks on this CPU: AVX-512 where the CPU has
//! AVX-512F (the `x86-v4` feature hetpar-nn turns on), AVX2+FMA or scalar code elsewhere.
//! Odd shapes reach the kernels' edge cases; every product is compared with a plain triple
//! loop in f64. The fused kernels' element-wise loops take the same kind of path
//! (`kernels::simd`: AVX-512, else AVX2+FMA, else the baseline target), and must give the
//! baseline's bits on whichever they get. CI also runs this test under valgrind, whose
//! virtual CPU has no AVX-512, so the fallbacks are exercised on the same machine;
//! `HETPAR_EXPECT_KERNELS` (a prefix of the kernel name) makes the test check which
//! kernels it got:
//!
//!     HETPAR_EXPECT_KERNELS=AVX2 CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="valgrind -q" \
//!       cargo test --release --test gemm_dispatch -- --nocapture

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use candle_core::{DType, Device, Tensor};
use hetpar_nn::kernels::{exp_f32, exp_f32_fast, gemm, normal_cdf_f32, normal_cdf_f32_fast, simd};

/// `a [m, k] x b [k, n]` by the definition, in f64.
fn reference(a: &[f64], b: &[f64], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
        }
    }
    c
}

/// Largest relative difference of candle's product in `dtype` from the reference.
fn worst(dtype: DType, (m, k, n): (usize, usize, usize)) -> candle_core::Result<f64> {
    // Deterministic values in [-1, 1).
    let value = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2001) as f64 / 1000.0 - 1.0;
    let a: Vec<f64> = (0..m * k).map(|i| value(i, 1)).collect();
    let b: Vec<f64> = (0..k * n).map(|i| value(i, 2)).collect();
    let want = reference(&a, &b, (m, k, n));
    let ta = Tensor::from_vec(a, (m, k), &Device::Cpu)?.to_dtype(dtype)?;
    let tb = Tensor::from_vec(b, (k, n), &Device::Cpu)?.to_dtype(dtype)?;
    let got = ta.matmul(&tb)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let scale = want.iter().fold(0.0f64, |s, x| s.max(x.abs())).max(1e-30);
    Ok(got.iter().zip(&want).fold(0.0f64, |w, (g, r)| w.max((g - r).abs() / scale)))
}

#[test]
fn products_match_the_definition_on_the_kernels_this_cpu_gets() {
    let kernels = gemm::path();
    println!("gemm runs its {kernels} kernels on this CPU");
    if let Ok(want) = std::env::var("HETPAR_EXPECT_KERNELS") {
        assert!(kernels.starts_with(&want), "expected {want} kernels, got {kernels}");
    }
    let shapes = [(1, 1, 1), (3, 5, 7), (17, 33, 9), (67, 129, 45), (128, 256, 96), (200, 64, 300)];
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
        for &shape in &shapes {
            let w = worst(dtype, shape).unwrap();
            assert!(w <= tol, "{dtype:?} {shape:?}: relative difference {w:.2e} above {tol:e}");
        }
    }
}

/// `exp_f32` and `normal_cdf_f32` of every input, and their f32-evaluated forms (bf16
/// steps'), as bits (inlined into its caller, so it is compiled for the caller's path; a
/// plain loop, since a `collect` would run out of line).
#[inline(always)]
fn elementwise(xs: &[f32]) -> Vec<[u32; 4]> {
    let mut out = vec![[0; 4]; xs.len()];
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = [exp_f32(x), normal_cdf_f32(x), exp_f32_fast(x), normal_cdf_f32_fast(x)]
            .map(f32::to_bits);
    }
    out
}

#[test]
fn elementwise_kernels_give_the_baseline_bits_on_the_path_this_cpu_gets() {
    let path = simd::path();
    println!("the element-wise kernels run on the {path} path on this CPU");
    if let Ok(want) = std::env::var("HETPAR_EXPECT_KERNELS") {
        assert!(path.starts_with(&want), "expected the {want} path, got {path}");
    }
    // Both tails, the CDF's switch to 0 and the exponential's to 0 and infinity, and values
    // between representable steps.
    let xs: Vec<f32> = (0..20_001).map(|i| (i as f32 - 10_000.0) * 0.00917).collect();
    let plain = elementwise(&xs);
    let dispatched = simd::dispatch(
        #[inline(always)]
        || elementwise(&xs),
    );
    let differ = plain.iter().zip(&dispatched).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} of {} results differ from the baseline's on {path}", xs.len());
}
