//! RMSNorm (Zhang and Sennrich 2019) and LayerNorm (Ba et al. 2016) over the last dim,
//! through the fused kernels. Their scales are replicated over `tp`.

use candle_core::Tensor;

use crate::error::Result;
use crate::init::Init;
use crate::kernels::block::PreNorm;
use crate::kernels::pointwise::{layer_norm, rms_norm};
use crate::layers::linear::Build;
use crate::params::{HasParams, Param};

/// A norm in front of a block (pre-norm layers): on its own, or inside the block's fused
/// node as its [`PreNorm`].
pub trait Norm {
    /// Normalizes the last dim.
    fn normalize(&self, x: &Tensor) -> Result<Tensor>;
    /// The norm as a fused block's pre-norm: its weights and their gradients' sinks.
    fn pre_norm(&self) -> PreNorm;
}

/// `x / sqrt(mean(x^2) + eps) * weight`.
#[derive(Debug)]
pub struct RmsNorm {
    weight: Param,
    eps: f64,
}

impl RmsNorm {
    /// `name.weight` `[dim]`, initialized to ones.
    pub fn new(b: &Build, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: b.replicated(format!("{name}.weight"), &[dim], Init::Const(1.0))?,
            eps,
        })
    }

    /// Normalizes the last dim.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, self.weight.tensor(), self.eps)?)
    }
}

impl Norm for RmsNorm {
    fn normalize(&self, x: &Tensor) -> Result<Tensor> {
        self.forward(x)
    }

    fn pre_norm(&self) -> PreNorm {
        let w = &self.weight;
        PreNorm::Rms { weight: (w.tensor().clone(), w.sink.clone()), eps: self.eps }
    }
}

impl HasParams for RmsNorm {
    fn params(&self) -> Vec<&Param> {
        vec![&self.weight]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight]
    }
}

/// `(x - mean) / sqrt(var + eps) * weight + bias`.
#[derive(Debug)]
pub struct LayerNorm {
    weight: Param,
    bias: Param,
    eps: f64,
}

impl LayerNorm {
    /// `name.weight` (ones) and `name.bias` (zeros), `[dim]`.
    pub fn new(b: &Build, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(LayerNorm {
            weight: b.replicated(format!("{name}.weight"), &[dim], Init::Const(1.0))?,
            bias: b.replicated(format!("{name}.bias"), &[dim], Init::Const(0.0))?,
            eps,
        })
    }

    /// Normalizes the last dim.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(layer_norm(x, self.weight.tensor(), self.bias.tensor(), self.eps)?)
    }
}

impl Norm for LayerNorm {
    fn normalize(&self, x: &Tensor) -> Result<Tensor> {
        self.forward(x)
    }

    fn pre_norm(&self) -> PreNorm {
        let (w, b) = (&self.weight, &self.bias);
        PreNorm::Layer {
            weight: (w.tensor().clone(), w.sink.clone()),
            bias: (b.tensor().clone(), b.sink.clone()),
            eps: self.eps,
        }
    }
}

impl HasParams for LayerNorm {
    fn params(&self) -> Vec<&Param> {
        vec![&self.weight, &self.bias]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight, &mut self.bias]
    }
}
