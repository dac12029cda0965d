//! Communication errors: every message names the operation, the group and, where known, the
//! ranks at fault.

use std::time::Duration;

use thiserror::Error;

/// Compact rank list: `0-7`, `0,2,4`.
pub fn ranks(list: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < list.len() {
        let mut j = i;
        while j + 1 < list.len() && list[j + 1] == list[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{}-{}", list[i], list[j]) } else { list[i].to_string() });
        i = j + 1;
    }
    format!("[{}]", out.join(","))
}

/// Why a communication failed. Ranks are global (world) ranks.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CommError {
    /// A blocking operation did not complete in time.
    #[error("{op} over ranks {} timed out after {after:?} on rank {rank}: {detail}", ranks(.group))]
    Timeout {
        /// The operation, with its sequence number where useful.
        op: String,
        /// Global ranks of the group.
        group: Vec<usize>,
        /// The rank reporting.
        rank: usize,
        /// The configured timeout.
        after: Duration,
        /// Who never arrived (or what is known about it).
        detail: String,
    },
    /// Another rank failed (panicked or exited) while this one waited for it.
    #[error("rank {failed} failed: {message}")]
    PeerFailed {
        /// Global rank that failed.
        failed: usize,
        /// What happened to it.
        message: String,
    },
    /// Members disagree about an operation (kind, sizes, root, type).
    #[error("{op} over ranks {}: {detail}", ranks(.group))]
    Mismatch {
        /// The operation.
        op: String,
        /// Global ranks of the group.
        group: Vec<usize>,
        /// What disagrees.
        detail: String,
    },
    /// A call with bad arguments (rank out of range, buffer of the wrong size).
    #[error("{0}")]
    Usage(String),
    /// An error reported by the transport itself.
    #[error("{backend}: {message}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// Its message.
        message: String,
    },
}

/// Shorthand.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
