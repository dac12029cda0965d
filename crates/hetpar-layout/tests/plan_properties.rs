//! Property tests: every strategy on random worlds (up to 64 ranks, one or two encoders,
//! colocated and non-colocated, random TP/SP/CP/PP, any DP ratio, encoder dp 1 to 32
//! splitting items, random manifests of 0-4 items per sample with text-only samples and
//! microbatches holding fewer items than an encoder has replicas) satisfies the boundary
//! contract under the symbolic executor, in both directions.

use std::collections::BTreeMap;

use hetpar_layout::manifest::item_replica;
use hetpar_layout::plan::Op;
use hetpar_layout::testing::{arb_world, check_plan};
use hetpar_layout::{
    Direction, EdgeGeometry, EdgePlan, StepTraffic, Strategy, step_traffic, step_work,
};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn every_plan_keeps_the_contract(world in arb_world(6)) {
        for edge in 0..world.layouts.len() - 1 {
            for k in 0..world.manifest.n_microbatches() {
                // The item rule from the manifest alone: every holder of a row belongs to the
                // encoder replica that owns the row's item.
                let src = &world.layouts[edge + 1];
                let n = world.manifest.microbatch_items(edge, k).len();
                let geo = world.geometry(edge, k);
                for row in &geo.rows {
                    let owner = item_replica(n, src.dp(), row.item);
                    for &h in geo.holders(row) {
                        prop_assert_eq!(src.coords(h).expect("a source rank").dp_idx, owner);
                    }
                }
                for strategy in world.strategies(edge) {
                    let plan = EdgePlan::new(world.geometry(edge, k), strategy);
                    if let Err(e) = check_plan(&plan) {
                        let (src, dst) = (&world.layouts[edge + 1], &world.layouts[0]);
                        prop_assert!(
                            false,
                            "{strategy} {} {} -> {} {}, microbatch {k}: {e}",
                            src.span(), src.describe(), dst.span(), dst.describe()
                        );
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Dropping any one operation of a plan (a receive, a send, one member's part of a
    /// collective, a local copy) is caught: a deadlock, an unset read or an unfilled row.
    #[test]
    fn a_plan_missing_any_op_is_rejected(world in arb_world(4), pick in any::<prop::sample::Index>()) {
        let plan = EdgePlan::new(world.geometry(0, 0), world.strategies(0)[0]);
        let slots: Vec<(usize, usize)> = plan
            .forward
            .ops
            .iter()
            .flat_map(|(&r, ops)| (0..ops.len()).map(move |i| (r, i)))
            .collect();
        prop_assume!(!slots.is_empty());
        let (rank, i) = slots[pick.index(slots.len())];
        let mut broken = plan.clone();
        let dropped = broken.forward.ops.get_mut(&rank).expect("rank").remove(i);
        prop_assert!(check_plan(&broken).is_err(), "dropping rank {rank} op {i} ({dropped}) went unnoticed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// A rank's view of the geometry names the rows it holds and needs in the same order as
    /// the whole geometry, with the same flags, and the plan built from it (`exact`,
    /// `leaders` with one stripe and with the most, `gather` through its group's views) is that rank's part of the whole plan, op for op
    /// and stage row for stage row, in both directions.
    #[test]
    fn a_ranks_view_plans_its_part_of_the_whole(world in arb_world(6)) {
        for edge in 0..world.layouts.len() - 1 {
            let (src, dst) = (&world.layouts[edge + 1], &world.layouts[0]);
            let strategies = world.strategies(edge);
            let outside = src.span().end.max(dst.span().end);
            for k in 0..world.manifest.n_microbatches() {
                let g = world.geometry(edge, k);
                let wholes: Vec<EdgePlan> =
                    strategies.iter().map(|&s| EdgePlan::new(g.clone(), s)).collect();
                let ranks = src.span().ranks().chain(dst.span().ranks());
                for rank in ranks.chain([outside]) {
                    let view = EdgeGeometry::for_rank(src, dst, &world.manifest, (edge, k), rank);
                    prop_assert_eq!(view.moves, g.moves);
                    prop_assert_eq!(view.rank, Some(rank));
                    // Each row with its holders and needers (the geometries number their
                    // sets apart).
                    let rows = |geo: &EdgeGeometry, map: &BTreeMap<usize, Vec<usize>>| {
                        map.get(&rank).map(|v| {
                            v.iter()
                                .map(|&i| {
                                    let r = &geo.rows[i];
                                    let sets = (geo.holders(r).to_vec(), geo.needers(r).to_vec());
                                    (r.id, r.pos, r.item, r.src_replica, r.dst_replica, r.canonical, sets)
                                })
                                .collect::<Vec<_>>()
                        })
                    };
                    prop_assert_eq!(rows(&view, &view.held), rows(&g, &g.held), "held of {}", rank);
                    prop_assert_eq!(rows(&view, &view.needed), rows(&g, &g.needed), "needed of {}", rank);
                    for (whole, &s) in wholes.iter().zip(&strategies) {
                        let part = EdgePlan::of_rank((src, dst), &world.manifest, (edge, k), s, rank);
                        prop_assert_eq!(&part.geometry, &view);
                        for dir in [Direction::Forward, Direction::Backward] {
                            let (w, p) = (whole.program(dir), part.program(dir));
                            prop_assert_eq!(p.ops.get(&rank), w.ops.get(&rank), "{} {:?} ops of {}", s, dir, rank);
                            prop_assert!(p.ops.keys().chain(p.stage_rows.keys()).all(|&r| r == rank));
                            prop_assert_eq!(p.stage_rows.get(&rank), w.stage_rows.get(&rank));
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// What `hetpar layout` reports, summed from each rank's share one rank at a time (under
    /// `gather` one share per group), is what the whole plans move: rows sent and received
    /// per rank, rows crossing between islands, and each rank's lower bound, every strategy,
    /// both directions, every microbatch summed.
    #[test]
    fn the_step_traffic_of_the_shares_is_the_whole_plans(world in arb_world(6)) {
        for edge in 0..world.layouts.len() - 1 {
            let (src, dst) = (&world.layouts[edge + 1], &world.layouts[0]);
            let strategies = world.strategies(edge);
            let ticks = std::cell::Cell::new(0);
            let got = step_traffic((src, dst), &world.manifest, edge, &strategies, &|n| ticks.set(ticks.get() + n));
            // Progress hears of every unit of work it was told of, no more.
            prop_assert_eq!(ticks.get(), step_work((src, dst), &world.manifest));
            for (s, fwd, bwd) in got {
                let mut want = [StepTraffic::default(), StepTraffic::default()];
                for k in 0..world.manifest.n_microbatches() {
                    let plan = EdgePlan::new(world.geometry(edge, k), s);
                    let geo = &plan.geometry;
                    let bounds = [geo.forward_lower_bound(), geo.backward_lower_bound()];
                    for ((w, dir), bound) in want.iter_mut().zip([Direction::Forward, Direction::Backward]).zip(bounds) {
                        let prog = plan.program(dir);
                        let t = prog.traffic();
                        for (map, by_rank) in [(&mut w.sent, &t.sent), (&mut w.received, &t.received), (&mut w.lower_bound, &bound)] {
                            for (&r, &n) in by_rank {
                                *map.entry(r).or_insert(0) += n;
                            }
                        }
                        for (&r, ops) in &prog.ops {
                            for op in ops {
                                if let Op::Send { peer, rows } = op
                                    && src.span().contains(r) != src.span().contains(*peer)
                                {
                                    w.crossing += rows.rows();
                                }
                            }
                        }
                    }
                }
                let [wf, wb] = want;
                prop_assert_eq!(&fwd, &wf, "{} forward", s);
                prop_assert_eq!(&bwd, &wb, "{} backward", s);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The runs of rows ([`EdgeGeometry::for_each_run`]) are the whole geometry's rows, in
    /// order, each with its holders, needers and canonical needer; the `gather` groups found
    /// from them ([`EdgePlan::gather_groups`]) are the whole plan's all-gather-v groups and
    /// counts, both directions.
    #[test]
    fn runs_are_the_rows_and_gather_groups_the_whole_plans(world in arb_world(6)) {
        for edge in 0..world.layouts.len() - 1 {
            let (src, dst) = (&world.layouts[edge + 1], &world.layouts[0]);
            let mut ranks: Vec<usize> = src.span().ranks().chain(dst.span().ranks()).collect();
            ranks.sort_unstable();
            ranks.dedup();
            for k in 0..world.manifest.n_microbatches() {
                let geo = world.geometry(edge, k);
                let mut runs = Vec::new();
                EdgeGeometry::for_each_run(src, dst, &world.manifest, (edge, k), |len, h, n, c| {
                    runs.extend(std::iter::repeat_n((h.to_vec(), n.to_vec(), c), len));
                });
                let rows: Vec<_> =
                    geo.rows.iter().map(|r| (geo.holders(r).to_vec(), geo.needers(r).to_vec(), r.canonical)).collect();
                prop_assert_eq!(runs, rows);
                if !world.strategies(edge).contains(&Strategy::Gather) {
                    continue;
                }
                let plan = EdgePlan::new(geo, Strategy::Gather);
                let got = EdgePlan::gather_groups((src, dst), &world.manifest, (edge, k), &ranks);
                for (dir, got) in [Direction::Forward, Direction::Backward].into_iter().zip(got) {
                    let mut want: Vec<(Vec<usize>, Vec<usize>)> = plan
                        .program(dir)
                        .ops
                        .values()
                        .flatten()
                        .filter_map(|op| match op {
                            Op::AllGatherV { group, counts, .. } => Some((group.clone(), counts.clone())),
                            _ => None,
                        })
                        .collect();
                    want.sort_unstable();
                    want.dedup();
                    prop_assert_eq!(&got, &want, "{:?} microbatch {}", dir, k);
                }
            }
        }
    }
}
