//! Mixture of experts (Shazeer et al. 2017; Mixtral's top-k routing) with expert
//! parallelism: experts are split over `ep`, tokens travel to their experts and back by
//! all-to-all-v, and no token is dropped (no capacity limit).
//!
//! Per rank: tokens replicated over `tp` (no SP) are first split over `tp`, so every rank of
//! the stage routes distinct tokens. The router's softmax picks the top-k experts of each
//! token; gates are the picked probabilities renormalized to sum to one. Assignments are
//! sorted by destination rank and expert, sent, computed by each local expert (SwiGLU,
//! Mixtral names `w1`, `w3`, `w2`), sent back, weighted and summed per token.
//!
//! The load-balancing loss (Switch Transformer, Fedus et al. 2021) is
//! `coef * E * sum_e f_e * P_e` over the whole stage's tokens, with `f_e` the share of
//! assignments to expert `e` and `P_e` its mean router probability. Each rank returns its
//! part (global `f`, its own tokens' probability sum over the global token count), so the
//! parts add up to the loss over ranks and the gradient of each part is exact.

use std::sync::Arc;

use candle_core::{D, DType, Device, Tensor};
use hetpar_comm::{CommExt, ReduceOp};
use hetpar_layout::Axis;

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::init::Init;
use crate::kernels::experts::{ExpertWeights, combine_experts, experts_swiglu, routed_experts};
use crate::kernels::linear::Matmul;
use crate::layers::attention::softmax;
use crate::layers::comm::{gather_rows, split_rows};
use crate::layers::linear::{Build, matmul_t};
use crate::layers::norm::Norm;
use crate::ops::AllToAllRows;
use crate::params::{HasParams, Param};

/// Sizes of a MoE layer.
#[derive(Clone, Copy, Debug)]
pub struct MoeSpec {
    /// Model width.
    pub hidden: usize,
    /// Width of each expert's MLP.
    pub ffn: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Weight of the load-balancing loss.
    pub aux_coef: f64,
}

#[derive(Debug)]
struct Expert {
    w1: Param,
    w3: Param,
    w2: Param,
}

/// A sparse MoE block.
#[derive(Debug)]
pub struct Moe {
    ctx: Arc<ParallelCtx>,
    spec: MoeSpec,
    gate: Param,
    /// How the experts multiply (the router always in the parameters' type: its
    /// probabilities pick the experts, and it is a small product).
    matmul: Matmul,
    /// This rank's experts, by global id.
    experts: Vec<(usize, Expert)>,
}

impl Moe {
    /// `name.gate.weight` `[experts, hidden]` (every rank) and
    /// `name.experts.{e}.{w1,w3,w2}.weight` for the experts of this rank's `ep` index.
    pub fn new(b: &Build, name: &str, spec: MoeSpec, std: f64, out_std: f64) -> Result<Self> {
        let ctx = b.ctx.clone();
        let ep = ctx.ep.size();
        if !spec.experts.is_multiple_of(ep) {
            return Err(NnError::Input(format!(
                "ep({ep}) does not divide experts({})",
                spec.experts
            )));
        }
        // The router sees distinct tokens on every rank of the stage: its gradient is partial
        // over tp too, with or without sequence parallelism.
        let gate = Param::new(
            format!("{name}.gate.weight"),
            &[spec.experts, spec.hidden],
            None,
            vec![Axis::Dp, Axis::Cp, Axis::Tp],
            Init::Normal(std),
            b.seed,
            b.dtype,
        )?;
        let per = spec.experts / ep;
        let first = ctx.ep.rank * per;
        let expert_param = |e: usize, w: &str, shape: [usize; 2], s: f64| {
            Param::new(
                format!("{name}.experts.{e}.{w}.weight"),
                &shape,
                None,
                vec![Axis::Edp],
                Init::Normal(s),
                b.seed,
                b.dtype,
            )
        };
        let experts = (first..first + per)
            .map(|e| {
                Ok((
                    e,
                    Expert {
                        w1: expert_param(e, "w1", [spec.ffn, spec.hidden], std)?,
                        w3: expert_param(e, "w3", [spec.ffn, spec.hidden], std)?,
                        w2: expert_param(e, "w2", [spec.hidden, spec.ffn], out_std)?,
                    },
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Moe { ctx, spec, gate, matmul: b.matmul, experts })
    }

    /// `x` `[b, s, hidden]` to the output `[b, s, hidden]` and this rank's part of the
    /// load-balancing loss (a scalar).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(self.run(x, None)?.0)
    }

    /// `x + self(norm(x))`, a pre-norm layer's second half, and this rank's part of the
    /// load-balancing loss. Where one node takes every expert ([`routed_experts`], `ep` 1)
    /// of a stream not split over `tp`, the residual sum is that node's last step (the same
    /// sum), so no add node zero-fills and adds a gradient the size of `x` for each side.
    pub fn residual(&self, x: &Tensor, norm: &impl Norm) -> Result<(Tensor, Tensor)> {
        let ((y, aux), added) = self.run(&norm.normalize(x)?, Some(x))?;
        Ok((if added { y } else { (x + y)? }, aux))
    }

    /// [`Self::forward`] of `x`, with `residual` added where one node takes every expert
    /// of the whole stream (not split over `tp`); whether it was.
    fn run(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<((Tensor, Tensor), bool)> {
        let (b, s, h) = x.dims3()?;
        let n = b * s;
        let split = self.ctx.tp.size() > 1 && !self.ctx.sp();
        // With every expert here (`ep` 1) one node takes the routing and the experts
        // ([`routed_experts`]). Where the stream is not split over `tp` either, the router
        // and the node read `x` as it is, `[b, s, h]` (a reshape's backward would zero-fill
        // and add a gradient the size of `x` on each side), and the node adds the residual.
        let local = self.ctx.ep.comm().is_none();
        let whole = local && !split;
        let xs = match (split, whole) {
            (true, _) => split_rows(&self.ctx.tp, &x.reshape((n, h))?)?,
            (false, true) => x.clone(),
            (false, false) => x.reshape((n, h))?,
        };
        let n_sub = if split { xs.dims()[0] } else { n };
        let (e_count, k) = (self.spec.experts, self.spec.top_k);
        let logits = matmul_t(Matmul::Native, &xs, &self.gate)?;
        let logits = if whole { logits.reshape((n_sub, e_count))? } else { logits };
        let probs = softmax(&logits)?;

        // Top-k per token, ties to the lower expert id (a stable descending sort).
        let p: Vec<f64> = probs.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        let mut picks: Vec<Vec<usize>> = Vec::with_capacity(n_sub);
        for t in 0..n_sub {
            let row = &p[t * e_count..(t + 1) * e_count];
            let mut order: Vec<usize> = (0..e_count).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]));
            picks.push(order[..k].to_vec());
        }
        let pick_idx: Vec<u32> = picks.iter().flatten().map(|&e| e as u32).collect();
        let pick_idx = Tensor::from_vec(pick_idx, (n_sub, k), &Device::Cpu)?;
        let picked = probs.gather(&pick_idx, 1)?;
        let gates = picked.broadcast_div(&picked.sum_keepdim(D::Minus1)?)?;

        // Dispatch order: by destination ep rank, then expert, then token, then slot.
        let mut assign: Vec<(usize, usize, usize)> = (0..n_sub)
            .flat_map(|t| picks[t].iter().enumerate().map(move |(j, &e)| (e, t, j)))
            .collect();
        assign.sort();
        let tokens: Vec<u32> = assign.iter().map(|&(_, t, _)| t as u32).collect();
        let slots: Vec<u32> = assign.iter().map(|&(_, t, j)| (t * k + j) as u32).collect();
        let a = assign.len();
        let slot_idx = Tensor::from_vec(slots, a, &Device::Cpu)?;
        let g = gates.flatten_all()?.index_select(&slot_idx, 0)?;
        let mut per_expert = vec![0i64; e_count];
        for &(e, _, _) in &assign {
            per_expert[e] += 1;
        }
        let combined = if local && a > 0 {
            // Every expert is here: the gather, the experts and the weighted sum are one
            // node ([`routed_experts`]).
            let rows = per_expert.iter().map(|&c| c as usize).collect();
            let (experts, routing) = (self.expert_weights(), (rows, tokens));
            routed_experts(self.matmul, &xs, &g, experts, routing, residual.filter(|_| whole))?
        } else {
            // (`xs` is `[b, s, h]` only where one node would have run, but no token was
            // routed.)
            let rows = if xs.rank() == 2 { xs.clone() } else { xs.reshape((n_sub, h))? };
            self.exchanged(&rows, &g, tokens, &per_expert)?
        };
        let out = if split { gather_rows(&self.ctx.tp, &combined, n)? } else { combined };
        let aux = self.aux_loss(&probs, &per_expert, n_sub)?;
        // (A reshape is a node even to the same shape.)
        let out = if out.dims() == [b, s, h] { out } else { out.reshape((b, s, h))? };
        Ok(((out, aux), residual.is_some() && whole && a > 0))
    }

    /// This rank's experts' weights with their gradients' sinks.
    fn expert_weights(&self) -> Vec<ExpertWeights> {
        self.experts
            .iter()
            .map(|(_, x)| {
                let w = |p: &Param| (p.tensor().clone(), p.sink.clone());
                ExpertWeights { w1: w(&x.w1), w3: w(&x.w3), w2: w(&x.w2) }
            })
            .collect()
    }

    /// The experts over `ep` ranks: the rows of `xs` (`tokens[i]` for assignment `i`, in
    /// dispatch order, `per_expert` of them for each expert) go to their experts' ranks,
    /// through the local experts there and back, and are summed at their tokens times
    /// their gates `g` ([`combine_experts`]).
    fn exchanged(
        &self,
        xs: &Tensor,
        g: &Tensor,
        tokens: Vec<u32>,
        per_expert: &[i64],
    ) -> Result<Tensor> {
        let per = self.spec.experts / self.ctx.ep.size();
        let tok_idx = Tensor::from_vec(tokens.clone(), tokens.len(), &Device::Cpu)?;
        let disp = xs.index_select(&tok_idx, 0)?;
        let (recv, recv_counts) = self.exchange(&disp, per_expert, per)?;
        // Each local expert computes its rows; rows from each source arrive grouped by
        // expert.
        let mut offset = 0;
        let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); per];
        for src in &recv_counts {
            for (le, &c) in src.iter().enumerate() {
                rows_of[le].extend((offset..offset + c as usize).map(|r| r as u32));
                offset += c as usize;
            }
        }
        // Grouped by expert (already so from one source), the experts run as one node over
        // their row blocks ([`experts_swiglu`]) and their outputs go back in receive order:
        // one copy each way.
        let order: Vec<u32> = rows_of.concat();
        let grouped = order.iter().enumerate().all(|(i, &r)| i as u32 == r);
        let by_expert = if grouped {
            recv.clone()
        } else {
            recv.index_select(&Tensor::from_vec(order.clone(), order.len(), &Device::Cpu)?, 0)?
        };
        let y = if order.is_empty() {
            recv.zeros_like()?
        } else {
            let rows = rows_of.iter().map(Vec::len).collect();
            // The router's weight anchors the node in the graph (it gets no gradient there).
            let anchor = self.gate.tensor();
            experts_swiglu(self.matmul, &by_expert, anchor, self.expert_weights(), rows)?
        };
        let out_recv = if grouped {
            y
        } else {
            let mut inverse = vec![0u32; order.len()];
            for (i, &r) in order.iter().enumerate() {
                inverse[r as usize] = i as u32;
            }
            y.index_select(&Tensor::from_vec(inverse, order.len(), &Device::Cpu)?, 0)?
        };
        let back = self.exchange_back(&out_recv, per_expert, &recv_counts, per)?;
        // Back in assignment order: weighted and summed per token as one node.
        Ok(combine_experts(&back, g, tokens, xs.dims()[0])?)
    }

    /// Sends each assignment row to the ep rank owning its expert. Returns the received
    /// rows (grouped by source, then local expert) and the per-source, per-local-expert
    /// counts.
    fn exchange(
        &self,
        disp: &Tensor,
        per_expert: &[i64],
        per: usize,
    ) -> Result<(Tensor, Vec<Vec<i64>>)> {
        let Some(comm) = self.ctx.ep.comm() else {
            return Ok((disp.clone(), vec![per_expert.to_vec()]));
        };
        let ep = self.ctx.ep.size();
        let mut counts = vec![0i64; ep * per];
        comm.all_to_all_v(per_expert, &vec![per; ep], &mut counts, &vec![per; ep])?;
        let recv_counts: Vec<Vec<i64>> = counts.chunks(per).map(<[i64]>::to_vec).collect();
        let send_rows: Vec<usize> =
            per_expert.chunks(per).map(|c| c.iter().sum::<i64>() as usize).collect();
        let recv_rows: Vec<usize> =
            recv_counts.iter().map(|c| c.iter().sum::<i64>() as usize).collect();
        let op = AllToAllRows {
            comm: comm.clone(),
            send: Arc::new(send_rows),
            recv: Arc::new(recv_rows),
        };
        Ok((disp.contiguous()?.apply_op1(op)?, recv_counts))
    }

    /// The inverse of [`Self::exchange`]: expert outputs back to the ranks that sent them.
    fn exchange_back(
        &self,
        rows: &Tensor,
        per_expert: &[i64],
        recv_counts: &[Vec<i64>],
        per: usize,
    ) -> Result<Tensor> {
        let Some(comm) = self.ctx.ep.comm() else {
            return Ok(rows.clone());
        };
        let send_rows: Vec<usize> =
            recv_counts.iter().map(|c| c.iter().sum::<i64>() as usize).collect();
        let recv_rows: Vec<usize> =
            per_expert.chunks(per).map(|c| c.iter().sum::<i64>() as usize).collect();
        let op = AllToAllRows {
            comm: comm.clone(),
            send: Arc::new(send_rows),
            recv: Arc::new(recv_rows),
        };
        Ok(rows.contiguous()?.apply_op1(op)?)
    }

    fn aux_loss(&self, probs: &Tensor, per_expert: &[i64], n_sub: usize) -> Result<Tensor> {
        let mut counts = per_expert.to_vec();
        let mut tokens = [n_sub as i64];
        if let Some(c) = self.ctx.stage.comm() {
            c.all_reduce(&mut counts, ReduceOp::Sum)?;
            c.all_reduce(&mut tokens, ReduceOp::Sum)?;
        }
        let (e, k, total) = (self.spec.experts, self.spec.top_k, tokens[0].max(1) as f64);
        let f: Vec<f64> = counts.iter().map(|&c| c as f64 / (total * k as f64)).collect();
        let f = Tensor::from_vec(f, e, &Device::Cpu)?.to_dtype(probs.dtype())?;
        let p_sum = probs.sum(0)?;
        Ok(((p_sum * f)?.sum_all()? * (self.spec.aux_coef * e as f64 / total))?)
    }
}

impl HasParams for Moe {
    fn params(&self) -> Vec<&Param> {
        std::iter::once(&self.gate)
            .chain(self.experts.iter().flat_map(|(_, x)| [&x.w1, &x.w3, &x.w2]))
            .collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        std::iter::once(&mut self.gate)
            .chain(self.experts.iter_mut().flat_map(|(_, x)| [&mut x.w1, &mut x.w3, &mut x.w2]))
            .collect()
    }
}
