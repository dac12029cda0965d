//! Boundary routing plans (SEMANTICS.md sections 4-5): for one edge, one microbatch and one
//! strategy, the forward and backward programs of every rank, and what they move.
//!
//! Strategies:
//! - `exact` (any placement): each rank receives exactly the rows it lacks, from one holder;
//!   an all-to-all-v over the shared span when colocated, direct point-to-point across
//!   islands when not. Moves exactly the lower bound.
//! - `gather` (colocated): all-gather-v inside connected groups, each rank selects what it
//!   needs; the seed's "gather and interval selection".
//! - `leaders` (non-colocated): boundary leaders per replica pair, with optional striping
//!   over several leader pairs.
//!
//! A backward never sums replicas: each row's gradient is read from one complete replica,
//! the target's own when it consumed the row, else the canonical one (lowest tp, then cp).

mod exact;
mod gather;
mod leaders;
mod program;

pub use program::{Buf, Op, Program, Seg, Segs, Traffic, all_gather_traffic, rank_list};

use crate::edge::{Direction, EdgeId, PlacementMode, Strategy};
use crate::geometry::{EdgeGeometry, EdgeItems};
use crate::graph::ModelGraph;
use crate::layout::ModuleLayout;
use crate::manifest::BatchManifest;

/// A direction of an edge seen abstractly: rows live in a "from" buffer on some ranks and
/// must reach a "to" buffer on others. Strategies are written once against this.
pub(crate) struct Movement<'a> {
    pub geo: &'a EdgeGeometry,
    pub dir: Direction,
}

impl<'a> Movement<'a> {
    pub fn source_buf(&self) -> Buf {
        match self.dir {
            Direction::Forward => Buf::Held,
            Direction::Backward => Buf::Needed,
        }
    }

    pub fn target_buf(&self) -> Buf {
        match self.dir {
            Direction::Forward => Buf::Needed,
            Direction::Backward => Buf::Held,
        }
    }

    /// Rows `rank` must end with, in to-buffer order.
    pub fn targets(&self, rank: usize) -> &'a [usize] {
        let map = match self.dir {
            Direction::Forward => &self.geo.needed,
            Direction::Backward => &self.geo.held,
        };
        map.get(&rank).map_or(&[], Vec::as_slice)
    }

    /// Rows `rank` has in its from-buffer, in buffer order.
    pub fn source_rows(&self, rank: usize) -> &'a [usize] {
        let map = match self.dir {
            Direction::Forward => &self.geo.held,
            Direction::Backward => &self.geo.needed,
        };
        map.get(&rank).map_or(&[], Vec::as_slice)
    }

    /// Ranks that want `row` in their to-buffer.
    pub fn row_targets(&self, row: usize) -> &'a [usize] {
        let r = &self.geo.rows[row];
        match self.dir {
            Direction::Forward => self.geo.needers(r),
            Direction::Backward => self.geo.holders(r),
        }
    }

    /// Whether some rank wants a row its from-buffer lacks, anywhere in the microbatch
    /// (the same in every rank's view of the geometry).
    pub fn moves(&self) -> bool {
        self.geo.moves[match self.dir {
            Direction::Forward => 0,
            Direction::Backward => 1,
        }]
    }

    /// Ranks that have `row` in their from-buffer.
    pub fn sources(&self, row: usize) -> &'a [usize] {
        let r = &self.geo.rows[row];
        match self.dir {
            Direction::Forward => self.geo.holders(r),
            Direction::Backward => self.geo.needers(r),
        }
    }

    pub fn source_slot(&self, rank: usize, row: usize) -> Option<usize> {
        match self.dir {
            Direction::Forward => self.geo.held_slot(rank, row),
            Direction::Backward => self.geo.needed_slot(rank, row),
        }
    }

    pub fn target_slot(&self, rank: usize, row: usize) -> Option<usize> {
        match self.dir {
            Direction::Forward => self.geo.needed_slot(rank, row),
            Direction::Backward => self.geo.held_slot(rank, row),
        }
    }

    /// The source `target` reads a row it lacks from. Forward spreads targets over the
    /// replicated holders; backward always reads the canonical gradient.
    pub fn pick(&self, row: usize, target: usize) -> usize {
        match self.dir {
            Direction::Forward => {
                let h = self.sources(row);
                h[target % h.len()]
            }
            Direction::Backward => self.geo.rows[row].canonical,
        }
    }

    /// The single source that contributes `row` to a collective.
    pub fn contributor(&self, row: usize) -> usize {
        match self.dir {
            Direction::Forward => self.sources(row)[0],
            Direction::Backward => self.geo.rows[row].canonical,
        }
    }

    /// Layout and stage index of the side rows come from.
    pub fn source_side(&self) -> (&'a ModuleLayout, usize) {
        match self.dir {
            Direction::Forward => (&self.geo.src, self.geo.src.pp() - 1),
            Direction::Backward => (&self.geo.dst, 0),
        }
    }

    /// Layout and stage index of the side rows go to.
    pub fn target_side(&self) -> (&'a ModuleLayout, usize) {
        match self.dir {
            Direction::Forward => (&self.geo.dst, 0),
            Direction::Backward => (&self.geo.src, self.geo.src.pp() - 1),
        }
    }

    /// Replica on the from-side that has `row`.
    pub fn source_replica(&self, row: usize) -> usize {
        let r = &self.geo.rows[row];
        match self.dir {
            Direction::Forward => r.src_replica,
            Direction::Backward => r.dst_replica,
        }
    }

    /// Replica on the to-side that wants `row`.
    pub fn target_replica(&self, row: usize) -> usize {
        let r = &self.geo.rows[row];
        match self.dir {
            Direction::Forward => r.dst_replica,
            Direction::Backward => r.src_replica,
        }
    }

    /// Appends to `prog` the local copy of every row `target` already has in its source
    /// buffer; returns the `(target slot, row)` pairs it lacks.
    pub fn copy_local(&self, prog: &mut Program, target: usize) -> Vec<(usize, usize)> {
        let (mut from, mut to, mut missing) = (Segs::default(), Segs::default(), Vec::new());
        for (slot, &row) in self.targets(target).iter().enumerate() {
            match self.source_slot(target, row) {
                Some(own) => {
                    from.push(self.source_buf(), own);
                    to.push(self.target_buf(), slot);
                }
                None => missing.push((slot, row)),
            }
        }
        if !from.is_empty() {
            prog.push(target, Op::Copy { from, to });
        }
        missing
    }

    /// A program with an entry for every rank of both modules.
    pub fn empty_program(&self) -> Program {
        Program::for_ranks(self.geo.ranks())
    }
}

/// Forward and backward programs of one edge in one microbatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgePlan {
    /// Strategy used.
    pub strategy: Strategy,
    /// Placement mode of the edge.
    pub mode: PlacementMode,
    /// Rows, holders and needers.
    pub geometry: EdgeGeometry,
    /// Activations, source to destination.
    pub forward: Program,
    /// Gradients, destination to source.
    pub backward: Program,
}

impl EdgePlan {
    /// Plans `geometry` with `strategy`. Panics when the strategy does not fit the placement
    /// (gather across islands, leaders on shared ranks): config validation rules that out.
    /// A rank's view of the geometry ([`EdgeGeometry::for_rank`]) gives that rank's programs
    /// alone, under `exact` and `leaders`; `gather` walks its group through other ranks'
    /// views, which [`EdgePlan::of_rank`] builds (here it panics on a view).
    pub fn new(geometry: EdgeGeometry, strategy: Strategy) -> EdgePlan {
        assert!(
            geometry.rank.is_none() || strategy != Strategy::Gather,
            "strategy {strategy} walks other ranks' views: plan a view with EdgePlan::of_rank"
        );
        let mode = Self::mode(&geometry);
        let build = |dir| {
            let mv = Movement { geo: &geometry, dir };
            match (strategy, mode) {
                (Strategy::Exact, _) => exact::plan(&mv, mode),
                (Strategy::Gather, PlacementMode::Colocated) => gather::plan(&mv),
                (Strategy::Leaders { stripes }, PlacementMode::NonColocated) => {
                    leaders::plan(&mv, stripes)
                }
                _ => panic!("strategy {strategy} does not apply to {} edges", mode.name()),
            }
        };
        let programs = (build(Direction::Forward), build(Direction::Backward));
        Self::with_programs(geometry, strategy, programs)
    }

    /// Colocated (one span) or not (disjoint spans; validation rejects a partial overlap).
    fn mode(geometry: &EdgeGeometry) -> PlacementMode {
        if geometry.src.span() == geometry.dst.span() {
            PlacementMode::Colocated
        } else {
            assert!(
                !geometry.src.span().overlaps(&geometry.dst.span()),
                "spans overlap partly: rejected by validation"
            );
            PlacementMode::NonColocated
        }
    }

    /// The plan of `geometry` with its programs; of a view, the viewing rank's alone (its
    /// other ranks see their rows of the viewing rank's replicas only, so their programs
    /// would be partial).
    fn with_programs(
        geometry: EdgeGeometry,
        strategy: Strategy,
        (mut forward, mut backward): (Program, Program),
    ) -> EdgePlan {
        if let Some(me) = geometry.rank {
            forward.keep_only(me);
            backward.keep_only(me);
        }
        let mode = Self::mode(&geometry);
        EdgePlan { strategy, mode, geometry, forward, backward }
    }

    /// Rank `rank`'s part of the plan of `strategy` for `edge` in microbatch `k` from `src`
    /// to `dst`, planned from its view of the geometry ([`EdgeGeometry::for_rank`]): under
    /// `exact` and `leaders` from that view alone; under `gather` from the views of the
    /// members of its group too, found by walking the group's links from the rank.
    pub fn of_rank(
        (src, dst): (&ModuleLayout, &ModuleLayout),
        manifest: &BatchManifest,
        (edge, k): (EdgeId, usize),
        strategy: Strategy,
        rank: usize,
    ) -> EdgePlan {
        let items = EdgeItems::new((src, dst), manifest, (edge, k));
        let view = |r| items.view(r);
        let geometry = view(rank);
        if strategy != Strategy::Gather {
            return EdgePlan::new(geometry, strategy);
        }
        let build = |dir| {
            let mut program = gather::plan_for(&Movement { geo: &geometry, dir }, &view);
            program.keep_only(rank);
            program
        };
        let programs = (build(Direction::Forward), build(Direction::Backward));
        Self::with_programs(geometry, strategy, programs)
    }

    /// The `gather` groups of `edge` in microbatch `k` over `ranks` (every rank of
    /// either module, ascending), `[forward, backward]`: each group's members in rank order
    /// and the rows each contributes (groups in the order of their first members), what the
    /// whole plan's all-gather-v ops list, from one
    /// pass over the microbatch's rows without holding them (for reports of large worlds).
    pub fn gather_groups(
        layouts: (&ModuleLayout, &ModuleLayout),
        manifest: &BatchManifest,
        (edge, k): (EdgeId, usize),
        ranks: &[usize],
    ) -> [Vec<(Vec<usize>, Vec<usize>)>; 2] {
        gather::groups(layouts, manifest, (edge, k), ranks)
    }

    /// The plan of `edge` in microbatch `k`, with the edge's configured strategy.
    pub fn for_edge(
        graph: &ModelGraph,
        edge: EdgeId,
        manifest: &BatchManifest,
        k: usize,
    ) -> EdgePlan {
        let e = &graph.edges[edge];
        Self::with_strategy(graph, edge, manifest, k, e.strategy)
    }

    /// Rank `rank`'s share of [`EdgePlan::for_edge`], what a rank builds to run a step
    /// ([`EdgePlan::of_rank`]): it holds the rows of the rank's replicas and its programs
    /// alone, at the cost of those rows (not every rank's at every rank, which grows with
    /// the world); under `gather`, of the rows of its group's members' replicas.
    pub fn for_rank(
        graph: &ModelGraph,
        edge: EdgeId,
        manifest: &BatchManifest,
        k: usize,
        rank: usize,
    ) -> EdgePlan {
        let e = &graph.edges[edge];
        let layouts = (&graph.modules[e.src].layout, &graph.modules[e.dst].layout);
        EdgePlan::of_rank(layouts, manifest, (edge, k), e.strategy, rank)
    }

    /// The plan of `edge` in microbatch `k` with another strategy (for comparisons).
    pub fn with_strategy(
        graph: &ModelGraph,
        edge: EdgeId,
        manifest: &BatchManifest,
        k: usize,
        strategy: Strategy,
    ) -> EdgePlan {
        let e = &graph.edges[edge];
        let (src, dst) = (&graph.modules[e.src].layout, &graph.modules[e.dst].layout);
        EdgePlan::new(EdgeGeometry::new(src, dst, manifest, edge, k), strategy)
    }

    /// The program of `dir`.
    pub fn program(&self, dir: Direction) -> &Program {
        match dir {
            Direction::Forward => &self.forward,
            Direction::Backward => &self.backward,
        }
    }
}

/// Boundary leaders of a layout's stage: per replica, the first `stripes` ranks of the stage
/// in local order (`tp` fastest, then `cp`); index 0 is the canonical `(tp 0, cp 0)` leader.
pub fn leader_ranks(layout: &ModuleLayout, pp_idx: usize, stripes: usize) -> Vec<Vec<usize>> {
    (0..layout.dp())
        .map(|d| layout.stage_ranks(d, pp_idx).into_iter().take(stripes).collect())
        .collect()
}
