//! What one step's boundaries move: per edge, plans of every microbatch summed into bytes
//! per rank and in total, next to the lower bound and the other applicable strategies.
//! `hetpar layout` prints this.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::edge::{DpRelation, EdgeId, PlacementMode, Strategy};
use crate::geometry::EdgeItems;
use crate::graph::ModelGraph;
use crate::layout::{ModuleLayout, Span};
use crate::manifest::{BatchManifest, item_range};
use crate::plan::{EdgePlan, Op, Program, all_gather_traffic, leader_ranks};

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
    /// An entry of zero rows for every rank of `ranks`.
    fn over(ranks: &[usize]) -> StepTraffic {
        let zeros: BTreeMap<usize, usize> = ranks.iter().map(|&r| (r, 0)).collect();
        StepTraffic {
            sent: zeros.clone(),
            received: zeros.clone(),
            lower_bound: zeros,
            crossing: 0,
        }
    }

    /// Adds `rank`'s own operations in `prog` (a rank's share, or any program: only
    /// `rank`'s list is read).
    fn add_rank(&mut self, prog: &Program, rank: usize, src: Span) {
        for op in prog.ops.get(&rank).map_or(&[][..], Vec::as_slice) {
            if let Op::Send { peer, rows } = op
                && src.contains(rank) != src.contains(*peer)
            {
                self.crossing += rows.rows();
            }
            self.add_moved(rank, op.traffic(rank));
        }
    }

    fn add_moved(&mut self, rank: usize, (sent, received): (usize, usize)) {
        *self.sent.entry(rank).or_insert(0) += sent;
        *self.received.entry(rank).or_insert(0) += received;
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
    /// The strategies a report of `edge` compares: every one that applies, and the
    /// configured one.
    fn strategies(graph: &ModelGraph, edge: EdgeId) -> Vec<Strategy> {
        let e = graph.edges[edge];
        let (src, dst) = (&graph.modules[e.src].layout, &graph.modules[e.dst].layout);
        let mut strategies = Strategy::all_for(e.mode, src.stage_width().min(dst.stage_width()));
        if !strategies.contains(&e.strategy) {
            strategies.push(e.strategy);
        }
        strategies
    }

    /// The units of work [`EdgeReport::new`] reports to its `progress` ([`step_work`]).
    pub fn work(graph: &ModelGraph, edge: EdgeId, manifest: &BatchManifest) -> usize {
        let e = graph.edges[edge];
        let layouts = (&graph.modules[e.src].layout, &graph.modules[e.dst].layout);
        step_work(layouts, manifest)
    }

    /// Sums the plans of every microbatch of `manifest` for `edge`, each rank's share at a
    /// time ([`step_traffic`]), telling `progress` how many of [`EdgeReport::work`]'s units
    /// each stretch of it did (seconds at thousands of ranks).
    pub fn new(
        graph: &ModelGraph,
        edge: EdgeId,
        manifest: &BatchManifest,
        progress: &dyn Fn(usize),
    ) -> EdgeReport {
        let e = graph.edges[edge];
        let (src, dst) = (&graph.modules[e.src], &graph.modules[e.dst]);
        let strategies = Self::strategies(graph, edge);
        let layouts = (&src.layout, &dst.layout);
        let alternatives = step_traffic(layouts, manifest, edge, &strategies, progress);
        let rows = (0..manifest.n_microbatches())
            .flat_map(|k| manifest.microbatch_items(edge, k))
            .map(|i| manifest.item(i).rows)
            .sum();
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

/// Every rank of either module, ascending.
fn ranks_of((src, dst): (&ModuleLayout, &ModuleLayout)) -> Vec<usize> {
    let mut ranks: Vec<usize> = src.span().ranks().chain(dst.span().ranks()).collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// The units of work [`step_traffic`] reports to its `progress`: one per rank of either
/// module and microbatch (each rank's share; `gather`'s groups, found in one pass over a
/// microbatch's rows, take a small part of that).
pub fn step_work(layouts: (&ModuleLayout, &ModuleLayout), manifest: &BatchManifest) -> usize {
    manifest.n_microbatches() * ranks_of(layouts).len()
}

/// What each of `strategies` moves over the step on edge `edge` from `src` to `dst`:
/// `(strategy, forward, backward)`, every microbatch of `manifest` summed, with every
/// rank's lower bounds. Summed from each rank's share, one rank at a time: under `exact`
/// and `leaders` the programs planned from the rank's view ([`crate::EdgeGeometry::for_rank`]),
/// under `gather` each group's members and contributions ([`EdgePlan::gather_groups`]).
/// So it holds one rank's rows and programs, where the whole plans hold every row and
/// every rank's collective lists at once (one entry per member of the shared span under
/// `exact`: the square of the world, out of memory at 16,384 ranks).
///
/// `progress` hears of the [`step_work`] units as they are done.
pub fn step_traffic(
    (src, dst): (&ModuleLayout, &ModuleLayout),
    manifest: &BatchManifest,
    edge: EdgeId,
    strategies: &[Strategy],
    progress: &dyn Fn(usize),
) -> Vec<(Strategy, StepTraffic, StepTraffic)> {
    let span = src.span();
    let ranks = ranks_of((src, dst));
    let mut traffic: Vec<[StepTraffic; 2]> =
        strategies.iter().map(|_| [StepTraffic::over(&ranks), StepTraffic::over(&ranks)]).collect();
    for k in 0..manifest.n_microbatches() {
        let items = EdgeItems::new((src, dst), manifest, (edge, k));
        for &r in &ranks {
            let view = items.view(r);
            // A view's lower bounds are whole for the viewing rank alone.
            let bounds = view.lower_bounds_of(r);
            let mut view = Some(view);
            for (i, (&s, t)) in strategies.iter().zip(&mut traffic).enumerate() {
                for (t, bound) in t.iter_mut().zip(bounds) {
                    *t.lower_bound.entry(r).or_insert(0) += bound;
                }
                if s != Strategy::Gather {
                    // The last strategy planned takes the view itself.
                    let last = strategies[i + 1..].iter().all(|&s| s == Strategy::Gather);
                    let geo = if last { view.take() } else { view.clone() };
                    let plan = EdgePlan::new(geo.expect("the view, until the last plan"), s);
                    t[0].add_rank(&plan.forward, r, span);
                    t[1].add_rank(&plan.backward, r, span);
                }
            }
            progress(1);
        }
        if let Some(i) = strategies.iter().position(|&s| s == Strategy::Gather) {
            add_gather(&mut traffic[i], (src, dst), manifest, (edge, k), &ranks);
        }
    }
    strategies.iter().zip(traffic).map(|(&s, [f, b])| (s, f, b)).collect()
}

/// Adds `gather`'s traffic in microbatch `k` to `[forward, backward]`: the all-gather-v is
/// the only operation of a `gather` program that moves rows (the rest are local copies), so
/// each group's members and their contributions ([`EdgePlan::gather_groups`], one pass over
/// the microbatch's rows) give every member's traffic.
fn add_gather(
    traffic: &mut [StepTraffic; 2],
    layouts: (&ModuleLayout, &ModuleLayout),
    manifest: &BatchManifest,
    (edge, k): (EdgeId, usize),
    ranks: &[usize],
) {
    let groups = EdgePlan::gather_groups(layouts, manifest, (edge, k), ranks);
    for (t, groups) in traffic.iter_mut().zip(groups) {
        for (group, counts) in groups {
            for (i, &m) in group.iter().enumerate() {
                t.add_moved(m, all_gather_traffic(&counts, i));
            }
        }
    }
}
