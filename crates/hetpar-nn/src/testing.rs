//! Test support (feature `testing`): snapshot a rank's parameters and gradients, reassemble
//! global tensors from every rank's shards (summing partial gradients over each parameter's
//! reduction axes, checking that replicas agree), and compare runs.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use hetpar_layout::{Axis, Coords, ExpertCoords};

use crate::ctx::ParallelCtx;
use crate::error::Result;
use crate::layers::attention::CpMode;
use crate::models::vit::VitConfig;
use crate::params::{Param, ShardSpec};

/// One parameter of one rank: values and gradient, flattened, in f64.
#[derive(Clone, Debug)]
pub struct ParamSnap {
    /// Global name.
    pub name: String,
    /// Its place in the global tensor.
    pub spec: ShardSpec,
    /// Local values.
    pub values: Vec<f64>,
    /// Local gradient (zeros when the parameter got none).
    pub grad: Vec<f64>,
}

/// What one rank reports: its coordinates, parameters and named outputs.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// World rank.
    pub rank: usize,
    /// Dense coordinates.
    pub coords: Coords,
    /// Expert coordinates.
    pub expert: ExpertCoords,
    /// Parameters and gradients.
    pub params: Vec<ParamSnap>,
    /// Named values (outputs, losses) as the test defines them.
    pub values: BTreeMap<String, Vec<f64>>,
}

/// Flattens a tensor to f64.
pub fn flat(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

/// Snapshots `params` with their gradients from `grads`.
pub fn snapshot(
    ctx: &ParallelCtx,
    params: &[&Param],
    grads: &GradStore,
    values: BTreeMap<String, Vec<f64>>,
) -> Result<RankReport> {
    let params = params
        .iter()
        .map(|p| {
            let values = flat(p.tensor())?;
            let grad = match p.take_grad(grads)? {
                Some(g) => flat(&g)?,
                None => vec![0.0; values.len()],
            };
            Ok(ParamSnap { name: p.name.clone(), spec: p.spec.clone(), values, grad })
        })
        .collect::<Result<_>>()?;
    Ok(RankReport { rank: ctx.rank, coords: ctx.coords, expert: ctx.expert, params, values })
}

/// Snapshots `params` without gradients (their values after training steps, say).
pub fn snapshot_values(ctx: &ParallelCtx, params: &[&Param]) -> Result<RankReport> {
    let params = params
        .iter()
        .map(|p| {
            let values = flat(p.tensor())?;
            let grad = vec![0.0; values.len()];
            Ok(ParamSnap { name: p.name.clone(), spec: p.spec.clone(), values, grad })
        })
        .collect::<Result<_>>()?;
    Ok(RankReport {
        rank: ctx.rank,
        coords: ctx.coords,
        expert: ctx.expert,
        params,
        values: BTreeMap::new(),
    })
}

/// The norm of the difference over the norm of `b` (the parity measure for parameters);
/// 0 when both are zero.
pub fn norm_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    match (n == 0.0, d == 0.0) {
        (true, true) => 0.0,
        (true, false) => f64::INFINITY,
        _ => (d / n).sqrt(),
    }
}

/// A reassembled global parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct Global {
    /// Shape.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f64>,
    /// Gradient, row-major.
    pub grad: Vec<f64>,
}

/// `max |a - b| / max |b|` (the largest error relative to the largest reference value).
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    rel_err_floor(a, b, 1e-300)
}

fn rel_err_floor(a: &[f64], b: &[f64], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let scale = max_abs(b).max(floor);
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

/// Below this fraction of the largest gradient compared, a reference gradient is zero up to
/// rounding (see [`compare_params`]).
pub const ZERO: f64 = 1e-4;

/// Coordinates that identify a reduction group of a parameter: every axis outside its
/// reduction axes.
fn group_key(r: &RankReport, reduce: &[Axis]) -> Vec<usize> {
    if reduce.contains(&Axis::Edp) {
        return vec![r.expert.etp_idx, r.expert.ep_idx, r.expert.pp_idx];
    }
    let c = r.coords;
    [(Axis::Tp, c.tp_idx), (Axis::Cp, c.cp_idx), (Axis::Dp, c.dp_idx), (Axis::Pp, c.pp_idx)]
        .iter()
        .filter(|(a, _)| !reduce.contains(a))
        .map(|&(_, i)| i)
        .collect()
}

/// Reassembles every parameter from all ranks' reports: slices are placed by their split,
/// partial gradients summed within reduction groups, and reduction groups holding the same
/// slice must agree within `tol` (they are replicas).
pub fn assemble(reports: &[RankReport], tol: f64) -> Result<BTreeMap<String, Global>, String> {
    // name -> split offset -> group key -> summed (values, grad, spec)
    type Groups = BTreeMap<Vec<usize>, (Vec<f64>, Vec<f64>, ShardSpec)>;
    let mut by_name: BTreeMap<String, BTreeMap<Option<(usize, usize)>, Groups>> = BTreeMap::new();
    for r in reports {
        for p in &r.params {
            let slice = p.spec.split.map(|s| (s.dim, s.offset));
            let key = group_key(r, &p.spec.reduce);
            let groups = by_name.entry(p.name.clone()).or_default().entry(slice).or_default();
            match groups.get_mut(&key) {
                None => {
                    groups.insert(key, (p.values.clone(), p.grad.clone(), p.spec.clone()));
                }
                Some((values, grad, _)) => {
                    if values != &p.values {
                        return Err(format!(
                            "{}: rank {} holds other values for the same slice",
                            p.name, r.rank
                        ));
                    }
                    grad.iter_mut().zip(&p.grad).for_each(|(g, x)| *g += x);
                }
            }
        }
    }
    // The largest gradient anywhere: replicas of a gradient that is zero up to rounding are
    // compared against it (see `compare_params`).
    let scale = reports
        .iter()
        .flat_map(|r| r.params.iter().flat_map(|p| p.grad.iter()))
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let mut out = BTreeMap::new();
    for (name, slices) in by_name {
        let mut global: Option<Global> = None;
        for (slice, groups) in slices {
            let mut it = groups.values();
            let (values, grad, spec) = it.next().expect("a slice has a holder");
            for (_, other, _) in it {
                let e = rel_err_floor(other, grad, ZERO * scale);
                if e > tol {
                    return Err(format!(
                        "{name}: replicas of slice {slice:?} disagree on the gradient by {e:e}"
                    ));
                }
            }
            let g = global.get_or_insert_with(|| {
                let n = spec.global_shape.iter().product();
                Global {
                    shape: spec.global_shape.clone(),
                    values: vec![f64::NAN; n],
                    grad: vec![f64::NAN; n],
                }
            });
            place(g, spec, values, grad);
        }
        let g = global.expect("a parameter has a slice");
        if g.values.iter().any(|v| v.is_nan()) {
            return Err(format!("{name}: the slices do not cover the global tensor"));
        }
        out.insert(name, g);
    }
    Ok(out)
}

fn place(g: &mut Global, spec: &ShardSpec, values: &[f64], grad: &[f64]) {
    let shape = &spec.global_shape;
    let Some(split) = spec.split else {
        g.values.copy_from_slice(values);
        g.grad.copy_from_slice(grad);
        return;
    };
    let outer: usize = shape[..split.dim].iter().product();
    let inner: usize = shape[split.dim + 1..].iter().product();
    for o in 0..outer {
        for i in 0..split.len {
            let local = (o * split.len + i) * inner;
            let global = (o * shape[split.dim] + split.offset + i) * inner;
            g.values[global..global + inner].copy_from_slice(&values[local..local + inner]);
            g.grad[global..global + inner].copy_from_slice(&grad[local..local + inner]);
        }
    }
}

/// Checks that `sharded` has the same parameters as `reference`, bitwise equal initial
/// values (layout-independent init) and gradients within `tol` relative error.
///
/// Each gradient's error is relative to its own largest reference value. Gradients that are
/// zero in exact arithmetic (an attention key bias shifts every score of a query equally, so
/// softmax ignores it) hold only rounding noise, where a relative error means nothing: when
/// the reference gradient stays below `ZERO` times the largest gradient of the comparison,
/// both runs must stay below that bound instead.
pub fn compare_params(
    reference: &BTreeMap<String, Global>,
    sharded: &BTreeMap<String, Global>,
    tol: f64,
) -> Result<(), String> {
    let (a, b): (Vec<&String>, Vec<&String>) =
        (reference.keys().collect(), sharded.keys().collect());
    if a != b {
        return Err(format!("parameter names differ: reference {a:?}, sharded {b:?}"));
    }
    let global = reference.values().flat_map(|g| g.grad.iter()).fold(0.0f64, |m, x| m.max(x.abs()));
    for (name, r) in reference {
        let s = &sharded[name];
        if r.values != s.values {
            return Err(format!("{name}: initial values differ between layouts"));
        }
        let (ref_max, got_max) = (max_abs(&r.grad), max_abs(&s.grad));
        if ref_max < ZERO * global {
            if got_max >= ZERO * global {
                return Err(format!(
                    "{name}: gradient is zero in the reference (max {ref_max:e}) but reaches {got_max:e}"
                ));
            }
            continue;
        }
        let e = rel_err(&s.grad, &r.grad);
        if e > tol || e.is_nan() {
            return Err(format!("{name}: gradient differs by {e:e} (tolerance {tol:e})"));
        }
    }
    Ok(())
}

/// A ViT small enough for equivalence tests: 16 patches of 16 pixels, 2 layers of width 32.
pub const TINY_VIT: VitConfig = VitConfig {
    image_size: 16,
    patch_size: 4,
    hidden: 32,
    layers: 2,
    heads: 4,
    ffn: 48,
    out_hidden: 24,
    ln_eps: 1e-6,
    cp_mode: CpMode::AllGather,
};

/// A one-rank Llama's logits at the last position of `tokens` (one sequence, no encoder
/// rows): what reference implementations are compared on.
pub fn last_logits(model: &crate::models::llama::Llama, tokens: &[u32]) -> Result<Vec<f32>> {
    let batch = crate::models::llama::LlamaBatch {
        tokens: tokens.to_vec(),
        batch: 1,
        positions: crate::layers::attention::CpPositions::single(tokens.len()),
        boundary: None,
        targets: std::sync::Arc::new(vec![-1; tokens.len()]),
    };
    let (x, _) = model.layers(&model.embed(&batch)?, &batch.positions)?;
    let logits = model.logits(&x)?;
    Ok(logits.narrow(0, tokens.len() - 1, 1)?.flatten_all()?.to_vec1()?)
}
