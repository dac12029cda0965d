//! Multi-head and grouped-query self-attention with tensor, sequence and context
//! parallelism.
//!
//! Heads are split over `tp` (q/k/v column-parallel, output row-parallel). Under context
//! parallelism each rank holds the load-balanced `2*cp` chunks of the sequence it owns and
//! attends to every key: either after an all-gather of K/V over `cp` (`CpMode::AllGather`,
//! gradients reduce-scattered back), or by passing K/V blocks around the `cp` ring and
//! combining them with an online softmax (`CpMode::Ring`, Liu et al. 2023; Milakov and
//! Gimelshein 2018). Masks come from global positions, so the zigzag order never has to be
//! undone. With autograd keeping every block, the ring moves the same bytes point to point
//! instead of all-gathering them but does not yet lower activation memory.

use std::sync::Arc;

use candle_core::{D, Device, Tensor};
use hetpar_layout::ModuleLayout;
use hetpar_layout::ownership::SeqSplit;

use crate::ctx::ParallelCtx;
use crate::error::Result;
use crate::layers::comm::gather_dim;
use crate::layers::linear::{Build, ColumnParallel, RowParallel};
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

    fn heads(&self, x: &Tensor, n: usize) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let d = self.spec.hidden / self.spec.heads;
        Ok(x.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous()?)
    }

    /// Additive mask `[q, k]`: 0 where `k_pos <= q_pos` (causal) or everywhere.
    fn mask(&self, q_pos: &[usize], k_pos: &[usize], like: &Tensor) -> Result<Option<Tensor>> {
        if !self.spec.causal {
            return Ok(None);
        }
        let m: Vec<f64> = q_pos
            .iter()
            .flat_map(|&q| k_pos.iter().map(move |&k| if k <= q { 0.0 } else { f64::NEG_INFINITY }))
            .collect();
        Ok(Some(
            Tensor::from_vec(m, (q_pos.len(), k_pos.len()), &Device::Cpu)?
                .to_dtype(like.dtype())?,
        ))
    }

    /// `[b, heads, s_q, s_k]` scores of `q` against `k` (K/V heads repeated for GQA).
    fn scores(&self, q: &Tensor, k: &Tensor, q_pos: &[usize], k_pos: &[usize]) -> Result<Tensor> {
        let d = (self.spec.hidden / self.spec.heads) as f64;
        let k = repeat_kv(k, self.spec.heads / self.spec.kv_heads)?;
        let s = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? / d.sqrt())?;
        Ok(match self.mask(q_pos, k_pos, &s)? {
            Some(m) => s.broadcast_add(&m)?,
            None => s,
        })
    }

    /// `x` `[b, s, hidden]` (this rank's tokens; sequence-sharded again under SP) at
    /// `positions` to `[b, s, hidden]`.
    pub fn forward(&self, x: &Tensor, positions: &CpPositions) -> Result<Tensor> {
        let (hq, hkv) =
            (self.spec.heads / self.ctx.tp.size(), self.spec.kv_heads / self.ctx.tp.size());
        let mut q = self.heads(&self.q.forward(x)?, hq)?;
        let mut k = self.heads(&self.k.forward(x)?, hkv)?;
        let v = self.heads(&self.v.forward(x)?, hkv)?;
        let own = positions.own();
        if let Some(_rope) = &self.rope {
            let (cos, sin) = self.rope.as_ref().expect("rope").tables(own, q.dtype())?;
            q = Rope::apply(&q, &cos, &sin)?;
            k = Rope::apply(&k, &cos, &sin)?;
        }
        let out = if self.ctx.cp.size() == 1 {
            softmax(&self.scores(&q, &k, own, own)?)?
                .matmul(&repeat_kv(&v, self.spec.heads / self.spec.kv_heads)?)?
        } else {
            match self.spec.cp_mode {
                CpMode::AllGather => self.all_gather(&q, &k, &v, positions)?,
                CpMode::Ring => self.ring(&q, &k, &v, positions)?,
            }
        };
        let (b, h, s, d) = out.dims4()?;
        let merged = out.transpose(1, 2)?.contiguous()?.reshape((b, s, h * d))?;
        self.o.forward(&merged)
    }

    fn all_gather(&self, q: &Tensor, k: &Tensor, v: &Tensor, p: &CpPositions) -> Result<Tensor> {
        let k = gather_dim(&self.ctx.cp, k, 2)?;
        let v = gather_dim(&self.ctx.cp, v, 2)?;
        let k_pos: Vec<usize> = p.ranks.concat();
        let probs = softmax(&self.scores(q, &k, p.own(), &k_pos)?)?;
        Ok(probs.matmul(&repeat_kv(&v, self.spec.heads / self.spec.kv_heads)?)?)
    }

    fn ring(&self, q: &Tensor, k: &Tensor, v: &Tensor, p: &CpPositions) -> Result<Tensor> {
        let comm = self.ctx.cp.comm().expect("cp > 1 has a communicator").clone();
        let n = p.ranks.len();
        let rep = self.spec.heads / self.spec.kv_heads;
        let (mut k, mut v) = (k.clone(), v.clone());
        // Running max (a constant for stability), numerator and denominator.
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for step in 0..n {
            if step > 0 {
                k = k.contiguous()?.apply_op1(RingShift { comm: comm.clone(), forward: true })?;
                v = v.contiguous()?.apply_op1(RingShift { comm: comm.clone(), forward: true })?;
            }
            // After `step` shifts this rank holds the block of cp rank `me - step`.
            let src = (p.me + n - step) % n;
            let s = self.scores(q, &k, p.own(), &p.ranks[src])?;
            let block_max = s.max_keepdim(D::Minus1)?.detach();
            let vv = repeat_kv(&v, rep)?;
            state = Some(match state {
                None => {
                    let e = s.broadcast_sub(&block_max)?.exp()?;
                    let l = e.sum_keepdim(D::Minus1)?;
                    (block_max, e.matmul(&vv)?, l)
                }
                Some((m, acc, l)) => {
                    let m_new = m.maximum(&block_max)?;
                    let scale = (m - &m_new)?.exp()?;
                    let e = s.broadcast_sub(&m_new)?.exp()?;
                    let acc = (acc.broadcast_mul(&scale)? + e.matmul(&vv)?)?;
                    let l = (l.broadcast_mul(&scale)? + e.sum_keepdim(D::Minus1)?)?;
                    (m_new, acc, l)
                }
            });
        }
        let (_, acc, l) = state.expect("at least one block");
        Ok(acc.broadcast_div(&l)?)
    }
}

/// Softmax over the last dim with differentiable ops (max subtracted for stability).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// `[b, kv, s, d]` to `[b, kv * rep, s, d]`, each K/V head serving `rep` query heads.
pub fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, s, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?.broadcast_as((b, kv, rep, s, d))?.contiguous()?.reshape((
        b,
        kv * rep,
        s,
        d,
    ))?)
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
