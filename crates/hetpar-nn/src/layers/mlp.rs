//! Feed-forward blocks: SwiGLU (Shazeer 2020; Llama) and a GELU MLP (ViT, projector).
//! Up/gate projections are column-parallel, the down projection row-parallel, so the hidden
//! activation never leaves its tp shard.

use candle_core::Tensor;

use crate::error::Result;
use crate::kernels::block::{PreNorm, anchor, gelu_mlp, swiglu_mlp};
use crate::layers::linear::{Build, ColumnParallel, RowParallel};
use crate::layers::norm::Norm;
use crate::params::{HasParams, Param};

/// `down(silu(gate(x)) * up(x))`, HF Llama names `gate_proj`, `up_proj`, `down_proj`.
#[derive(Debug)]
pub struct SwiGlu {
    gate: ColumnParallel,
    up: ColumnParallel,
    down: RowParallel,
}

impl SwiGlu {
    /// Under `name`; `out_std` initializes the down projection.
    pub fn new(
        b: &Build,
        name: &str,
        hidden: usize,
        ffn: usize,
        std: f64,
        out_std: f64,
    ) -> Result<Self> {
        Ok(SwiGlu {
            gate: ColumnParallel::new(b, &format!("{name}.gate_proj"), hidden, ffn, false, std)?,
            up: ColumnParallel::new(b, &format!("{name}.up_proj"), hidden, ffn, false, std)?,
            down: RowParallel::new(b, &format!("{name}.down_proj"), ffn, hidden, false, out_std)?,
        })
    }

    /// `[b, s, hidden]` to `[b, s, hidden]` (sequence-sharded in and out under SP), as one
    /// node ([`swiglu_mlp`]; over `tp` with its collectives inside): the composed layers'
    /// bits.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fused(x, None)
    }

    /// `x + self(norm(x))`, a pre-norm layer's second half, as one node ([`swiglu_mlp`]
    /// with its [`PreNorm`]: the composed half's bits).
    pub fn residual(&self, x: &Tensor, norm: &impl Norm) -> Result<Tensor> {
        self.fused(x, Some(norm.pre_norm()))
    }

    fn fused(&self, x: &Tensor, pre: Option<PreNorm>) -> Result<Tensor> {
        let (gate, how) = self.gate.projection();
        let anchor = anchor(x.dtype())?;
        let (down, tp) = self.down.projection();
        let parts = [gate, self.up.projection().0, down];
        Ok(swiglu_mlp(how, x, &anchor, parts, (pre, tp))?)
    }

    /// The layers composed node by node: the reference [`Self::forward`] keeps the bits of.
    #[cfg(test)]
    pub(super) fn composed(&self, x: &Tensor) -> Result<Tensor> {
        // One gather (or gradient reduction) over `tp` for both projections.
        let x = self.gate.input(x)?;
        let h = crate::kernels::pointwise::swiglu_as(
            self.gate.matmul(),
            &self.gate.local(&x)?,
            &self.up.local(&x)?,
        )?;
        self.down.forward(&h)
    }
}

impl HasParams for SwiGlu {
    fn params(&self) -> Vec<&Param> {
        [self.gate.params(), self.up.params(), self.down.params()].concat()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.gate.params_mut();
        v.extend(self.up.params_mut());
        v.extend(self.down.params_mut());
        v
    }
}

/// `fc2(gelu(fc1(x)))` with biases, HF names `fc1`, `fc2` (or any two names).
#[derive(Debug)]
pub struct GeluMlp {
    fc1: ColumnParallel,
    fc2: RowParallel,
}

impl GeluMlp {
    /// `first` maps `input` to `hidden`, `second` maps `hidden` to `output`.
    pub fn new(
        b: &Build,
        first: &str,
        second: &str,
        dims: (usize, usize, usize),
        std: f64,
        out_std: f64,
    ) -> Result<Self> {
        let (input, hidden, output) = dims;
        Ok(GeluMlp {
            fc1: ColumnParallel::new(b, first, input, hidden, true, std)?,
            fc2: RowParallel::new(b, second, hidden, output, true, out_std)?,
        })
    }

    /// `[b, s, input]` to `[b, s, output]` (sequence-sharded under SP), as one node
    /// ([`gelu_mlp`]; over `tp` with its collectives inside): the composed layers' bits.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fused(x, None)
    }

    /// `x + self(norm(x))` (`input == output`), a pre-norm layer's second half, as one node
    /// ([`gelu_mlp`] with its [`PreNorm`]: the composed half's bits).
    pub fn residual(&self, x: &Tensor, norm: &impl Norm) -> Result<Tensor> {
        self.fused(x, Some(norm.pre_norm()))
    }

    fn fused(&self, x: &Tensor, pre: Option<PreNorm>) -> Result<Tensor> {
        let (fc1, how) = self.fc1.projection();
        let anchor = anchor(x.dtype())?;
        let (fc2, tp) = self.fc2.projection();
        Ok(gelu_mlp(how, x, &anchor, fc1, fc2, (pre, tp))?)
    }

    /// The layers composed node by node: the reference [`Self::forward`] keeps the bits of.
    #[cfg(test)]
    pub(super) fn composed(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward_gelu(x)?)
    }
}

impl HasParams for GeluMlp {
    fn params(&self) -> Vec<&Param> {
        [self.fc1.params(), self.fc2.params()].concat()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.fc1.params_mut();
        v.extend(self.fc2.params_mut());
        v
    }
}
