//! hetpar-layout: the pure core of hetpar. Module layouts and rank coordinates, the
//! validated module graph, batch manifests, and boundary routing plans with their byte
//! counts and lower bounds. No IO, no threads, no communicator: every value here can be
//! printed, compared and tested without ranks.
//!
//! Flow: [`Config::from_toml`] -> [`ModelGraph::from_config`] (all validation) ->
//! [`BatchManifest`] per step -> [`EdgeGeometry`] per edge and microbatch ->
//! [`EdgePlan`] (per-rank forward and backward programs) -> [`symbolic::execute`] checks
//! them on labels.

pub mod axis;
pub mod config;
pub mod edge;
pub mod error;
pub mod geometry;
pub mod graph;
pub mod layout;
pub mod manifest;
pub mod ownership;
pub mod plan;
pub mod report;
pub mod symbolic;
#[cfg(feature = "testing")]
pub mod testing;

pub use axis::{Axis, View};
pub use config::{Config, Dtype, OnNonFinite};
pub use edge::{Direction, DpRelation, EdgeId, ModuleId, PlacementMode, Strategy};
pub use error::ConfigError;
pub use geometry::{EdgeGeometry, EdgeItems, Row, RowId};
pub use graph::{Edge, ModelGraph, Module, ModuleSpec};
pub use layout::{Coords, ExpertCoords, LayoutSpec, ModuleLayout, Span};
pub use manifest::{BatchManifest, Item, ItemRef, Sample};
pub use plan::EdgePlan;
pub use report::{EdgeReport, Leaders, MicrobatchItems, StepTraffic, step_traffic, step_work};
