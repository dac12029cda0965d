//! A Llama-style decoder LLM (RMSNorm, RoPE, grouped-query attention, SwiGLU), dense or with
//! Mixtral-style MoE layers, with HF parameter names (`model.embed_tokens`,
//! `model.layers.{i}.self_attn.q_proj`, `...mlp.gate_proj` or
//! `...block_sparse_moe.experts.{e}.w1`, `model.norm`, `lm_head`).
//!
//! The input embedding takes encoder rows at placeholder positions: the embedded tokens at
//! those slots are replaced by the boundary rows, whose gradient flows back to the encoder.
//! A pipeline stage holds a range of layers, the embedding on the first stage and the final
//! norm and head on the last.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::layers::attention::{Attention, AttentionSpec, CpMode, CpPositions};
use crate::layers::embedding::VocabParallelEmbedding;
use crate::layers::linear::{Build, ColumnParallel};
use crate::layers::loss::cross_entropy;
use crate::layers::mlp::SwiGlu;
use crate::layers::moe::{Moe, MoeSpec};
use crate::layers::norm::RmsNorm;
use crate::params::{HasParams, Param};

/// Sizes and options of a Llama model.
#[derive(Clone, Copy, Debug)]
pub struct LlamaConfig {
    /// Vocabulary.
    pub vocab: usize,
    /// Width.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// MLP width (per expert for MoE).
    pub ffn: usize,
    /// Experts (0: dense).
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Weight of the MoE load-balancing loss.
    pub aux_coef: f64,
    /// Context-parallel attention mode.
    pub cp_mode: CpMode,
}

/// Encoder rows placed into the embedded sequence.
#[derive(Clone, Debug)]
pub struct Boundary {
    /// Rows `[n, hidden]`.
    pub rows: Tensor,
    /// For each row, its slot in this rank's embedded tokens flattened as `[batch * local_seq]`.
    pub slots: Vec<usize>,
}

/// One step's input on one rank.
#[derive(Clone, Debug)]
pub struct LlamaBatch {
    /// Token ids `[batch, cp_seq]` of this rank's context-parallel positions (the same on
    /// every tp rank), row-major.
    pub tokens: Vec<u32>,
    /// Samples.
    pub batch: usize,
    /// Positions of every cp rank.
    pub positions: CpPositions,
    /// Encoder rows, if any.
    pub boundary: Option<Boundary>,
    /// Target ids `[batch, cp_seq]`, negative where no loss is taken.
    pub targets: Arc<Vec<i64>>,
}

/// One step's result on one rank.
#[derive(Debug)]
pub struct LlamaOutput {
    /// Sum of the token losses of this rank's positions (replicated over tp).
    pub loss_sum: Tensor,
    /// This rank's part of the MoE load-balancing loss (0 when dense).
    pub aux: Tensor,
    /// Tokens with a target on this rank.
    pub tokens: usize,
}

#[derive(Debug)]
enum Ffn {
    Dense(Box<SwiGlu>),
    Moe(Box<Moe>),
}

#[derive(Debug)]
struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    ffn: Ffn,
}

/// The layers of one pipeline stage of a Llama model.
#[derive(Debug)]
pub struct Llama {
    ctx: Arc<ParallelCtx>,
    cfg: LlamaConfig,
    embed: Option<VocabParallelEmbedding>,
    layers: Vec<Layer>,
    norm: Option<RmsNorm>,
    head: Option<ColumnParallel>,
}

impl Llama {
    /// The whole model on one stage.
    pub fn new(b: &Build, cfg: LlamaConfig) -> Result<Llama> {
        Self::stage(b, cfg, 0..cfg.layers, true, true)
    }

    /// Layers `layers`, the embedding if `first`, the norm and head if `last`.
    pub fn stage(
        b: &Build,
        cfg: LlamaConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
    ) -> Result<Llama> {
        let std = 0.02;
        // Output projections scaled down with depth (Megatron's scaled init).
        let out_std = std / (2.0 * cfg.layers as f64).sqrt();
        let spec = AttentionSpec {
            hidden: cfg.hidden,
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            causal: true,
            rope_theta: Some(cfg.rope_theta),
            bias: false,
            key_bias: false,
            cp_mode: cfg.cp_mode,
        };
        let layers = layers
            .map(|i| {
                let p = format!("model.layers.{i}");
                let ffn = if cfg.experts > 0 {
                    let moe = MoeSpec {
                        hidden: cfg.hidden,
                        ffn: cfg.ffn,
                        experts: cfg.experts,
                        top_k: cfg.top_k,
                        aux_coef: cfg.aux_coef,
                    };
                    Ffn::Moe(Box::new(Moe::new(
                        b,
                        &format!("{p}.block_sparse_moe"),
                        moe,
                        std,
                        out_std,
                    )?))
                } else {
                    Ffn::Dense(Box::new(SwiGlu::new(
                        b,
                        &format!("{p}.mlp"),
                        cfg.hidden,
                        cfg.ffn,
                        std,
                        out_std,
                    )?))
                };
                Ok(Layer {
                    input_norm: RmsNorm::new(
                        b,
                        &format!("{p}.input_layernorm"),
                        cfg.hidden,
                        cfg.rms_eps,
                    )?,
                    attn: Attention::new(
                        b,
                        &format!("{p}.self_attn"),
                        "o_proj",
                        spec,
                        std,
                        out_std,
                    )?,
                    post_norm: RmsNorm::new(
                        b,
                        &format!("{p}.post_attention_layernorm"),
                        cfg.hidden,
                        cfg.rms_eps,
                    )?,
                    ffn,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Llama {
            ctx: b.ctx.clone(),
            cfg,
            embed: if first {
                Some(VocabParallelEmbedding::new(
                    b,
                    "model.embed_tokens",
                    cfg.vocab,
                    cfg.hidden,
                    std,
                )?)
            } else {
                None
            },
            layers,
            norm: if last {
                Some(RmsNorm::new(b, "model.norm", cfg.hidden, cfg.rms_eps)?)
            } else {
                None
            },
            head: if last {
                Some(ColumnParallel::new(b, "lm_head", cfg.hidden, cfg.vocab, false, std)?)
            } else {
                None
            },
        })
    }

    /// Token embeddings with the boundary rows in their slots: `[batch, local_seq, hidden]`.
    pub fn embed(&self, batch: &LlamaBatch) -> Result<Tensor> {
        let embed = self
            .embed
            .as_ref()
            .ok_or_else(|| NnError::Input("this stage has no embedding".into()))?;
        let x = embed.forward(&batch.tokens, batch.batch)?;
        let Some(bnd) = &batch.boundary else { return Ok(x) };
        let (b, s, h) = x.dims3()?;
        if bnd.rows.dims2()? != (bnd.slots.len(), h) {
            return Err(NnError::Input(format!(
                "boundary rows {:?} for {} slots of width {h}",
                bnd.rows.dims(),
                bnd.slots.len()
            )));
        }
        let mut keep = vec![1.0f64; b * s];
        for &slot in &bnd.slots {
            *keep.get_mut(slot).ok_or_else(|| {
                NnError::Input(format!("boundary slot {slot} is outside {b} x {s} local tokens"))
            })? = 0.0;
        }
        let keep = Tensor::from_vec(keep, (b * s, 1), &Device::Cpu)?.to_dtype(x.dtype())?;
        let idx = Tensor::from_vec(
            bnd.slots.iter().map(|&s| s as u32).collect::<Vec<_>>(),
            bnd.slots.len(),
            &Device::Cpu,
        )?;
        let flat = x.reshape((b * s, h))?.broadcast_mul(&keep)?.index_add(
            &idx,
            &bnd.rows.to_dtype(x.dtype())?,
            0,
        )?;
        Ok(flat.reshape((b, s, h))?)
    }

    /// Runs this stage's layers on `x`; returns the output and the MoE aux loss part.
    pub fn layers(&self, x: &Tensor, positions: &CpPositions) -> Result<(Tensor, Tensor)> {
        let mut x = x.clone();
        let mut aux = Tensor::zeros((), x.dtype(), &Device::Cpu)?;
        for l in &self.layers {
            x = l.attn.residual(&x, &l.input_norm, positions)?;
            x = match &l.ffn {
                Ffn::Dense(m) => m.residual(&x, &l.post_norm)?,
                Ffn::Moe(m) => {
                    let (y, a) = m.residual(&x, &l.post_norm)?;
                    aux = (aux + a)?;
                    y
                }
            };
        }
        Ok((x, aux))
    }

    /// Vocabulary-sharded logits `[batch * cp_seq, vocab / tp]` of hidden states `x`.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let (norm, head) = match (&self.norm, &self.head) {
            (Some(n), Some(h)) => (n, h),
            _ => return Err(NnError::Input("this stage has no head".into())),
        };
        let y = head.forward(&norm.forward(x)?)?;
        let (b, s, v) = y.dims3()?;
        Ok(y.reshape((b * s, v))?)
    }

    /// The whole forward of a single-stage model: embedding, layers, head, loss.
    pub fn forward(&self, batch: &LlamaBatch) -> Result<LlamaOutput> {
        let x = self.embed(batch)?;
        let (x, aux) = self.layers(&x, &batch.positions)?;
        let losses = cross_entropy(&self.ctx, &self.logits(&x)?, batch.targets.clone())?;
        Ok(LlamaOutput {
            loss_sum: losses.sum_all()?,
            aux,
            tokens: batch.targets.iter().filter(|&&t| t >= 0).count(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }
}

impl HasParams for Llama {
    fn params(&self) -> Vec<&Param> {
        let mut v: Vec<&Param> = self.embed.iter().flat_map(HasParams::params).collect();
        for l in &self.layers {
            v.extend(l.input_norm.params());
            v.extend(l.attn.params());
            v.extend(l.post_norm.params());
            match &l.ffn {
                Ffn::Dense(m) => v.extend(m.params()),
                Ffn::Moe(m) => v.extend(m.params()),
            }
        }
        v.extend(self.norm.iter().flat_map(HasParams::params));
        v.extend(self.head.iter().flat_map(HasParams::params));
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v: Vec<&mut Param> =
            self.embed.iter_mut().flat_map(HasParams::params_mut).collect();
        for l in &mut self.layers {
            v.extend(l.input_norm.params_mut());
            v.extend(l.attn.params_mut());
            v.extend(l.post_norm.params_mut());
            match &mut l.ffn {
                Ffn::Dense(m) => v.extend(m.params_mut()),
                Ffn::Moe(m) => v.extend(m.params_mut()),
            }
        }
        v.extend(self.norm.iter_mut().flat_map(HasParams::params_mut));
        v.extend(self.head.iter_mut().flat_map(HasParams::params_mut));
        v
    }
}
