//! The part of a model graph a schedule needs: each module's layout and pipeline options, the
//! edges, and the number of microbatches.

use std::collections::BTreeSet;

use hetpar_layout::graph::topo_sort;
use hetpar_layout::{Axis, ModelGraph, ModuleId, ModuleLayout};

use crate::action::Labels;
use crate::error::ScheduleError;

/// A module as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipeModule {
    /// Name, for grids and messages.
    pub name: String,
    /// Layout and placement.
    pub layout: ModuleLayout,
    /// Virtual stages per rank (interleaved 1F1B when > 1).
    pub vpp: usize,
    /// Offloaded to host memory while the LLM pipeline runs.
    pub offload: bool,
    /// `false`: frozen (no gradient reduction, no optimizer step; no backward unless a
    /// trainable module feeds it).
    pub trainable: bool,
}

impl PipeModule {
    /// Virtual stages in total: `pp * vpp`.
    pub fn n_vstages(&self) -> usize {
        self.layout.pp() * self.vpp
    }

    /// The global rank that runs virtual stage `vstage` at the data/tensor/context position
    /// of `like` (a rank of this module).
    pub fn peer(&self, like: usize, vstage: usize) -> usize {
        let mut c = self.layout.coords(like).expect("rank of this module");
        c.pp_idx = vstage % self.layout.pp();
        self.layout.rank(c)
    }
}

/// Which schedule family a graph gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Some modules share ranks: encoder forwards, LLM pipeline, encoder backwards.
    ThreePhase,
    /// Every module on its own rank island: one 1F1B over the stage graph (plain 1F1B, or
    /// interleaved, for a graph of one module).
    GraphAware,
}

impl ScheduleKind {
    /// `three-phase` or `graph-aware 1F1B`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::ThreePhase => "three-phase",
            ScheduleKind::GraphAware => "graph-aware 1F1B",
        }
    }
}

/// Modules, edges and microbatches: the input of every schedule builder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineGraph {
    modules: Vec<PipeModule>,
    edges: Vec<(ModuleId, ModuleId)>,
    microbatches: usize,
    sink: ModuleId,
    order: Vec<ModuleId>,
    backward: Vec<bool>,
}

impl PipelineGraph {
    /// Checks that the edges form a DAG with exactly one sink (the module every other feeds,
    /// directly or not), that there is at least one microbatch, and that interleaved modules
    /// get a multiple of their pipeline size.
    pub fn new(
        modules: Vec<PipeModule>,
        edges: Vec<(ModuleId, ModuleId)>,
        microbatches: usize,
    ) -> Result<PipelineGraph, ScheduleError> {
        let bad = |m: String| Err(ScheduleError::Graph(m));
        if microbatches == 0 {
            return bad("a schedule needs at least one microbatch".into());
        }
        if let Some(m) =
            modules.iter().find(|m| m.vpp > 1 && !microbatches.is_multiple_of(m.layout.pp()))
        {
            return bad(format!(
                "{}: interleaved 1F1B (vpp {}) needs microbatches({microbatches}) divisible by pp({})",
                m.name,
                m.vpp,
                m.layout.pp()
            ));
        }
        let order = match topo_sort(modules.len(), &edges) {
            Ok(o) => o,
            Err(cycle) => {
                let names: Vec<&str> = cycle.iter().map(|&m| modules[m].name.as_str()).collect();
                return bad(format!("edges form a cycle: {}", names.join(" -> ")));
            }
        };
        let sinks: Vec<ModuleId> =
            (0..modules.len()).filter(|&m| !edges.iter().any(|e| e.0 == m)).collect();
        if sinks.len() != 1 {
            let names: Vec<&str> = sinks.iter().map(|&m| modules[m].name.as_str()).collect();
            return bad(format!(
                "a schedule needs exactly one sink module, found {}",
                names.join(", ")
            ));
        }
        // A module runs backwards when it trains or something feeding it does.
        let mut backward = vec![false; modules.len()];
        for &m in &order {
            backward[m] = modules[m].trainable || edges.iter().any(|e| e.1 == m && backward[e.0]);
        }
        if !backward[sinks[0]] {
            return bad("every module is frozen (trainable = false): nothing to train".into());
        }
        Ok(PipelineGraph { modules, edges, microbatches, sink: sinks[0], order, backward })
    }

    /// The schedule input of a validated model graph.
    pub fn from_model(graph: &ModelGraph) -> PipelineGraph {
        let modules = graph
            .modules
            .iter()
            .map(|m| PipeModule {
                name: m.name.clone(),
                layout: m.layout.clone(),
                vpp: m.vpp,
                offload: m.offload,
                trainable: m.trainable,
            })
            .collect();
        let edges = graph.edges.iter().map(|e| (e.src, e.dst)).collect();
        PipelineGraph::new(modules, edges, graph.train.microbatches)
            .expect("a validated model graph is a DAG into one llama module")
    }

    /// Modules by id.
    pub fn modules(&self) -> &[PipeModule] {
        &self.modules
    }

    /// Edges `(src, dst)` by id.
    pub fn edges(&self) -> &[(ModuleId, ModuleId)] {
        &self.edges
    }

    /// Microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The module every other one feeds (the LLM).
    pub fn sink(&self) -> ModuleId {
        self.sink
    }

    /// Whether `module` runs backward passes: it is trainable or a module feeding it
    /// (directly or not) is. The sink always does. An edge carries gradients back exactly
    /// when its source runs backwards.
    pub fn has_backward(&self, module: ModuleId) -> bool {
        self.backward[module]
    }

    /// Modules in dependency order.
    pub fn topo_order(&self) -> &[ModuleId] {
        &self.order
    }

    /// Every rank of every module, ascending.
    pub fn ranks(&self) -> BTreeSet<usize> {
        self.modules.iter().flat_map(|m| m.layout.span().ranks()).collect()
    }

    /// Three-phase when two modules share ranks, graph-aware 1F1B otherwise.
    pub fn kind(&self) -> ScheduleKind {
        let spans: Vec<_> = self.modules.iter().map(|m| m.layout.span()).collect();
        let shared = spans.iter().enumerate().any(|(i, a)| spans[i + 1..].iter().any(|b| b == a));
        if shared { ScheduleKind::ThreePhase } else { ScheduleKind::GraphAware }
    }

    /// Ranks that take part in edge `e`'s boundary transform: the source's last stage and
    /// the destination's first stage.
    pub fn boundary_participants(&self, e: usize) -> Vec<usize> {
        let (src, dst) = (&self.modules[self.edges[e].0], &self.modules[self.edges[e].1]);
        let last = src.layout.pp() - 1;
        let mut v: Vec<usize> = (0..src.layout.dp())
            .flat_map(|d| src.layout.stage_ranks(d, last))
            .chain((0..dst.layout.dp()).flat_map(|d| dst.layout.stage_ranks(d, 0)))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Every gradient-reduction group of `module` (each rank with its data- and
    /// context-parallel peers), in order of their lowest rank.
    pub fn reduce_groups(&self, module: ModuleId) -> Vec<Vec<usize>> {
        self.modules[module].layout.groups(&[Axis::Dp, Axis::Cp])
    }

    /// Names for printing.
    pub fn labels(&self) -> Labels {
        Labels {
            modules: self.modules.iter().map(|m| m.name.clone()).collect(),
            edge_src: self.edges.iter().map(|e| e.0).collect(),
            edge_dst: self.edges.iter().map(|e| e.1).collect(),
            pp: self.modules.iter().map(|m| m.layout.pp()).collect(),
            sink: self.sink,
        }
    }
}
