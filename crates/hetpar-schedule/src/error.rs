//! Why a schedule cannot be built or is not valid.

use thiserror::Error;

/// A rejected graph or an invalid schedule. Messages name the rank and the action.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// The graph cannot be scheduled (cycle, several sinks, no microbatch).
    #[error("{0}")]
    Graph(String),
    /// A posted message is not matched, matched twice, or inconsistent between ranks; or a
    /// stage's passes are missing or out of order.
    #[error("rank {rank} action {index} ({action}): {problem}")]
    Invalid {
        /// Rank whose action is wrong.
        rank: usize,
        /// Index of the action in the rank's schedule.
        index: usize,
        /// The action in words.
        action: String,
        /// What is wrong.
        problem: String,
    },
    /// A state where no rank can move.
    #[error("deadlock: {0}")]
    Deadlock(String),
}
