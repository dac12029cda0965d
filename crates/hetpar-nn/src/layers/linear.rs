//! Column- and row-parallel linear layers (Megatron; Shoeybi et al. 2019), with sequence
//! parallelism (Korthikanti et al. 2022). Activations are `[batch, seq, features]`.
//!
//! Column-parallel: `W` `[out, in]` split by output rows over `tp`. The input enters through
//! `f` (replicated input) or an all-gather along the sequence (SP). Row-parallel: `W` split
//! by input columns; partial outputs leave through `g` (all-reduce) or a reduce-scatter
//! along the sequence (SP); the bias is added after the reduction.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::ctx::ParallelCtx;
use crate::error::Result;
use crate::init::Init;
use crate::kernels::block::{Projection, TpEdges};
use crate::kernels::linear::{Matmul, linear_bias_gelu_into, linear_bias_into, linear_into};
use crate::kernels::pointwise::{bias_add, gelu_as};
use crate::layers::comm::{copy_to, gather_dim, reduce_from, reduce_scatter_dim};
use crate::params::{HasParams, Param, even_split, replicated_reduce, sharded_reduce};

/// What every layer constructor needs: the rank's context, the init seed, the dtype, and
/// how the linear layers multiply.
#[derive(Clone, Debug)]
pub struct Build {
    /// The module's parallel context.
    pub ctx: Arc<ParallelCtx>,
    /// Initialization seed.
    pub seed: u64,
    /// Parameter dtype.
    pub dtype: DType,
    /// How linear layers multiply (bf16 under `dtype = "bf16"`, with f32 parameters).
    pub matmul: Matmul,
}

impl Build {
    /// Layers in `dtype` that multiply in it.
    pub fn new(ctx: Arc<ParallelCtx>, seed: u64, dtype: DType) -> Build {
        Build { ctx, seed, dtype, matmul: Matmul::Native }
    }

    /// The same, with linear layers multiplying as `matmul` says.
    pub fn with_matmul(self, matmul: Matmul) -> Build {
        Build { matmul, ..self }
    }

    /// A parameter sharded along `dim` over `tp` (or whole at tp 1).
    pub fn tp_sharded(
        &self,
        name: String,
        shape: &[usize],
        dim: usize,
        init: Init,
    ) -> Result<Param> {
        let (tp, idx) = (self.ctx.tp.size(), self.ctx.tp.rank);
        Param::new(
            name,
            shape,
            even_split(dim, shape[dim], tp, idx),
            sharded_reduce(),
            init,
            self.seed,
            self.dtype,
        )
    }

    /// A parameter every tp rank holds whole.
    pub fn replicated(&self, name: String, shape: &[usize], init: Init) -> Result<Param> {
        Param::new(name, shape, None, replicated_reduce(&self.ctx), init, self.seed, self.dtype)
    }
}

/// `x [b, s, in] @ W^T` with `W [out, in]` the parameter `w`, through the fused
/// [`crate::kernels::linear::LinearOp`], multiplying as `how` says; `dW` goes to `w`'s
/// sink.
pub fn matmul_t(how: Matmul, x: &Tensor, w: &Param) -> Result<Tensor> {
    Ok(linear_into(how, x, w.tensor(), &w.sink)?)
}

/// A linear layer with its output features split over `tp`.
#[derive(Debug)]
pub struct ColumnParallel {
    ctx: Arc<ParallelCtx>,
    matmul: Matmul,
    weight: Param,
    bias: Option<Param>,
    bias_detached: bool,
}

impl ColumnParallel {
    /// `name.weight` `[out, in]` (and `name.bias` `[out]`), each rank holding `out / tp` rows.
    pub fn new(
        b: &Build,
        name: &str,
        input: usize,
        output: usize,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let weight =
            b.tp_sharded(format!("{name}.weight"), &[output, input], 0, Init::Normal(std))?;
        let bias = if bias {
            Some(b.tp_sharded(format!("{name}.bias"), &[output], 0, Init::Const(0.0))?)
        } else {
            None
        };
        Ok(ColumnParallel {
            ctx: b.ctx.clone(),
            matmul: b.matmul,
            weight,
            bias,
            bias_detached: false,
        })
    }

    /// The same layer with its bias outside autograd: it is added but gets no gradient.
    pub fn with_detached_bias(self) -> Self {
        ColumnParallel { bias_detached: true, ..self }
    }

    /// `[b, s, in]` (sequence-sharded under SP) to `[b, s_full, out / tp]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.local(&self.input(x)?)
    }

    /// What every rank's shard multiplies: `x` all-gathered over the sequence under SP (a
    /// reduce-scatter of its gradient backward), else `x` itself with its gradient
    /// all-reduced backward (Megatron's `f`), as a node of its own: the composed path (the
    /// attention layer under ring attention; the fused blocks make this gather inside their
    /// node). Column-parallel layers that read one input (q, k and v) share it,
    /// [`Self::local`] on each: one gather and one reduction of the summed gradient, as
    /// Megatron's fused projections, where a [`Self::forward`] each would gather the input
    /// and reduce its gradient once per layer.
    pub fn input(&self, x: &Tensor) -> Result<Tensor> {
        if self.ctx.sp() { gather_dim(&self.ctx.tp, x, 1) } else { copy_to(&self.ctx.tp, x) }
    }

    /// `gelu(forward(x))`, with the GELU fused into the product's node where there is a
    /// bias (the same bits).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        let (w, how, sink) = (self.weight.tensor(), self.matmul, &self.weight.sink);
        let Some(b) = &self.bias else {
            return Ok(gelu_as(how, &self.forward(x)?)?);
        };
        let x = self.input(x)?;
        let b = if self.bias_detached { b.tensor().detach() } else { b.tensor().clone() };
        Ok(linear_bias_gelu_into(how, &x, w, &b, sink)?)
    }

    /// How the layer multiplies.
    pub(crate) fn matmul(&self) -> Matmul {
        self.matmul
    }

    /// The weight and bias as a fused node takes them, with their sinks (a detached bias
    /// without one: it is applied, never trained), and how the layer multiplies.
    pub(crate) fn projection(&self) -> (Projection, Matmul) {
        let bias = self.bias.as_ref().map(|b| {
            let sink = (!self.bias_detached).then(|| b.sink.clone());
            (b.tensor().clone(), sink)
        });
        (
            Projection { weight: (self.weight.tensor().clone(), self.weight.sink.clone()), bias },
            self.matmul,
        )
    }

    /// The local matmul on an already replicated (or gathered) input.
    pub fn local(&self, x: &Tensor) -> Result<Tensor> {
        let (w, how, sink) = (self.weight.tensor(), self.matmul, &self.weight.sink);
        Ok(match &self.bias {
            Some(b) if self.bias_detached => {
                linear_bias_into(how, x, w, &b.tensor().detach(), sink)?
            }
            Some(b) => linear_bias_into(how, x, w, b.tensor(), sink)?,
            None => linear_into(how, x, w, sink)?,
        })
    }
}

impl HasParams for ColumnParallel {
    fn params(&self) -> Vec<&Param> {
        std::iter::once(&self.weight).chain(&self.bias).collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        std::iter::once(&mut self.weight).chain(&mut self.bias).collect()
    }
}

/// A linear layer with its input features split over `tp`.
#[derive(Debug)]
pub struct RowParallel {
    ctx: Arc<ParallelCtx>,
    matmul: Matmul,
    weight: Param,
    bias: Option<Param>,
}

impl RowParallel {
    /// The weight and bias as a fused node takes them, with their sinks, and over `tp` the
    /// node's tensor-parallel edges: the gather (SP) or `f` in front of the block, the
    /// reduce-scatter (SP) or `g` after it, and this layer's bias, added after the
    /// reduction (so the projection has none).
    pub(crate) fn projection(&self) -> (Projection, Option<TpEdges>) {
        let weight = (self.weight.tensor().clone(), self.weight.sink.clone());
        let bias = self.bias.as_ref().map(|b| (b.tensor().clone(), b.sink.clone()));
        match self.ctx.tp.comm() {
            None => {
                let bias = bias.map(|(b, sink)| (b, Some(sink)));
                (Projection { weight, bias }, None)
            }
            Some(comm) => {
                let edges = TpEdges { comm: comm.clone(), sp: self.ctx.sp(), bias };
                (Projection { weight, bias: None }, Some(edges))
            }
        }
    }

    /// `name.weight` `[out, in]`, each rank holding `in / tp` columns; `name.bias` whole.
    pub fn new(
        b: &Build,
        name: &str,
        input: usize,
        output: usize,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let weight =
            b.tp_sharded(format!("{name}.weight"), &[output, input], 1, Init::Normal(std))?;
        let bias = if bias {
            Some(b.replicated(format!("{name}.bias"), &[output], Init::Const(0.0))?)
        } else {
            None
        };
        Ok(RowParallel { ctx: b.ctx.clone(), matmul: b.matmul, weight, bias })
    }

    /// `[b, s_full, in / tp]` to `[b, s, out]` (sequence-sharded under SP).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (w, how, sink) = (self.weight.tensor(), self.matmul, &self.weight.sink);
        if let (None, Some(b)) = (self.ctx.tp.comm(), &self.bias) {
            // One rank: no partial sums to reduce, so the bias joins the product.
            return Ok(linear_bias_into(how, x, w, b.tensor(), sink)?);
        }
        let partial = linear_into(how, x, w, sink)?;
        let y = if self.ctx.sp() {
            reduce_scatter_dim(&self.ctx.tp, &partial, 1)?
        } else {
            reduce_from(&self.ctx.tp, &partial)?
        };
        Ok(match &self.bias {
            Some(b) => bias_add(&y, b.tensor())?,
            None => y,
        })
    }
}

impl HasParams for RowParallel {
    fn params(&self) -> Vec<&Param> {
        std::iter::once(&self.weight).chain(&self.bias).collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        std::iter::once(&mut self.weight).chain(&mut self.bias).collect()
    }
}
