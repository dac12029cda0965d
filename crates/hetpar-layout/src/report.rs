//! What one step's boundaries move: per edge, plans of every microbatch summed into bytes
//! per rank and in total, next to the lower bound and the other applicable strategies.
//! `hetpar layout` prints this; the planner reads the same numbers.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::edge::{DpRelation, EdgeId, PlacementMode, Strategy};
use crate::graph::ModelGraph;
use crate::layout::Span;
use crate::manifest::{BatchManifest, item_range};
use crate::plan::{EdgePlan, Op, Program, leader_ranks};

/// Rows moved by one direction of an edge over a step, per rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTraffic {
    /// Rows each rank sends.
    pub sent: BTreeMap<usize, usize>,
    /// Rows each rank receives.
    pub received: BTreeMap<usize, usize>,
    /// Rows each rank must receive at least (rows it lacks).
    pub lower_bound: BTreeMap<usize, usize>,
    /// Rows sent between the two modules' spans (the island boundary; 0 when colocated).
    pub crossing: usize,
}

impl StepTraffic {
    fn add(&mut self, prog: &Program, src: Span, lower: &BTreeMap<usize, usize>) {
        let t = prog.traffic();
        for (&rank, ops) in &prog.ops {
            for op in ops {
                if let Op::Send { peer, rows } = op
                    && src.contains(rank) != src.contains(*peer)
                {
                    self.crossing += rows.rows();
                }
            }
        }
        for (map, src) in [
            (&mut self.sent, &t.sent),
            (&mut self.received, &t.received),
            (&mut self.lower_bound, lower),
        ] {
            for (&r, &n) in src {
                *map.entry(r).or_insert(0) += n;
            }
        }
    }

    /// Rows moved in total.
    pub fn total(&self) -> usize {
        self.received.values().sum()
    }

    /// The least any strategy can move.
    pub fn total_lower_bound(&self) -> usize {
        self.lower_bound.values().sum()
    }
}

/// Boundary leaders of an edge: per replica, its leader ranks (one per stripe).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leaders {
    /// Source replicas' last-stage leaders.
    pub src: Vec<Vec<usize>>,
    /// Destination replicas' first-stage leaders.
    pub dst: Vec<Vec<usize>>,
}

/// Which items of one microbatch each source replica owns (SEMANTICS.md section 3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MicrobatchItems {
    /// The sample of each item, in canonical order.
    pub samples: Vec<usize>,
    /// Per source replica, its range of positions in `samples` (empty when it owns none).
    pub replicas: Vec<Range<usize>>,
}

/// One edge over one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgeReport {
    /// Which edge.
    pub edge: EdgeId,
    /// Source module name.
    pub src: String,
    /// Destination module name.
    pub dst: String,
    /// Placement mode.
    pub mode: PlacementMode,
    /// DP relation.
    pub relation: DpRelation,
    /// Configured strategy.
    pub strategy: Strategy,
    /// Bytes per row: destination hidden size times the activation element's size (f32
    /// under both dtypes, [`crate::config::Dtype::activation_bytes`]).
    pub row_bytes: usize,
    /// Rows on the edge this step.
    pub rows: usize,
    /// Samples with no row on this edge (text-only for this encoder).
    pub empty_samples: usize,
    /// Per microbatch, the items and the source replica owning each.
    pub items: Vec<MicrobatchItems>,
    /// Boundary leaders, for the `leaders` strategy.
    pub leaders: Option<Leaders>,
    /// Forward traffic of the configured strategy.
    pub forward: StepTraffic,
    /// Backward traffic of the configured strategy.
    pub backward: StepTraffic,
    /// Every applicable strategy with its forward and backward traffic.
    pub alternatives: Vec<(Strategy, StepTraffic, StepTraffic)>,
}

impl EdgeReport {
    /// Sums the plans of every microbatch of `manifest` for `edge`.
    pub fn new(graph: &ModelGraph, edge: EdgeId, manifest: &BatchManifest) -> EdgeReport {
        let e = graph.edges[edge];
        let (src, dst) = (&graph.modules[e.src], &graph.modules[e.dst]);
        let max_stripes = src.layout.stage_width().min(dst.layout.stage_width());
        let mut strategies = Strategy::all_for(e.mode, max_stripes);
        if !strategies.contains(&e.strategy) {
            strategies.push(e.strategy);
        }
        let mut alternatives = Vec::new();
        let mut rows = 0;
        for &s in &strategies {
            let (mut fwd, mut bwd) = (StepTraffic::default(), StepTraffic::default());
            for k in 0..manifest.n_microbatches() {
                let plan = EdgePlan::with_strategy(graph, edge, manifest, k, s);
                let geo = &plan.geometry;
                let span = src.layout.span();
                fwd.add(&plan.forward, span, &geo.forward_lower_bound());
                bwd.add(&plan.backward, span, &geo.backward_lower_bound());
                if s == e.strategy {
                    rows += geo.rows.len();
                }
            }
            alternatives.push((s, fwd, bwd));
        }
        let (_, forward, backward) = alternatives
            .iter()
            .find(|(s, _, _)| *s == e.strategy)
            .cloned()
            .expect("configured strategy planned");
        let leaders = match e.strategy {
            Strategy::Leaders { stripes } => Some(Leaders {
                src: leader_ranks(&src.layout, src.layout.pp() - 1, stripes),
                dst: leader_ranks(&dst.layout, 0, stripes),
            }),
            _ => None,
        };
        let empty_samples =
            (0..manifest.samples().len()).filter(|&s| manifest.edge_rows(s, edge) == 0).count();
        let dp = src.layout.dp();
        let items = (0..manifest.n_microbatches())
            .map(|k| {
                let samples: Vec<usize> =
                    manifest.microbatch_items(edge, k).iter().map(|r| r.sample).collect();
                let replicas = (0..dp).map(|d| item_range(samples.len(), dp, d)).collect();
                MicrobatchItems { samples, replicas }
            })
            .collect();
        EdgeReport {
            edge,
            src: src.name.clone(),
            dst: dst.name.clone(),
            mode: e.mode,
            relation: e.relation,
            strategy: e.strategy,
            row_bytes: dst.dims.hidden * graph.train.dtype.activation_bytes(),
            rows,
            empty_samples,
            items,
            leaders,
            forward,
            backward,
            alternatives,
        }
    }
}
