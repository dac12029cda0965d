//! hetpar-runtime: runs what the pure crates decide. Today: the boundary executor, which
//! walks an edge's routing plan forward and backward on row buffers over any communicator;
//! the step executor, which walks a rank's schedule through its modules' stages; and the
//! gradient side of a step (reduction by `ShardSpec`, the global norm, AdamW).

pub mod agree;
pub mod assemble;
pub mod bench;
pub mod boundary;
pub mod checkpoint;
pub mod data;
pub mod error;
pub mod executor;
pub mod export;
pub mod memory;
pub mod optim;
pub mod plans;
pub mod stage;
pub mod stages;
pub mod step;
pub mod synthetic;
#[cfg(feature = "testing")]
pub mod testing;
pub mod train;

pub use agree::{RunFacts, agree};
pub use assemble::{Sources, build_stages};
pub use boundary::{Groups, run_boundary};
pub use data::{BatchSource, FileData, HELDOUT};
pub use error::RuntimeError;
pub use executor::{Executor, OnNonFinite, StepReport, TrainOptions};
pub use memory::{ActivationFloor, HostCopy, Resident, activations_held};
pub use optim::{AdamState, AdamW, LrSchedule};
pub use plans::StepPlans;
pub use stage::{BoundaryIn, Forward, NO_TOP, Scored, Stage};
pub use step::Grads;
pub use train::{Answered, EvalReport, StepLog, Tally, Trainer, train_options};
