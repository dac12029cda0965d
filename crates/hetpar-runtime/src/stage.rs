//! The executor's view of a model: a module's virtual stages on one rank. The executor
//! keeps the per-microbatch stash (received activations as leaves, outputs, gradients) and
//! never looks inside a model; a new module kind adds an implementation of [`Stage`].

use candle_core::{DType, Tensor};
use hetpar_layout::ModuleId;
use hetpar_nn::{ParallelCtx, Param};

use crate::error::RuntimeError;

/// What a virtual stage's forward produced for one microbatch.
#[derive(Debug)]
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
}

/// A module's virtual stages on one rank.
pub trait Stage: Send {
    /// The module.
    fn module(&self) -> ModuleId;
    /// Its parallel context on this rank.
    fn ctx(&self) -> &ParallelCtx;
    /// Element type of activations and gradients.
    fn dtype(&self) -> DType;
    /// Prepares step `step` (its data); called once before the step's first action.
    fn begin_step(&mut self, step: usize) -> Result<(), RuntimeError>;
    /// Shape of the activation virtual stage `vstage` receives for microbatch `mb` from its
    /// predecessor.
    fn input_shape(&self, vstage: usize, mb: usize) -> Vec<usize>;
    /// Forward of virtual stage `vstage` for microbatch `mb`; `input` is the received
    /// activation (a leaf whose gradient the executor sends back), `None` on the module's
    /// first stage.
    fn forward(
        &mut self,
        vstage: usize,
        mb: usize,
        input: Option<&Tensor>,
    ) -> Result<Forward, RuntimeError>;
    /// Every parameter this rank holds, in a fixed order.
    fn params(&self) -> Vec<&Param>;
}
