//! Rotary position embedding (Su et al. 2021) in the rotate-half form of HF Llama: the head
//! dim is split into halves `(x1, x2)` and rotated by `theta_i * position`. Positions are
//! global, so a context-parallel rank rotates its own zigzag positions.

use candle_core::{D, DType, Device, Tensor};

use crate::error::Result;

/// Frequencies `theta^(-2i/d)` of a head dim `d`.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    /// For heads of `head_dim` and base `theta`.
    pub fn new(head_dim: usize, theta: f64) -> Rope {
        Rope {
            inv_freq: (0..head_dim)
                .step_by(2)
                .map(|i| 1.0 / theta.powf(i as f64 / head_dim as f64))
                .collect(),
        }
    }

    /// `cos` and `sin` `[positions, head_dim / 2]`.
    pub fn tables(&self, positions: &[usize], dtype: DType) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let angles: Vec<f64> = positions
            .iter()
            .flat_map(|&p| self.inv_freq.iter().map(move |f| p as f64 * f))
            .collect();
        let cos: Vec<f64> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f64> = angles.iter().map(|a| a.sin()).collect();
        let shape = (positions.len(), half);
        Ok((
            Tensor::from_vec(cos, shape, &Device::Cpu)?.to_dtype(dtype)?,
            Tensor::from_vec(sin, shape, &Device::Cpu)?.to_dtype(dtype)?,
        ))
    }

    /// Rotates `x` `[batch, heads, seq, head_dim]` by the tables of its positions.
    pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        let (x1, x2) = (x.narrow(D::Minus1, 0, d / 2)?, x.narrow(D::Minus1, d / 2, d / 2)?);
        let (s, h) = cos.dims2()?;
        let (cos, sin) = (cos.reshape((1, 1, s, h))?, sin.reshape((1, 1, s, h))?);
        let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Ok(Tensor::cat(&[a, b], D::Minus1)?)
    }
}
