//! AdamW (Loshchilov and Hutter 2019: Adam's bias-corrected moments, weight decay decoupled
//! from the gradient) and the learning-rate schedule (linear warmup, cosine decay).
//!
//! The update of an element depends only on that element's gradient and state, so every
//! rank updates its own slices and the result equals one rank's update of the whole model.
//! Weight decay applies to matrices and higher (weights, embeddings, convolutions), not to
//! biases and norm scales, as Megatron-LM and HF do by default.

use candle_core::Tensor;
use hetpar_nn::Param;

use crate::error::RuntimeError;
use crate::step::Grads;

type Result<T> = std::result::Result<T, RuntimeError>;

/// Learning rate by step: `warmup` steps rising linearly to `peak` (step 0 takes
/// `peak / warmup`), then a half cosine from `peak` down to `min` at step `total - 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Highest rate.
    pub peak: f64,
    /// Rate at the end of the decay.
    pub min: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// Steps of the run.
    pub total: usize,
}

impl LrSchedule {
    /// The rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup + 1);
        if span == 0 {
            return self.peak;
        }
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// AdamW's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay (times the learning rate).
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// One module's optimizer state on one rank: both moments of every local parameter slice
/// and the steps taken.
#[derive(Debug)]
pub struct AdamState {
    /// First moments, in parameter order.
    pub m: Vec<Tensor>,
    /// Second moments.
    pub v: Vec<Tensor>,
    /// Updates applied so far.
    pub steps: u64,
}

impl AdamState {
    /// Zero moments for `params`.
    pub fn new(params: &[&Param]) -> Result<AdamState> {
        let zeros = || {
            params
                .iter()
                .map(|p| p.tensor().zeros_like())
                .collect::<std::result::Result<Vec<_>, _>>()
        };
        Ok(AdamState { m: zeros()?, v: zeros()?, steps: 0 })
    }

    /// Applies one update to `params` from `grads` scaled by `scale` (the clip factor) at
    /// learning rate `lr`.
    pub fn update(
        &mut self,
        opt: &AdamW,
        params: &[&Param],
        grads: &Grads,
        lr: f64,
        scale: f64,
    ) -> Result<()> {
        self.steps += 1;
        let t = self.steps as i32;
        let (bc1, bc2) = (1.0 - opt.beta1.powi(t), 1.0 - opt.beta2.powi(t));
        for (i, p) in params.iter().enumerate() {
            let g = grads.tensors[i].affine(scale, 0.0)?;
            let m = ((&self.m[i] * opt.beta1)? + (&g * (1.0 - opt.beta1))?)?;
            let v = ((&self.v[i] * opt.beta2)? + (g.sqr()? * (1.0 - opt.beta2))?)?;
            let denom = ((&v / bc2)?.sqrt()? + opt.eps)?;
            let step = ((&m / bc1)? / denom)?;
            let decay = if p.tensor().rank() >= 2 { opt.weight_decay } else { 0.0 };
            let w = p.tensor().affine(1.0 - lr * decay, 0.0)?;
            p.var.set(&(w - (step * lr)?)?)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = LrSchedule { peak: 1.0, min: 0.1, warmup: 4, total: 15 };
        let lr: Vec<f64> = (0..16).map(|i| s.at(i)).collect();
        assert_eq!(&lr[..4], [0.25, 0.5, 0.75, 1.0]);
        assert_eq!(lr[4], 1.0);
        assert!((lr[9] - 0.55).abs() < 1e-12, "{}", lr[9]);
        assert!((lr[14] - 0.1).abs() < 1e-12 && (lr[15] - 0.1).abs() < 1e-12);
        assert!(lr[4..15].windows(2).all(|w| w[1] < w[0]));
        let flat = LrSchedule { peak: 0.5, min: 0.0, warmup: 0, total: 1 };
        assert_eq!(flat.at(0), 0.5);
    }
}
