//! The vocab-parallel cross-entropy over logits sharded by vocabulary (never gathered).

use std::sync::Arc;

use candle_core::Tensor;

use crate::ctx::ParallelCtx;
use crate::error::Result;
use crate::ops::VocabCrossEntropy;

/// Per-token cross-entropy `[tokens]` of `logits` `[tokens, vocab / tp]` (this rank's
/// vocabulary shard) against `targets` (global ids; negative means ignored, loss 0).
pub fn cross_entropy(ctx: &ParallelCtx, logits: &Tensor, targets: Arc<Vec<i64>>) -> Result<Tensor> {
    let local = logits.dims2()?.1;
    let op = VocabCrossEntropy::new(ctx.tp.comm().cloned(), targets, ctx.tp.rank * local);
    Ok(logits.contiguous()?.apply_op1(op)?)
}
