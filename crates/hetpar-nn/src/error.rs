//! Errors of the model code.

use hetpar_comm::CommError;
use thiserror::Error;

/// Why a layer or model call failed.
#[derive(Debug, Error)]
pub enum NnError {
    /// A tensor operation failed (collectives inside autograd surface here too, with the
    /// communicator's message).
    #[error("tensor: {0}")]
    Candle(#[from] candle_core::Error),
    /// A communication outside autograd failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Bad input: wrong shapes, missing weights, a corrupt weight file.
    #[error("{0}")]
    Input(String),
}

/// Shorthand.
pub type Result<T, E = NnError> = std::result::Result<T, E>;
