//! hetpar-runtime: runs what the pure crates decide. Today: the boundary executor, which
//! walks an edge's routing plan forward and backward on row buffers over any communicator.

pub mod boundary;
pub mod error;
#[cfg(feature = "testing")]
pub mod testing;

pub use boundary::{Groups, run_boundary};
pub use error::RuntimeError;
