//! Each layer sharded over tp (with and without sequence parallelism) matches the
//! world-size-1 run: outputs, input gradients and every parameter gradient, within 1e-5
//! relative in f32 and 1e-10 in f64.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use hetpar_comm::{CommExt, LocalOptions, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::layers::mlp::SwiGlu;
use hetpar_nn::layers::norm::{LayerNorm, RmsNorm};
use hetpar_nn::testing::{RankReport, assemble, compare_params, flat, rel_err, snapshot};
use hetpar_nn::{Build, HasParams, Init, ParallelCtx};

const B: usize = 2;
const S: usize = 8;
const H: usize = 16;
const FFN: usize = 32;

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-10 } else { 1e-5 }
}

/// A deterministic global tensor.
fn global(name: &str, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| Init::Normal(1.0).value(99, name, i as u64)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor").to_dtype(dtype).expect("dtype")
}

/// Part `idx` of `parts` along `dim`.
fn part(t: &Tensor, dim: usize, parts: usize, idx: usize) -> Tensor {
    let n = t.dims()[dim] / parts;
    t.narrow(dim, idx * n, n).expect("narrow").contiguous().expect("contiguous")
}

fn layout(tp: usize, sp: bool) -> ModuleLayout {
    ModuleLayout::new("m", Span::new(0, tp), LayoutSpec { tp, sp, ..LayoutSpec::default() })
        .expect("layout")
}

/// Runs norm -> SwiGLU on every rank of a tp layout; returns reports with the local output
/// and input gradient.
fn run_mlp(tp: usize, sp: bool, dtype: DType) -> Vec<RankReport> {
    let l = layout(tp, sp);
    launch(tp, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let ctx = ParallelCtx::new(c, &l).expect("ctx");
        let b = Build::new(ctx.clone(), 5, dtype);
        let ln = LayerNorm::new(&b, "ln", H, 1e-5).expect("ln");
        let rms = RmsNorm::new(&b, "rms", H, 1e-6).expect("rms");
        let mlp = SwiGlu::new(&b, "mlp", H, FFN, 0.2, 0.1).expect("mlp");
        let shard = |t: Tensor| if ctx.sp() { part(&t, 1, tp, ctx.tp.rank) } else { t };
        let x = Var::from_tensor(&shard(global("x", &[B, S, H], dtype))).expect("var");
        let probe = shard(global("probe", &[B, S, H], dtype));
        let y = mlp
            .forward(&rms.forward(&ln.forward(x.as_tensor()).unwrap()).unwrap())
            .expect("forward");
        let loss = (&y * &probe).unwrap().sum_all().unwrap();
        let grads = loss.backward().expect("backward");
        let params: Vec<_> = [ln.params(), rms.params(), mlp.params()].concat();
        let mut values = BTreeMap::new();
        values.insert("out".into(), flat(&y).unwrap());
        values.insert("x_grad".into(), flat(grads.get(x.as_tensor()).unwrap()).unwrap());
        snapshot(&ctx, &params, &grads, values).expect("snapshot")
    })
    .expect("launch")
}

/// Concatenates the ranks' `key` along the sequence (SP) or checks replicas agree.
fn joined(reports: &[RankReport], key: &str, sp: bool, tol: f64) -> Vec<f64> {
    if !sp {
        for r in &reports[1..] {
            assert!(
                rel_err(&r.values[key], &reports[0].values[key]) <= tol,
                "{key} replicas differ"
            );
        }
        return reports[0].values[key].clone();
    }
    // [B, S/tp, H] per rank -> [B, S, H].
    let tp = reports.len();
    let part = S / tp * H;
    let mut out = Vec::with_capacity(B * S * H);
    for b in 0..B {
        for r in reports {
            out.extend_from_slice(&r.values[key][b * part..(b + 1) * part]);
        }
    }
    out
}

#[test]
fn norms_and_swiglu_match_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = tolerance(dtype);
        let reference = run_mlp(1, false, dtype);
        let ref_params = assemble(&reference, tol).expect("reference");
        for (tp, sp) in [(2, false), (2, true), (4, false), (4, true)] {
            let runs = run_mlp(tp, sp, dtype);
            let what = format!("tp {tp} sp {sp} {dtype:?}");
            compare_params(&ref_params, &assemble(&runs, tol).expect("assemble"), tol)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for key in ["out", "x_grad"] {
                let e = rel_err(&joined(&runs, key, sp, tol), &reference[0].values[key]);
                assert!(e <= tol, "{what}: {key} differs by {e:e}");
            }
        }
    }
}

#[test]
fn tp_one_issues_no_collective() {
    let log = hetpar_comm::Log::new();
    let l = layout(1, false);
    launch(1, LocalOptions::default(), |c| {
        let rec = hetpar_comm::Recording::new(Box::new(c), log.clone());
        let ctx = ParallelCtx::new(&rec, &l).expect("ctx");
        let b = Build::new(ctx, 5, DType::F32);
        let mlp = SwiGlu::new(&b, "mlp", H, FFN, 0.2, 0.1).expect("mlp");
        let x = global("x", &[B, S, H], DType::F32);
        let y = mlp.forward(&x).expect("forward");
        y.sum_all().unwrap().backward().expect("backward");
        assert_eq!(rec.global_rank(), 0);
    })
    .expect("launch");
    assert!(log.records().is_empty(), "{:?}", log.count_by_kind());
}

#[test]
fn gate_and_up_share_one_gather_and_one_reduction() {
    // Per rank and step: the input's gather forward and its gradient's reduce-scatter
    // backward once for both projections, the down projection's reduce-scatter forward and
    // its gradient's gather backward: two of each, not three.
    let log = hetpar_comm::Log::new();
    let l = layout(2, true);
    launch(2, LocalOptions::default(), |c| {
        let rec = hetpar_comm::Recording::new(Box::new(c), log.clone());
        let ctx = ParallelCtx::new(&rec, &l).expect("ctx");
        let b = Build::new(ctx.clone(), 5, DType::F32);
        let mlp = SwiGlu::new(&b, "mlp", H, FFN, 0.2, 0.1).expect("mlp");
        let x = part(&global("x", &[B, S, H], DType::F32), 1, 2, ctx.tp.rank);
        let x = Var::from_tensor(&x).expect("var");
        let y = mlp.forward(x.as_tensor()).expect("forward");
        y.sum_all().unwrap().backward().expect("backward");
    })
    .expect("launch");
    let kinds = log.count_by_kind();
    let want = BTreeMap::from([
        (hetpar_comm::OpKind::AllGatherV, 4),
        (hetpar_comm::OpKind::ReduceScatter, 4),
    ]);
    assert_eq!(kinds, want, "calls of both ranks");
}
