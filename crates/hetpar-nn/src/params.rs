//! Parameters: a trainable shard of a named global tensor, with how it maps into the global
//! tensor and over which groups its gradient is summed (SEMANTICS.md section 6).

use candle_core::{DType, Device, Tensor, Var};
use hetpar_layout::Axis;

use crate::ctx::ParallelCtx;
use crate::error::Result;
use crate::init::Init;

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

/// A parameter of this rank.
#[derive(Clone, Debug)]
pub struct Param {
    /// Global name (HF-compatible).
    pub name: String,
    /// The local values.
    pub var: Var,
    /// How they map into the global tensor.
    pub spec: ShardSpec,
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
        let local_shape: Vec<usize> = global_shape
            .iter()
            .enumerate()
            .map(|(d, &n)| match split {
                Some(s) if s.dim == d => s.len,
                _ => n,
            })
            .collect();
        let count: usize = local_shape.iter().product();
        let strides: Vec<usize> =
            (0..global_shape.len()).map(|d| global_shape[d + 1..].iter().product()).collect();
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
                init.value(seed, &name, global as u64)
            })
            .collect();
        let t = Tensor::from_vec(values, local_shape, &Device::Cpu)?.to_dtype(dtype)?;
        Ok(Param {
            name,
            var: Var::from_tensor(&t)?,
            spec: ShardSpec { global_shape: global_shape.to_vec(), split, reduce },
        })
    }

    /// The local tensor.
    pub fn tensor(&self) -> &Tensor {
        self.var.as_tensor()
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
}
