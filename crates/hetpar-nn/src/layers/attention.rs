//! Multi-head and grouped-query self-attention with tensor, sequence and context
//! parallelism.
//!
//! Heads are split over `tp` (q/k/v column-parallel, output row-parallel). Under context
//! parallelism each rank holds the load-balanced `2*cp` chunks of the sequence it owns and
//! attends to every key: either after an all-gather of K/V over `cp` (`CpMode::AllGather`,
//! gradients reduce-scattered back), or by passing K/V blocks around the `cp` ring and
//! combining them with an online softmax (`CpMode::Ring`, Liu et al. 2023; Milakov and
//! Gimelshein 2018). Masks come from global positions, so the zigzag order never has to be
//! undone. Attention itself is the fused kernel [`FlashAttention`] on `[b, s, heads, d]`: no
//! score matrix is stored but a short bidirectional sequence's probabilities (at most 256
//! rows a side, kept for the backward), blocks of keys after every query are skipped, and
//! grouped K/V heads are read in place. The ring merges its blocks' outputs by their
//! log-sum-exp; with autograd keeping every block it moves the same bytes point to point
//! instead of all-gathering them but does not yet lower activation memory.

use std::sync::Arc;

use candle_core::{D, Tensor};
use hetpar_layout::ModuleLayout;
use hetpar_layout::ownership::SeqSplit;

use crate::ctx::ParallelCtx;
use crate::error::Result;
use crate::kernels::attention::FlashAttention;
use crate::kernels::block::{BlockWeights, PreNorm, anchor, attention_block};
use crate::layers::comm::gather_dim;
use crate::layers::linear::{Build, ColumnParallel, RowParallel};
use crate::layers::norm::Norm;
use crate::layers::rope::Rope;
use crate::ops::RingShift;
use crate::params::{HasParams, Param};

/// How keys and values reach every context-parallel rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CpMode {
    /// All-gather K/V over `cp`.
    #[default]
    AllGather,
    /// Pass K/V blocks around the `cp` ring, online softmax.
    Ring,
}

/// The sequence positions of every context-parallel rank (in their local order) and which
/// one is this rank: queries are this rank's positions, keys everyone's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpPositions {
    /// Positions of each cp rank.
    pub ranks: Vec<Vec<usize>>,
    /// This rank's cp index.
    pub me: usize,
}

impl CpPositions {
    /// Positions `0..n` on one rank (no context parallelism).
    pub fn single(n: usize) -> CpPositions {
        CpPositions { ranks: vec![(0..n).collect()], me: 0 }
    }

    /// The load-balanced CP split of a `seq`-token sequence under `layout` (each cp rank's
    /// two chunks, SP ignored: attention covers whole CP chunks), seen from cp rank `me`.
    pub fn sequence(layout: &ModuleLayout, seq: usize, me: usize) -> CpPositions {
        let split = SeqSplit::new(seq, layout);
        let ranks = (0..layout.cp()).map(|j| split.cp_owned(j).into_iter().flatten().collect());
        CpPositions { ranks: ranks.collect(), me }
    }

    /// This rank's positions.
    pub fn own(&self) -> &[usize] {
        &self.ranks[self.me]
    }
}

/// Attention sizes and options.
#[derive(Clone, Copy, Debug)]
pub struct AttentionSpec {
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (equal to `heads` for MHA).
    pub kv_heads: usize,
    /// Causal mask (LLM) or bidirectional (ViT).
    pub causal: bool,
    /// Rotary base, or `None` for no rotary embedding.
    pub rope_theta: Option<f64>,
    /// Biases on the projections (ViT yes, Llama no).
    pub bias: bool,
    /// With `bias`, a bias on the key projection too (CLIP and SigLIP have one, Whisper
    /// none). A key bias adds the same score to every key of a query, which the softmax
    /// cancels: its gradient is zero in exact arithmetic and rounding noise in practice,
    /// which Adam's normalization would turn into full-size steps of random sign that
    /// differ between layouts. So the bias is applied outside autograd and never trained
    /// (it keeps its loaded value).
    pub key_bias: bool,
    /// Context-parallel communication.
    pub cp_mode: CpMode,
}

/// A self-attention block.
#[derive(Debug)]
pub struct Attention {
    ctx: Arc<ParallelCtx>,
    spec: AttentionSpec,
    q: ColumnParallel,
    k: ColumnParallel,
    v: ColumnParallel,
    o: RowParallel,
    rope: Option<Rope>,
}

impl Attention {
    /// Projections `name.{q,k,v,o_name}` (HF: `o_proj` for Llama, `out_proj` for ViT).
    pub fn new(
        b: &Build,
        name: &str,
        o_name: &str,
        spec: AttentionSpec,
        std: f64,
        out_std: f64,
    ) -> Result<Self> {
        let d = spec.hidden / spec.heads;
        let col = |n: &str, out: usize, bias: bool| {
            ColumnParallel::new(b, &format!("{name}.{n}"), spec.hidden, out, bias, std)
        };
        Ok(Attention {
            ctx: b.ctx.clone(),
            spec,
            q: col("q_proj", spec.heads * d, spec.bias)?,
            k: col("k_proj", spec.kv_heads * d, spec.bias && spec.key_bias)?.with_detached_bias(),
            v: col("v_proj", spec.kv_heads * d, spec.bias)?,
            o: RowParallel::new(
                b,
                &format!("{name}.{o_name}"),
                spec.heads * d,
                spec.hidden,
                spec.bias,
                out_std,
            )?,
            rope: spec.rope_theta.map(|t| Rope::new(d, t)),
        })
    }

    /// `[b, s, n * d]` projections viewed as `[b, s, n, d]` (no copy).
    fn heads(&self, x: &Tensor, n: usize) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let d = self.spec.hidden / self.spec.heads;
        Ok(x.reshape((b, s, n, d))?)
    }

    /// The fused attention of queries at `q_pos` over keys at `k_pos`, its products
    /// multiplying as the layer's projections do (bf16 under `dtype = "bf16"`) on every path:
    /// one rank, `tp` and both CP modes round alike.
    fn attend(&self, q_pos: &[usize], k_pos: &[usize], lse: bool) -> FlashAttention {
        let d = (self.spec.hidden / self.spec.heads) as f64;
        FlashAttention::new(
            Arc::new(q_pos.to_vec()),
            Arc::new(k_pos.to_vec()),
            self.spec.causal,
            1.0 / d.sqrt(),
            lse,
        )
        .with_matmul(self.q.matmul())
    }

    /// `x` `[b, s, hidden]` (this rank's tokens; sequence-sharded again under SP) at
    /// `positions` to `[b, s, hidden]`.
    pub fn forward(&self, x: &Tensor, positions: &CpPositions) -> Result<Tensor> {
        if self.one_node() {
            return self.fused(x, positions, None);
        }
        self.composed(x, positions)
    }

    /// [`Self::forward`] node by node: the projections, head reshapes, rotations, attention
    /// core and the collectives each their own nodes (the path of ring attention).
    pub(super) fn composed(&self, x: &Tensor, positions: &CpPositions) -> Result<Tensor> {
        let (hq, hkv) =
            (self.spec.heads / self.ctx.tp.size(), self.spec.kv_heads / self.ctx.tp.size());
        // One gather (or gradient reduction) over `tp` for the three projections.
        let x = self.q.input(x)?;
        let mut q = self.heads(&self.q.local(&x)?, hq)?;
        let mut k = self.heads(&self.k.local(&x)?, hkv)?;
        let v = self.heads(&self.v.local(&x)?, hkv)?;
        let own = positions.own();
        if let Some(rope) = &self.rope {
            let tables = rope.tables(own);
            q = Rope::apply(&q, &tables)?;
            k = Rope::apply(&k, &tables)?;
        }
        let out = if self.ctx.cp.size() == 1 {
            self.attend(own, own, false).apply(&q, &k, &v)?
        } else {
            match self.spec.cp_mode {
                CpMode::AllGather => self.all_gather(&q, &k, &v, positions)?,
                CpMode::Ring => self.ring(&q, &k, &v, positions)?,
            }
        };
        let (b, s, h, d) = out.dims4()?;
        self.o.forward(&out.reshape((b, s, h * d))?)
    }

    /// `x + self(norm(x))`, a pre-norm layer's first half; but under ring attention one node
    /// ([`attention_block`] with its [`PreNorm`]: the composed half's bits).
    pub fn residual(
        &self,
        x: &Tensor,
        norm: &impl Norm,
        positions: &CpPositions,
    ) -> Result<Tensor> {
        if self.one_node() {
            return self.fused(x, positions, Some(norm.pre_norm()));
        }
        Ok((x + self.composed(&norm.normalize(x)?, positions)?)?)
    }

    /// Whether the block runs as one node: on one rank, over `tp` and under context
    /// parallelism by all-gather (their collectives inside the node); ring attention's
    /// steps stay nodes of their own.
    fn one_node(&self) -> bool {
        self.ctx.cp.size() == 1 || self.spec.cp_mode == CpMode::AllGather
    }

    /// The block as one node ([`attention_block`]; over `tp` this rank's heads, under
    /// context parallelism every cp rank's keys and values, with the collectives inside),
    /// behind `pre` where given: the composed block's bits without candle's zero fills and
    /// adds between its nodes.
    fn fused(&self, x: &Tensor, positions: &CpPositions, pre: Option<PreNorm>) -> Result<Tensor> {
        let own = positions.own();
        let rope = self.rope.as_ref().map(|r| r.tables(own));
        let (q, how) = self.q.projection();
        let anchor = anchor(x.dtype())?;
        let (o, tp) = self.o.projection();
        let weights = BlockWeights { q, k: self.k.projection().0, v: self.v.projection().0, o };
        let shards = self.ctx.tp.size();
        let heads = (self.spec.heads / shards, self.spec.kv_heads / shards);
        let cp = self.ctx.cp.comm().cloned();
        let attention = match cp {
            None => self.attend(own, own, false),
            Some(_) => self.attend(own, &positions.ranks.concat(), false),
        };
        let edges = (pre, tp, cp);
        Ok(attention_block(how, x, &anchor, weights, heads, rope, attention, edges)?)
    }

    fn all_gather(&self, q: &Tensor, k: &Tensor, v: &Tensor, p: &CpPositions) -> Result<Tensor> {
        let k = gather_dim(&self.ctx.cp, k, 1)?;
        let v = gather_dim(&self.ctx.cp, v, 1)?;
        Ok(self.attend(p.own(), &p.ranks.concat(), false).apply(q, &k, &v)?)
    }

    /// Each ring step attends to the block it holds, keeping each row's log-sum-exp; the
    /// blocks merge by those weights at the end (the online softmax across ranks).
    fn ring(&self, q: &Tensor, k: &Tensor, v: &Tensor, p: &CpPositions) -> Result<Tensor> {
        let comm = self.ctx.cp.comm().expect("cp > 1 has a communicator").clone();
        let n = p.ranks.len();
        let d = q.dim(3)?;
        let (mut k, mut v) = (k.contiguous()?, v.contiguous()?);
        let (mut outs, mut lses) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for step in 0..n {
            if step > 0 {
                k = k.apply_op1(RingShift { comm: comm.clone(), forward: true })?;
                v = v.apply_op1(RingShift { comm: comm.clone(), forward: true })?;
            }
            // After `step` shifts this rank holds the block of cp rank `me - step`.
            let src = (p.me + n - step) % n;
            let block = self.attend(p.own(), &p.ranks[src], true).apply(q, &k, &v)?;
            outs.push(block.narrow(3, 0, d)?);
            lses.push(block.narrow(3, d, 1)?);
        }
        // Every row sees its own position in the first block, so the maximum is finite.
        let lse = Tensor::cat(&lses, 3)?;
        let top = lse.max_keepdim(3)?.detach();
        let w = lse.broadcast_sub(&top)?.exp()?;
        let mut acc = outs[0].broadcast_mul(&w.narrow(3, 0, 1)?)?;
        for (i, o) in outs.iter().enumerate().skip(1) {
            acc = (acc + o.broadcast_mul(&w.narrow(3, i, 1)?)?)?;
        }
        Ok(acc.broadcast_div(&w.sum_keepdim(3)?)?)
    }
}

/// Softmax over the last dim with differentiable ops (max subtracted for stability): the
/// MoE router's, and the unfused attention references'.
pub fn softmax(x: &Tensor) -> candle_core::Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

impl HasParams for Attention {
    fn params(&self) -> Vec<&Param> {
        [self.q.params(), self.k.params(), self.v.params(), self.o.params()].concat()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.q.params_mut();
        v.extend(self.k.params_mut());
        v.extend(self.v.params_mut());
        v.extend(self.o.params_mut());
        v
    }
}
