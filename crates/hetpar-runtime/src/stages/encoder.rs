//! Encoders (the ViT, the audio encoder) as [`Stage`]s. A replica runs the items it owns in
//! each microbatch (a contiguous range of the microbatch's items on the encoder's edge, in
//! canonical order) and returns its rows of each, item after item, which is the edge
//! geometry's `held` order. A replica that owns no item returns no rows and still takes its
//! part in every collective of the step.
//!
//! Under pipeline parallelism each stage of a replica holds a range of the layers: the
//! first reads the items, the ones after it take the hidden states `[items, local_rows,
//! hidden]` of the replica's items from the stage before (an empty tensor where the
//! replica owns none), the last returns the rows.

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

    fn params_mut(&mut self) -> Vec<&mut Param> {
        match self {
            EncoderModel::Vit(m) => m.params_mut(),
            EncoderModel::Audio(m) => m.params_mut(),
        }
    }

    /// Rows of one item this rank holds, and the encoder's width: the shape of the hidden
    /// states between pipeline stages.
    fn hidden_shape(&self) -> Result<(usize, usize), RuntimeError> {
        Ok(match self {
            EncoderModel::Vit(m) => (m.local_positions()?.len(), m.config().hidden),
            EncoderModel::Audio(m) => (m.local_positions()?.len(), m.config().hidden),
        })
    }
}

/// An encoder module on one rank (one pipeline stage of it).
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
        Ok(EncoderStage { module, edge, ctx, dtype, width, model, source, step: None })
    }
}

impl EncoderStage {
    fn begun(&self) -> Result<(&usize, &BatchManifest), RuntimeError> {
        let (step, manifest) =
            self.step.as_ref().ok_or_else(|| RuntimeError::Model("no step has begun".into()))?;
        Ok((step, manifest))
    }

    /// The items this rank's replica owns in microbatch `mb`.
    fn mine(&self, manifest: &BatchManifest, mb: usize) -> Vec<ItemRef> {
        let (dp, d) = (self.ctx.layout.dp(), self.ctx.coords.dp_idx);
        let items = manifest.microbatch_items(self.edge, mb);
        items[manifest.replica_items(self.edge, dp, d, mb)].to_vec()
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
        self.ctx.layout.pp()
    }

    fn width(&self) -> usize {
        self.width
    }

    fn begin_step(&mut self, step: usize, manifest: &BatchManifest) -> Result<(), RuntimeError> {
        self.step = Some((step, manifest.clone()));
        Ok(())
    }

    fn input_shape(&self, vstage: usize, mb: usize) -> Result<Vec<usize>, RuntimeError> {
        if vstage == 0 || vstage >= self.n_vstages() {
            return Err(RuntimeError::Model(format!(
                "module {}: stage {vstage} of {} receives no activation",
                self.ctx.layout.name(),
                self.n_vstages()
            )));
        }
        let (_, manifest) = self.begun()?;
        let (rows, hidden) = self.model.hidden_shape()?;
        Ok(vec![self.mine(manifest, mb).len(), rows, hidden])
    }

    fn forward(
        &mut self,
        vstage: usize,
        mb: usize,
        input: Option<&Tensor>,
        _boundary: &[BoundaryIn<'_>],
    ) -> Result<Forward, RuntimeError> {
        let (step, manifest) = self.begun()?;
        let mine = self.mine(manifest, mb);
        let last = vstage + 1 == self.n_vstages();
        let cpu = &candle_core::Device::Cpu;
        if mine.is_empty() {
            let out = if last {
                Tensor::zeros((0, self.width), self.dtype, cpu)?
            } else {
                let (rows, hidden) = self.model.hidden_shape()?;
                Tensor::zeros((0, rows, hidden), self.dtype, cpu)?
            };
            return Ok(Forward { out: Some(out), loss: None, reported: 0.0, scored: Vec::new() });
        }
        let x = match input {
            Some(x) if vstage > 0 => x.clone(),
            None if vstage == 0 => {
                let inputs = mine
                    .iter()
                    .map(|&r| self.source.item(*step, manifest, self.edge, r))
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::stack(&inputs, 0)?.to_dtype(self.dtype)?
            }
            _ => {
                return Err(RuntimeError::Model(format!(
                    "module {} stage {vstage}: {} input",
                    self.ctx.layout.name(),
                    if vstage == 0 { "the first stage takes no" } else { "no" }
                )));
            }
        };
        let y = self.model.forward(&x)?;
        if !last {
            return Ok(Forward { out: Some(y), loss: None, reported: 0.0, scored: Vec::new() });
        }
        let (n, rows, w) = y.dims3()?;
        Ok(Forward {
            out: Some(y.reshape((n * rows, w))?),
            loss: None,
            reported: 0.0,
            scored: Vec::new(),
        })
    }

    fn params(&self) -> Vec<&Param> {
        self.model.params()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.model.params_mut()
    }
}
