//! Tests of the bf16 products: every kernel this machine runs against the f64 product of the
//! rounded operands, each destination and operand layout, threads, new destinations and the
//! packing buffers kept between products.

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
                            let p = round(at(&a, av, r, i)) as f64 * round(at(&b, bv, i, c)) as f64;
                            want += p;
                            mag += p.abs();
                        }
                        let here = dv.offset + r * dv.rs + c * dv.cs;
                        seen[here] = true;
                        let prev = if accumulate { old[here] as f64 } else { 0.0 };
                        let want = prev + beta as f64 * want;
                        let bound = (k + 2) as f64 * 2f64.powi(-24) * (mag + prev.abs()) + 1e-30;
                        let got = dst[here] as f64;
                        assert!(
                            (got - want).abs() <= bound,
                            "{kernel:?} ({m}, {n}, {k}) layout {layout} at ({r}, {c}): {got} against {want}"
                        );
                    }
                }
                for (i, seen) in seen.into_iter().enumerate() {
                    assert!(seen || dst[i] == old[i], "{kernel:?} ({m}, {n}, {k}): {i} is outside");
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
