//! hetpar-plan: the planner. Given a workload (modules with real sizes, sequence, batch) and
//! a cluster, it predicts step time, TFLOPS/GPU, tokens/s and memory per GPU of candidate
//! layouts and placements, and searches for the best homogeneous, colocated and
//! non-colocated one.
//!
//! Flow: [`Workload::from_toml`] -> [`search::search`] (enumerate [`Candidate`]s, cost them
//! with [`cost`] and [`boundary`], prune by memory and by a lower bound, simulate the
//! schedules of `hetpar-schedule` with those durations in [`evaluate`]) -> [`explain`] and
//! [`emit::config`]. Pure: no IO, no threads.

pub mod boundary;
pub mod candidate;
pub mod cost;
pub mod emit;
pub mod error;
pub mod evaluate;
pub mod explain;
pub mod hardware;
pub mod model;
pub mod search;
pub mod validation;
pub mod workload;

pub use candidate::{Candidate, Choice, Kind, Memory, Prediction};
pub use error::{PlanError, Result};
pub use evaluate::Evaluator;
pub use hardware::{Efficiency, Hardware};
pub use model::{Mlp, ModuleShape};
pub use search::{Plan, Ranked, search};
pub use workload::{FlopCount, Workload};
