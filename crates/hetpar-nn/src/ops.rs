//! Collectives as autograd operations: candle custom ops whose forward and backward call the
//! communicator (Megatron's `f`/`g` operators and their sequence-parallel relatives, the
//! expert all-to-all, and the vocab-parallel cross-entropy).
//!
//! Each op runs on contiguous f32 or f64 tensors. A group of one never reaches these ops:
//! callers skip them (see [`crate::layers::comm`]), so a tp 1 layer issues no collective.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Error, Layout, Shape, Tensor, WithDType};
use hetpar_comm::{CommExt, Communicator, Element, ReduceOp};

use crate::kernels::{Real, by_real_dtype, max, simd, slice, with_data};

type CResult<T> = candle_core::Result<T>;

fn comm_err(op: &str, e: impl std::fmt::Display) -> Error {
    Error::Msg(format!("{op}: {e}"))
}

/// Runs `f` on the storage as f32 or f64.
macro_rules! by_dtype {
    ($s:expr, $l:expr, $op:expr, |$x:ident : $t:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(_) => {
                type $t = f32;
                let $x = slice::<f32>($s, $l, $op)?;
                $body
            }
            CpuStorage::F64(_) => {
                type $t = f64;
                let $x = slice::<f64>($s, $l, $op)?;
                $body
            }
            other => {
                Err(Error::Msg(format!("{} supports f32 and f64, not {:?}", $op, other.dtype())))
            }
        }
    };
}

fn storage<T: WithDType>(v: Vec<T>) -> CpuStorage {
    T::to_cpu_storage_owned(v)
}

/// `[outer, dim, inner]` split of `shape` around `dim`.
fn split3(shape: &Shape, dim: usize) -> (usize, usize, usize) {
    let d = shape.dims();
    (d[..dim].iter().product(), d[dim], d[dim + 1..].iter().product())
}

/// `g`: all-reduce (sum) in the forward, identity in the backward.
#[derive(Clone, Debug)]
pub struct AllReduce(pub Arc<dyn Communicator>);

/// `f`: identity in the forward, all-reduce (sum) of the gradient in the backward.
#[derive(Clone, Debug)]
pub struct AllReduceGrad(pub Arc<dyn Communicator>);

fn all_reduce<T: WithDType + Element>(c: &dyn Communicator, x: &[T]) -> CResult<Vec<T>> {
    let mut v = x.to_vec();
    c.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| comm_err("all-reduce", e))?;
    Ok(v)
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        "all-reduce"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, l, "all-reduce", |x: T| Ok((
            storage(all_reduce::<T>(self.0.as_ref(), x)?),
            l.shape().clone()
        )))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

impl CustomOp1 for AllReduceGrad {
    fn name(&self) -> &'static str {
        "identity-all-reduce-grad"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, l, "identity", |x: T| Ok((storage::<T>(x.to_vec()), l.shape().clone())))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&AllReduce(self.0.clone()))?))
    }
}

/// All-gather along `dim` (equal parts, concatenated in member order) in the forward,
/// reduce-scatter (sum) along `dim` in the backward: Megatron's sequence-parallel gather.
#[derive(Clone, Debug)]
pub struct GatherDim {
    /// The group.
    pub comm: Arc<dyn Communicator>,
    /// The dimension.
    pub dim: usize,
}

/// Reduce-scatter (sum) along `dim` in the forward, all-gather along `dim` in the backward.
#[derive(Clone, Debug)]
pub struct ReduceScatterDim {
    /// The group.
    pub comm: Arc<dyn Communicator>,
    /// The dimension.
    pub dim: usize,
}

/// [`GatherDim`]'s forward on a slice of `shape`: the parts concatenated along `dim` in
/// member order.
pub(crate) fn gather_dim<T: WithDType + Element>(
    c: &dyn Communicator,
    x: &[T],
    shape: &Shape,
    dim: usize,
) -> CResult<(Vec<T>, Shape)> {
    let n = c.size();
    let (outer, _, _) = split3(shape, dim);
    // Each member's `[d, inner]` run of every outer index lands in its place: `[outer, n * d,
    // inner]` (the local backend copies them there directly).
    let mut out = vec![T::from_f64(0.0); x.len() * n];
    c.all_gather_interleaved(x, &mut out, outer).map_err(|e| comm_err("all-gather", e))?;
    let mut dims = shape.dims().to_vec();
    dims[dim] *= n;
    Ok((out, Shape::from(dims)))
}

/// [`ReduceScatterDim`]'s forward on a slice of `shape`: the members' sums of this member's
/// part along `dim`.
pub(crate) fn reduce_scatter_dim<T: WithDType + Element>(
    c: &dyn Communicator,
    x: &[T],
    shape: &Shape,
    dim: usize,
) -> CResult<(Vec<T>, Shape)> {
    let n = c.size();
    let (outer, d, _) = split3(shape, dim);
    if d % n != 0 {
        return Err(Error::Msg(format!(
            "reduce-scatter along dim {dim} of {shape:?} over {n} ranks: {d} does not divide"
        )));
    }
    let dl = d / n;
    // `x` is `[outer, n, dl * inner]`: member m's block of every outer index, reduced over
    // the members (the local backend reads the blocks in place, others pack them first).
    let mut out = vec![T::from_f64(0.0); x.len() / n];
    c.reduce_scatter_interleaved(x, &mut out, ReduceOp::Sum, outer)
        .map_err(|e| comm_err("reduce-scatter", e))?;
    let mut dims = shape.dims().to_vec();
    dims[dim] = dl;
    Ok((out, Shape::from(dims)))
}

impl CustomOp1 for GatherDim {
    fn name(&self) -> &'static str {
        "all-gather-dim"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, l, "all-gather-dim", |x: T| {
            let (v, shape) = gather_dim::<T>(self.comm.as_ref(), x, l.shape(), self.dim)?;
            Ok((storage(v), shape))
        })
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let op = ReduceScatterDim { comm: self.comm.clone(), dim: self.dim };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

impl CustomOp1 for ReduceScatterDim {
    fn name(&self) -> &'static str {
        "reduce-scatter-dim"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_dtype!(s, l, "reduce-scatter-dim", |x: T| {
            let (v, shape) = reduce_scatter_dim::<T>(self.comm.as_ref(), x, l.shape(), self.dim)?;
            Ok((storage(v), shape))
        })
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let op = GatherDim { comm: self.comm.clone(), dim: self.dim };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

/// All-gather-v of rows (dim 0, `counts[m]` rows from member `m`) in the forward; the
/// backward keeps this member's rows of the (replicated, complete) gradient.
#[derive(Clone, Debug)]
pub struct GatherRows {
    /// The group.
    pub comm: Arc<dyn Communicator>,
    /// Rows per member.
    pub counts: Arc<Vec<usize>>,
}

/// Keeps this member's rows (dim 0) in the forward; all-gathers the gradient's parts in the
/// backward: the split of a replicated tensor whose consumers work on disjoint rows.
#[derive(Clone, Debug)]
pub struct SplitRows {
    /// The group.
    pub comm: Arc<dyn Communicator>,
    /// Rows per member.
    pub counts: Arc<Vec<usize>>,
}

fn row_width(shape: &Shape) -> usize {
    shape.dims()[1..].iter().product()
}

fn own_rows<T: WithDType>(x: &[T], counts: &[usize], me: usize, width: usize) -> Vec<T> {
    let start: usize = counts[..me].iter().sum();
    x[start * width..(start + counts[me]) * width].to_vec()
}

fn gather_rows<T: WithDType + Element>(
    c: &dyn Communicator,
    x: &[T],
    counts: &[usize],
    width: usize,
) -> CResult<Vec<T>> {
    let mut out = vec![T::from_f64(0.0); counts.iter().sum::<usize>() * width];
    let c_el: Vec<usize> = counts.iter().map(|r| r * width).collect();
    c.all_gather_v(x, &mut out, &c_el).map_err(|e| comm_err("all-gather-v rows", e))?;
    Ok(out)
}

impl CustomOp1 for GatherRows {
    fn name(&self) -> &'static str {
        "gather-rows"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let w = row_width(l.shape());
        let mut dims = l.shape().dims().to_vec();
        dims[0] = self.counts.iter().sum();
        by_dtype!(s, l, "gather-rows", |x: T| Ok((
            storage(gather_rows::<T>(self.comm.as_ref(), x, &self.counts, w)?),
            Shape::from(dims)
        )))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let me = self.comm.rank();
        let start: usize = self.counts[..me].iter().sum();
        Ok(Some(grad.narrow(0, start, self.counts[me])?))
    }
}

impl CustomOp1 for SplitRows {
    fn name(&self) -> &'static str {
        "split-rows"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let w = row_width(l.shape());
        let me = self.comm.rank();
        let mut dims = l.shape().dims().to_vec();
        dims[0] = self.counts[me];
        by_dtype!(s, l, "split-rows", |x: T| Ok((
            storage(own_rows::<T>(x, &self.counts, me, w)),
            Shape::from(dims)
        )))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let op = GatherRows { comm: self.comm.clone(), counts: self.counts.clone() };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

/// All-to-all-v of rows: `send[m]` consecutive rows to member `m`, `recv[m]` rows from
/// member `m`; the backward sends the gradients back the same way.
#[derive(Clone, Debug)]
pub struct AllToAllRows {
    /// The group.
    pub comm: Arc<dyn Communicator>,
    /// Rows sent to each member.
    pub send: Arc<Vec<usize>>,
    /// Rows received from each member.
    pub recv: Arc<Vec<usize>>,
}

impl CustomOp1 for AllToAllRows {
    fn name(&self) -> &'static str {
        "all-to-all-rows"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let w = row_width(l.shape());
        let mut dims = l.shape().dims().to_vec();
        dims[0] = self.recv.iter().sum();
        by_dtype!(s, l, "all-to-all-rows", |x: T| {
            let sc: Vec<usize> = self.send.iter().map(|r| r * w).collect();
            let rc: Vec<usize> = self.recv.iter().map(|r| r * w).collect();
            let mut out = vec![T::from_f64(0.0); rc.iter().sum()];
            self.comm
                .all_to_all_v(x, &sc, &mut out, &rc)
                .map_err(|e| comm_err("all-to-all-v rows", e))?;
            Ok((storage(out), Shape::from(dims)))
        })
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let back = AllToAllRows {
            comm: self.comm.clone(),
            send: self.recv.clone(),
            recv: self.send.clone(),
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// Cross-entropy over vocabulary-sharded logits `[tokens, vocab / tp]` (Megatron's
/// vocab-parallel cross-entropy): the max, the exponential sum and the target logit are
/// reduced over the group, full logits are never gathered. Output: the loss of each token
/// (0 where the target is negative: ignored). Backward: `softmax - onehot`, per shard.
#[derive(Debug)]
pub struct VocabCrossEntropy {
    /// The tensor-parallel group (None at tp 1).
    pub comm: Option<Arc<dyn Communicator>>,
    /// Target token of each row, global vocabulary id; negative means ignored.
    pub targets: Arc<Vec<i64>>,
    /// First vocabulary id of this shard.
    pub vocab_start: usize,
    /// Per-row (max, sum of exp) from the forward, for the backward.
    stats: Mutex<Vec<(f64, f64)>>,
}

impl VocabCrossEntropy {
    /// The op for `targets` on the shard starting at `vocab_start`.
    pub fn new(
        comm: Option<Arc<dyn Communicator>>,
        targets: Arc<Vec<i64>>,
        vocab_start: usize,
    ) -> Self {
        VocabCrossEntropy { comm, targets, vocab_start, stats: Mutex::new(Vec::new()) }
    }

    fn reduce(&self, v: &mut [f64], op: ReduceOp) -> CResult<()> {
        match &self.comm {
            Some(c) => c.all_reduce(v, op).map_err(|e| comm_err("vocab cross-entropy", e)),
            None => Ok(()),
        }
    }

    fn forward<T: Real>(&self, x: &[T], shape: &Shape) -> CResult<Vec<T>> {
        let (n, v) = shape.dims2()?;
        if n != self.targets.len() {
            return Err(Error::Msg(format!(
                "cross-entropy: {n} rows of logits for {} targets",
                self.targets.len()
            )));
        }
        let row = |i: usize| &x[i * v..(i + 1) * v];
        // Plain loops inside `fast!`: an iterator's `collect` runs out of line, compiled for
        // the baseline target, where the exponential's fused multiply-adds are library calls.
        let mut row_max = vec![0.0f64; n];
        simd::fast!({
            for (i, m) in row_max.iter_mut().enumerate() {
                *m = max(row(i)).to_f64();
            }
        });
        self.reduce(&mut row_max, ReduceOp::Max)?;
        // `e^(x - max)` in the element type (f32 through the correctly rounding exp), summed
        // in f64.
        let mut sum = vec![0.0f64; n];
        simd::fast!({
            let mut e = vec![T::ZERO; v];
            for (i, s) in sum.iter_mut().enumerate() {
                let m = T::from_f64(row_max[i]);
                for (d, &a) in e.iter_mut().zip(row(i)) {
                    *d = a - m;
                }
                T::exp_in_place(&mut e);
                *s = sum_f64(&e);
            }
        });
        self.reduce(&mut sum, ReduceOp::Sum)?;
        let local = self.vocab_start..self.vocab_start + v;
        let mut target: Vec<f64> = (0..n)
            .map(|i| {
                let t = self.targets[i];
                if t >= 0 && local.contains(&(t as usize)) {
                    row(i)[t as usize - self.vocab_start].to_f64()
                } else {
                    0.0
                }
            })
            .collect();
        self.reduce(&mut target, ReduceOp::Sum)?;
        let loss = (0..n)
            .map(|i| {
                if self.targets[i] < 0 {
                    T::from_f64(0.0)
                } else {
                    T::from_f64(sum[i].ln() + row_max[i] - target[i])
                }
            })
            .collect();
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) =
            row_max.into_iter().zip(sum).collect();
        Ok(loss)
    }

    /// `(softmax - onehot) * g` of each row with a target, from the forward's statistics.
    #[inline(always)]
    fn logits_grad<T: Real>(&self, x: &[T], stats: &[(f64, f64)], g: &[f64], v: usize) -> Vec<T> {
        let mut out = vec![T::ZERO; x.len()];
        for (i, (o, xr)) in out.chunks_exact_mut(v).zip(x.chunks_exact(v)).enumerate() {
            let t = self.targets[i];
            if t < 0 {
                continue;
            }
            let (max, sum) = stats[i];
            let (m, scale) = (T::from_f64(max), T::from_f64(g[i] / sum));
            for (d, &a) in o.iter_mut().zip(xr) {
                *d = a - m;
            }
            T::exp_in_place(o);
            for d in o.iter_mut() {
                *d *= scale;
            }
            let t = t as usize;
            if (self.vocab_start..self.vocab_start + v).contains(&t) {
                o[t - self.vocab_start] -= T::from_f64(g[i]);
            }
        }
        out
    }
}

/// `sum a_i` in f64 with eight partial sums (vectorizes; a fixed order).
#[inline(always)]
fn sum_f64<T: Real>(a: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let c = a.chunks_exact(8);
    let tail: f64 = c.remainder().iter().map(|x| x.to_f64()).sum();
    for x in c {
        for l in 0..8 {
            acc[l] += x[l].to_f64();
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

impl CustomOp1 for VocabCrossEntropy {
    fn name(&self) -> &'static str {
        "vocab-parallel-cross-entropy"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let n = l.shape().dims()[0];
        by_dtype!(s, l, "cross-entropy", |x: T| Ok((
            storage(self.forward::<T>(x, l.shape())?),
            Shape::from(n)
        )))
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let (n, v) = arg.dims2()?;
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let g: Vec<f64> = grad.to_dtype(candle_core::DType::F64)?.to_vec1()?;
        fn run<T: Real>(
            op: &VocabCrossEntropy,
            arg: &Tensor,
            stats: &[(f64, f64)],
            g: &[f64],
            (n, v): (usize, usize),
        ) -> CResult<Tensor> {
            let out = with_data::<T, _>(arg, "cross-entropy backward", |x| {
                Ok(simd::fast!(op.logits_grad(x, stats, g, v)))
            })?;
            Tensor::from_vec(out, (n, v), arg.device())
        }
        Ok(Some(by_real_dtype!(arg.dtype(), "cross-entropy", |T| run::<T>(
            self,
            arg,
            &stats,
            &g,
            (n, v)
        ))?))
    }
}

/// One step of a ring: sends this tensor to the next member and receives the previous
/// member's (equal shapes). The backward sends the gradient the other way round.
#[derive(Clone, Debug)]
pub struct RingShift {
    /// The ring.
    pub comm: Arc<dyn Communicator>,
    /// `+1`: send to the next member; `-1`: to the previous one.
    pub forward: bool,
}

const RING_TAG: u32 = 0x5249;

impl CustomOp1 for RingShift {
    fn name(&self) -> &'static str {
        "ring-shift"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (n, me) = (self.comm.size(), self.comm.rank());
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let (to, from) = if self.forward { (next, prev) } else { (prev, next) };
        by_dtype!(s, l, "ring-shift", |x: T| {
            let mut out = vec![T::from_f64(0.0); x.len()];
            self.comm
                .send_recv(x, to, RING_TAG, &mut out, from, RING_TAG)
                .map_err(|e| comm_err("ring shift", e))?;
            Ok((storage(out), l.shape().clone()))
        })
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let back = RingShift { comm: self.comm.clone(), forward: !self.forward };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}
