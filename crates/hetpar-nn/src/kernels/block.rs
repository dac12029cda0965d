//! A self-attention block as one autograd node: the q, k and v projections, the rotary
//! embedding of q and k where the model has one, the attention core and the output
//! projection; and an MLP (GELU or SwiGLU), likewise. On one rank, or over `tp` with this
//! rank's heads or FFN columns and the tensor-parallel collectives inside the node
//! ([`TpEdges`]); the attention block also under context parallelism by all-gather, every
//! cp rank's keys and values gathered inside the node after the rotation (their gradients
//! reduce-scattered back), as the composed layer gathers them.
//!
//! Composed, the block is seven nodes between its input and output (three projections,
//! three head reshapes, the attention core, a reshape and the output projection), and
//! candle's backward zero-fills the gradient of every input of every node and adds into
//! it: about eight fills and ten full passes over `[tokens, hidden]`-sized tensors per block
//! and step that no arithmetic needs (the input's gradient alone is a fill and three adds,
//! one per projection). Here the forward keeps q, k, v, the attention's output and its
//! log-sum-exps (and, for a short bidirectional sequence, the attention core keeps its
//! probabilities: [`FlashAttention::keeps_probabilities`]), and the backward runs the same
//! kernels in the same order as the composed nodes' backwards: the output projection's
//! ([`backward`]), the attention core's, then each projection's, summing the input's three
//! gradients in the order candle's backward visits them; the weights' and trained biases'
//! gradients go to their sinks. The results
//! are the composed block's bits (zeros aside: candle's store turns `-0` into `0`).
//!
//! Given its pre-norm ([`PreNorm`]), either block is the node `x + block(norm(x))`, the
//! residual layer's half: composed, the norm, the block and the residual add are three
//! nodes, and candle's backward gives the norm's output, the block's output and the
//! layer's input a zero-filled gradient each and adds into them (the input twice): three
//! fills and four adds over `[tokens, hidden]` per half, where the one node leaves one
//! fill and one add (its input's) and a sum of its own, in place. The node keeps the
//! norm's output for the backward, and sums the input's gradient as candle's backward
//! does, the residual's part first, then the norm's; the norm's weights' gradients go to
//! their sinks. The results are again the composed layer's bits (zeros aside).
//!
//! Over `tp` the composed layers add two more nodes: the gather of the (normed) input
//! along the sequence under SP (or Megatron's `f`) and the reduce-scatter (or all-reduce,
//! `g`) of the partial output, then the row-parallel bias add; each is an edge of
//! `[tokens, hidden]` candle fills and adds into. The node calls the same collectives on
//! the same data in the same order, forward and backward, keeps the gathered input for
//! the backward as the composed graph does, and adds the bias after the reduction, so the
//! bits are again the composed layers'.
//!
//! The weights are not inputs of the node (a custom op takes at most three); an anchor, a
//! variable the caller passes ([`anchor`]), makes candle run the backward whenever the
//! block trains, and gets no gradient from it. It is an empty variable of its own, not one
//! of the weights: candle holds its inputs' storage locks while the op runs, and the op
//! reads the weights' storage.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{CpuStorage, CustomOp2, Device, Error, Layout, Shape, Tensor};
use hetpar_comm::{CommExt, Communicator, ReduceOp};

use super::attention::{Dims, FlashAttention};
use super::linear::{Matmul, backward, biased};
use super::pointwise::{
    BiasAddOp, GeluOp, LayerNormOp, NormalCdf, RmsNormOp, RopeOp, RopeTables, SwiGluOp,
};
use super::sink::GradSink;
use super::{Anchored, CResult, Real, by_real, kept, saved_state, simd, slice, with_data};
use crate::ops;

/// One projection: its weight `[out, in]` with the sink its gradient goes to, and its bias
/// `[out]` with its sink (`None`: applied but never trained, as the key bias).
#[derive(Clone, Debug)]
pub struct Projection {
    /// The weight and its sink.
    pub weight: (Tensor, GradSink),
    /// The bias and, when it trains, its sink.
    pub bias: Option<(Tensor, Option<GradSink>)>,
}

/// The four projections of a block.
#[derive(Clone, Debug)]
pub struct BlockWeights {
    /// Queries: `[heads * d, hidden]`.
    pub q: Projection,
    /// Keys: `[kv_heads * d, hidden]`.
    pub k: Projection,
    /// Values: `[kv_heads * d, hidden]`.
    pub v: Projection,
    /// Output: `[hidden, heads * d]`.
    pub o: Projection,
}

/// The norm in front of a block, which makes the block's node `x + block(norm(x))`: its
/// weights, each with the sink its gradient goes to (so they must be the parameters'
/// `Var`s: a tensor computed from one would get no gradient).
#[derive(Clone, Debug)]
pub enum PreNorm {
    /// LayerNorm's weight and bias, and the epsilon added to the variance.
    Layer {
        /// The weight and its sink.
        weight: (Tensor, GradSink),
        /// The bias and its sink.
        bias: (Tensor, GradSink),
        /// Added to the variance.
        eps: f64,
    },
    /// RMSNorm's weight, and the epsilon added to the mean square.
    Rms {
        /// The weight and its sink.
        weight: (Tensor, GradSink),
        /// Added to the mean square.
        eps: f64,
    },
}

/// The tensor-parallel edges of a block whose weights are this rank's shards (Megatron's
/// column-parallel projections in, a row-parallel one out; Shoeybi et al. 2019): the input
/// enters through an all-gather along the sequence under SP (its gradient reduce-scattered
/// back; Korthikanti et al. 2022) or as it is (its gradient all-reduced, Megatron's `f`),
/// the block's partial output leaves through a reduce-scatter along the sequence under SP
/// or an all-reduce (`g`), and the row-parallel layer's bias, which every rank holds whole,
/// is added after the reduction. The collectives are the composed layers' calls on the
/// same data (`crate::ops`), so the node keeps their bits.
#[derive(Clone, Debug)]
pub struct TpEdges {
    /// The tensor-parallel group.
    pub comm: Arc<dyn Communicator>,
    /// Sequence parallelism: the input and output are this rank's part of the sequence
    /// (`[b, s / tp, ..]`).
    pub sp: bool,
    /// The output's bias and its sink (the row-parallel layer's; the block's own output
    /// projection then has none).
    pub bias: Option<(Tensor, GradSink)>,
}

/// A block's tensor-parallel edges, and its gathered input from the forward (under SP).
#[derive(Debug)]
struct Tp {
    edges: TpEdges,
    gathered: Mutex<Option<Tensor>>,
}

impl Tp {
    fn new(edges: Option<TpEdges>) -> Option<Tp> {
        edges.map(|edges| Tp { edges, gathered: Mutex::new(None) })
    }

    /// The shape the block sees: `shape` with its sequence gathered under SP.
    fn whole(&self, shape: &Shape) -> CResult<Shape> {
        let mut dims = shape.dims().to_vec();
        if self.edges.sp {
            if dims.len() != 3 {
                return Err(Error::Msg(format!(
                    "tensor-parallel block: a sequence-parallel input is [b, s, h], not {shape:?}"
                )));
            }
            dims[1] *= self.edges.comm.size();
        }
        Ok(Shape::from(dims))
    }

    /// `shape` with its last dim holding `len` elements in all.
    fn rows_of(shape: &Shape, len: usize) -> Shape {
        let mut dims = shape.dims().to_vec();
        let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
        if let Some(last) = dims.last_mut() {
            *last = len.checked_div(rows).unwrap_or(0);
        }
        Shape::from(dims)
    }

    /// The bias and its sink, after checking that the bias is as wide as the rows of an
    /// output (or output gradient) of `len` elements on `shape`'s rows; `None` without one.
    fn bias(&self, shape: &Shape, len: usize, op: &str) -> CResult<Option<&(Tensor, GradSink)>> {
        let Some(bias) = &self.edges.bias else { return Ok(None) };
        let (n, out) = (bias.0.dims1()?, Self::rows_of(shape, len));
        if out.dims().last() != Some(&n) || len != out.elem_count() {
            return Err(Error::Msg(format!(
                "{op}: a bias of {n} for {len} elements on rows of {shape:?}"
            )));
        }
        Ok(Some(bias))
    }

    /// Sums `v` over the group in place (Megatron's `g` forward, `f` backward).
    fn all_reduce<T: Real>(&self, v: &mut [T], op: &str) -> CResult<()> {
        let c = self.edges.comm.as_ref();
        c.all_reduce(v, ReduceOp::Sum).map_err(|e| Error::Msg(format!("{op}: {e}")))
    }

    /// `reduce(block(gather(x))) + bias` on `x` of `shape`; `block` maps the (gathered)
    /// input of its shape to this rank's partial output.
    fn forward<T: Real>(
        &self,
        x: &[T],
        shape: &Shape,
        block: impl FnOnce(&[T], &Shape) -> CResult<Vec<T>>,
    ) -> CResult<Vec<T>> {
        let op = "tensor-parallel block";
        let c = self.edges.comm.as_ref();
        let mut y = if self.edges.sp {
            let whole = self.whole(shape)?;
            let (g, _) = ops::gather_dim(c, x, shape, 1)?;
            let part = block(&g, &whole)?;
            *saved_state(&self.gathered, op)? = Some(kept(g)?);
            ops::reduce_scatter_dim(c, &part, &Self::rows_of(&whole, part.len()), 1)?.0
        } else {
            let mut part = block(x, shape)?;
            self.all_reduce(&mut part, op)?;
            part
        };
        if let Some((b, _)) = self.bias(shape, y.len(), op)? {
            with_data::<T, _>(b, op, |b| {
                simd::fast!(BiasAddOp::add_rows(&mut y, b));
                Ok(())
            })?;
        }
        Ok(y)
    }

    /// `x`'s gradient from the output's `dy`, where `block(input, shape, dy)` maps the
    /// (gathered) input of its shape and the (gathered) output gradient to the input's
    /// partial gradient; the bias's gradient goes to its sink. In the order of the composed
    /// layers' backward: the bias, the output's collective, the block, the input's.
    fn backward<T: Real>(
        &self,
        x: &[T],
        shape: &Shape,
        dy: &[T],
        block: impl FnOnce(&[T], &Shape, &[T]) -> CResult<Vec<T>>,
    ) -> CResult<Vec<T>> {
        let op = "tensor-parallel block backward";
        let c = self.edges.comm.as_ref();
        if let Some((b, sink)) = self.bias(shape, dy.len(), op)? {
            let n = b.dims1()?;
            sink.add(simd::fast!(BiasAddOp::bias_grad(dy, n)))?;
        }
        if !self.edges.sp {
            let mut dx = block(x, shape, dy)?;
            self.all_reduce(&mut dx, op)?;
            return Ok(dx);
        }
        let whole = self.whole(shape)?;
        let gathered = saved_state(&self.gathered, op)?
            .clone()
            .ok_or_else(|| Error::Msg(format!("{op}: backward without its forward")))?;
        let (dy, _) = ops::gather_dim(c, dy, &Self::rows_of(shape, dy.len()), 1)?;
        let dg = with_data::<T, _>(&gathered, op, |g| block(g, &whole, &dy))?;
        Ok(ops::reduce_scatter_dim(c, &dg, &whole, 1)?.0)
    }
}

/// Runs a block's node forward on `x` of `shape`: `block` (on its input and that input's
/// shape) inside the tensor-parallel edges where there are some, inside the pre-norm and
/// residual where there is one.
fn framed_forward<T: Real>(
    residual: Option<&Residual>,
    tp: Option<&Tp>,
    x: &[T],
    shape: &Shape,
    block: impl FnOnce(&[T], &Shape) -> CResult<Vec<T>>,
) -> CResult<Vec<T>> {
    let inner = |n: &[T]| match tp {
        None => block(n, shape),
        Some(tp) => tp.forward(n, shape, block),
    };
    match residual {
        None => inner(x),
        Some(r) => r.forward(x, shape.dims().last().copied().unwrap_or(0), inner),
    }
}

/// The node's backward to [`framed_forward`]: `x`'s gradient from the output's `dy`, where
/// `block(input, shape, dy)` gives the block's input's gradient.
fn framed_backward<T: Real>(
    residual: Option<&Residual>,
    tp: Option<&Tp>,
    x: &[T],
    shape: &Shape,
    dy: &[T],
    block: impl FnOnce(&[T], &Shape, &[T]) -> CResult<Vec<T>>,
) -> CResult<Vec<T>> {
    let inner = |n: &[T], dy: &[T]| match tp {
        None => block(n, shape, dy),
        Some(tp) => tp.backward(n, shape, dy, block),
    };
    match residual {
        None => inner(x, dy),
        Some(r) => r.backward(x, dy, shape.dims().last().copied().unwrap_or(0), inner),
    }
}

/// A block's pre-norm and residual, and the norm's output from the forward.
#[derive(Debug)]
struct Residual {
    norm: PreNorm,
    normed: Mutex<Option<Tensor>>,
}

impl Residual {
    fn new(norm: Option<PreNorm>) -> Option<Residual> {
        norm.map(|norm| Residual { norm, normed: Mutex::new(None) })
    }

    /// Checks that the norm (and a LayerNorm's bias) is as wide as the input's rows of
    /// `hidden`, `len` elements in all.
    fn check(&self, len: usize, hidden: usize) -> CResult<()> {
        let (w, bias) = match &self.norm {
            PreNorm::Layer { weight, bias, .. } => (&weight.0, Some(&bias.0)),
            PreNorm::Rms { weight, .. } => (&weight.0, None),
        };
        let h = w.dims1()?;
        if h != hidden || h == 0 || !len.is_multiple_of(h) || bias.is_some_and(|b| b.dims() != [h])
        {
            return Err(Error::Msg(format!(
                "pre-norm block: norm weight {:?} (bias {:?}) for rows of {hidden} ({len} \
                 elements)",
                w.shape(),
                bias.map(|b| b.shape())
            )));
        }
        Ok(())
    }

    /// `x + block(norm(x))` on rows of `h`, keeping `norm(x)`.
    fn forward<T: Real>(
        &self,
        x: &[T],
        h: usize,
        block: impl FnOnce(&[T]) -> CResult<Vec<T>>,
    ) -> CResult<Vec<T>> {
        let op = "pre-norm block";
        self.check(x.len(), h)?;
        let n = match &self.norm {
            PreNorm::Layer { weight, bias, eps } => with_data::<T, _>(&weight.0, op, |w| {
                with_data::<T, _>(&bias.0, op, |b| {
                    Ok(simd::fast!(LayerNormOp { eps: *eps }.forward(x, w, b, h)))
                })
            })?,
            PreNorm::Rms { weight, eps } => with_data::<T, _>(&weight.0, op, |w| {
                Ok(simd::fast!(RmsNormOp { eps: *eps }.forward(x, w, h)))
            })?,
        };
        let mut y = block(&n)?;
        if y.len() != x.len() {
            return Err(Error::Msg(format!(
                "{op}: an output of {} elements for an input of {}",
                y.len(),
                x.len()
            )));
        }
        // The residual add `x + block`, as candle's add computes it.
        simd::fast!(for (a, &v) in y.iter_mut().zip(x) {
            *a = v + *a;
        });
        *saved_state(&self.normed, op)? = Some(kept(n)?);
        Ok(y)
    }

    /// `x`'s gradient from the output's `dy`, where `block(normed, dy)` gives the norm
    /// output's gradient: `dy + norm'(x)^T block'`, summed in the order of candle's
    /// backward (the residual add reaches `x` first). The norm's weights' gradients go to
    /// their sinks.
    fn backward<T: Real>(
        &self,
        x: &[T],
        dy: &[T],
        h: usize,
        block: impl FnOnce(&[T], &[T]) -> CResult<Vec<T>>,
    ) -> CResult<Vec<T>> {
        let op = "pre-norm block backward";
        self.check(x.len(), h)?;
        let wrong = |what: &str, n: usize| {
            Error::Msg(format!("{op}: {what} of {n} elements for an input of {}", x.len()))
        };
        if dy.len() != x.len() {
            return Err(wrong("an output gradient", dy.len()));
        }
        let normed = saved_state(&self.normed, op)?
            .clone()
            .ok_or_else(|| Error::Msg("pre-norm block: backward without its forward".into()))?;
        let dn = with_data::<T, _>(&normed, op, |n| block(n, dy))?;
        if dn.len() != x.len() {
            return Err(wrong("a norm output gradient", dn.len()));
        }
        let mut dx = match &self.norm {
            PreNorm::Layer { weight, bias, eps } => {
                let [dx, dw, db] = with_data::<T, _>(&weight.0, op, |w| {
                    Ok(simd::fast!(LayerNormOp { eps: *eps }.backward(x, w, &dn, h)))
                })?;
                weight.1.add(dw)?;
                bias.1.add(db)?;
                dx
            }
            PreNorm::Rms { weight, eps } => {
                let (dx, dw) = with_data::<T, _>(&weight.0, op, |w| {
                    Ok(simd::fast!(RmsNormOp { eps: *eps }.backward(x, w, &dn, h)))
                })?;
                weight.1.add(dw)?;
                dx
            }
        };
        simd::fast!(for (d, &g) in dx.iter_mut().zip(dy) {
            *d = g + *d;
        });
        Ok(dx)
    }
}

/// What the forward keeps for the backward.
#[derive(Debug)]
struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    att: Tensor,
    lse: Vec<f64>,
}

#[derive(Debug)]
struct AttentionBlockOp {
    how: Matmul,
    weights: BlockWeights,
    /// Query and key/value heads.
    heads: (usize, usize),
    /// The rotary tables of the sequence's positions, if q and k are rotated.
    rope: Option<Arc<RopeTables>>,
    attention: FlashAttention,
    saved: Mutex<Option<Saved>>,
    /// The pre-norm and residual, where the node is the layer's half.
    residual: Option<Residual>,
    /// The tensor-parallel edges, where the weights are shards.
    tp: Option<Tp>,
    /// The context-parallel group whose keys and values every rank attends to, gathered
    /// along the sequence after the rotation (`CpMode::AllGather`; their gradients
    /// reduce-scattered back), or `None` without context parallelism.
    cp: Option<Arc<dyn Communicator>>,
}

/// `(rows, in, out)` of `p` on `rows` rows.
fn proj_dims(p: &Projection, rows: usize) -> CResult<(usize, usize, usize)> {
    let (out, inner) = p.weight.0.dims2()?;
    Ok((rows, inner, out))
}

/// `input @ w^T + b` on `rows` rows, as [`super::linear::LinearBiasOp`] computes it.
fn project<T: Real>(how: Matmul, p: &Projection, input: &[T], rows: usize) -> CResult<Vec<T>> {
    let op = "fused block";
    let dims = proj_dims(p, rows)?;
    with_data::<T, _>(&p.weight.0, op, |w| match &p.bias {
        Some((b, _)) => with_data::<T, _>(b, op, |b| biased(how, input, w, Some(b), dims)),
        None => biased(how, input, w, None, dims),
    })
}

/// The input's gradient through `p` (returned) and the weight's and bias's (to their
/// sinks), as [`super::linear::LinearBiasOp`]'s backward computes them.
fn project_back<T: Real>(
    how: Matmul,
    p: &Projection,
    input: &[T],
    dy: &[T],
    rows: usize,
) -> CResult<Vec<T>> {
    let dims = proj_dims(p, rows)?;
    let (dx, dw) = with_data::<T, _>(&p.weight.0, "fused block backward", |w| {
        backward(how, input, w, dy, dims)
    })?;
    p.weight.1.add(dw)?;
    if let Some((_, Some(sink))) = &p.bias {
        sink.add(simd::fast!(BiasAddOp::bias_grad(dy, dims.2)))?;
    }
    Ok(dx)
}

impl AttentionBlockOp {
    fn saved(&self) -> CResult<MutexGuard<'_, Option<Saved>>> {
        saved_state(&self.saved, "attention block")
    }

    /// The attention core's dims on `[b, s, hidden]` input, after checking that every
    /// projection, bias and rotary table fits it (errors, where a wrong width would reach
    /// gemm's bound checks, or the rotation's slices, as panics).
    fn dims(&self, b: usize, s: usize, hidden: usize) -> CResult<Dims> {
        let (hq, hkv) = self.heads;
        let w = &self.weights;
        let q_out = w.q.weight.0.dims2()?.0;
        let d = q_out.checked_div(hq).unwrap_or(0);
        let fits = |p: &Projection, out: usize, inner: usize| -> CResult<bool> {
            let bias_fits = p.bias.as_ref().is_none_or(|(b, _)| b.dims() == [out]);
            Ok(p.weight.0.dims2()? == (out, inner) && bias_fits)
        };
        if d == 0
            || !fits(&w.q, hq * d, hidden)?
            || !fits(&w.k, hkv * d, hidden)?
            || !fits(&w.v, hkv * d, hidden)?
            || !fits(&w.o, hidden, hq * d)?
        {
            return Err(Error::Msg(format!(
                "attention block: weights q {:?}, k {:?}, v {:?}, o {:?} (and biases) do not fit \
                 {hq} query and {hkv} key/value heads on input width {hidden}",
                w.q.weight.0.shape(),
                w.k.weight.0.shape(),
                w.v.weight.0.shape(),
                w.o.weight.0.shape()
            )));
        }
        if let Some(t) = &self.rope
            && (d != 2 * t.half || t.cos.len() != s * t.half || t.sin.len() != s * t.half)
        {
            return Err(Error::Msg(format!(
                "attention block: rotary tables of {} positions x {} for {s} positions of \
                 head dim {d}",
                t.cos.len() / t.half.max(1),
                t.half
            )));
        }
        let kv = Shape::from((b, s * self.cp.as_ref().map_or(1, |c| c.size()), hkv, d));
        self.attention.dims(&Shape::from((b, s, hq, d)), &kv, &kv)
    }

    fn forward<T: Real>(&self, x: &[T], (b, s, hidden): (usize, usize, usize)) -> CResult<Vec<T>> {
        let rows = b * s;
        let w = &self.weights;
        let dm = self.dims(b, s, hidden)?;
        let (mut q, mut k, v) = (
            project(self.how, &w.q, x, rows)?,
            project(self.how, &w.k, x, rows)?,
            project(self.how, &w.v, x, rows)?,
        );
        if let Some(tables) = &self.rope {
            let (hq, hkv) = self.heads;
            let rot = RopeOp { tables: tables.clone(), inverse: false };
            q = simd::fast!({ rot.rotate(&q, s, hq) });
            k = simd::fast!({ rot.rotate(&k, s, hkv) });
        }
        let (k, v) = match &self.cp {
            None => (k, v),
            Some(c) => {
                let part = Shape::from((b, s, k.len() / (b * s).max(1)));
                let k = ops::gather_dim(c.as_ref(), &k, &part, 1)?.0;
                (k, ops::gather_dim(c.as_ref(), &v, &part, 1)?.0)
            }
        };
        let (att, lse) = simd::fast!(self.attention.forward(&q, &k, &v, dm))?;
        let o = project(self.how, &w.o, &att, rows)?;
        *self.saved()? =
            Some(Saved { q: kept(q)?, k: kept(k)?, v: kept(v)?, att: kept(att)?, lse });
        Ok(o)
    }

    fn backward<T: Real>(
        &self,
        x: &[T],
        dy: &[T],
        (b, s, hidden): (usize, usize, usize),
    ) -> CResult<Vec<T>> {
        let op = "attention block backward";
        let rows = b * s;
        let saved = self.saved()?;
        let sv = saved
            .as_ref()
            .ok_or_else(|| Error::Msg("attention block: backward without its forward".into()))?;
        let w = &self.weights;
        let dm = self.dims(b, s, hidden)?;
        with_data::<T, _>(&sv.q, op, |q| {
            with_data::<T, _>(&sv.k, op, |k| {
                with_data::<T, _>(&sv.v, op, |v| {
                    with_data::<T, _>(&sv.att, op, |att| {
                        let datt = project_back(self.how, &w.o, att, dy, rows)?;
                        let (mut dq, mut dk, mut dv) =
                            simd::fast!(self.attention.backward(q, k, v, att, &datt, &sv.lse, dm))?;
                        if let Some(c) = &self.cp {
                            // Each rank's keys' and values' gradients, summed over the ranks
                            // that attended to them.
                            let sk = s * c.size();
                            let all = Shape::from((b, sk, dk.len() / (b * sk).max(1)));
                            dk = ops::reduce_scatter_dim(c.as_ref(), &dk, &all, 1)?.0;
                            dv = ops::reduce_scatter_dim(c.as_ref(), &dv, &all, 1)?.0;
                        }
                        if let Some(tables) = &self.rope {
                            let (hq, hkv) = self.heads;
                            let back = RopeOp { tables: tables.clone(), inverse: true };
                            dq = simd::fast!({ back.rotate(&dq, s, hq) });
                            dk = simd::fast!({ back.rotate(&dk, s, hkv) });
                        }
                        // Candle's backward reaches v's projection first, then k's, then q's.
                        let mut dx = project_back(self.how, &w.v, x, &dv, rows)?;
                        let dxk = project_back(self.how, &w.k, x, &dk, rows)?;
                        let dxq = project_back(self.how, &w.q, x, &dq, rows)?;
                        for ((d, &a), &c) in dx.iter_mut().zip(&dxk).zip(&dxq) {
                            *d = (*d + a) + c;
                        }
                        Ok(dx)
                    })
                })
            })
        })
    }
}

impl Anchored for AttentionBlockOp {
    const NAME: &'static str = "attention block";

    fn input_grad<T: NormalCdf>(&self, x: &[T], shape: &Shape, dy: &[T]) -> CResult<Vec<T>> {
        let (residual, tp) = (self.residual.as_ref(), self.tp.as_ref());
        framed_backward(residual, tp, x, shape, dy, |x, shape, dy| {
            self.backward(x, dy, shape.dims3()?)
        })
    }
}

impl CustomOp2 for AttentionBlockOp {
    fn name(&self) -> &'static str {
        "attention-block"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        l1.shape().dims3()?;
        let (residual, tp) = (self.residual.as_ref(), self.tp.as_ref());
        by_real!(s1, "attention block", |T| {
            let x = slice::<T>(s1, l1, "attention block")?;
            let y = framed_forward(residual, tp, x, l1.shape(), |x, shape| {
                self.forward(x, shape.dims3()?)
            })?;
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        self.anchored_bwd(x, grad)
    }
}

/// The block over `x` `[b, s, hidden]` (one rank's whole sequences) as one node: `heads`
/// query and `kv_heads` key/value heads, q and k rotated by `rope`'s tables (one row per
/// position of the sequence) where given, the core as `attention` runs it; `anchor` (an
/// empty variable, [`anchor`]) makes candle run the backward. The weights' gradients go
/// to their sinks, so they must be the parameters' `Var`s. Given `pre`, the node is
/// `x + block(pre(x))` ([`PreNorm`]). Given `tp`, the weights and heads are this rank's
/// shards (the output projection's bias, if any, is `tp`'s) and `x` is this rank's part of
/// the sequence under SP ([`TpEdges`]). Given `cp`, `x` holds this context-parallel rank's
/// positions, the keys and values of every rank of `cp` are gathered after the rotation,
/// and `attention` attends to all of them (its key positions every rank's, in member order).
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    how: Matmul,
    x: &Tensor,
    anchor: &Tensor,
    weights: BlockWeights,
    (heads, kv_heads): (usize, usize),
    rope: Option<Arc<RopeTables>>,
    attention: FlashAttention,
    (pre, tp, cp): (Option<PreNorm>, Option<TpEdges>, Option<Arc<dyn Communicator>>),
) -> CResult<Tensor> {
    let op = AttentionBlockOp {
        how,
        weights,
        heads: (heads, kv_heads),
        rope,
        attention,
        saved: Mutex::new(None),
        residual: Residual::new(pre),
        tp: Tp::new(tp),
        cp,
    };
    x.contiguous()?.apply_op2(anchor, op)
}

/// An MLP as one node (on one rank, or over `tp` within its [`TpEdges`]): the GELU MLP's
/// first layer and GELU (composed, one node, [`super::linear::linear_bias_gelu_into`]) then
/// its second layer, or SwiGLU's gate and up projections, their product and the down
/// projection. Composed, every activation between
/// the layers (the MLP's widest tensors) is an edge whose gradient candle zero-fills and
/// adds into on every backward, and the input's gradient is a fill and two adds in SwiGLU;
/// here the forward keeps the activations the backward needs and the backward runs the
/// layers' backwards in turn, with the composed MLP's bits (the two input gradients of
/// SwiGLU sum in either order to the same bits).
#[derive(Debug)]
enum Mlp {
    Gelu { fc1: Projection, fc2: Projection },
    SwiGlu { gate: Projection, up: Projection, down: Projection },
}

#[derive(Debug)]
struct MlpOp {
    how: Matmul,
    mlp: Mlp,
    /// The activations the backward reads, from the forward: the GELU's input and output,
    /// or SwiGLU's gate, up and product.
    saved: Mutex<Vec<Tensor>>,
    /// The pre-norm and residual, where the node is the layer's half.
    residual: Option<Residual>,
    /// The tensor-parallel edges, where the weights are shards.
    tp: Option<Tp>,
}

impl MlpOp {
    fn saved(&self) -> CResult<MutexGuard<'_, Vec<Tensor>>> {
        saved_state(&self.saved, "MLP")
    }

    /// `(in, out)` widths, after checking that the layers (and biases) chain.
    fn widths(&self) -> CResult<(usize, usize)> {
        let shape = |p: &Projection| -> CResult<(usize, usize)> {
            let (out, inner) = p.weight.0.dims2()?;
            match &p.bias {
                Some((b, _)) if b.dims() != [out] => Err(Error::Msg(format!(
                    "MLP: bias {:?} for weight {:?}",
                    b.shape(),
                    p.weight.0.shape()
                ))),
                _ => Ok((out, inner)),
            }
        };
        let (first, up, last) = match &self.mlp {
            Mlp::Gelu { fc1, fc2 } => (shape(fc1)?, None, shape(fc2)?),
            Mlp::SwiGlu { gate, up, down } => (shape(gate)?, Some(shape(up)?), shape(down)?),
        };
        if up.is_some_and(|u| u != first) || last.1 != first.0 {
            return Err(Error::Msg(format!(
                "MLP: layers of {first:?}, {up:?} and {last:?} (out, in) do not chain"
            )));
        }
        Ok((first.1, last.0))
    }

    fn forward<T: NormalCdf>(&self, x: &[T], rows: usize) -> CResult<Vec<T>> {
        let how = self.how;
        let (y, saved) = match &self.mlp {
            Mlp::Gelu { fc1, fc2 } => {
                let pre = project(how, fc1, x, rows)?;
                let h = simd::fast!({ GeluOp::forward(&pre, how) });
                let y = project(how, fc2, &h, rows)?;
                (y, vec![kept(pre)?, kept(h)?])
            }
            Mlp::SwiGlu { gate, up, down } => {
                let (g, u) = (project(how, gate, x, rows)?, project(how, up, x, rows)?);
                let h = simd::fast!({ SwiGluOp::forward(&g, &u, how) });
                let y = project(how, down, &h, rows)?;
                (y, vec![kept(g)?, kept(u)?, kept(h)?])
            }
        };
        *self.saved()? = saved;
        Ok(y)
    }

    fn backward<T: NormalCdf>(&self, x: &[T], dy: &[T], rows: usize) -> CResult<Vec<T>> {
        let op = "MLP backward";
        let how = self.how;
        let saved = self.saved()?;
        match (&self.mlp, saved.as_slice()) {
            (Mlp::Gelu { fc1, fc2 }, [pre, h]) => with_data::<T, _>(pre, op, |pre| {
                with_data::<T, _>(h, op, |h| {
                    let dh = project_back(how, fc2, h, dy, rows)?;
                    let dpre = simd::fast!({ GeluOp::backward(pre, h, &dh, how) });
                    project_back(how, fc1, x, &dpre, rows)
                })
            }),
            (Mlp::SwiGlu { gate, up, down }, [g, u, h]) => with_data::<T, _>(g, op, |g| {
                with_data::<T, _>(u, op, |u| {
                    with_data::<T, _>(h, op, |h| {
                        let dh = project_back(how, down, h, dy, rows)?;
                        let (dg, du) = simd::fast!({ SwiGluOp::backward(g, u, &dh, how) });
                        let mut dx = project_back(how, gate, x, &dg, rows)?;
                        let dxu = project_back(how, up, x, &du, rows)?;
                        for (d, &a) in dx.iter_mut().zip(&dxu) {
                            *d += a;
                        }
                        Ok(dx)
                    })
                })
            }),
            _ => Err(Error::Msg("MLP: backward without its forward".into())),
        }
    }
}

impl Anchored for MlpOp {
    const NAME: &'static str = "MLP";

    fn input_grad<T: NormalCdf>(&self, x: &[T], shape: &Shape, dy: &[T]) -> CResult<Vec<T>> {
        let inner = self.widths()?.0;
        let (residual, tp) = (self.residual.as_ref(), self.tp.as_ref());
        framed_backward(residual, tp, x, shape, dy, |x, _, dy| {
            self.backward(x, dy, x.len() / inner.max(1))
        })
    }
}

impl CustomOp2 for MlpOp {
    fn name(&self) -> &'static str {
        "mlp"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (inner, out) = self.widths()?;
        let Some((&width, _)) = l1.shape().dims().split_last() else {
            return Err(Error::Msg(format!("MLP: input {:?} has no feature dim", l1.shape())));
        };
        if width != inner {
            return Err(Error::Msg(format!("MLP: input {:?}, first layer of {inner}", l1.shape())));
        }
        let mut shape = l1.shape().dims().to_vec();
        *shape.last_mut().expect("checked above") = out;
        let (residual, tp) = (self.residual.as_ref(), self.tp.as_ref());
        by_real!(s1, "MLP", |T| {
            let x = slice::<T>(s1, l1, "MLP")?;
            let y = framed_forward(residual, tp, x, l1.shape(), |x, _| {
                self.forward(x, x.len() / inner.max(1))
            })?;
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), Shape::from(shape)))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        self.anchored_bwd(x, grad)
    }
}

/// `fc2(gelu(fc1(x)))` as one node, `x` `[.., in]`; `anchor` (an empty variable,
/// [`anchor`]) makes candle run the backward. The weights' and biases' gradients go to
/// their sinks, so they must be the parameters' `Var`s. Given `pre`, the node is
/// `x + mlp(pre(x))` ([`PreNorm`]). Given `tp`, the layers are this rank's shards (`fc2`'s
/// bias, if any, is `tp`'s) and `x` `[b, s / tp, in]` under SP ([`TpEdges`]).
pub fn gelu_mlp(
    how: Matmul,
    x: &Tensor,
    anchor: &Tensor,
    fc1: Projection,
    fc2: Projection,
    (pre, tp): (Option<PreNorm>, Option<TpEdges>),
) -> CResult<Tensor> {
    let op = MlpOp {
        how,
        mlp: Mlp::Gelu { fc1, fc2 },
        saved: Mutex::new(Vec::new()),
        residual: Residual::new(pre),
        tp: Tp::new(tp),
    };
    x.contiguous()?.apply_op2(anchor, op)
}

/// `down(silu(gate(x)) * up(x))` as one node, as [`gelu_mlp`] (`pre` and `tp` too).
pub fn swiglu_mlp(
    how: Matmul,
    x: &Tensor,
    anchor: &Tensor,
    [gate, up, down]: [Projection; 3],
    (pre, tp): (Option<PreNorm>, Option<TpEdges>),
) -> CResult<Tensor> {
    let op = MlpOp {
        how,
        mlp: Mlp::SwiGlu { gate, up, down },
        saved: Mutex::new(Vec::new()),
        residual: Residual::new(pre),
        tp: Tp::new(tp),
    };
    x.contiguous()?.apply_op2(anchor, op)
}

/// An anchor for a fused node: an empty variable, which no op reads.
pub fn anchor(dtype: candle_core::DType) -> CResult<Tensor> {
    Ok(candle_core::Var::zeros(0, dtype, &Device::Cpu)?.as_tensor().clone())
}
