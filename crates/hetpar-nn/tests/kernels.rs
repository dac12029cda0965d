//! The fused kernels against the unfused compositions they replace
//! (`hetpar_nn::kernels::reference`): outputs and every input gradient, f32 within 1e-5 and
//! f64 within 1e-10 of the reference's largest value.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use hetpar_nn::Init;
use hetpar_nn::kernels::adam::{AdamStep, adamw_step};
use hetpar_nn::kernels::attention::FlashAttention;
use hetpar_nn::kernels::bf16;
use hetpar_nn::kernels::block::{
    BlockWeights, PreNorm, Projection, attention_block, gelu_mlp, swiglu_mlp,
};
use hetpar_nn::kernels::experts::{ExpertWeights, combine_experts, experts_swiglu, routed_experts};
use hetpar_nn::kernels::linear::{
    Matmul, linear, linear_bias, linear_bias_as, linear_bias_gelu_into, linear_bias_into,
    linear_into,
};
use hetpar_nn::kernels::pointwise::{
    RopeTables, bias_add, gelu, gelu_as, layer_norm, rms_norm, rope, swiglu, swiglu_as,
};
use hetpar_nn::kernels::reference;
use hetpar_nn::kernels::sink::GradSink;
use hetpar_nn::ops::VocabCrossEntropy;
use hetpar_nn::testing::{flat, rel_err};

/// The element types and products the fused ops run: f32 and f64 natively, f32 tensors
/// with bf16 products.
fn products() -> [(DType, Matmul); 3] {
    [(DType::F32, Matmul::Native), (DType::F64, Matmul::Native), (DType::F32, Matmul::Bf16)]
}

/// A tensor's values as bits (of their f64 widening: equal bits, equal values).
fn bits(t: &Tensor) -> Vec<u64> {
    flat(t).unwrap().iter().map(|v| v.to_bits()).collect()
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-10 } else { 1e-5 }
}

fn var(name: &str, shape: &[usize], dtype: DType) -> Var {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| Init::Normal(1.0).value(11, name, i as u64)).collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap())
        .unwrap()
}

fn close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let e = rel_err(&flat(got).unwrap(), &flat(want).unwrap());
    assert!(e <= tol, "{what}: relative error {e:e} above {tol:e}");
}

/// A pre-norm of `hidden` in `dtype` for the fused blocks' residual form: LayerNorm (weight
/// and bias, their sinks `sinks[0]`, `sinks[1]`) or RMSNorm (weight, `sinks[0]`), with the
/// composed norm beside it and the weights' gradients, fused (sinks) or composed (store).
struct Pre {
    layer: bool,
    w: Var,
    b: Var,
    sinks: [GradSink; 2],
}

const PRE_EPS: f64 = 1e-6;

impl Pre {
    fn new(layer: bool, hidden: usize, dtype: DType) -> Pre {
        // Scales of both signs around 0.5, so the norm's gradients are no multiple of dy's.
        let w = var("pre_w", &[hidden], dtype).as_tensor().affine(1.0, 0.5).unwrap();
        let w = Var::from_tensor(&w).unwrap();
        Pre {
            layer,
            w,
            b: var("pre_b", &[hidden], dtype),
            sinks: [GradSink::new(), GradSink::new()],
        }
    }

    fn fused(&self) -> PreNorm {
        let (w, b) = (self.w.as_tensor().clone(), self.b.as_tensor().clone());
        if self.layer {
            PreNorm::Layer {
                weight: (w, self.sinks[0].clone()),
                bias: (b, self.sinks[1].clone()),
                eps: PRE_EPS,
            }
        } else {
            PreNorm::Rms { weight: (w, self.sinks[0].clone()), eps: PRE_EPS }
        }
    }

    fn composed(&self, x: &Tensor) -> Tensor {
        if self.layer {
            layer_norm(x, &self.w, &self.b, PRE_EPS).unwrap()
        } else {
            rms_norm(x, &self.w, PRE_EPS).unwrap()
        }
    }

    /// The norm's weights' gradients: from the sinks where `fused`, else from the store
    /// (each asserted absent from the other).
    fn grads(&self, store: &candle_core::backprop::GradStore, fused: bool) -> Vec<Tensor> {
        let vars: &[&Var] = if self.layer { &[&self.w, &self.b] } else { &[&self.w] };
        vars.iter()
            .zip(&self.sinks)
            .map(|(v, sink)| {
                let (stored, sunk) = (store.get(v), sink.take(v.shape()).unwrap());
                match (fused, stored, sunk) {
                    (true, None, Some(g)) => g,
                    (false, Some(g), None) => g.clone(),
                    (_, stored, sunk) => panic!(
                        "fused {fused}: a pre-norm gradient in the store {} and in the sink {}",
                        stored.is_some(),
                        sunk.is_some()
                    ),
                }
            })
            .collect()
    }
}

/// A loss that weighs every output element differently, so every gradient path shows.
fn weigh(t: &Tensor, name: &str) -> Tensor {
    let w = var(name, t.dims(), t.dtype());
    (t * w.as_tensor()).unwrap().sum_all().unwrap()
}

/// Asserts that a fused node's outputs and gradients equal the composed graph's, value by
/// value (candle's store turns `-0` into `0`, the nodes do not).
fn assert_same_values(got: &[Tensor], want: &[Tensor], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: how many results");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(flat(g).unwrap() == flat(w).unwrap(), "{what}: output {i}");
    }
}

#[derive(Clone)]
struct Case {
    name: &'static str,
    b: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    q_pos: Vec<usize>,
    k_pos: Vec<usize>,
    causal: bool,
}

fn cases() -> Vec<Case> {
    // Two chunks of a 4-way zigzag split of 200 positions: rank 1 holds chunks 1 and 6.
    let chunk = |c: usize| (c * 25..(c + 1) * 25).collect::<Vec<_>>();
    let zig_q = [chunk(1), chunk(6)].concat();
    let zig_k: Vec<usize> = [0, 7, 1, 6, 2, 5, 3, 4].iter().flat_map(|&c| chunk(c)).collect();
    vec![
        Case {
            name: "causal GQA, 150 tokens (blocks not dividing)",
            b: 2,
            heads: 4,
            kv_heads: 2,
            d: 16,
            q_pos: (0..150).collect(),
            k_pos: (0..150).collect(),
            causal: true,
        },
        Case {
            name: "causal, zigzag queries over all-gathered zigzag keys",
            b: 1,
            heads: 2,
            kv_heads: 1,
            d: 8,
            q_pos: zig_q,
            k_pos: zig_k,
            causal: true,
        },
        Case {
            name: "bidirectional MHA, 70 queries over 130 keys (one block each)",
            b: 2,
            heads: 3,
            kv_heads: 3,
            d: 12,
            q_pos: (0..70).collect(),
            k_pos: (0..130).collect(),
            causal: false,
        },
        Case {
            name: "bidirectional GQA, 70 queries over 130 keys (one block each: kept)",
            b: 2,
            heads: 4,
            kv_heads: 2,
            d: 8,
            q_pos: (0..70).collect(),
            k_pos: (0..130).collect(),
            causal: false,
        },
        Case {
            name: "bidirectional GQA, 100 queries over 290 keys (keys in blocks)",
            b: 1,
            heads: 2,
            kv_heads: 1,
            d: 8,
            q_pos: (0..100).collect(),
            k_pos: (0..290).collect(),
            causal: false,
        },
        Case {
            name: "bidirectional, 270 queries over 60 keys (queries in blocks)",
            b: 1,
            heads: 1,
            kv_heads: 1,
            d: 8,
            q_pos: (0..270).collect(),
            k_pos: (0..60).collect(),
            causal: false,
        },
    ]
}

fn inputs(c: &Case, dtype: DType) -> (Var, Var, Var) {
    let (sq, sk) = (c.q_pos.len(), c.k_pos.len());
    (
        var("q", &[c.b, sq, c.heads, c.d], dtype),
        var("k", &[c.b, sk, c.kv_heads, c.d], dtype),
        var("v", &[c.b, sk, c.kv_heads, c.d], dtype),
    )
}

#[test]
fn attention_matches_the_unfused_reference() {
    for dtype in [DType::F32, DType::F64] {
        let tol = tolerance(dtype);
        for c in cases() {
            let scale = 1.0 / (c.d as f64).sqrt();
            let run = |fused: bool| {
                let (q, k, v) = inputs(&c, dtype);
                let out = if fused {
                    FlashAttention::new(
                        Arc::new(c.q_pos.clone()),
                        Arc::new(c.k_pos.clone()),
                        c.causal,
                        scale,
                        false,
                    )
                    .apply(&q, &k, &v)
                    .unwrap()
                } else {
                    reference::attention(&q, &k, &v, (&c.q_pos, &c.k_pos), c.causal, scale).unwrap()
                };
                let grads = weigh(&out, "w").backward().unwrap();
                let g = |x: &Var| grads.get(x).unwrap().clone();
                (out, g(&q), g(&k), g(&v))
            };
            let (got, want) = (run(true), run(false));
            let what = |t: &str| format!("{} ({dtype:?}): {t}", c.name);
            close(&what("output"), &got.0, &want.0, tol);
            close(&what("dq"), &got.1, &want.1, tol);
            close(&what("dk"), &got.2, &want.2, tol);
            close(&what("dv"), &got.3, &want.3, tol);
        }
    }
}

/// Under bf16 products the attention core's products multiply bf16-rounded operands (each
/// within bf16's unit roundoff, 2^-8) and sum in f32, on every path (bidirectional kept probabilities, causal
/// blocks, grouped-query heads, with and without the log-sum-exp output ring attention
/// merges through): the output lies within a few such roundings of the f32
/// core's (2^-6 of its largest value; 3e-3 to 6e-3 measured), the gradients within twice
/// that (two rounded products in a row, with the softmax's `dP - delta` cancelling between
/// them, summed over many queries for `dk`, `dv`: 3e-3 to 1.5e-2 measured), and none keeps
/// the f32 bits. f64 tensors have no bf16 products.
#[test]
fn attention_with_bf16_products_rounds_within_bf16_of_f32() {
    for (c, with_lse) in cases().into_iter().flat_map(|c| [false, true].map(|l| (c.clone(), l))) {
        let scale = 1.0 / (c.d as f64).sqrt();
        let run = |how: Matmul| {
            let (q, k, v) = inputs(&c, DType::F32);
            let out = FlashAttention::new(
                Arc::new(c.q_pos.clone()),
                Arc::new(c.k_pos.clone()),
                c.causal,
                scale,
                with_lse,
            )
            .with_matmul(how)
            .apply(&q, &k, &v)
            .unwrap();
            let grads = weigh(&out, "w").backward().unwrap();
            let g = |x: &Var| flat(grads.get(x).unwrap()).unwrap();
            [flat(&out).unwrap(), g(&q), g(&k), g(&v)]
        };
        let (native, bf16) = (run(Matmul::Native), run(Matmul::Bf16));
        let what = ["output", "dq", "dk", "dv"];
        for (i, (n, b)) in native.iter().zip(&bf16).enumerate() {
            let (e, bound) = (rel_err(b, n), if i == 0 { 2f64.powi(-6) } else { 2f64.powi(-5) });
            let name = format!("{} (log-sum-exp output {with_lse}) {}", c.name, what[i]);
            assert!(e > 0.0 && e < bound, "{name}: bf16 against f32 {e:e}");
        }
    }
    let c = &cases()[0];
    let (q, k, v) = inputs(c, DType::F64);
    let e =
        FlashAttention::new(Arc::new(c.q_pos.clone()), Arc::new(c.k_pos.clone()), true, 1.0, false)
            .with_matmul(Matmul::Bf16)
            .apply(&q, &k, &v)
            .unwrap_err();
    assert!(e.to_string().contains("bf16 products take f32"), "{e}");
}

/// A second backward through the same graph reads the probabilities the forward kept
/// again: the same bits as the first.
#[test]
fn attention_gives_the_same_gradients_on_a_second_backward() {
    for dtype in [DType::F32, DType::F64] {
        let (q, k, v) = (
            var("q", &[2, 40, 4, 8], dtype),
            var("k", &[2, 50, 2, 8], dtype),
            var("v", &[2, 50, 2, 8], dtype),
        );
        let (qp, kp) = (Arc::new((0..40).collect()), Arc::new((0..50).collect()));
        let out = FlashAttention::new(qp, kp, false, 0.35, false).apply(&q, &k, &v).unwrap();
        let loss = weigh(&out, "w");
        let (first, second) = (loss.backward().unwrap(), loss.backward().unwrap());
        for x in [&q, &k, &v] {
            let (a, b) =
                (flat(first.get(x).unwrap()).unwrap(), flat(second.get(x).unwrap()).unwrap());
            assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}");
        }
    }
}

#[test]
fn attention_with_log_sum_exp_matches_and_takes_its_gradient() {
    for dtype in [DType::F32, DType::F64] {
        let tol = tolerance(dtype);
        let c = &cases()[0];
        let d = c.d;
        let scale = 0.3;
        let run = |fused: bool| {
            let (q, k, v) = inputs(c, dtype);
            let (out, lse) = if fused {
                let both = FlashAttention::new(
                    Arc::new(c.q_pos.clone()),
                    Arc::new(c.k_pos.clone()),
                    true,
                    scale,
                    true,
                )
                .apply(&q, &k, &v)
                .unwrap();
                (both.narrow(3, 0, d).unwrap(), both.narrow(3, d, 1).unwrap())
            } else {
                reference::attention_lse(&q, &k, &v, (&c.q_pos, &c.k_pos), true, scale).unwrap()
            };
            let loss = (weigh(&out, "w") + weigh(&lse, "w-lse")).unwrap();
            let grads = loss.backward().unwrap();
            let g = |x: &Var| grads.get(x).unwrap().clone();
            (out, lse, g(&q), g(&k), g(&v))
        };
        let (got, want) = (run(true), run(false));
        close(&format!("{dtype:?} output"), &got.0, &want.0, tol);
        close(&format!("{dtype:?} log-sum-exp"), &got.1, &want.1, tol);
        close(&format!("{dtype:?} dq"), &got.2, &want.2, tol);
        close(&format!("{dtype:?} dk"), &got.3, &want.3, tol);
        close(&format!("{dtype:?} dv"), &got.4, &want.4, tol);
    }
}

#[test]
fn rows_that_see_no_key_give_zero_and_minus_infinity() {
    // Queries at 0..10 against keys at 20..40 (a ring step's block from a later rank).
    let (q_pos, k_pos): (Vec<usize>, Vec<usize>) = ((0..10).collect(), (20..40).collect());
    let q = var("q", &[1, 10, 2, 4], DType::F32);
    let k = var("k", &[1, 20, 2, 4], DType::F32);
    let v = var("v", &[1, 20, 2, 4], DType::F32);
    let out = FlashAttention::new(Arc::new(q_pos), Arc::new(k_pos), true, 0.5, true)
        .apply(&q, &k, &v)
        .unwrap();
    let vals = flat(&out).unwrap();
    for row in vals.chunks(5) {
        assert_eq!(&row[..4], &[0.0; 4]);
        assert_eq!(row[4], f64::NEG_INFINITY);
    }
    let grads = out.narrow(3, 0, 4).unwrap().sum_all().unwrap().backward().unwrap();
    for x in [&q, &k, &v] {
        assert!(flat(grads.get(x).unwrap()).unwrap().iter().all(|g| *g == 0.0));
    }
}

#[test]
fn mismatched_attention_inputs_are_refused() {
    let q = var("q", &[1, 8, 3, 4], DType::F32);
    let k = var("k", &[1, 8, 2, 4], DType::F32);
    let pos = Arc::new((0..8).collect::<Vec<_>>());
    let e = FlashAttention::new(pos.clone(), pos.clone(), true, 1.0, false)
        .apply(&q, &k, &k)
        .unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    let k = var("k", &[1, 8, 1, 4], DType::F32);
    let e = FlashAttention::new(Arc::new(vec![0; 7]), pos, true, 1.0, false)
        .apply(&q, &k, &k)
        .unwrap_err();
    assert!(e.to_string().contains("7 query"), "{e}");
    let q16 = q.to_dtype(DType::BF16).unwrap();
    let k16 = k.to_dtype(DType::BF16).unwrap();
    let e = FlashAttention::new(
        Arc::new((0..8).collect()),
        Arc::new((0..8).collect()),
        true,
        1.0,
        false,
    )
    .apply(&q16, &k16, &k16)
    .unwrap_err();
    assert!(e.to_string().contains("f32 and f64"), "{e}");
}

#[test]
fn rms_norm_matches_the_unfused_reference() {
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let x = var("x", &[3, 7, 40], dtype);
            let w = var("w", &[40], dtype);
            let y = if fused {
                rms_norm(&x, &w, 1e-6).unwrap()
            } else {
                reference::rms_norm(&x, &w, 1e-6).unwrap()
            };
            let grads = weigh(&y, "dy").backward().unwrap();
            (y, grads.get(&x).unwrap().clone(), grads.get(&w).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("rms-norm {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("rms-norm {dtype:?} dx"), &got.1, &want.1, tol);
        close(&format!("rms-norm {dtype:?} dw"), &got.2, &want.2, tol);
    }
}

#[test]
fn rope_matches_the_unfused_reference() {
    let half = 6;
    let positions = [3usize, 9, 0, 41, 7];
    let angles: Vec<f64> = positions
        .iter()
        .flat_map(|&p| (0..half).map(move |j| p as f64 * 10_000f64.powf(-(j as f64) / half as f64)))
        .collect();
    let tables = Arc::new(RopeTables {
        half,
        cos: angles.iter().map(|a| a.cos()).collect(),
        sin: angles.iter().map(|a| a.sin()).collect(),
    });
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let x = var("x", &[2, 5, 3, 2 * half], dtype);
            let y = if fused {
                rope(&x, &tables).unwrap()
            } else {
                reference::rope(&x, &tables).unwrap()
            };
            let grads = weigh(&y, "dy").backward().unwrap();
            (y, grads.get(&x).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("rope {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("rope {dtype:?} dx"), &got.1, &want.1, tol);
    }
}

#[test]
fn swiglu_matches_the_unfused_reference() {
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let g = var("g", &[4, 9, 33], dtype);
            let u = var("u", &[4, 9, 33], dtype);
            let h =
                if fused { swiglu(&g, &u).unwrap() } else { reference::swiglu(&g, &u).unwrap() };
            let grads = weigh(&h, "dh").backward().unwrap();
            (h, grads.get(&g).unwrap().clone(), grads.get(&u).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("swiglu {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("swiglu {dtype:?} dgate"), &got.1, &want.1, tol);
        close(&format!("swiglu {dtype:?} dup"), &got.2, &want.2, tol);
    }
}

#[test]
fn layer_norm_matches_the_unfused_reference() {
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            // Rows with an offset, so the centring matters.
            let x = (var("x", &[3, 7, 40], dtype).as_tensor() + 3.0).unwrap();
            let x = Var::from_tensor(&x).unwrap();
            let w = var("w", &[40], dtype);
            let b = var("b", &[40], dtype);
            let y = if fused {
                layer_norm(&x, &w, &b, 1e-5).unwrap()
            } else {
                reference::layer_norm(&x, &w, &b, 1e-5).unwrap()
            };
            let grads = weigh(&y, "dy").backward().unwrap();
            let g = |v: &Var| grads.get(v).unwrap().clone();
            (y, g(&x), g(&w), g(&b))
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("layer-norm {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("layer-norm {dtype:?} dx"), &got.1, &want.1, tol);
        close(&format!("layer-norm {dtype:?} dw"), &got.2, &want.2, tol);
        close(&format!("layer-norm {dtype:?} db"), &got.3, &want.3, tol);
    }
}

#[test]
fn gelu_matches_the_unfused_reference() {
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let x =
                Var::from_tensor(&(var("x", &[5, 61], dtype).as_tensor() * 3.0).unwrap()).unwrap();
            let y = if fused { gelu(&x).unwrap() } else { reference::gelu(&x).unwrap() };
            let grads = weigh(&y, "dy").backward().unwrap();
            (y, grads.get(&x).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("gelu {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("gelu {dtype:?} dx"), &got.1, &want.1, tol);
    }
}

/// Under bf16 products the GELU's CDF and exponential and SwiGLU's sigmoid are evaluated
/// in f32 (`exp_f32_fast`, `normal_cdf_f32_fast`): other bits than the f64-evaluated forms,
/// within a few f32 ulp of them, forward and backward. With a bf16 unit roundoff of 2^-8,
/// f32's last bits are noise there; the f32 and f64 steps keep the rounded forms.
#[test]
fn under_bf16_products_gelu_and_swiglu_evaluate_in_f32_within_a_few_ulp() {
    let dtype = DType::F32;
    // Arguments over [-12, 12], the tails included.
    let x = Var::from_tensor(&(var("x", &[5, 61], dtype).as_tensor() * 4.0).unwrap()).unwrap();
    let gelu_run = |how: Matmul| {
        let y = gelu_as(how, &x).unwrap();
        let grads = weigh(&y, "dy").backward().unwrap();
        [y, grads.get(&x).unwrap().clone()]
    };
    let (g, u) = (var("g", &[4, 9, 33], dtype), var("u", &[4, 9, 33], dtype));
    let g = Var::from_tensor(&(g.as_tensor() * 4.0).unwrap()).unwrap();
    let swiglu_run = |how: Matmul| {
        let h = swiglu_as(how, &g, &u).unwrap();
        let grads = weigh(&h, "dh").backward().unwrap();
        [h, grads.get(&g).unwrap().clone(), grads.get(&u).unwrap().clone()]
    };
    let cases = [
        ("gelu", gelu_run(Matmul::Bf16).to_vec(), gelu_run(Matmul::Native).to_vec()),
        ("swiglu", swiglu_run(Matmul::Bf16).to_vec(), swiglu_run(Matmul::Native).to_vec()),
    ];
    for (op, fast, rounded) in cases {
        for (i, (f, r)) in fast.iter().zip(&rounded).enumerate() {
            // Relative to the largest value, within about two ulp of it (measured 3e-9 to
            // 4e-8: the differences sit at the smaller values).
            let err = rel_err(&flat(f).unwrap(), &flat(r).unwrap());
            assert!(err <= 2e-7, "{op} result {i}: {err:e}");
            if i == 0 {
                assert_ne!(bits(f), bits(r), "{op}: the bf16 step kept the f64-evaluated form");
            }
        }
    }
}

#[test]
fn bias_add_matches_the_unfused_reference() {
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let x = var("x", &[3, 5, 17], dtype);
            let b = var("b", &[17], dtype);
            let y = if fused {
                bias_add(&x, &b).unwrap()
            } else {
                reference::bias_add(&x, &b).unwrap()
            };
            let grads = weigh(&y, "dy").backward().unwrap();
            (y, grads.get(&x).unwrap().clone(), grads.get(&b).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("bias-add {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("bias-add {dtype:?} dx"), &got.1, &want.1, tol);
        close(&format!("bias-add {dtype:?} db"), &got.2, &want.2, tol);
    }
}

#[test]
fn cross_entropy_matches_the_unfused_reference() {
    let targets: Vec<i64> = (0..37).map(|i| if i % 5 == 3 { -1 } else { (i * 13) % 300 }).collect();
    for dtype in [DType::F32, DType::F64] {
        let run = |fused: bool| {
            let x =
                Var::from_tensor(&(var("logits", &[37, 300], dtype).as_tensor() * 4.0).unwrap())
                    .unwrap();
            let loss = if fused {
                let op = VocabCrossEntropy::new(None, Arc::new(targets.clone()), 0);
                x.as_tensor().apply_op1(op).unwrap()
            } else {
                reference::cross_entropy(&x, &targets).unwrap()
            };
            let grads = weigh(&loss, "dl").backward().unwrap();
            (loss, grads.get(&x).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("cross-entropy {dtype:?}"), &got.0, &want.0, tol);
        close(&format!("cross-entropy {dtype:?} dlogits"), &got.1, &want.1, tol);
    }
}

#[test]
fn linear_matches_the_unfused_reference() {
    // 21 rows of 40 take the row-major product; in f32, 6 rows of 64 (at most half the
    // inner length) the column-major one and a transpose.
    for (dtype, rows) in
        [DType::F32, DType::F64].into_iter().flat_map(|d| [(d, [3, 7, 40]), (d, [2, 3, 64])])
    {
        let run = |fused: bool| {
            let x = var("x", &rows, dtype);
            let w = var("w", &[23, rows[2]], dtype);
            let y =
                if fused { linear(&x, &w).unwrap() } else { reference::linear(&x, &w).unwrap() };
            let grads = weigh(&y, "dy").backward().unwrap();
            (y, grads.get(&x).unwrap().clone(), grads.get(&w).unwrap().clone())
        };
        let (got, want) = (run(true), run(false));
        let tol = tolerance(dtype);
        close(&format!("linear {dtype:?} {rows:?}"), &got.0, &want.0, tol);
        close(&format!("linear {dtype:?} {rows:?} dx"), &got.1, &want.1, tol);
        close(&format!("linear {dtype:?} {rows:?} dw"), &got.2, &want.2, tol);
    }
    let e = linear(&var("x", &[2, 5], DType::F32), &var("w", &[3, 4], DType::F32)).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
}

#[test]
fn linear_with_bias_matches_the_unfused_reference_and_the_two_fused_ops_bitwise() {
    // Both forms of the f32 product (21 rows of 40 row-major; 6 rows of 64 column-major).
    let cases =
        [DType::F32, DType::F64].into_iter().flat_map(|d| [(d, [3, 7, 40]), (d, [2, 3, 64])]);
    for (dtype, shape) in cases {
        // 0: one fused op; 1: the fused linear, then the fused bias add; 2: the reference.
        let run = |how: usize| {
            let x = var("x", &shape, dtype);
            let w = var("w", &[23, shape[2]], dtype);
            let b = var("b", &[23], dtype);
            let y = match how {
                0 => linear_bias(&x, &w, &b).unwrap(),
                1 => bias_add(&linear(&x, &w).unwrap(), &b).unwrap(),
                _ => reference::bias_add(&reference::linear(&x, &w).unwrap(), &b).unwrap(),
            };
            let grads = weigh(&y, "dy").backward().unwrap();
            let g = |v: &Var| grads.get(v).unwrap().clone();
            [y.clone(), g(&x), g(&w), g(&b)]
        };
        let (got, pair, want) = (run(0), run(1), run(2));
        let tol = tolerance(dtype);
        for (i, what) in ["y", "dx", "dw", "db"].iter().enumerate() {
            close(&format!("linear-bias {dtype:?} {shape:?} {what}"), &got[i], &want[i], tol);
            assert_eq!(
                bits(&got[i]),
                bits(&pair[i]),
                "linear-bias {dtype:?} {shape:?} {what}: not the bits of linear then bias-add"
            );
        }
    }
    let (x, w) = (var("x", &[2, 4], DType::F32), var("w", &[3, 4], DType::F32));
    let e = linear_bias(&x, &w, &var("b", &[4], DType::F32)).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
}

#[test]
fn linear_with_bias_takes_strided_inputs_detached_biases_and_empty_outputs() {
    // A transposed input, and a bias detached as k_proj's is: the input gets its gradient,
    // the bias's variable none.
    let xt = var("x", &[40, 7], DType::F64);
    let (w, b) = (var("w", &[5, 40], DType::F64), var("b", &[5], DType::F64));
    let x = xt.as_tensor().t().unwrap();
    let y = linear_bias(&x, &w, &b.as_tensor().detach()).unwrap();
    let want = reference::bias_add(&reference::linear(&x, &w).unwrap(), &b).unwrap();
    close("linear-bias strided", &y, &want, tolerance(DType::F64));
    let grads = weigh(&y, "dy").backward().unwrap();
    assert_eq!(grads.get(&xt).unwrap().dims(), &[40, 7]);
    assert!(grads.get(&b).is_none(), "a detached bias got a gradient");
    // No outputs: an empty product, and its backward gives empty and zero gradients.
    let x = var("x", &[3, 4], DType::F32);
    let (w, b) = (var("w", &[0, 4], DType::F32), var("b", &[0], DType::F32));
    let y = linear_bias(&x, &w, &b).unwrap();
    assert_eq!(y.dims(), &[3, 0]);
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(flat(grads.get(&x).unwrap()).unwrap(), vec![0.0; 12]);
    assert_eq!(grads.get(&b).unwrap().dims(), &[0]);
}

#[test]
fn an_input_that_tracks_no_gradient_gets_none_and_the_weights_keep_their_bits() {
    // Data (an image's patches, cut from the pixels) under a linear layer: no `dx` is
    // computed for it, and `dw`, `db` are the bits of the same input as a variable.
    for (dtype, how) in products() {
        let (x, w, b) =
            (var("x", &[3, 7, 40], dtype), var("w", &[23, 40], dtype), var("b", &[23], dtype));
        let data = x.as_tensor().detach();
        assert!(!data.track_op());
        for gelu in [false, true] {
            let sink = GradSink::new();
            let run = |input: &Tensor| {
                let y = if gelu {
                    linear_bias_gelu_into(how, input, &w, &b, &sink).unwrap()
                } else {
                    (linear_bias_as(how, input, &w, &b).unwrap()
                        + hetpar_nn::kernels::linear::linear_as(how, input, &w).unwrap())
                    .unwrap()
                };
                let store = weigh(&y, "dy").backward().unwrap();
                let dw = match sink.take(w.shape()).unwrap() {
                    Some(dw) => dw,
                    None => store.get(&w).unwrap().clone(),
                };
                (store.get(input).cloned(), dw, store.get(&b).unwrap().clone())
            };
            let (tracked, untracked) = (run(x.as_tensor()), run(&data));
            assert!(tracked.0.is_some(), "{dtype:?} {how:?} gelu {gelu}: a variable's dx");
            assert!(untracked.0.is_none(), "{dtype:?} {how:?} gelu {gelu}: dx for data");
            assert_eq!(bits(&untracked.1), bits(&tracked.1), "{dtype:?} {how:?} gelu {gelu}: dw");
            assert_eq!(bits(&untracked.2), bits(&tracked.2), "{dtype:?} {how:?} gelu {gelu}: db");
        }
    }
}

#[test]
fn linear_into_a_sink_gives_the_stores_bits_and_leaves_the_weight_out_of_the_store() {
    for (dtype, how) in products() {
        let (x, w, b) =
            (var("x", &[3, 7, 40], dtype), var("w", &[23, 40], dtype), var("b", &[23], dtype));
        // Through the store: the weight used twice, as its gradient sums there.
        let y = (linear_bias_as(how, &x, &w, &b).unwrap()
            + hetpar_nn::kernels::linear::linear_as(how, &x, &w).unwrap())
        .unwrap();
        let store = weigh(&y, "dy").backward().unwrap();
        let want: Vec<Tensor> =
            [&x, &w, &b].iter().map(|v| store.get(v).unwrap().clone()).collect();
        // Through a sink: the same bits, and no weight gradient in the store.
        let sink = GradSink::new();
        let y = (linear_bias_into(how, &x, &w, &b, &sink).unwrap()
            + linear_into(how, &x, &w, &sink).unwrap())
        .unwrap();
        let store = weigh(&y, "dy").backward().unwrap();
        assert!(
            store.get(&w).is_none(),
            "{dtype:?} {how:?}: the weight's gradient went to the store"
        );
        let dw = sink.take(w.shape()).unwrap().unwrap();
        assert_eq!(bits(&dw), bits(&want[1]), "{dtype:?} {how:?}: dw");
        assert_eq!(bits(store.get(&x).unwrap()), bits(&want[0]), "{dtype:?} {how:?}: dx");
        assert_eq!(bits(store.get(&b).unwrap()), bits(&want[2]), "{dtype:?} {how:?}: db");
        assert!(sink.take(w.shape()).unwrap().is_none(), "a take empties the sink");
    }
    // A weight computed from a variable (a reshape) is no variable: its gradient must pass
    // through the store to the variable, so the sink stays empty.
    let (x, w4) = (var("x", &[5, 12], DType::F64), var("w", &[3, 2, 6], DType::F64));
    let sink = GradSink::new();
    let y =
        linear_into(Matmul::Native, &x, &w4.as_tensor().reshape((3, 12)).unwrap(), &sink).unwrap();
    let store = weigh(&y, "dy").backward().unwrap();
    assert_eq!(store.get(&w4).unwrap().dims(), &[3, 2, 6]);
    assert!(sink.take(w4.shape()).unwrap().is_none());
}

#[test]
fn the_linear_with_its_gelu_as_one_node_gives_the_two_nodes_bits() {
    for (dtype, how) in products() {
        let (x, w, b) =
            (var("x", &[3, 7, 40], dtype), var("w", &[56, 40], dtype), var("b", &[56], dtype));
        // Pre-activations of both signs and several sizes, the tails included.
        let x = Var::from_tensor(&(x.as_tensor() * 1.5).unwrap()).unwrap();
        let run = |fused: bool| {
            let sink = GradSink::new();
            let y = if fused {
                linear_bias_gelu_into(how, &x, &w, &b, &sink).unwrap()
            } else {
                gelu_as(how, &linear_bias_into(how, &x, &w, &b, &sink).unwrap()).unwrap()
            };
            let store = weigh(&y, "dy").backward().unwrap();
            let dw = sink.take(w.shape()).unwrap().unwrap();
            [y, store.get(&x).unwrap().clone(), dw, store.get(&b).unwrap().clone()]
        };
        let (got, want) = (run(true), run(false));
        for (name, (g, w)) in ["y", "dx", "dw", "db"].iter().zip(got.iter().zip(&want)) {
            assert_eq!(bits(g), bits(w), "{dtype:?} {how:?}: {name}");
        }
    }
}

#[test]
fn the_attention_block_as_one_node_gives_the_composed_blocks_bits() {
    let (b, s, hidden) = (2, 37, 32);
    for (dtype, how) in products() {
        // ViT-like: every projection with a bias, the key's applied but not trained; and
        // Llama-like: no biases, grouped K/V, causal, rotary.
        // Each alone, and as a pre-norm layer's half `x + block(norm(x))`: LayerNorm in front
        // of the ViT-like block, RMSNorm in front of the Llama-like one.
        for (heads, kv_heads, bias, causal, residual) in [
            (4, 4, true, false, false),
            (4, 4, true, false, true),
            (4, 2, false, true, false),
            (4, 2, false, true, true),
        ] {
            let d = hidden / heads;
            let pre = Pre::new(bias, hidden, dtype);
            let tables = causal.then(|| {
                hetpar_nn::layers::rope::Rope::new(d, 10_000.0)
                    .tables(&(3..3 + s).collect::<Vec<_>>())
            });
            let x = var("x", &[b, s, hidden], dtype);
            let w = |n: &str, out: usize, inner: usize| var(n, &[out, inner], dtype);
            let (wq, wk, wv) = (
                w("wq", heads * d, hidden),
                w("wk", kv_heads * d, hidden),
                w("wv", kv_heads * d, hidden),
            );
            let wo = w("wo", hidden, heads * d);
            let bias_of = |n: &str, out: usize| bias.then(|| var(n, &[out], dtype));
            let (bq, bk, bv, bo) = (
                bias_of("bq", heads * d),
                bias_of("bk", kv_heads * d),
                bias_of("bv", kv_heads * d),
                bias_of("bo", hidden),
            );
            let pos: Arc<Vec<usize>> = Arc::new((0..s).collect());
            // The core multiplies as the projections do (bf16 products under bf16), as the
            // attention layer builds it.
            let attention = || {
                FlashAttention::new(
                    pos.clone(),
                    pos.clone(),
                    causal,
                    1.0 / (d as f64).sqrt(),
                    false,
                )
                .with_matmul(how)
            };
            // Weights' sinks 0..4, the biases' 4..8.
            let sinks: Vec<GradSink> = (0..8).map(|_| GradSink::new()).collect();
            let run = |fused: bool| {
                let y = if fused {
                    let p = |w: &Var, b: &Option<Var>, i: usize, trained: bool| Projection {
                        weight: (w.as_tensor().clone(), sinks[i].clone()),
                        bias: b.as_ref().map(|b| {
                            let t = if trained {
                                b.as_tensor().clone()
                            } else {
                                b.as_tensor().detach()
                            };
                            (t, trained.then(|| sinks[i + 4].clone()))
                        }),
                    };
                    let weights = BlockWeights {
                        q: p(&wq, &bq, 0, true),
                        k: p(&wk, &bk, 1, false),
                        v: p(&wv, &bv, 2, true),
                        o: p(&wo, &bo, 3, true),
                    };
                    let heads = (heads, kv_heads);
                    let tables = tables.clone();
                    let pre = residual.then(|| pre.fused());
                    attention_block(
                        how,
                        &x,
                        &wq,
                        weights,
                        heads,
                        tables,
                        attention(),
                        (pre, None, None),
                    )
                    .unwrap()
                } else {
                    let input = if residual { pre.composed(&x) } else { x.as_tensor().clone() };
                    let lin =
                        |x: &Tensor, w: &Var, b: &Option<Var>, i: usize, trained: bool| match b {
                            Some(b) => {
                                let t = if trained {
                                    b.as_tensor().clone()
                                } else {
                                    b.as_tensor().detach()
                                };
                                linear_bias_into(how, x, w, &t, &sinks[i]).unwrap()
                            }
                            None => linear_into(how, x, w, &sinks[i]).unwrap(),
                        };
                    let mut q = lin(&input, &wq, &bq, 0, true).reshape((b, s, heads, d)).unwrap();
                    let mut k =
                        lin(&input, &wk, &bk, 1, false).reshape((b, s, kv_heads, d)).unwrap();
                    if let Some(t) = &tables {
                        (q, k) = (rope(&q, t).unwrap(), rope(&k, t).unwrap());
                    }
                    let v = lin(&input, &wv, &bv, 2, true).reshape((b, s, kv_heads, d)).unwrap();
                    let a =
                        attention().apply(&q, &k, &v).unwrap().reshape((b, s, heads * d)).unwrap();
                    let o = lin(&a, &wo, &bo, 3, true);
                    if residual { (x.as_tensor() + o).unwrap() } else { o }
                };
                let store = weigh(&y, "dy").backward().unwrap();
                let mut out = vec![y, store.get(&x).unwrap().clone()];
                for (i, v) in [&wq, &wk, &wv, &wo].iter().enumerate() {
                    out.push(sinks[i].take(v.shape()).unwrap().unwrap());
                }
                for (i, v) in [(4, &bq), (6, &bv), (7, &bo)] {
                    if let Some(v) = v {
                        // Composed, the biases' gradients are in the store; fused, in the sinks.
                        let g = match store.get(v) {
                            Some(g) => g.clone(),
                            None => sinks[i].take(v.shape()).unwrap().unwrap(),
                        };
                        out.push(g);
                    }
                }
                if residual {
                    out.extend(pre.grads(&store, fused));
                }
                out
            };
            let what = format!(
                "{dtype:?} {how:?} heads {heads}/{kv_heads} bias {bias} residual {residual}"
            );
            assert_same_values(&run(true), &run(false), &what);
        }
    }
}

#[test]
fn the_gelu_mlp_as_one_node_gives_the_composed_mlps_bits() {
    for (dtype, how) in products() {
        // Alone (24 -> 40 -> 16), and as a pre-norm layer's half `x + mlp(layer_norm(x))`.
        for (out, residual) in [(16, false), (24, true)] {
            let x = Var::from_tensor(&(var("x", &[3, 7, 24], dtype).as_tensor() * 2.0).unwrap())
                .unwrap();
            let (w1, b1) = (var("w1", &[40, 24], dtype), var("b1", &[40], dtype));
            let (w2, b2) = (var("w2", &[out, 40], dtype), var("b2", &[out], dtype));
            let pre = Pre::new(true, 24, dtype);
            let sinks: Vec<GradSink> = (0..4).map(|_| GradSink::new()).collect();
            let run = |fused: bool| {
                let y = if fused {
                    let p = |w: &Var, b: &Var, i: usize| Projection {
                        weight: (w.as_tensor().clone(), sinks[i].clone()),
                        bias: Some((b.as_tensor().clone(), Some(sinks[i + 2].clone()))),
                    };
                    let pre = residual.then(|| pre.fused());
                    gelu_mlp(how, &x, &w1, p(&w1, &b1, 0), p(&w2, &b2, 1), (pre, None)).unwrap()
                } else {
                    let input = if residual { pre.composed(&x) } else { x.as_tensor().clone() };
                    let h = linear_bias_gelu_into(how, &input, &w1, &b1, &sinks[0]).unwrap();
                    let y = linear_bias_into(how, &h, &w2, &b2, &sinks[1]).unwrap();
                    if residual { (x.as_tensor() + y).unwrap() } else { y }
                };
                let store = weigh(&y, "dy").backward().unwrap();
                let mut out = vec![y, store.get(&x).unwrap().clone()];
                out.push(sinks[0].take(w1.shape()).unwrap().unwrap());
                out.push(sinks[1].take(w2.shape()).unwrap().unwrap());
                for (i, b) in [(2, &b1), (3, &b2)] {
                    out.push(match store.get(b) {
                        Some(g) => g.clone(),
                        None => sinks[i].take(b.shape()).unwrap().unwrap(),
                    });
                }
                if residual {
                    out.extend(pre.grads(&store, fused));
                }
                out
            };
            let what = format!("{dtype:?} {how:?} residual {residual}");
            assert_same_values(&run(true), &run(false), &what);
        }
    }
}

#[test]
fn a_fused_block_with_weights_or_tables_that_do_not_fit_is_an_error() {
    let dtype = DType::F32;
    let x = var("x", &[1, 6, 16], dtype);
    let p = |n: &str, out: usize, inner: usize| Projection {
        weight: (var(n, &[out, inner], dtype).as_tensor().clone(), GradSink::new()),
        bias: None,
    };
    let pos: Arc<Vec<usize>> = Arc::new((0..6).collect());
    let attention = || FlashAttention::new(pos.clone(), pos.clone(), true, 0.5, false);
    let a = hetpar_nn::kernels::block::anchor(dtype).unwrap();
    let block = |k_rows: usize, tables| {
        let weights = BlockWeights {
            q: p("q", 16, 16),
            k: p("k", k_rows, 16),
            v: p("v", 8, 16),
            o: p("o", 16, 16),
        };
        let edges = (None, None, None);
        attention_block(Matmul::Native, &x, &a, weights, (4, 2), tables, attention(), edges)
    };
    // A key projection one row short of two heads of 4.
    assert!(block(7, None).unwrap_err().to_string().contains("do not fit"));
    // Rotary tables for 5 positions on a sequence of 6.
    let tables = hetpar_nn::layers::rope::Rope::new(4, 10_000.0).tables(&[0, 1, 2, 3, 4]);
    assert!(block(8, Some(tables)).unwrap_err().to_string().contains("rotary tables"));
    // An MLP whose layers do not chain.
    let mlp = [p("g", 24, 16), p("u", 24, 16), p("d", 16, 20)];
    let e = swiglu_mlp(Matmul::Native, &x, &a, mlp, (None, None));
    assert!(e.unwrap_err().to_string().contains("do not chain"));
    // A pre-norm of half the rows' width (which divides the input's elements).
    let mlp = [p("g", 24, 16), p("u", 24, 16), p("d", 16, 24)];
    let weight = (var("n", &[8], dtype).as_tensor().clone(), GradSink::new());
    let e =
        swiglu_mlp(Matmul::Native, &x, &a, mlp, (Some(PreNorm::Rms { weight, eps: 1e-6 }), None));
    assert!(e.unwrap_err().to_string().contains("pre-norm block"));
}

#[test]
fn the_swiglu_mlp_as_one_node_gives_the_composed_mlps_bits() {
    for (dtype, how) in products() {
        // Alone, and as a pre-norm layer's half `x + mlp(rms_norm(x))`.
        for residual in [false, true] {
            let x = var("x", &[2, 9, 24], dtype);
            let (wg, wu, wd) = (
                var("wg", &[40, 24], dtype),
                var("wu", &[40, 24], dtype),
                var("wd", &[24, 40], dtype),
            );
            let pre = Pre::new(false, 24, dtype);
            let sinks: Vec<GradSink> = (0..3).map(|_| GradSink::new()).collect();
            let run = |fused: bool| {
                let y = if fused {
                    let p = |w: &Var, i: usize| Projection {
                        weight: (w.as_tensor().clone(), sinks[i].clone()),
                        bias: None,
                    };
                    let pre = residual.then(|| pre.fused());
                    swiglu_mlp(how, &x, &wg, [p(&wg, 0), p(&wu, 1), p(&wd, 2)], (pre, None))
                        .unwrap()
                } else {
                    let input = if residual { pre.composed(&x) } else { x.as_tensor().clone() };
                    let g = linear_into(how, &input, &wg, &sinks[0]).unwrap();
                    let u = linear_into(how, &input, &wu, &sinks[1]).unwrap();
                    let y =
                        linear_into(how, &swiglu_as(how, &g, &u).unwrap(), &wd, &sinks[2]).unwrap();
                    if residual { (x.as_tensor() + y).unwrap() } else { y }
                };
                let store = weigh(&y, "dy").backward().unwrap();
                let mut out = vec![y, store.get(&x).unwrap().clone()];
                for (i, w) in [&wg, &wu, &wd].iter().enumerate() {
                    out.push(sinks[i].take(w.shape()).unwrap().unwrap());
                }
                if residual {
                    out.extend(pre.grads(&store, fused));
                }
                out
            };
            let what = format!("{dtype:?} {how:?} residual {residual}");
            assert_same_values(&run(true), &run(false), &what);
        }
    }
}

/// `w1`, `w3` `[ffn, hidden]` and `w2` `[hidden, ffn]` of `experts` experts.
fn expert_vars(experts: usize, hidden: usize, ffn: usize, dtype: DType) -> Vec<[Var; 3]> {
    (0..experts)
        .map(|e| {
            [
                var(&format!("w1.{e}"), &[ffn, hidden], dtype),
                var(&format!("w3.{e}"), &[ffn, hidden], dtype),
                var(&format!("w2.{e}"), &[hidden, ffn], dtype),
            ]
        })
        .collect()
}

/// The experts' weights `w` with their gradients' sinks.
fn expert_weights(w: &[[Var; 3]], sinks: &[[GradSink; 3]]) -> Vec<ExpertWeights> {
    w.iter()
        .zip(sinks)
        .map(|(w, s)| ExpertWeights {
            w1: (w[0].as_tensor().clone(), s[0].clone()),
            w3: (w[1].as_tensor().clone(), s[1].clone()),
            w2: (w[2].as_tensor().clone(), s[2].clone()),
        })
        .collect()
}

#[test]
fn the_experts_node_gives_the_per_expert_graphs_bits() {
    let (hidden, ffn, rows) = (16, 24, vec![5usize, 0, 7]);
    let n: usize = rows.iter().sum();
    for (dtype, how) in products() {
        let x = var("x", &[n, hidden], dtype);
        let w = expert_vars(rows.len(), hidden, ffn, dtype);
        let sinks = |_| [GradSink::new(), GradSink::new(), GradSink::new()];
        // Per expert: its rows selected, two products, SwiGLU, a product; concatenated.
        let per: Vec<[GradSink; 3]> = (0..rows.len()).map(sinks).collect();
        let mut outs = Vec::new();
        let mut start = 0u32;
        for (e, &r) in rows.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let idx =
                Tensor::from_vec((start..start + r as u32).collect(), r, &Device::Cpu).unwrap();
            let xe = x.as_tensor().index_select(&idx, 0).unwrap();
            let g = linear_into(how, &xe, &w[e][0], &per[e][0]).unwrap();
            let u = linear_into(how, &xe, &w[e][1], &per[e][1]).unwrap();
            let h = swiglu_as(how, &g, &u).unwrap();
            outs.push(linear_into(how, &h, &w[e][2], &per[e][2]).unwrap());
            start += r as u32;
        }
        let want = Tensor::cat(&outs, 0).unwrap();
        let store = weigh(&want, "dy").backward().unwrap();
        let want_dx = store.get(&x).unwrap().clone();
        // One node.
        let fused: Vec<[GradSink; 3]> = (0..rows.len()).map(sinks).collect();
        let weights = expert_weights(&w, &fused);
        let anchor = var("anchor", &[1], dtype);
        let got = experts_swiglu(how, &x, &anchor, weights, rows.clone()).unwrap();
        let store = weigh(&got, "dy").backward().unwrap();
        let what = format!("experts {dtype:?} {how:?}");
        assert_eq!(bits(&got), bits(&want), "{what}: outputs");
        assert_eq!(bits(store.get(&x).unwrap()), bits(&want_dx), "{what}: dx");
        assert!(store.get(&anchor).is_none(), "{what}: the anchor got a gradient");
        for e in 0..rows.len() {
            for j in 0..3 {
                let shape = w[e][j].shape();
                let (a, b) = (fused[e][j].take(shape).unwrap(), per[e][j].take(shape).unwrap());
                match (a, b) {
                    (Some(a), Some(b)) => {
                        assert_eq!(bits(&a), bits(&b), "{what}: expert {e} weight {j}")
                    }
                    (None, None) => assert_eq!(rows[e], 0, "{what}: expert {e} got no gradient"),
                    _ => panic!("{what}: expert {e} weight {j}: a gradient on one side only"),
                }
            }
        }
    }
    let x = var("x", &[4, 16], DType::F32);
    let weights = vec![ExpertWeights {
        w1: (var("w1", &[8, 16], DType::F32).as_tensor().clone(), GradSink::new()),
        w3: (var("w3", &[8, 16], DType::F32).as_tensor().clone(), GradSink::new()),
        w2: (var("w2", &[16, 8], DType::F32).as_tensor().clone(), GradSink::new()),
    }];
    let anchor = var("anchor", &[1], DType::F32);
    let e = experts_swiglu(Matmul::Native, &x, &anchor, weights, vec![3]).unwrap_err();
    assert!(e.to_string().contains("4 rows for 1 experts, grouped as [3]"), "{e}");
}

#[test]
fn the_routed_experts_node_gives_the_composed_routing_and_experts_values() {
    let (hidden, ffn, n) = (16, 24, 7);
    // Assignments grouped by expert (expert 1 has none); token 3 has none, token 0 three,
    // the others one or two.
    let tokens: Vec<u32> = vec![0, 2, 5, 6, 0, 1, 2, 4, 5, 6, 0];
    let rows = vec![4usize, 0, 6, 1];
    let a = tokens.len();
    // Also as the MoE layer runs it on one rank: tokens `[1, n, hidden]`, the residual
    // added in the node.
    for ((dtype, how), residual) in products().into_iter().flat_map(|p| [(p, false), (p, true)]) {
        let what = format!("routed experts {dtype:?} {how:?} residual {residual}");
        let x =
            if residual { var("x", &[1, n, hidden], dtype) } else { var("x", &[n, hidden], dtype) };
        let res = var("residual", x.dims(), dtype);
        let gates = var("gates", &[a], dtype);
        let w = expert_vars(rows.len(), hidden, ffn, dtype);
        let sinks = |_| [GradSink::new(), GradSink::new(), GradSink::new()];
        let weights = |s: &[[GradSink; 3]]| expert_weights(&w, s);
        // Composed, as the MoE layer across ranks: gather, the experts' node, weigh, sum.
        let per: Vec<[GradSink; 3]> = (0..rows.len()).map(sinks).collect();
        let idx = Tensor::from_vec(tokens.clone(), a, &Device::Cpu).unwrap();
        let x2 = x.as_tensor().reshape((n, hidden)).unwrap();
        let routed = x2.index_select(&idx, 0).unwrap();
        let anchor = var("anchor", &[1], dtype);
        let y = experts_swiglu(how, &routed, &anchor, weights(&per), rows.clone()).unwrap();
        let weighted = y.broadcast_mul(&gates.as_tensor().unsqueeze(1).unwrap()).unwrap();
        let want = x2.zeros_like().unwrap().index_add(&idx, &weighted, 0).unwrap();
        let want = want.reshape(x.shape()).unwrap();
        let want = if residual { (res.as_tensor() + want).unwrap() } else { want };
        let store = weigh(&want, "dy").backward().unwrap();
        let (want_dx, want_dg) = (store.get(&x).unwrap(), store.get(&gates).unwrap());
        let want_dr = store.get(&res).cloned();
        // One node.
        let fused: Vec<[GradSink; 3]> = (0..rows.len()).map(sinks).collect();
        let routing = (rows.clone(), tokens.clone());
        let r = residual.then(|| res.as_tensor());
        let got = routed_experts(how, &x, &gates, weights(&fused), routing, r).unwrap();
        let store = weigh(&got, "dy").backward().unwrap();
        assert_eq!(bits(&got), bits(&want), "{what}: outputs");
        if !residual {
            let token3 = flat(&got.get(3).unwrap()).unwrap();
            assert!(token3.iter().all(|&v| v == 0.0), "{what}: token 3");
        }
        assert_eq!(bits(store.get(&x).unwrap()), bits(want_dx), "{what}: dx");
        match (store.get(&res), want_dr) {
            (Some(got), Some(want)) => assert_eq!(bits(got), bits(&want), "{what}: residual"),
            (None, None) => assert!(!residual),
            _ => panic!("{what}: a residual gradient on one side only"),
        }
        // A gate's gradient sums in another order than candle's reduction.
        close(&format!("{what}: gates"), store.get(&gates).unwrap(), want_dg, tolerance(dtype));
        for e in 0..rows.len() {
            for j in 0..3 {
                let shape = w[e][j].shape();
                match (fused[e][j].take(shape).unwrap(), per[e][j].take(shape).unwrap()) {
                    (Some(a), Some(b)) => {
                        assert_eq!(bits(&a), bits(&b), "{what}: expert {e} weight {j}")
                    }
                    (None, None) => assert_eq!(rows[e], 0, "{what}: expert {e} got no gradient"),
                    _ => panic!("{what}: expert {e} weight {j}: a gradient on one side only"),
                }
            }
        }
    }
    // Refused: a token out of range, gates and tokens of different counts.
    let x = var("x", &[4, 16], DType::F32);
    let one = || {
        vec![ExpertWeights {
            w1: (var("w1", &[8, 16], DType::F32).as_tensor().clone(), GradSink::new()),
            w3: (var("w3", &[8, 16], DType::F32).as_tensor().clone(), GradSink::new()),
            w2: (var("w2", &[16, 8], DType::F32).as_tensor().clone(), GradSink::new()),
        }]
    };
    let gates = var("gates", &[2], DType::F32);
    let routed = |routing, r| routed_experts(Matmul::Native, &x, &gates, one(), routing, r);
    let e = routed((vec![2], vec![1, 4]), None).unwrap_err();
    assert!(e.to_string().contains("token 4 of 4"), "{e}");
    let e = routed((vec![3], vec![0, 1, 2]), None).unwrap_err();
    assert!(e.to_string().contains("2 assignments, 3 tokens"), "{e}");
    let r = var("residual", &[4, 15], DType::F32);
    let e = routed((vec![2], vec![1, 3]), Some(r.as_tensor())).unwrap_err();
    assert!(e.to_string().contains("a residual [4, 15] for tokens [4, 16]"), "{e}");
}

#[test]
fn the_combine_node_gives_the_composed_weighted_sum() {
    // 9 rows back from the experts for 5 tokens: token 3 none, token 0 three.
    let tokens: Vec<u32> = vec![0, 2, 4, 0, 1, 2, 4, 0, 1];
    let (a, n, hidden) = (tokens.len(), 5, 12);
    for dtype in [DType::F32, DType::F64] {
        let what = format!("combine {dtype:?}");
        let rows = var("rows", &[a, hidden], dtype);
        let gates = var("gates", &[a], dtype);
        let idx = Tensor::from_vec(tokens.clone(), a, &Device::Cpu).unwrap();
        let weighted = rows.as_tensor().broadcast_mul(&gates.unsqueeze(1).unwrap()).unwrap();
        let zeros = Tensor::zeros((n, hidden), dtype, &Device::Cpu).unwrap();
        let want = zeros.index_add(&idx, &weighted, 0).unwrap();
        let want_grads = weigh(&want, "dy").backward().unwrap();
        let got = combine_experts(&rows, &gates, tokens.clone(), n).unwrap();
        let grads = weigh(&got, "dy").backward().unwrap();
        assert_eq!(bits(&got), bits(&want), "{what}: outputs");
        assert!(flat(&got.get(3).unwrap()).unwrap().iter().all(|&v| v == 0.0), "{what}: token 3");
        let (d, want_d) = (grads.get(&rows).unwrap(), want_grads.get(&rows).unwrap());
        assert_eq!(bits(d), bits(want_d), "{what}: the rows' gradient");
        let (dg, want_dg) = (grads.get(&gates).unwrap(), want_grads.get(&gates).unwrap());
        close(&format!("{what}: gates"), dg, want_dg, tolerance(dtype));
    }
    let rows = var("rows", &[3, 4], DType::F32);
    let e = combine_experts(&rows, &var("gates", &[3], DType::F32), vec![0, 5, 1], 5).unwrap_err();
    assert!(e.to_string().contains("token 5 of 5"), "{e}");
    let e = combine_experts(&rows, &var("gates", &[2], DType::F32), vec![0, 1, 1], 5).unwrap_err();
    assert!(e.to_string().contains("3 rows, [2] gates"), "{e}");
}

/// `t` (f32) rounded to bf16, as an f64 tensor.
fn rounded(t: &Tensor) -> Tensor {
    let v: Vec<f64> = flat(t).unwrap().iter().map(|&x| bf16::round(x as f32) as f64).collect();
    Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap()
}

#[test]
fn bf16_linear_multiplies_the_rounded_operands_forward_and_backward() {
    // 21 rows against 23 outputs take the kernel's row-major form, 10 rows (at most half
    // the outputs) the transposed one.
    for shape in [[3, 7, 40], [2, 5, 40]] {
        let rows = shape[0] * shape[1];
        let x = var("x", &shape, DType::F32);
        let w = var("w", &[23, 40], DType::F32);
        let b = var("b", &[23], DType::F32);
        let y = linear_bias_as(Matmul::Bf16, &x, &w, &b).unwrap();
        let dy = var("dy", y.dims(), DType::F32);
        let grads = (&y * dy.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        // The same products in f64 on bf16-rounded operands (the output gradient rounded
        // too, as the backward's products take it), the bias and its gradient unrounded.
        let (xr, wr, dyr) = (rounded(&x), rounded(&w), rounded(&dy));
        let b64 = b.as_tensor().to_dtype(DType::F64).unwrap();
        let want_y = reference::bias_add(&reference::linear(&xr, &wr).unwrap(), &b64).unwrap();
        let dy2 = dyr.reshape((rows, 23)).unwrap();
        let want_dx = dy2.matmul(&wr).unwrap().reshape(&shape[..]).unwrap();
        let want_dw = dy2.t().unwrap().matmul(&xr.reshape((rows, 40)).unwrap()).unwrap();
        let want_db = dy.as_tensor().to_dtype(DType::F64).unwrap().reshape((rows, 23)).unwrap();
        let want_db = want_db.sum(0).unwrap();
        // f32 sums of exact products: the f32 tolerance.
        let tol = tolerance(DType::F32);
        close(&format!("bf16 linear {shape:?} y"), &y, &want_y, tol);
        close(&format!("bf16 linear {shape:?} dx"), grads.get(&x).unwrap(), &want_dx, tol);
        close(&format!("bf16 linear {shape:?} dw"), grads.get(&w).unwrap(), &want_dw, tol);
        close(&format!("bf16 linear {shape:?} db"), grads.get(&b).unwrap(), &want_db, tol);
    }
    let x = var("x", &[3, 7, 40], DType::F32);
    let w = var("w", &[23, 40], DType::F32);
    let b = var("b", &[23], DType::F32);
    let y = linear_bias_as(Matmul::Bf16, &x, &w, &b).unwrap();
    // And it is not the f32 product: the rounding shows at well above the f32 tolerance.
    let f32_y = linear_bias(&x, &w, &b).unwrap();
    let moved = rel_err(&flat(&y).unwrap(), &flat(&f32_y).unwrap());
    assert!(moved > 1e-4, "bf16 products within {moved:e} of f32's: were operands rounded?");
    // f64 tensors have no bf16 compute.
    let (x64, w64) = (var("x", &[2, 4], DType::F64), var("w", &[3, 4], DType::F64));
    let e = hetpar_nn::kernels::linear::linear_as(Matmul::Bf16, &x64, &w64).unwrap_err();
    assert!(e.to_string().contains("f32"), "{e}");
}

#[test]
fn a_linear_of_no_features_keeps_its_rows() {
    let x = Tensor::zeros((3, 0), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::zeros((4, 0), DType::F32, &Device::Cpu).unwrap();
    let y = linear(&x, &w).unwrap();
    assert_eq!(y.dims(), &[3, 4]);
    assert_eq!(flat(&y).unwrap(), vec![0.0; 12]);
}

#[test]
fn adamw_in_place_gives_the_bits_of_the_element_wise_update() {
    for dtype in [DType::F32, DType::F64] {
        let w = var("w", &[9, 31], dtype).as_tensor().copy().unwrap();
        let mut want = (w.copy().unwrap(), w.zeros_like().unwrap(), w.zeros_like().unwrap());
        let (m, v) = (w.zeros_like().unwrap(), w.zeros_like().unwrap());
        for t in 1..=4 {
            let g = (var("g", &[9, 31], dtype).as_tensor() * t as f64).unwrap();
            let s = AdamStep {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                scale: if t == 2 { 0.3 } else { 1.0 },
                bc1: 1.0 - 0.9f64.powi(t),
                bc2: 1.0 - 0.999f64.powi(t),
                lr: 1e-2,
                decay: 0.1,
            };
            assert!(adamw_step(&w, &g, &m, &v, s).unwrap(), "a finite update");
            want = reference::adamw(&want.0, &g, &want.1, &want.2, &s).unwrap();
            let bits =
                |t: &Tensor| flat(t).unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (what, got, want) in [("w", &w, &want.0), ("m", &m, &want.1), ("v", &v, &want.2)] {
                assert_eq!(bits(got), bits(want), "adamw {dtype:?} step {t}: {what}");
            }
        }
    }
    let w = var("w", &[4], DType::F32).as_tensor().copy().unwrap();
    let other = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
    let step = AdamStep {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        scale: 1.0,
        bc1: 0.1,
        bc2: 0.01,
        lr: 0.1,
        decay: 0.0,
    };
    let e = adamw_step(&w, &other, &w.zeros_like().unwrap(), &w.zeros_like().unwrap(), step)
        .unwrap_err();
    assert!(e.to_string().contains("for a parameter"), "{e}");
    // The moments are locked one inside the other: one tensor passed twice is refused, not
    // left waiting for its own lock.
    let (m, v) = (w.zeros_like().unwrap(), w.zeros_like().unwrap());
    for (g, m, v) in [(&w.ones_like().unwrap(), &m, &m), (&m, &m, &v), (&v, &m, &v)] {
        let e = adamw_step(&w, g, m, v, step).unwrap_err();
        assert!(e.to_string().contains("must not share storage"), "{e}");
    }
}

/// A finite gradient whose update overflows is written and reported: a weight pushed past
/// the type's range by the learning rate, a second moment by the gradient's square (which
/// would otherwise freeze its weight silently), and a NaN weight; one element of many.
#[test]
fn adamw_reports_an_update_that_overflows() {
    // The first step's constants (bias corrections 1 - 0.9 and 1 - 0.999).
    let (beta1, beta2) = (0.9, 0.999);
    let (bc1, bc2) = (1.0 - beta1, 1.0 - beta2);
    let step = |lr: f64| AdamStep { beta1, beta2, eps: 1e-8, scale: 1.0, bc1, bc2, lr, decay: 0.0 };
    for dtype in [DType::F32, DType::F64] {
        let max = if dtype == DType::F32 { f32::MAX as f64 } else { f64::MAX };
        let n = 37;
        let at = |i: usize, x: f64| {
            let mut v = vec![0.5; n];
            v[i] = x;
            Tensor::from_vec(v, n, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
        };
        let fresh = || {
            (
                Tensor::zeros(n, dtype, &Device::Cpu).unwrap(),
                Tensor::zeros(n, dtype, &Device::Cpu).unwrap(),
            )
        };
        // The weight at the type's largest value, moved further by the learning rate.
        let (m, v) = fresh();
        let w = at(17, -max);
        assert!(!adamw_step(&w, &at(17, 1.0), &m, &v, step(max)).unwrap(), "{dtype:?} weight");
        // A gradient whose square overflows the second moment.
        let (m, v) = fresh();
        let w = at(0, 0.5);
        let huge = max.sqrt() * 4.0;
        assert!(!adamw_step(&w, &at(n - 1, huge), &m, &v, step(1e-3)).unwrap(), "{dtype:?} v");
        // A weight already NaN.
        let (m, v) = fresh();
        let w = at(30, f64::NAN);
        assert!(!adamw_step(&w, &at(0, 1.0), &m, &v, step(1e-3)).unwrap(), "{dtype:?} NaN");
        // The same shapes with ordinary values stay finite.
        let (m, v) = fresh();
        assert!(adamw_step(&at(3, 2.0), &at(3, 1.0), &m, &v, step(1e-3)).unwrap(), "{dtype:?}");
    }
}
