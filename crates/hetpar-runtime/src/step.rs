//! The gradient side of a step (SEMANTICS.md section 6): gradients summed over microbatches,
//! reduced over each parameter's `ShardSpec` axes, checked for NaN and infinity, and one
//! global norm over every module that counts each parameter element once.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Storage, Tensor};
use hetpar_comm::{CommExt, Communicator, ReduceOp};
use hetpar_layout::Axis;
use hetpar_nn::{Group, ParallelCtx, Param};

use crate::error::RuntimeError;

type Result<T> = std::result::Result<T, RuntimeError>;

/// Gradients of one module's local parameters, in the order of its `params()`.
#[derive(Debug)]
pub struct Grads {
    /// One per parameter, its local shape.
    pub tensors: Vec<Tensor>,
    /// Which tensors are still [`Grads::zeros`]'s zeros: the first gradient replaces them.
    fresh: Vec<bool>,
}

impl Grads {
    /// Gradients with these values (none of them fresh zeros).
    pub fn new(tensors: Vec<Tensor>) -> Grads {
        let fresh = vec![false; tensors.len()];
        Grads { tensors, fresh }
    }

    /// Zero gradients for `params`.
    pub fn zeros(params: &[&Param]) -> Result<Grads> {
        let tensors = params
            .iter()
            .map(|p| p.tensor().zeros_like())
            .collect::<std::result::Result<_, _>>()?;
        let fresh = vec![true; params.len()];
        Ok(Grads { tensors, fresh })
    }

    /// Adds the gradients a backward left in `store` and in the parameters' sinks
    /// ([`Param::take_grad`]; a parameter it did not reach adds nothing). The first one a
    /// parameter gets replaces its zeros rather than being added to them: `0 + g` is `g`
    /// (but for the sign of a zero), without a pass over the tensor.
    pub fn accumulate(&mut self, params: &[&Param], store: &GradStore) -> Result<()> {
        for ((g, fresh), p) in self.tensors.iter_mut().zip(&mut self.fresh).zip(params) {
            if let Some(d) = p.take_grad(store)? {
                *g = if *fresh { d.contiguous()? } else { (&*g + d)? };
                *fresh = false;
            }
        }
        Ok(())
    }

    /// The first parameter whose gradient holds a NaN or an infinity.
    pub fn first_nonfinite<'p>(&self, params: &[&'p Param]) -> Result<Option<&'p str>> {
        for (g, p) in self.tensors.iter().zip(params) {
            if !finite(g)? {
                return Ok(Some(&p.name));
            }
        }
        Ok(None)
    }
}

/// Whether every element of `t` is finite: one pass over a contiguous CPU tensor's own
/// storage (no copy); otherwise the sum of absolute values, which a NaN or an infinity makes
/// non-finite.
pub fn finite(t: &Tensor) -> Result<bool> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            match cpu {
                CpuStorage::F32(v) => return Ok(v[start..end].iter().all(|x| x.is_finite())),
                CpuStorage::F64(v) => return Ok(v[start..end].iter().all(|x| x.is_finite())),
                _ => {}
            }
        }
    }
    Ok(t.to_dtype(DType::F64)?.abs()?.sum_all()?.to_scalar::<f64>()?.is_finite())
}

/// The group over which a parameter with reduction `axes` sums its gradient: `dp x cp` for
/// dense parameters, with `tp` under sequence parallelism, `edp` for experts.
fn reduction_group<'a>(ctx: &'a ParallelCtx, axes: &[Axis]) -> Result<&'a Group> {
    let has = |a: Axis| axes.contains(&a);
    Ok(match (has(Axis::Dp), has(Axis::Cp), has(Axis::Tp), has(Axis::Edp)) {
        (true, true, false, false) => &ctx.dp_cp,
        (true, true, true, false) => &ctx.stage,
        (false, false, false, true) => &ctx.edp,
        _ => {
            return Err(RuntimeError::Model(format!(
                "no reduction group for axes {axes:?} in module {}",
                ctx.layout.name()
            )));
        }
    })
}

/// Sums every gradient over its parameter's reduction axes: one all-reduce per group and
/// dtype with the gradients concatenated in parameter order, so every member sums the
/// same buffer in the same order.
pub fn reduce(ctx: &ParallelCtx, params: &[&Param], grads: &mut Grads) -> Result<()> {
    // Buckets: (group ranks, dtype) -> parameter indices, in first-use order.
    let mut buckets: Vec<(&Group, DType, Vec<usize>)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let g = reduction_group(ctx, &p.spec.reduce)?;
        if g.size() == 1 {
            continue;
        }
        let dtype = grads.tensors[i].dtype();
        match buckets.iter_mut().find(|(b, d, _)| b.ranks == g.ranks && *d == dtype) {
            Some((_, _, v)) => v.push(i),
            None => buckets.push((g, dtype, vec![i])),
        }
    }
    for (group, dtype, idx) in buckets {
        let comm = group.comm().expect("a group of more than one has a communicator");
        let flat: Vec<Tensor> = idx
            .iter()
            .map(|&i| grads.tensors[i].flatten_all())
            .collect::<std::result::Result<_, _>>()?;
        let joined = Tensor::cat(&flat, 0)?;
        let summed = match dtype {
            DType::F64 => {
                let mut v = joined.to_vec1::<f64>()?;
                comm.all_reduce(&mut v, ReduceOp::Sum)?;
                Tensor::from_vec(v, joined.shape(), joined.device())?
            }
            DType::F32 => {
                let mut v = joined.to_vec1::<f32>()?;
                comm.all_reduce(&mut v, ReduceOp::Sum)?;
                Tensor::from_vec(v, joined.shape(), joined.device())?
            }
            other => {
                return Err(RuntimeError::Model(format!(
                    "gradients in {other:?} are not reduced; train in f32 or f64"
                )));
            }
        };
        let mut at = 0;
        for &i in &idx {
            let t = &grads.tensors[i];
            let n = t.elem_count();
            grads.tensors[i] = summed.narrow(0, at, n)?.reshape(t.shape())?;
            at += n;
        }
    }
    Ok(())
}

/// Whether this rank counts its copy of `p` in the global norm: after reduction the copies
/// of a slice are equal on every member of its reduction group, and a parameter neither
/// split nor reduced over `tp` is equal on every tp rank too; the lowest of them counts.
fn counts(ctx: &ParallelCtx, p: &Param) -> Result<bool> {
    let first = reduction_group(ctx, &p.spec.reduce)?.rank == 0;
    let tp_copy = p.spec.split.is_none()
        && !p.spec.reduce.contains(&Axis::Tp)
        && !p.spec.reduce.contains(&Axis::Edp);
    Ok(first && (!tp_copy || ctx.tp.rank == 0))
}

/// This rank's share of the squared global gradient norm of one module (reduced
/// gradients): summed over every rank of the job it gives each element once.
pub fn norm_sq_share(ctx: &ParallelCtx, params: &[&Param], grads: &Grads) -> Result<f64> {
    let mut sum = 0.0;
    for (p, g) in params.iter().zip(&grads.tensors) {
        if counts(ctx, p)? {
            sum += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
    }
    Ok(sum)
}

/// The global gradient norm: every rank's shares summed over `world` (every rank of the
/// job, whatever modules it holds).
pub fn global_norm(world: &dyn Communicator, share: f64) -> Result<f64> {
    let mut x = [share];
    world.all_reduce(&mut x, ReduceOp::Sum)?;
    Ok(x[0].sqrt())
}

/// The factor gradients are scaled by so their global norm is at most `max_norm` (1 when
/// it already is, or when clipping is off: `max_norm <= 0`).
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 }
}
