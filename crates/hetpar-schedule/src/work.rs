//! How much each encoder replica has to compute in each microbatch, read from the step's
//! manifest (SEMANTICS.md section 3): encoder replicas split a microbatch's items, so a
//! replica may own none. A schedule does not change with the manifest: a replica with no
//! item still runs its place in the schedule (an empty pass, the boundary transforms and
//! the gradient reduction it belongs to), because the other ranks of those collectives wait
//! for it. [`WorkDurations`] makes its empty passes take no time, so a simulated step shows
//! the replica idling at those collectives instead of skipping them.

use std::collections::BTreeMap;

use hetpar_layout::{BatchManifest, ModuleId};

use crate::action::{Action, MsgId};
use crate::graph::PipelineGraph;
use crate::validate::Durations;

/// Items per replica per microbatch of the modules that split items (encoders); modules
/// not listed (the LLM) split samples and always have work.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Work {
    /// Per module: `items[mb][replica]`.
    items: BTreeMap<ModuleId, Vec<Vec<usize>>>,
}

impl Work {
    /// Work from explicit counts: per module, `items[mb][replica]`.
    pub fn new(items: BTreeMap<ModuleId, Vec<Vec<usize>>>) -> Work {
        Work { items }
    }

    /// The items each replica of every encoder owns in each microbatch of `manifest`. The
    /// graph's edge ids are the manifest's (`PipelineGraph::from_model` keeps them); an
    /// encoder's items are those of its edges.
    pub fn from_manifest(graph: &PipelineGraph, manifest: &BatchManifest) -> Work {
        let mut items = BTreeMap::new();
        for (edge, &(src, _)) in graph.edges().iter().enumerate() {
            let dp = graph.modules()[src].layout.dp();
            let per_mb: Vec<Vec<usize>> = (0..graph.microbatches())
                .map(|k| (0..dp).map(|d| manifest.replica_items(edge, dp, d, k).len()).collect())
                .collect();
            let entry = items.entry(src).or_insert_with(|| vec![vec![0; dp]; per_mb.len()]);
            for (acc, mb) in entry.iter_mut().zip(per_mb) {
                for (a, n) in acc.iter_mut().zip(mb) {
                    *a += n;
                }
            }
        }
        Work { items }
    }

    /// Items replica `replica` of `module` owns in microbatch `mb`; `None` for a module that
    /// splits samples.
    pub fn items(&self, module: ModuleId, replica: usize, mb: usize) -> Option<usize> {
        self.items.get(&module).map(|m| m[mb][replica])
    }

    /// Every `(module, mb, replica)` with no item, in order.
    pub fn empty(&self) -> Vec<(ModuleId, usize, usize)> {
        let mut out = Vec::new();
        for (&module, per_mb) in &self.items {
            for (mb, replicas) in per_mb.iter().enumerate() {
                out.extend(
                    replicas
                        .iter()
                        .enumerate()
                        .filter(|(_, n)| **n == 0)
                        .map(|(d, _)| (module, mb, d)),
                );
            }
        }
        out
    }
}

/// Durations of `inner`, except that a pass of a replica with no item in that microbatch
/// takes no time.
#[derive(Clone, Copy, Debug)]
pub struct WorkDurations<'a, D> {
    /// Durations of everything else.
    pub inner: D,
    /// Items per replica.
    pub work: &'a Work,
    /// The graph the schedule was built for (rank to replica).
    pub graph: &'a PipelineGraph,
}

impl<D: Durations> Durations for WorkDurations<'_, D> {
    fn action(&self, rank: usize, action: &Action) -> f64 {
        if let Action::Compute(c) = action {
            let layout = &self.graph.modules()[c.module].layout;
            let replica = layout.coords(rank).expect("a rank of the module computes it").dp_idx;
            if self.work.items(c.module, replica, c.mb) == Some(0) {
                return 0.0;
            }
        }
        self.inner.action(rank, action)
    }

    fn message(&self, msg: &MsgId) -> f64 {
        self.inner.message(msg)
    }
}
