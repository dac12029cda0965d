//! The MoE block with experts over ep (1, 2, 4), mixed with tp (with and without SP) and
//! expert data parallelism, matches the world-size-1 run; all-to-all appears only under
//! ep > 1; as a pre-norm layer's second half on one rank (the residual inside the routed
//! node) it keeps the composed half's bits.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Var};
use common::*;
use hetpar_comm::{LocalOptions, Log, OpKind, Recording, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::layers::moe::{Moe, MoeSpec};
use hetpar_nn::testing::{RankReport, assemble, compare_params, flat, rel_err, snapshot};
use hetpar_nn::{Build, HasParams, ParallelCtx};

const B: usize = 4;
const S: usize = 8;
const SPEC: MoeSpec = MoeSpec { hidden: 16, ffn: 24, experts: 4, top_k: 2, aux_coef: 0.1 };

fn layout(tp: usize, dp: usize, ep: usize, sp: bool) -> ModuleLayout {
    let spec = LayoutSpec { tp, ep, etp: Some(1), sp, ..LayoutSpec::default() };
    ModuleLayout::new("m", Span::new(0, tp * dp), spec).expect("layout")
}

/// Samples of this rank's replica and the positions it holds.
fn mine(l: &ModuleLayout, rank: usize) -> (std::ops::Range<usize>, Vec<usize>) {
    let c = l.coords(rank).unwrap();
    let per = B / l.dp();
    (c.dp_idx * per..(c.dp_idx + 1) * per, local_positions(l, rank, S))
}

fn run(l: &ModuleLayout, dtype: DType, log: Option<&Log>) -> Vec<RankReport> {
    launch(l.span().len(), LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let rec;
        let comm: &dyn hetpar_comm::Communicator = match log {
            Some(log) => {
                rec = Recording::new(Box::new(c), log.clone());
                &rec
            }
            None => c,
        };
        let ctx = ParallelCtx::new(comm, l).unwrap();
        let b = Build::new(ctx.clone(), 11, dtype);
        let moe = Moe::new(&b, "moe", SPEC, 0.4, 0.3).unwrap();
        let (samples, pos) = mine(l, ctx.rank);
        let pick = |t: candle_core::Tensor| {
            at_positions(&t.narrow(0, samples.start, samples.len()).unwrap(), &pos)
        };
        let x = Var::from_tensor(&pick(global("x", &[B, S, SPEC.hidden], dtype))).unwrap();
        let probe = pick(global("probe", &[B, S, SPEC.hidden], dtype));
        let (y, aux) = moe.forward(x.as_tensor()).unwrap();
        let loss = ((&y * &probe).unwrap().sum_all().unwrap() + &aux).unwrap();
        let grads = loss.backward().unwrap();
        let mut values = BTreeMap::new();
        values.insert("out".to_string(), flat(&y).unwrap());
        values.insert("x_grad".to_string(), flat(grads.get(x.as_tensor()).unwrap()).unwrap());
        values.insert("aux".to_string(), flat(&aux).unwrap());
        snapshot(&ctx, &moe.params(), &grads, values).unwrap()
    })
    .unwrap()
}

/// `[B, S, H]` from every rank's `[samples, positions, H]`; replicas must agree.
fn reassemble(l: &ModuleLayout, runs: &[RankReport], key: &str, tol: f64) -> Vec<f64> {
    let h = SPEC.hidden;
    let mut out: Vec<Option<Vec<f64>>> = vec![None; B * S];
    for r in runs {
        let (samples, pos) = mine(l, r.rank);
        for (si, s) in samples.enumerate() {
            for (i, &p) in pos.iter().enumerate() {
                let at = (si * pos.len() + i) * h;
                let row = r.values[key][at..at + h].to_vec();
                if let Some(prev) = &out[s * S + p] {
                    assert!(rel_err(&row, prev) <= tol, "{key}: replicas of ({s},{p}) differ");
                }
                out[s * S + p] = Some(row);
            }
        }
    }
    out.into_iter().flat_map(|r| r.unwrap()).collect()
}

#[test]
fn moe_matches_one_rank_under_ep_tp_and_edp() {
    for dtype in [DType::F32, DType::F64] {
        let tol = tolerance(dtype);
        let reference = run(&layout(1, 1, 1, false), dtype, None);
        let ref_params = assemble(&reference, tol).unwrap();
        for (tp, dp, ep, sp) in [
            (1, 2, 1, false),
            (1, 2, 2, false),
            (1, 4, 4, false),
            (1, 4, 2, false),
            (2, 1, 1, false),
            (2, 1, 1, true),
            (2, 1, 2, false),
            (2, 1, 2, true),
            (2, 2, 4, true),
        ] {
            let l = layout(tp, dp, ep, sp);
            let what = format!("tp {tp} dp {dp} ep {ep} sp {sp} {dtype:?}");
            let runs = run(&l, dtype, None);
            compare_params(&ref_params, &assemble(&runs, tol).unwrap(), tol)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for key in ["out", "x_grad"] {
                let e = rel_err(&reassemble(&l, &runs, key, tol), &reference[0].values[key]);
                assert!(e <= tol, "{what}: {key} differs by {e:e}");
            }
            let aux: f64 = runs.iter().map(|r| r.values["aux"][0]).sum();
            let e = rel_err(&[aux], &reference[0].values["aux"]);
            assert!(e <= tol, "{what}: aux loss {aux} vs {}", reference[0].values["aux"][0]);
        }
    }
}

#[test]
fn all_to_all_only_under_ep() {
    for (ep, expect) in [(1, false), (2, true)] {
        let log = Log::new();
        run(&layout(1, 2, ep, false), DType::F32, Some(&log));
        assert_eq!(
            log.count_by_kind().contains_key(&OpKind::AllToAllV),
            expect,
            "ep {ep}: {:?}",
            log.count_by_kind()
        );
    }
}

#[test]
fn the_residual_half_keeps_the_composed_bits() {
    use hetpar_nn::layers::norm::RmsNorm;
    let l = layout(1, 1, 1, false);
    for dtype in [DType::F32, DType::F64] {
        let reports = launch(1, LocalOptions::default(), |c| {
            let ctx = ParallelCtx::new(c, &l).unwrap();
            let b = Build::new(ctx.clone(), 11, dtype);
            let moe = Moe::new(&b, "moe", SPEC, 0.4, 0.3).unwrap();
            let norm = RmsNorm::new(&b, "norm", SPEC.hidden, 1e-5).unwrap();
            let x = Var::from_tensor(&global("x", &[B, S, SPEC.hidden], dtype)).unwrap();
            let probe = global("probe", &[B, S, SPEC.hidden], dtype);
            let mut params = moe.params();
            params.extend(norm.params());
            // Composed (`x + moe(norm(x))`), then the half as `Moe::residual` runs it.
            [false, true].map(|fused| {
                let (y, aux) = if fused {
                    moe.residual(x.as_tensor(), &norm).unwrap()
                } else {
                    let (y, aux) = moe.forward(&norm.forward(x.as_tensor()).unwrap()).unwrap();
                    ((x.as_tensor() + y).unwrap(), aux)
                };
                let loss = ((&y * &probe).unwrap().sum_all().unwrap() + &aux).unwrap();
                let grads = loss.backward().unwrap();
                let mut values = BTreeMap::new();
                values.insert("out".to_string(), flat(&y).unwrap());
                let dx = flat(grads.get(x.as_tensor()).unwrap()).unwrap();
                values.insert("x_grad".to_string(), dx);
                values.insert("aux".to_string(), flat(&aux).unwrap());
                snapshot(&ctx, &params, &grads, values).unwrap()
            })
        })
        .unwrap();
        let [composed, fused] = &reports[0];
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for key in ["out", "x_grad", "aux"] {
            let (a, b) = (&composed.values[key], &fused.values[key]);
            assert_eq!(bits(a), bits(b), "{dtype:?}: {key}");
        }
        for (a, b) in composed.params.iter().zip(&fused.params) {
            assert_eq!(a.name, b.name);
            assert!(a.grad.iter().any(|&g| g != 0.0), "{dtype:?}: {} got no gradient", a.name);
            assert_eq!(bits(&a.grad), bits(&b.grad), "{dtype:?}: {}", a.name);
        }
    }
}
