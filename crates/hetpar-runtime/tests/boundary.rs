//! The boundary executor on the local backend: on random plans (the generator of
//! hetpar-layout's property tests) and on the fixed set the MPI runner uses, every
//! destination buffer and every returned gradient is bitwise what the symbolic executor
//! predicts, and the recording wrapper's byte counts equal the plan's.

use std::time::Duration;

use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::testing::arb_world;
use hetpar_layout::{Direction, EdgePlan};
use hetpar_runtime::testing::{WIDTH, check_boundary, fixed_plans};
use hetpar_runtime::{Groups, RuntimeError, run_boundary};
use proptest::prelude::*;

fn run_everywhere(plan: &EdgePlan, name: &str) -> Result<(), String> {
    let world = plan.geometry.ranks().max().expect("ranks") + 1;
    let out = launch(world, LocalOptions { timeout: Duration::from_secs(20) }, |c| {
        check_boundary(c, plan, name)
    })
    .map_err(|e| e.to_string())?;
    out.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn executor_matches_the_symbolic_prediction(world in arb_world(5)) {
        for edge in 0..world.layouts.len() - 1 {
            for strategy in world.strategies(edge) {
                let plan = EdgePlan::new(world.geometry(edge, 0), strategy);
                run_everywhere(&plan, &format!("edge {edge} {strategy}")).map_err(TestCaseError::fail)?;
            }
        }
    }
}

#[test]
fn the_fixed_mpi_set_passes_on_local_ranks() {
    for n in [4, 8] {
        for (name, plan) in fixed_plans(n) {
            run_everywhere(&plan, &name).unwrap_or_else(|e| panic!("{n} ranks: {e}"));
        }
    }
}

#[test]
fn buffers_that_disagree_with_the_plan_are_rejected_before_moving() {
    let plan = fixed_plans(4).into_iter().find(|(n, _)| n == "fan-in exact").expect("plan").1;
    let out = launch(4, LocalOptions { timeout: Duration::from_secs(2) }, |c| {
        let mut groups = Groups::new();
        groups.prepare(c, [&plan.forward]).expect("groups");
        let rank = hetpar_comm::CommExt::global_rank(c);
        let rows = |m: &std::collections::BTreeMap<usize, Vec<usize>>| m[&rank].len();
        // Rank 1 passes one value too few; the others are fine and then wait for it.
        let mut held = vec![0.0f32; rows(&plan.geometry.held) * WIDTH - usize::from(rank == 1)];
        let mut needed = vec![0.0f32; rows(&plan.geometry.needed) * WIDTH];
        run_boundary(
            c,
            &groups,
            &plan,
            Direction::Forward,
            "vision -> llm",
            WIDTH,
            0,
            &mut held,
            &mut needed,
        )
    })
    .expect("no panic");
    let e = out[1].clone().expect_err("short buffer");
    assert!(matches!(&e, RuntimeError::Boundary { edge, .. } if edge == "vision -> llm"), "{e}");
    assert!(e.to_string().starts_with("boundary vision -> llm: rank 1 passes "), "{e}");
    let e = out[0].clone().expect_err("peer gone").to_string();
    assert!(e.starts_with("rank 1 failed: exited without joining it"), "{e}");
}
