//! Errors of the runtime.

use hetpar_comm::CommError;
use thiserror::Error;

/// Why a step could not run.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RuntimeError {
    /// A communication failed (timeout, failed peer, mismatch).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Boundary buffers disagree with the plan (RELIABILITY.md row 8), found before any
    /// byte moves.
    #[error("boundary {edge}: {message}")]
    Boundary {
        /// The edge, `src -> dst`.
        edge: String,
        /// What disagrees, with the numbers.
        message: String,
    },
}
