//! Errors of the runtime.

use hetpar_comm::CommError;
use thiserror::Error;

/// Why a step could not run.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RuntimeError {
    /// A communication failed (timeout, failed peer, mismatch).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Training data could not be read or used (the message names the record and file).
    #[error("data: {0}")]
    Data(String),
    /// Model code failed (a tensor operation, bad input to a stage).
    #[error("{0}")]
    Model(String),
    /// A gradient held a NaN or an infinity (RELIABILITY.md row 6).
    #[error("non-finite gradient in {module} parameter {param}")]
    NonFinite {
        /// Module.
        module: String,
        /// Parameter (HF name).
        param: String,
    },
    /// An update from finite gradients left a weight or its second moment non-finite
    /// (RELIABILITY.md row 6): the learning rate or weight decay pushed the weight past the
    /// element type's range, or a gradient's square overflowed the second moment. The
    /// update is written in place, so it cannot be skipped like a non-finite gradient.
    #[error(
        "the update of {module} parameter {param} at learning rate {lr} left it non-finite (its gradients were finite): train.lr or train.weight_decay is too large for the element type, or a gradient's square overflows; the run stops whatever train.on_nonfinite says, and this step is not saved"
    )]
    UpdateOverflow {
        /// Module.
        module: String,
        /// Parameter (HF name).
        param: String,
        /// The step's learning rate, as written.
        lr: String,
    },
    /// The ranks of a job were started with different configs, data or checkpoints
    /// ([`crate::agree::agree`]); the message names the ranks and the keys that differ.
    #[error("{0}")]
    Disagree(String),
    /// Boundary buffers disagree with the plan (RELIABILITY.md row 8), found before any
    /// byte moves.
    #[error("boundary {edge}: {message}")]
    Boundary {
        /// The edge, `src -> dst`.
        edge: String,
        /// What disagrees, with the numbers.
        message: String,
    },
    /// An error of a training step ([`crate::Trainer::step`]), with that step.
    #[error("step {step}: {error}")]
    InStep {
        /// The step, counted from 1 as the progress line counts it (`metrics.jsonl`'s
        /// `step` is one less).
        step: usize,
        /// What went wrong in it.
        error: Box<RuntimeError>,
    },
}

impl RuntimeError {
    /// The error itself, without the step [`RuntimeError::InStep`] adds.
    pub fn cause(&self) -> &RuntimeError {
        match self {
            RuntimeError::InStep { error, .. } => error.cause(),
            other => other,
        }
    }
}

impl From<hetpar_nn::NnError> for RuntimeError {
    fn from(e: hetpar_nn::NnError) -> Self {
        match e {
            hetpar_nn::NnError::Comm(c) => RuntimeError::Comm(c),
            other => RuntimeError::Model(other.to_string()),
        }
    }
}

impl From<candle_core::Error> for RuntimeError {
    fn from(e: candle_core::Error) -> Self {
        RuntimeError::Model(format!("tensor: {e}"))
    }
}
