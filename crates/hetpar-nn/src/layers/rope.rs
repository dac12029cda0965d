//! Rotary position embedding (Su et al. 2021) in the rotate-half form of HF Llama: the head
//! dim is split into halves `(x1, x2)` and rotated by `theta_i * position`. Positions are
//! global, so a context-parallel rank rotates its own zigzag positions. The rotation runs
//! as the fused [`crate::kernels::pointwise::RopeOp`].

use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use crate::error::Result;
use crate::kernels::pointwise::{RopeTables, rope};

/// Frequencies `theta^(-2i/d)` of a head dim `d`, and the tables of the positions last
/// asked for (a step asks for the same ones in every layer).
#[derive(Debug)]
pub struct Rope {
    inv_freq: Vec<f64>,
    last: Mutex<Option<(Vec<usize>, Arc<RopeTables>)>>,
}

impl Rope {
    /// For heads of `head_dim` and base `theta`.
    pub fn new(head_dim: usize, theta: f64) -> Rope {
        Rope {
            inv_freq: (0..head_dim)
                .step_by(2)
                .map(|i| 1.0 / theta.powf(i as f64 / head_dim as f64))
                .collect(),
            last: Mutex::new(None),
        }
    }

    /// `cos` and `sin` of `positions`, `[positions, head_dim / 2]`.
    pub fn tables(&self, positions: &[usize]) -> Arc<RopeTables> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((p, t)) = last.as_ref()
            && p == positions
        {
            return t.clone();
        }
        let angles: Vec<f64> = positions
            .iter()
            .flat_map(|&p| self.inv_freq.iter().map(move |f| p as f64 * f))
            .collect();
        let t = Arc::new(RopeTables {
            half: self.inv_freq.len(),
            cos: angles.iter().map(|a| a.cos()).collect(),
            sin: angles.iter().map(|a| a.sin()).collect(),
        });
        *last = Some((positions.to_vec(), t.clone()));
        t
    }

    /// Rotates `x` `[batch, seq, heads, head_dim]` by the tables of its positions.
    pub fn apply(x: &Tensor, tables: &Arc<RopeTables>) -> Result<Tensor> {
        Ok(rope(x, tables)?)
    }
}
