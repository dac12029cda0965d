//! Planner errors: a bad workload or hardware file, or a search with no feasible candidate.

use thiserror::Error;

/// Why the planner cannot answer.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// Shorthand.
pub type Result<T, E = PlanError> = std::result::Result<T, E>;
