//! The routing plans of one step: per edge and microbatch, the edge plan every rank derives
//! from the model graph and the step's manifest (no shape handshake). A training rank
//! builds its own share ([`StepPlans::for_rank`]); tools and tests build every rank's.

use std::collections::BTreeMap;

use hetpar_layout::{BatchManifest, EdgeId, EdgePlan, ModelGraph, ModuleId};

use crate::error::RuntimeError;

/// A step's manifest and its boundary plans.
#[derive(Clone, Debug)]
pub struct StepPlans {
    /// The step's samples and items.
    pub manifest: BatchManifest,
    /// `(source, destination)` module of each edge.
    pub edges: Vec<(ModuleId, ModuleId)>,
    /// Module names by id, for errors.
    pub names: Vec<String>,
    plans: BTreeMap<(EdgeId, usize), EdgePlan>,
}

impl StepPlans {
    /// Every edge's plan for every microbatch of `manifest`.
    pub fn new(graph: &ModelGraph, manifest: BatchManifest) -> StepPlans {
        Self::build(graph, manifest, |e, m, k| EdgePlan::for_edge(graph, e, m, k))
    }

    /// Rank `rank`'s plans ([`EdgePlan::for_rank`]): what one rank of a run builds each
    /// step. Each holds the rows of the rank's replicas and its programs alone, so the cost
    /// stays the rank's share of the step as the world grows.
    pub fn for_rank(graph: &ModelGraph, manifest: BatchManifest, rank: usize) -> StepPlans {
        Self::build(graph, manifest, |e, m, k| EdgePlan::for_rank(graph, e, m, k, rank))
    }

    /// Every edge's plan for every microbatch of `manifest`, each from `plan`.
    fn build(
        graph: &ModelGraph,
        manifest: BatchManifest,
        plan: impl Fn(EdgeId, &BatchManifest, usize) -> EdgePlan,
    ) -> StepPlans {
        let mut plans = BTreeMap::new();
        for e in 0..graph.edges.len() {
            for k in 0..manifest.n_microbatches() {
                plans.insert((e, k), plan(e, &manifest, k));
            }
        }
        StepPlans {
            manifest,
            edges: graph.edges.iter().map(|e| (e.src, e.dst)).collect(),
            names: graph.modules.iter().map(|m| m.name.clone()).collect(),
            plans,
        }
    }

    /// A step without edges (an LLM alone) over `manifest`.
    pub fn without_edges(manifest: BatchManifest, names: Vec<String>) -> StepPlans {
        StepPlans { manifest, edges: Vec::new(), names, plans: BTreeMap::new() }
    }

    /// The plan of `edge` in microbatch `mb`.
    pub fn plan(&self, edge: EdgeId, mb: usize) -> Result<&EdgePlan, RuntimeError> {
        self.plans.get(&(edge, mb)).ok_or_else(|| {
            RuntimeError::Model(format!("no plan for edge {edge} in microbatch {mb}"))
        })
    }

    /// Every plan, in (edge, microbatch) order.
    pub fn all(&self) -> impl Iterator<Item = &EdgePlan> {
        self.plans.values()
    }

    /// `src -> dst` of an edge, for errors.
    pub fn edge_name(&self, edge: EdgeId) -> String {
        let (s, d) = self.edges[edge];
        format!("{} -> {}", self.names[s], self.names[d])
    }
}
