//! The executor's view of a model: a module's virtual stages on one rank. The executor
//! keeps the per-microbatch stash (received activations as leaves, outputs, gradients) and
//! never looks inside a model; a new module kind adds an implementation of [`Stage`].

use candle_core::{DType, Tensor};
use hetpar_layout::{BatchManifest, EdgeGeometry, EdgeId, ModuleId};
use hetpar_nn::{ParallelCtx, Param};

use crate::error::RuntimeError;

/// One target token of a scored (held-out) batch, on the rank that holds its logit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scored {
    /// The sample (index in the step's manifest).
    pub sample: usize,
    /// The position whose next token it is.
    pub pos: usize,
    /// The target token.
    pub target: u32,
    /// The model's top token at `pos`: the target where its logit is the row's maximum
    /// over the whole vocabulary (a tie counts for the target), else the lowest id holding
    /// the maximum; [`NO_TOP`] where the row has none (a NaN logit).
    pub top: u32,
}

impl Scored {
    /// Whether the model's top token is the target (greedy decoding would emit it).
    pub fn correct(&self) -> bool {
        self.top == self.target
    }
}

/// [`Scored::top`] of a row whose logits have no maximum (a NaN among them).
pub const NO_TOP: u32 = u32::MAX;

/// What a virtual stage's forward produced for one microbatch.
#[derive(Debug, Default)]
pub struct Forward {
    /// The activation the next virtual stage takes (`None` where the module ends the
    /// model). Its gradient comes back as the seed of this stage's backward.
    pub out: Option<Tensor>,
    /// A scalar this stage adds to the objective, already normalized (the LLM's loss over
    /// the global count of target tokens, a MoE auxiliary loss); its gradient is part of
    /// the backward.
    pub loss: Option<Tensor>,
    /// This rank's share of the step's reported loss: summed over every rank of the job
    /// it gives the loss, each token counted once.
    pub reported: f64,
    /// Target tokens this rank scored (held-out batches only; see [`Scored`]).
    pub scored: Vec<Scored>,
}

/// Encoder rows an edge delivered to this rank for one microbatch: `rows` `[n, width]` in
/// the order of the edge geometry's `needed` list for this rank.
#[derive(Clone, Copy, Debug)]
pub struct BoundaryIn<'a> {
    /// The edge.
    pub edge: EdgeId,
    /// The rows, a leaf whose gradient goes back over the edge.
    pub rows: &'a Tensor,
    /// Who holds and needs each row.
    pub geometry: &'a EdgeGeometry,
}

/// A module's virtual stages on one rank.
pub trait Stage: Send {
    /// The module.
    fn module(&self) -> ModuleId;
    /// Its parallel context on this rank.
    fn ctx(&self) -> &ParallelCtx;
    /// Element type of activations and gradients.
    fn dtype(&self) -> DType;
    /// Virtual stages of the module (`pp * vpp`).
    fn n_vstages(&self) -> usize;
    /// Width of the rows this module exchanges at its boundaries (the LLM's hidden size).
    fn width(&self) -> usize;
    /// Prepares step `step` with its manifest (the same on every rank); called once before
    /// the step's first action.
    fn begin_step(&mut self, step: usize, manifest: &BatchManifest) -> Result<(), RuntimeError>;
    /// Shape of the activation virtual stage `vstage` receives for microbatch `mb` from its
    /// predecessor.
    fn input_shape(&self, vstage: usize, mb: usize) -> Result<Vec<usize>, RuntimeError>;
    /// Forward of virtual stage `vstage` for microbatch `mb`; `input` is the received
    /// activation (a leaf whose gradient the executor sends back), `None` on the module's
    /// first stage, where `boundary` holds what each edge into the module delivered. A
    /// module's last stage returns its boundary rows `[n, width]` in the order of the edge
    /// geometry's `held` list for this rank.
    fn forward(
        &mut self,
        vstage: usize,
        mb: usize,
        input: Option<&Tensor>,
        boundary: &[BoundaryIn<'_>],
    ) -> Result<Forward, RuntimeError>;
    /// Every parameter this rank holds, in a fixed order.
    fn params(&self) -> Vec<&Param>;
    /// The same parameters, in the same order, to release and restore their storage
    /// (offload).
    fn params_mut(&mut self) -> Vec<&mut Param>;
}
