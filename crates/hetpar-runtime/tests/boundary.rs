//! The boundary executor on the local backend: on random plans (the generator of
//! hetpar-layout's property tests) every destination buffer and every returned gradient is
//! bitwise what the symbolic executor predicts, and the recording wrapper's byte counts
//! equal the plan's.

use std::collections::BTreeMap;
use std::time::Duration;

use hetpar_comm::{Communicator, LocalOptions, Log, Recording, launch};
use hetpar_layout::symbolic::{Label, execute, initial_state};
use hetpar_layout::testing::arb_world;
use hetpar_layout::{Direction, EdgePlan, RowId};
use hetpar_runtime::{Groups, RuntimeError, run_boundary};
use proptest::prelude::*;

const WIDTH: usize = 3;

/// An exactly representable f32 naming a row, the rank whose copy it is, and a column.
fn enc(row: RowId, origin: usize, col: usize) -> f32 {
    (((row.sample * 64 + row.token) * 128 + origin) * 8 + col) as f32
}

fn encode(labels: &[Option<Label>]) -> Vec<f32> {
    labels
        .iter()
        .flat_map(|l| {
            let l = l.expect("the symbolic executor filled every slot");
            (0..WIDTH).map(move |c| enc(l.row, l.origin, c))
        })
        .collect()
}

/// Per rank: the needed buffer after the forward, the held buffer after the backward.
type Outcome = Vec<(Vec<f32>, Vec<f32>)>;

/// Runs both directions of `plan` on `world` local ranks, recording what moves.
fn run(plan: &EdgePlan, world: usize) -> (Outcome, Log) {
    let log = Log::new();
    let geo = &plan.geometry;
    let out = launch(world, LocalOptions { timeout: Duration::from_secs(20) }, |c| {
        let rec = Recording::new(Box::new(c), log.clone());
        let rank = c.rank();
        let mut groups = Groups::new();
        groups.prepare(&rec, [&plan.forward, &plan.backward]).expect("groups");
        let ids = |m: &BTreeMap<usize, Vec<usize>>| -> Vec<RowId> {
            m.get(&rank).map(|v| v.iter().map(|&i| geo.rows[i].id).collect()).unwrap_or_default()
        };
        let (held_ids, needed_ids) = (ids(&geo.held), ids(&geo.needed));
        let fill = |ids: &[RowId]| -> Vec<f32> {
            ids.iter().flat_map(|&r| (0..WIDTH).map(move |col| enc(r, rank, col))).collect()
        };
        let mut held = fill(&held_ids);
        let mut needed = vec![0.0f32; needed_ids.len() * WIDTH];
        run_boundary(
            &rec,
            &groups,
            plan,
            Direction::Forward,
            "enc -> llm",
            WIDTH,
            7,
            &mut held,
            &mut needed,
        )
        .expect("forward");
        let after_forward = needed.clone();
        let mut needed = fill(&needed_ids);
        let mut held = vec![0.0f32; held_ids.len() * WIDTH];
        run_boundary(
            &rec,
            &groups,
            plan,
            Direction::Backward,
            "enc -> llm",
            WIDTH,
            8,
            &mut held,
            &mut needed,
        )
        .expect("backward");
        (after_forward, held)
    })
    .expect("launch");
    (out, log)
}

fn check(plan: &EdgePlan) -> Result<(), TestCaseError> {
    let world = plan.geometry.ranks().max().expect("ranks") + 1;
    let (out, log) = run(plan, world);
    let fwd =
        execute(&plan.forward, initial_state(plan, Direction::Forward)).expect("symbolic forward");
    let bwd = execute(&plan.backward, initial_state(plan, Direction::Backward))
        .expect("symbolic backward");
    let bytes = log.bytes_by_rank();
    let (tf, tb) = (plan.forward.traffic(), plan.backward.traffic());
    for r in plan.geometry.ranks() {
        let (needed, held) = &out[r];
        prop_assert_eq!(needed, &encode(&fwd[&r].needed), "forward, rank {}", r);
        prop_assert_eq!(held, &encode(&bwd[&r].held), "backward, rank {}", r);
        let want = (
            (tf.sent[&r] + tb.sent[&r]) * WIDTH * 4,
            (tf.received[&r] + tb.received[&r]) * WIDTH * 4,
        );
        let got = bytes.get(&r).map_or((0, 0), |&(s, rv)| (s as usize, rv as usize));
        prop_assert_eq!(got, want, "recorded bytes of rank {}", r);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn executor_matches_the_symbolic_prediction(world in arb_world(5)) {
        for edge in 0..world.layouts.len() - 1 {
            for strategy in world.strategies(edge) {
                check(&EdgePlan::new(world.geometry(edge, 0), strategy))?;
            }
        }
    }
}

#[test]
fn buffers_that_disagree_with_the_plan_are_rejected_before_moving() {
    use hetpar_layout::{
        BatchManifest, EdgeGeometry, Item, LayoutSpec, ModuleLayout, Sample, Span, Strategy,
    };
    let enc = ModuleLayout::new("vision", Span::new(0, 2), LayoutSpec::default()).expect("layout");
    let llm =
        ModuleLayout::new("llm", Span::new(0, 2), LayoutSpec { tp: 2, ..LayoutSpec::default() })
            .expect("layout");
    let sample = Sample { len: 8, items: vec![Item { edge: 0, pos: 1, rows: 4 }] };
    let m = BatchManifest::new(8, 1, 1, vec![sample; 2]).expect("manifest");
    let plan = EdgePlan::new(EdgeGeometry::new(&enc, &llm, &m, 0, 0), Strategy::Exact);
    let out = launch(2, LocalOptions { timeout: Duration::from_secs(2) }, |c| {
        let groups = {
            let mut g = Groups::new();
            g.prepare(c, [&plan.forward]).expect("groups");
            g
        };
        // Rank 1 passes one row too few; rank 0 is fine and then waits for rank 1.
        let mut held = vec![0.0f32; (4 - c.rank()) * WIDTH];
        let mut needed = vec![0.0f32; 8 * WIDTH];
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
    assert_eq!(
        out[1].clone().expect_err("short buffer"),
        RuntimeError::Boundary {
            edge: "vision -> llm".into(),
            message: "rank 1 passes 9 values as its held rows, the plan has 4 rows of width 3 = 12"
                .into()
        }
    );
    let e = out[0].clone().expect_err("peer gone").to_string();
    assert!(e.starts_with("rank 1 failed: exited without joining it (all-to-all-v #0"), "{e}");
}
