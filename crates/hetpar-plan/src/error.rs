//! Planner errors: a bad workload or hardware file, or a search with no feasible candidate.

use thiserror::Error;

/// Why the planner cannot answer.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// A config check's error (`field: message`), from the layout crate's validation that
/// workloads share.
impl From<hetpar_layout::ConfigError> for PlanError {
    fn from(e: hetpar_layout::ConfigError) -> Self {
        PlanError(format!("{}: {}", e.field, e.message))
    }
}

/// Shorthand.
pub type Result<T, E = PlanError> = std::result::Result<T, E>;
