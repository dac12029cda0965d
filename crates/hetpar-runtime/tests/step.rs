//! The gradient side of a step: AdamW against its formulas written out, and reduction, the
//! global norm, clipping and the update on sharded ViT layouts matching one rank.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::models::vit::{Vit, VitConfig};
use hetpar_nn::testing::{
    RankReport, TINY_VIT, assemble, flat, norm_rel, rel_err, snapshot_values,
};
use hetpar_nn::{Build, HasParams, Init, ParallelCtx, Param};
use hetpar_runtime::step::{clip_factor, global_norm, norm_sq_share, reduce};
use hetpar_runtime::{AdamState, AdamW, Grads};

#[test]
fn adamw_follows_its_formulas() {
    let opt = AdamW { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
    let (lr, scale) = (0.05, 0.5);
    let w = Param::new("w".into(), &[2, 2], None, vec![], Init::Const(1.0), 0, DType::F64).unwrap();
    let b = Param::new("b".into(), &[2], None, vec![], Init::Const(1.0), 0, DType::F64).unwrap();
    let params = [&w, &b];
    let mut state = AdamState::new(&params).unwrap();
    let steps = [[0.4, -2.0, 0.0, 1e-3], [0.1, 3.0, -1.0, 2.0]];
    // The update written out for one element (PyTorch's AdamW): decay, then the step.
    let (mut p, mut m, mut v) = ([1.0f64; 4], [0.0f64; 4], [0.0f64; 4]);
    for (t, g) in steps.iter().enumerate() {
        let grads = Grads::new(vec![
            Tensor::from_vec(g.to_vec(), (2, 2), &Device::Cpu).unwrap(),
            Tensor::from_vec(g[..2].to_vec(), 2, &Device::Cpu).unwrap(),
        ]);
        assert_eq!(state.update(&opt, &params, &grads, lr, scale).unwrap(), None);
        let n = (t + 1) as i32;
        for i in 0..4 {
            let gi = g[i] * scale;
            m[i] = 0.9 * m[i] + 0.1 * gi;
            v[i] = 0.99 * v[i] + 0.01 * gi * gi;
            let step =
                (m[i] / (1.0 - 0.9f64.powi(n))) / ((v[i] / (1.0 - 0.99f64.powi(n))).sqrt() + 1e-8);
            p[i] = p[i] * (1.0 - lr * 0.1) - lr * step;
        }
        let got = flat(w.tensor()).unwrap();
        assert!(rel_err(&got, &p) < 1e-14, "step {t}: {got:?} vs {p:?}");
    }
    // The bias takes no weight decay: with the same gradients as the first two elements
    // it moves less than them exactly by their decay.
    let bias = flat(b.tensor()).unwrap();
    let mut q = [1.0f64; 2];
    let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
    for (t, g) in steps.iter().enumerate() {
        let n = (t + 1) as i32;
        for i in 0..2 {
            let gi = g[i] * scale;
            m[i] = 0.9 * m[i] + 0.1 * gi;
            v[i] = 0.99 * v[i] + 0.01 * gi * gi;
            q[i] -= lr * (m[i] / (1.0 - 0.9f64.powi(n)))
                / ((v[i] / (1.0 - 0.99f64.powi(n))).sqrt() + 1e-8);
        }
    }
    assert!(rel_err(&bias, &q) < 1e-14, "{bias:?} vs {q:?}");
    assert_eq!(state.steps, 2);
}

#[test]
fn clipping_scales_only_above_the_bound() {
    assert_eq!(clip_factor(0.5, 1.0), 1.0);
    assert_eq!(clip_factor(5.0, 0.0), 1.0);
    assert!((clip_factor(4.0, 1.0) * 4.0 - 1.0).abs() < 1e-6);
}

const VIT: VitConfig = TINY_VIT;

fn global(name: &str, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| Init::Normal(1.0).value(77, name, i as u64)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// Two steps of a ViT on `tp x cp x dp`: the loss `sum(out * probe) / rows` over every
/// image, gradients reduced, clipped and applied. Returns each rank's
/// parameters after the steps and the norms.
fn train(tp: usize, cp: usize, dp: usize, sp: bool, dtype: DType) -> (Vec<RankReport>, Vec<f64>) {
    let spec = LayoutSpec { tp, cp, sp, ..LayoutSpec::default() };
    let l = ModuleLayout::new("vision", Span::new(0, tp * cp * dp), spec).unwrap();
    let images = 4;
    let out = launch(tp * cp * dp, LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let vit = Vit::new(&Build::new(ctx.clone(), 3, dtype), VIT).unwrap();
        let params = vit.params();
        let mut state = AdamState::new(&params).unwrap();
        let opt = AdamW { weight_decay: 0.1, ..AdamW::default() };
        let (per, mine) = (images / dp, ctx.coords.dp_idx * images / dp);
        let local = vit.local_positions().unwrap();
        let idx = Tensor::from_vec(
            local.iter().map(|&p| p as u32).collect::<Vec<_>>(),
            local.len(),
            &Device::Cpu,
        )
        .unwrap();
        let rows = (images * VIT.patches()) as f64;
        let mut norms = Vec::new();
        for step in 0..2 {
            let pixels = global(&format!("pixels{step}"), &[images, 3, 16, 16], dtype);
            let probe = global(&format!("probe{step}"), &[images, VIT.patches(), 24], dtype)
                .narrow(0, mine, per)
                .unwrap()
                .index_select(&idx, 1)
                .unwrap();
            let y = vit.forward(&pixels.narrow(0, mine, per).unwrap()).unwrap();
            let loss = ((&y * &probe).unwrap().sum_all().unwrap() / rows).unwrap();
            let mut grads = Grads::zeros(&params).unwrap();
            grads.accumulate(&params, &loss.backward().unwrap()).unwrap();
            reduce(&ctx, &params, &mut grads).unwrap();
            assert_eq!(grads.first_nonfinite(&params).unwrap(), None);
            let norm = global_norm(c, norm_sq_share(&ctx, &params, &grads).unwrap()).unwrap();
            // Fixed bounds below the norms: clipping acts, by the same rule on every layout.
            let bound = [0.02, 0.01][step];
            let overflowed = state.update(&opt, &params, &grads, 1e-2, clip_factor(norm, bound));
            assert_eq!(overflowed.unwrap(), None);
            norms.push(norm);
        }
        (snapshot_values(&ctx, &params).unwrap(), norms)
    })
    .unwrap();
    let norms = out[0].1.clone();
    assert!(out.iter().all(|(_, n)| *n == norms), "ranks disagree on the global norm");
    (out.into_iter().map(|(r, _)| r).collect(), norms)
}

#[test]
fn sharded_steps_match_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let (reference, ref_norms) = train(1, 1, 1, false, dtype);
        assert!(ref_norms[0] > 0.02 && ref_norms[1] > 0.01, "the bounds clip: {ref_norms:?}");
        let reference = assemble(&reference, 0.0).unwrap();
        for (tp, cp, dp, sp) in [
            (2, 1, 1, false),
            (2, 1, 1, true),
            (1, 2, 1, false),
            (1, 1, 2, false),
            (2, 2, 1, true),
            (2, 1, 2, false),
        ] {
            let what = format!("tp {tp} cp {cp} dp {dp} sp {sp} {dtype:?}");
            let (runs, norms) = train(tp, cp, dp, sp, dtype);
            for (a, b) in norms.iter().zip(&ref_norms) {
                assert!((a - b).abs() <= tol * b, "{what}: norm {a} vs {b}");
            }
            let got = assemble(&runs, 0.0).unwrap_or_else(|e| panic!("{what}: {e}"));
            for (name, r) in &reference {
                let e = norm_rel(&got[name].values, &r.values);
                assert!(e <= tol, "{what}: {name} after two steps differs by {e:e}");
            }
        }
    }
}
