//! Encoders (the ViT, the audio encoder) as [`Stage`]s. A replica runs the items it owns in
//! each microbatch (a contiguous range of the microbatch's items on the encoder's edge, in
//! canonical order) and returns its rows of each, item after item, which is the edge
//! geometry's `held` order. A replica that owns no item returns no rows and still takes its
//! part in every collective of the step.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use hetpar_layout::{BatchManifest, EdgeId, ItemRef, ModuleId};
use hetpar_nn::models::audio::AudioEncoder;
use hetpar_nn::models::vit::Vit;
use hetpar_nn::{HasParams, ParallelCtx, Param};

use crate::error::RuntimeError;
use crate::stage::{BoundaryIn, Forward, Stage};

/// Where an encoder gets its inputs.
pub trait ItemSource: Send + Sync {
    /// The input of `item` in step `step`: pixels `[3, size, size]` for a ViT, log-mel
    /// features `[mels, frames]` for the audio encoder. Only ranks that run the item ask.
    fn item(
        &self,
        step: usize,
        manifest: &BatchManifest,
        edge: EdgeId,
        item: ItemRef,
    ) -> Result<Tensor, RuntimeError>;
}

/// An encoder model.
#[derive(Debug)]
pub enum EncoderModel {
    /// Vision.
    Vit(Vit),
    /// Audio.
    Audio(AudioEncoder),
}

impl EncoderModel {
    fn forward(&self, x: &Tensor) -> Result<Tensor, RuntimeError> {
        Ok(match self {
            EncoderModel::Vit(m) => m.forward(x)?,
            EncoderModel::Audio(m) => m.forward(x)?,
        })
    }

    fn params(&self) -> Vec<&Param> {
        match self {
            EncoderModel::Vit(m) => m.params(),
            EncoderModel::Audio(m) => m.params(),
        }
    }
}

/// An encoder module on one rank (one pipeline stage).
pub struct EncoderStage {
    module: ModuleId,
    edge: EdgeId,
    ctx: Arc<ParallelCtx>,
    dtype: DType,
    width: usize,
    model: EncoderModel,
    source: Arc<dyn ItemSource>,
    step: Option<(usize, BatchManifest)>,
}

impl std::fmt::Debug for EncoderStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EncoderStage(module {}, rank {})", self.module, self.ctx.rank)
    }
}

impl EncoderStage {
    /// Encoder `model` of `module` feeding `edge`, its rows `width` wide.
    pub fn new(
        module: ModuleId,
        edge: EdgeId,
        ctx: Arc<ParallelCtx>,
        dtype: DType,
        width: usize,
        model: EncoderModel,
        source: Arc<dyn ItemSource>,
    ) -> Result<EncoderStage, RuntimeError> {
        if ctx.layout.pp() > 1 {
            return Err(RuntimeError::Model(format!(
                "module {}: encoders run as one pipeline stage here (pp {} asked)",
                ctx.layout.name(),
                ctx.layout.pp()
            )));
        }
        Ok(EncoderStage { module, edge, ctx, dtype, width, model, source, step: None })
    }
}

impl Stage for EncoderStage {
    fn module(&self) -> ModuleId {
        self.module
    }

    fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn n_vstages(&self) -> usize {
        1
    }

    fn width(&self) -> usize {
        self.width
    }

    fn begin_step(&mut self, step: usize, manifest: &BatchManifest) -> Result<(), RuntimeError> {
        self.step = Some((step, manifest.clone()));
        Ok(())
    }

    fn input_shape(&self, vstage: usize, _mb: usize) -> Result<Vec<usize>, RuntimeError> {
        Err(RuntimeError::Model(format!(
            "module {}: an encoder of one pipeline stage receives no activation (asked for stage {vstage})",
            self.ctx.layout.name()
        )))
    }

    fn forward(
        &mut self,
        _vstage: usize,
        mb: usize,
        _input: Option<&Tensor>,
        _boundary: &[BoundaryIn<'_>],
    ) -> Result<Forward, RuntimeError> {
        let (step, manifest) =
            self.step.as_ref().ok_or_else(|| RuntimeError::Model("no step has begun".into()))?;
        let (dp, d) = (self.ctx.layout.dp(), self.ctx.coords.dp_idx);
        let items = manifest.microbatch_items(self.edge, mb);
        let mine = &items[manifest.replica_items(self.edge, dp, d, mb)];
        if mine.is_empty() {
            let out = Tensor::zeros((0, self.width), self.dtype, &candle_core::Device::Cpu)?;
            return Ok(Forward { out: Some(out), loss: None, reported: 0.0 });
        }
        let inputs = mine
            .iter()
            .map(|&r| self.source.item(*step, manifest, self.edge, r))
            .collect::<Result<Vec<_>, _>>()?;
        let x = Tensor::stack(&inputs, 0)?.to_dtype(self.dtype)?;
        let y = self.model.forward(&x)?;
        let (n, rows, w) = y.dims3()?;
        Ok(Forward { out: Some(y.reshape((n * rows, w))?), loss: None, reported: 0.0 })
    }

    fn params(&self) -> Vec<&Param> {
        self.model.params()
    }
}
