//! Vocab-parallel embedding (Megatron): the table `[vocab, hidden]` is split by rows over
//! `tp`; each rank looks up the tokens in its range (zeros elsewhere) and the partial
//! embeddings are summed over `tp`: an all-reduce, or a reduce-scatter along the sequence
//! under SP.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::init::Init;
use crate::layers::comm::{reduce_from, reduce_scatter_dim};
use crate::layers::linear::Build;
use crate::params::{HasParams, Param};

/// A token embedding table split by vocabulary rows.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    ctx: Arc<ParallelCtx>,
    weight: Param,
    vocab: usize,
}

impl VocabParallelEmbedding {
    /// `name.weight` `[vocab, hidden]`.
    pub fn new(b: &Build, name: &str, vocab: usize, hidden: usize, std: f64) -> Result<Self> {
        let weight =
            b.tp_sharded(format!("{name}.weight"), &[vocab, hidden], 0, Init::Normal(std))?;
        Ok(VocabParallelEmbedding { ctx: b.ctx.clone(), weight, vocab })
    }

    /// Embeds `tokens` (`[batch, seq]`, the rank's context-parallel positions) into
    /// `[batch, seq, hidden]`, sequence-sharded under SP.
    pub fn forward(&self, tokens: &[u32], batch: usize) -> Result<Tensor> {
        let seq = tokens.len() / batch;
        let (local, _) = self.weight.tensor().dims2()?;
        let start = self.ctx.tp.rank * local;
        let mut ids = Vec::with_capacity(tokens.len());
        let mut keep = Vec::with_capacity(tokens.len());
        for &t in tokens {
            let t = t as usize;
            if t >= self.vocab {
                return Err(NnError::Input(format!(
                    "token id {t} is outside the vocabulary of {}",
                    self.vocab
                )));
            }
            let here = (start..start + local).contains(&t);
            ids.push(if here { (t - start) as u32 } else { 0 });
            keep.push(if here { 1.0 } else { 0.0 });
        }
        let w = self.weight.tensor();
        let n = tokens.len();
        let idx = Tensor::from_vec(ids, n, &Device::Cpu)?;
        let mut e = w.index_select(&idx, 0)?;
        if self.ctx.tp.size() > 1 {
            let keep = Tensor::from_vec(keep, (n, 1), &Device::Cpu)?.to_dtype(w.dtype())?;
            e = e.broadcast_mul(&keep)?;
        }
        let e = e.reshape((batch, seq, w.dims()[1]))?;
        if self.ctx.sp() {
            reduce_scatter_dim(&self.ctx.tp, &e, 1)
        } else {
            reduce_from(&self.ctx.tp, &e)
        }
    }
}

impl HasParams for VocabParallelEmbedding {
    fn params(&self) -> Vec<&Param> {
        vec![&self.weight]
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight]
    }
}
