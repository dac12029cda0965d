//! Collectives on tensors, skipped for groups of one (a tp 1 layer issues no collective).

use std::sync::Arc;

use candle_core::Tensor;

use crate::ctx::Group;
use crate::error::Result;
use crate::ops::{AllReduce, AllReduceGrad, GatherDim, GatherRows, ReduceScatterDim, SplitRows};

/// Megatron's `f`: identity forward, all-reduce of the gradient backward. Marks the entry
/// of a tensor-parallel region whose input is replicated.
pub fn copy_to(g: &Group, x: &Tensor) -> Result<Tensor> {
    Ok(match g.comm() {
        Some(c) => x.contiguous()?.apply_op1(AllReduceGrad(c.clone()))?,
        None => x.clone(),
    })
}

/// Megatron's `g`: all-reduce forward, identity backward. Sums partial results.
pub fn reduce_from(g: &Group, x: &Tensor) -> Result<Tensor> {
    Ok(match g.comm() {
        Some(c) => x.contiguous()?.apply_op1(AllReduce(c.clone()))?,
        None => x.clone(),
    })
}

/// All-gather along `dim` forward, reduce-scatter backward (sequence parallelism's entry).
pub fn gather_dim(g: &Group, x: &Tensor, dim: usize) -> Result<Tensor> {
    Ok(match g.comm() {
        Some(c) => x.contiguous()?.apply_op1(GatherDim { comm: c.clone(), dim })?,
        None => x.clone(),
    })
}

/// Reduce-scatter along `dim` forward, all-gather backward (sequence parallelism's exit).
pub fn reduce_scatter_dim(g: &Group, x: &Tensor, dim: usize) -> Result<Tensor> {
    Ok(match g.comm() {
        Some(c) => x.contiguous()?.apply_op1(ReduceScatterDim { comm: c.clone(), dim })?,
        None => x.clone(),
    })
}

/// Balanced row counts of `n` rows over the group: member `m` gets `floor((m+1)n/k) -
/// floor(mn/k)`.
pub fn balanced_counts(n: usize, k: usize) -> Vec<usize> {
    (0..k).map(|m| (m + 1) * n / k - m * n / k).collect()
}

/// Keeps this member's rows of a replicated tensor (backward: all-gather of the parts).
pub fn split_rows(g: &Group, x: &Tensor) -> Result<Tensor> {
    Ok(match g.comm() {
        Some(c) => {
            let counts = Arc::new(balanced_counts(x.dims()[0], g.size()));
            x.contiguous()?.apply_op1(SplitRows { comm: c.clone(), counts })?
        }
        None => x.clone(),
    })
}

/// Concatenates the members' rows into the replicated tensor [`split_rows`] split
/// (backward: this member's rows of the complete gradient).
pub fn gather_rows(g: &Group, x: &Tensor, total: usize) -> Result<Tensor> {
    Ok(match g.comm() {
        Some(c) => {
            let counts = Arc::new(balanced_counts(total, g.size()));
            x.contiguous()?.apply_op1(GatherRows { comm: c.clone(), counts })?
        }
        None => x.clone(),
    })
}
