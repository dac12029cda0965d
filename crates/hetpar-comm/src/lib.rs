//! hetpar-comm: moving bytes between ranks. The [`Communicator`] trait (collectives,
//! all-to-all-v, point-to-point, subgroups, timeouts) and its backends: [`local`] (threads,
//! the default), `mpi` (feature `mpi`), `nccl` (feature `nccl`), and [`recording`], a wrapper
//! that logs what any backend moved, and [`counted`], one that only counts it. Only this crate knows about transports; everything
//! above it sees the trait.

pub mod bench;
pub mod comm;
#[cfg(feature = "testing")]
pub mod conformance;
pub mod counted;
pub mod dtype;
#[cfg(any(feature = "mpi", test))]
pub(crate) mod engine;
pub mod error;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod pool;
pub mod recording;

pub use comm::{CommExt, Communicator, P2p};
pub use counted::{Counted, Traffic};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use local::{LocalComm, LocalOptions, launch, launch_watched};
pub use recording::{Log, OpKind, OpRecord, Recording};
