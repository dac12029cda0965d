//! Parameters: a trainable shard of a named global tensor, with how it maps into the global
//! tensor and over which groups its gradient is summed (SEMANTICS.md section 6).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use hetpar_layout::Axis;

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::init::Init;
use crate::kernels::sink::GradSink;

/// Where a local tensor sits in the global one: `global.narrow(dim, offset, len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The split dimension.
    pub dim: usize,
    /// First global index along it.
    pub offset: usize,
    /// Local length along it.
    pub len: usize,
}

/// How a local parameter relates to its global tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// Shape of the full, unsharded tensor.
    pub global_shape: Vec<usize>,
    /// The slice this rank holds; `None` for the whole tensor.
    pub split: Option<Split>,
    /// Axes whose groups hold partial gradients of the same slice, to be summed: `dp` and
    /// `cp` always (they split tokens), `tp` for tp-replicated parameters under sequence
    /// parallelism, `edp` for experts.
    pub reduce: Vec<Axis>,
}

impl ShardSpec {
    /// Shape of the slice this rank holds.
    pub fn local_shape(&self) -> Vec<usize> {
        let mut shape = self.global_shape.clone();
        if let Some(s) = self.split {
            shape[s.dim] = s.len;
        }
        shape
    }
}

/// A parameter of this rank.
#[derive(Clone, Debug)]
pub struct Param {
    /// Global name (HF-compatible).
    pub name: String,
    /// The local values.
    pub var: Var,
    /// How they map into the global tensor.
    pub spec: ShardSpec,
    /// The gradient the fused linear ops computed for it, outside candle's store (see
    /// [`crate::kernels::sink`]); a clone of the parameter shares it.
    pub sink: GradSink,
}

impl Param {
    /// Creates and initializes the local shard of parameter `name`: element `i` of the global
    /// tensor gets `init.value(seed, name, i)`, whatever the layout.
    pub fn new(
        name: String,
        global_shape: &[usize],
        split: Option<Split>,
        reduce: Vec<Axis>,
        init: Init,
        seed: u64,
        dtype: DType,
    ) -> Result<Param> {
        let spec = ShardSpec { global_shape: global_shape.to_vec(), split, reduce };
        let local_shape = spec.local_shape();
        let count: usize = local_shape.iter().product();
        let strides: Vec<usize> =
            (0..global_shape.len()).map(|d| global_shape[d + 1..].iter().product()).collect();
        let value = init.values(seed, &name);
        let values: Vec<f64> = (0..count)
            .map(|local| {
                // Local row-major index -> global row-major index.
                let mut rest = local;
                let mut global = 0;
                for d in (0..local_shape.len()).rev() {
                    let mut i = rest % local_shape[d];
                    rest /= local_shape[d];
                    if let Some(s) = split
                        && s.dim == d
                    {
                        i += s.offset;
                    }
                    global += i * strides[d];
                }
                value(global as u64)
            })
            .collect();
        let t = Tensor::from_vec(values, local_shape, &Device::Cpu)?.to_dtype(dtype)?;
        Ok(Param { name, var: Var::from_tensor(&t)?, spec, sink: GradSink::new() })
    }

    /// The local tensor.
    pub fn tensor(&self) -> &Tensor {
        self.var.as_tensor()
    }

    /// The gradient a backward left for this parameter: what its sink holds plus what
    /// `store` holds (either may be absent), or `None` when the backward did not reach it.
    /// Takes the sink's part, so each backward's gradient is read once.
    pub fn take_grad(&self, store: &GradStore) -> Result<Option<Tensor>> {
        let sunk = self.sink.take(self.var.shape())?;
        Ok(match (sunk, store.get(self.tensor())) {
            (Some(a), Some(b)) => Some((a + b)?),
            (a, b) => a.or_else(|| b.cloned()),
        })
    }

    /// Whether the values are released (see [`Param::release`]).
    pub fn is_released(&self) -> bool {
        self.var.dims() != self.spec.local_shape().as_slice()
    }

    /// Hands the local values over and keeps an empty placeholder, so the storage goes once
    /// nothing else (an autograd graph) references it; [`Param::restore`] puts values back.
    pub fn release(&mut self) -> Result<Var> {
        let empty = Var::zeros(0, self.var.dtype(), self.var.device())?;
        Ok(std::mem::replace(&mut self.var, empty))
    }

    /// Puts back values of the local shape (what [`Param::release`] handed over).
    pub fn restore(&mut self, var: Var) -> Result<()> {
        let want = self.spec.local_shape();
        if var.dims() != want.as_slice() || var.dtype() != self.var.dtype() {
            return Err(NnError::Input(format!(
                "parameter {}: restoring {:?} {:?} into a {:?} {:?} shard",
                self.name,
                var.dtype(),
                var.dims(),
                self.var.dtype(),
                want
            )));
        }
        self.var = var;
        Ok(())
    }
}

/// Gradient reduction axes of a parameter replicated over `tp` in module `ctx`.
pub fn replicated_reduce(ctx: &ParallelCtx) -> Vec<Axis> {
    let mut v = vec![Axis::Dp, Axis::Cp];
    if ctx.sp() {
        v.push(Axis::Tp);
    }
    v
}

/// Gradient reduction axes of a parameter sharded over `tp`.
pub fn sharded_reduce() -> Vec<Axis> {
    vec![Axis::Dp, Axis::Cp]
}

/// `n` split over `parts` equal pieces; piece `idx`. Panics unless `parts` divides `n`
/// (config validation guarantees it).
pub fn even_split(dim: usize, n: usize, parts: usize, idx: usize) -> Option<Split> {
    assert!(n.is_multiple_of(parts), "{parts} shards do not divide {n}");
    (parts > 1).then(|| Split { dim, offset: idx * n / parts, len: n / parts })
}

/// Something with parameters.
pub trait HasParams {
    /// Every local parameter, in a fixed order.
    fn params(&self) -> Vec<&Param>;
    /// The same parameters, in the same order, to replace their tensors (offload releases
    /// a parameter's storage and restores it later).
    fn params_mut(&mut self) -> Vec<&mut Param>;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use candle_core::{DType, Var};

    use super::{Param, Split};
    use crate::init::Init;

    #[test]
    fn a_released_parameter_takes_back_only_its_own_shape() {
        let split = Some(Split { dim: 0, offset: 2, len: 2 });
        let mut p =
            Param::new("w".into(), &[4, 3], split, Vec::new(), Init::Normal(1.0), 7, DType::F32)
                .unwrap();
        let before = p.tensor().to_vec2::<f32>().unwrap();
        assert!(!p.is_released());
        let values = p.release().unwrap();
        assert!(p.is_released() && p.tensor().elem_count() == 0);
        let wrong = Var::zeros((4, 3), DType::F32, values.device()).unwrap();
        let e = p.restore(wrong).unwrap_err().to_string();
        assert!(e.contains("parameter w: restoring F32 [4, 3] into a F32 [2, 3] shard"), "{e}");
        p.restore(values).unwrap();
        assert!(!p.is_released());
        assert_eq!(p.tensor().to_vec2::<f32>().unwrap(), before);
    }
}
