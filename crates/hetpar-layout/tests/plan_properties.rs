//! Property tests: every strategy on random worlds (up to 64 ranks, one or two encoders,
//! colocated and non-colocated, random TP/SP/CP/PP, any DP ratio, encoder dp 1 to 32
//! splitting items, random manifests of 0-4 items per sample with text-only samples and
//! microbatches holding fewer items than an encoder has replicas) satisfies the boundary
//! contract under the symbolic executor, in both directions.

use hetpar_layout::EdgePlan;
use hetpar_layout::manifest::item_replica;
use hetpar_layout::testing::{arb_world, check_plan};
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
                for row in &world.geometry(edge, k).rows {
                    let owner = item_replica(n, src.dp(), row.item);
                    for &h in &row.holders {
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
