//! A ViT encoder (Dosovitskiy et al. 2020) with a 2-layer MLP projector into the LLM width
//! (LLaVA), with SigLIP/CLIP-style names: `vision_model.embeddings.patch_embedding`,
//! `vision_model.embeddings.position_embedding`, `vision_model.encoder.layers.{i}.
//! {layer_norm1,self_attn.{q,k,v,out}_proj,layer_norm2,mlp.fc1,mlp.fc2}`,
//! `vision_model.post_layernorm`, `multi_modal_projector.linear_{1,2}`.
//!
//! Each image is its own bidirectional sequence of patches. Under context parallelism a rank
//! holds a contiguous part of every image's patches (`cp` equal parts, cut again over `tp`
//! under SP), the same split the boundary plans assume (`ownership::item_owner`), so the
//! projector's output rows are exactly the rows this rank holds.
//!
//! Under pipeline parallelism a rank builds one stage ([`Vit::stage`]): a range of the
//! layers, the patch embedding on the first stage, the final norm and projector on the
//! last; the stages between take and give hidden states `[images, local_patches, hidden]`.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::init::Init;
use crate::kernels::linear::{Matmul, linear_bias_as};
use crate::layers::attention::{CpMode, CpPositions};
use crate::layers::linear::Build;
use crate::models::encoder::{self, HeadNames, LayerNames, LayerShape, Trunk};
use crate::params::{HasParams, Param};

/// Sizes and options of a ViT.
#[derive(Clone, Copy, Debug)]
pub struct VitConfig {
    /// Image side in pixels.
    pub image_size: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Width.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Heads.
    pub heads: usize,
    /// MLP width.
    pub ffn: usize,
    /// Output width: the LLM's hidden size.
    pub out_hidden: usize,
    /// LayerNorm epsilon.
    pub ln_eps: f64,
    /// Context-parallel attention mode.
    pub cp_mode: CpMode,
}

impl VitConfig {
    /// Patches (and output rows) per image.
    pub fn patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }
}

/// The patch and position embeddings (the first pipeline stage's).
#[derive(Debug)]
struct Embed {
    patch_w: Param,
    patch_b: Param,
    pos: Param,
    /// How the patch embedding multiplies (the model's linear layers' way).
    matmul: Matmul,
}

/// The encoder and projector (or one pipeline stage of them) on one rank.
#[derive(Debug)]
pub struct Vit {
    ctx: Arc<ParallelCtx>,
    cfg: VitConfig,
    embed: Option<Embed>,
    trunk: Trunk,
}

impl Vit {
    /// The model; every rank of the module builds its shard.
    pub fn new(b: &Build, cfg: VitConfig) -> Result<Vit> {
        Self::stage(b, cfg, 0..cfg.layers, true, true)
    }

    /// Layers `layers`, the embeddings if `first`, the final norm and projector if `last`.
    pub fn stage(
        b: &Build,
        cfg: VitConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
    ) -> Result<Vit> {
        let p = cfg.patch_size;
        let std = 0.02;
        let e = "vision_model.embeddings";
        let shape = LayerShape {
            hidden: cfg.hidden,
            heads: cfg.heads,
            ffn: cfg.ffn,
            ln_eps: cfg.ln_eps,
            layers: cfg.layers,
            key_bias: true,
            cp_mode: cfg.cp_mode,
        };
        let names = LayerNames {
            ln1: "layer_norm1",
            attn: "self_attn",
            ln2: "layer_norm2",
            fc1: "mlp.fc1",
            fc2: "mlp.fc2",
        };
        let head = HeadNames {
            norm: "vision_model.post_layernorm",
            proj1: "multi_modal_projector.linear_1",
            proj2: "multi_modal_projector.linear_2",
        };
        let head = last.then_some((&head, cfg.out_hidden));
        let prefix = "vision_model.encoder.layers";
        let trunk = Trunk::new(b, prefix, &names, shape, layers, head)?;
        let embed = if first {
            Some(Embed {
                // The conv patch embedding `[hidden, 3, p, p]` as a linear map over
                // flattened (channel, row, column) patches.
                patch_w: b.replicated(
                    format!("{e}.patch_embedding.weight"),
                    &[cfg.hidden, 3, p, p],
                    Init::Normal(std),
                )?,
                patch_b: b.replicated(
                    format!("{e}.patch_embedding.bias"),
                    &[cfg.hidden],
                    Init::Const(0.0),
                )?,
                pos: b.replicated(
                    format!("{e}.position_embedding.weight"),
                    &[cfg.patches(), cfg.hidden],
                    Init::Normal(std),
                )?,
                matmul: b.matmul,
            })
        } else {
            None
        };
        Ok(Vit { ctx: b.ctx.clone(), cfg, embed, trunk })
    }

    /// The configuration.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Patch positions of every cp rank (contiguous equal parts) and this rank's slot.
    pub fn cp_positions(&self) -> Result<CpPositions> {
        encoder::cp_positions(&self.ctx, self.cfg.patches(), "patches per image")
    }

    /// Patch positions this rank's tokens hold (its cp part, cut again over tp under SP).
    pub fn local_positions(&self) -> Result<Vec<usize>> {
        encoder::local_positions(&self.ctx, self.cfg.patches(), "patches per image")
    }

    /// This stage's forward: `pixels` `[images, 3, size, size]` on the first stage, hidden
    /// states `[images, local_patches, hidden]` on the others; projected rows `[images,
    /// local_patches, out_hidden]` (this rank's patches of every image, in patch order) out
    /// of the last, hidden states out of the others.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let x = match &self.embed {
            Some(e) => self.embed(e, input)?,
            None => input.clone(),
        };
        self.trunk.forward(x, &self.cp_positions()?)
    }

    fn embed(&self, e: &Embed, pixels: &Tensor) -> Result<Tensor> {
        let (n, c, hgt, wid) = pixels.dims4()?;
        let p = self.cfg.patch_size;
        if c != 3 || hgt != self.cfg.image_size || wid != self.cfg.image_size {
            return Err(NnError::Input(format!(
                "images are {c}x{hgt}x{wid}, the encoder takes 3x{0}x{0}",
                self.cfg.image_size
            )));
        }
        let g = hgt / p;
        // [n, 3, g, p, g, p] -> [n, g, g, 3, p, p] -> [n, patches, 3*p*p]
        let patches = pixels
            .reshape((n, 3, g, p, g, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((n, g * g, 3 * p * p))?;
        let local = self.local_positions()?;
        let idx = Tensor::from_vec(
            local.iter().map(|&i| i as u32).collect::<Vec<_>>(),
            local.len(),
            &Device::Cpu,
        )?;
        let patches = patches.index_select(&idx, 1)?.to_dtype(e.patch_w.tensor().dtype())?;
        let w = e.patch_w.tensor().reshape((self.cfg.hidden, 3 * p * p))?;
        let x = linear_bias_as(e.matmul, &patches, &w, e.patch_b.tensor())?;
        Ok(x.broadcast_add(&e.pos.tensor().index_select(&idx, 0)?.unsqueeze(0)?)?)
    }
}

impl HasParams for Vit {
    fn params(&self) -> Vec<&Param> {
        let mut v = Vec::new();
        if let Some(e) = &self.embed {
            v.extend([&e.patch_w, &e.patch_b, &e.pos]);
        }
        v.extend(self.trunk.params());
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = Vec::new();
        if let Some(e) = &mut self.embed {
            v.extend([&mut e.patch_w, &mut e.patch_b, &mut e.pos]);
        }
        v.extend(self.trunk.params_mut());
        v
    }
}
