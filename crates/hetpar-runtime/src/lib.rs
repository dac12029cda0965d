//! hetpar-runtime: runs what the pure crates decide. Today: the boundary executor, which
//! walks an edge's routing plan forward and backward on row buffers over any communicator;
//! the step executor, which walks a rank's schedule through its modules' stages; and the
//! gradient side of a step (reduction by `ShardSpec`, the global norm, AdamW).

pub mod boundary;
pub mod error;
pub mod executor;
pub mod optim;
pub mod stage;
pub mod stages;
pub mod step;
#[cfg(feature = "testing")]
pub mod testing;

pub use boundary::{Groups, run_boundary};
pub use error::RuntimeError;
pub use executor::{Executor, OnNonFinite, StepReport, TrainOptions};
pub use optim::{AdamState, AdamW, LrSchedule};
pub use stage::{Forward, Stage};
pub use step::Grads;
