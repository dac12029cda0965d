//! hetpar-schedule: pipeline schedules as data (SEMANTICS.md section 5). Per-rank action
//! lists for 1F1B, interleaved 1F1B, the three-phase colocated schedule and graph-aware 1F1B;
//! a validator that matches every message and executes the schedule on a clock; text and
//! SVG timelines. Pure: no threads, no IO, no communicator.
//!
//! Flow: [`PipelineGraph`] (from a validated model graph) -> [`Schedule::build`] ->
//! [`validate`] (static checks + [`simulate`] with [`Durations`], or [`WorkDurations`] for
//! a step's manifest, where encoder replicas without items pass empty) -> [`text_grid`] /
//! [`svg`]. [`held`] bounds what ranks sharing memory hold at once in every execution.

pub mod action;
pub mod build;
pub mod error;
pub mod graph;
pub mod held;
pub mod order;
pub mod render;
#[cfg(feature = "testing")]
pub mod testing;
pub mod validate;
mod warmup;
pub mod work;

pub use action::{Action, Compute, Labels, MsgId, Pass, Post, Role};
pub use build::{Options, Schedule};
pub use error::ScheduleError;
pub use graph::{PipeModule, PipelineGraph, ScheduleKind};
pub use held::{Held, Keeps, held};
pub use render::{svg, text_grid};
pub use validate::{Durations, Timeline, UnitDurations, check, simulate, validate};
pub use work::{Work, WorkDurations};
