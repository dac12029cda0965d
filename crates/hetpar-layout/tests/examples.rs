//! The worked cases of EXAMPLES.md, pinned: owners, lower bounds, leaders and the programs
//! each strategy emits for them.

use expect_test::expect;
use hetpar_layout::Direction;
use hetpar_layout::plan::Program;
use hetpar_layout::testing::check_plan;
use hetpar_layout::{
    BatchManifest, EdgeGeometry, EdgePlan, Item, LayoutSpec, ModuleLayout, RowId, Sample, Span,
    Strategy,
};

fn layout(
    name: &str,
    span: (usize, usize),
    tp: usize,
    cp: usize,
    pp: usize,
    sp: bool,
) -> ModuleLayout {
    let spec = LayoutSpec { tp, cp, pp, sp, ..LayoutSpec::default() };
    ModuleLayout::new(name, Span::new(span.0, span.1), spec).expect("valid layout")
}

/// `n` samples, each one item of `rows` rows at `pos`, in one microbatch.
fn manifest(n: usize, seq_len: usize, pos: usize, rows: usize) -> BatchManifest {
    let sample = Sample { len: seq_len, items: vec![Item { edge: 0, pos, rows }] };
    BatchManifest::new(seq_len, 1, 1, vec![sample; n]).expect("valid manifest")
}

fn plan(src: &ModuleLayout, dst: &ModuleLayout, m: &BatchManifest, s: Strategy) -> EdgePlan {
    let plan = EdgePlan::new(EdgeGeometry::new(src, dst, m, 0, 0), s);
    check_plan(&plan).expect("plan satisfies the contract");
    plan
}

fn moved(p: &EdgePlan, dir: Direction) -> usize {
    p.program(dir).traffic().total()
}

fn render(p: &Program) -> String {
    let mut s = String::new();
    for (rank, ops) in &p.ops {
        for op in ops {
            s.push_str(&format!("{rank}: {op}\n"));
        }
    }
    s
}

#[test]
fn case1_colocated_fan_in_on_eight_ranks() {
    let enc = layout("vision", (0, 8), 1, 1, 1, false);
    let llm = layout("llm", (0, 8), 8, 1, 1, false);
    let m = manifest(8, 8, 0, 4);
    let geo = EdgeGeometry::new(&enc, &llm, &m, 0, 0);
    assert_eq!(geo.forward_lower_bound().values().sum::<usize>(), 224);
    assert_eq!(geo.backward_lower_bound().values().sum::<usize>(), 0);
    for s in [Strategy::Exact, Strategy::Gather] {
        let p = plan(&enc, &llm, &m, s);
        assert_eq!(
            (moved(&p, Direction::Forward), moved(&p, Direction::Backward)),
            (224, 0),
            "{s}"
        );
    }
    // Gather-and-select is one all-gather over the 8 ranks, then interval selection; the
    // backward is a local slice on every rank.
    let p = plan(&enc, &llm, &m, Strategy::Gather);
    expect![[r#"
        0: copy H[0..4] -> N[0..4]
        0: all-gather-v over 0-7: contribute 4 rows from H[0..4], gather 32 into S[0..32]
        0: copy S[4..32] -> N[4..32]
    "#]]
    .assert_eq(&render(&p.forward).lines().take(3).map(|l| format!("{l}\n")).collect::<String>());
    expect![[r#"
        0: copy N[0..4] -> H[0..4]
        1: copy N[4..8] -> H[0..4]
        2: copy N[8..12] -> H[0..4]
        3: copy N[12..16] -> H[0..4]
        4: copy N[16..20] -> H[0..4]
        5: copy N[20..24] -> H[0..4]
        6: copy N[24..28] -> H[0..4]
        7: copy N[28..32] -> H[0..4]
    "#]]
    .assert_eq(&render(&p.backward));
}

#[test]
fn case3_colocated_into_cp2_needs_the_owned_tokens() {
    let enc = layout("vision", (0, 8), 1, 1, 1, false);
    let llm = layout("llm", (0, 8), 2, 2, 1, false);
    let m = manifest(8, 16, 2, 4);
    let geo = EdgeGeometry::new(&enc, &llm, &m, 0, 0);
    let ids =
        |rank: usize| -> Vec<RowId> { geo.needed[&rank].iter().map(|&i| geo.rows[i].id).collect() };
    let want = |tokens: [usize; 2]| -> Vec<RowId> {
        (0..4).flat_map(|sample| tokens.map(|token| RowId { sample, token })).collect()
    };
    assert_eq!(ids(0), want([0, 1]));
    assert_eq!(ids(2), want([2, 3]));
    assert_eq!(ids(1), ids(0));
    assert_eq!(ids(3), ids(2));
    assert_eq!(geo.forward_lower_bound().values().sum::<usize>(), 48);
    assert_eq!(geo.backward_lower_bound().values().sum::<usize>(), 16);
    let exact = plan(&enc, &llm, &m, Strategy::Exact);
    assert_eq!((moved(&exact, Direction::Forward), moved(&exact, Direction::Backward)), (48, 16));
    let gather = plan(&enc, &llm, &m, Strategy::Gather);
    // Two gather groups of 4 ranks each move 4 * 12 rows: twice the bound.
    assert_eq!(moved(&gather, Direction::Forward), 96);
}

#[test]
fn case4_non_colocated_leaders() {
    let enc = layout("vision", (0, 8), 2, 1, 2, false);
    let llm = layout("llm", (8, 12), 2, 1, 1, false);
    let m = manifest(4, 8, 1, 3);
    let p = plan(&enc, &llm, &m, Strategy::Leaders { stripes: 1 });
    expect![[r#"
        4: send 6 rows to 8 from H[0..6]
        6: send 6 rows to 10 from H[0..6]
        8: recv 6 rows from 4 into N[0..6]
        8: broadcast over 8-9 from 8: 6 rows at N[0..6]
        9: broadcast over 8-9 from 8: 6 rows at N[0..6]
        10: recv 6 rows from 6 into N[0..6]
        10: broadcast over 10-11 from 10: 6 rows at N[0..6]
        11: broadcast over 10-11 from 10: 6 rows at N[0..6]
    "#]]
    .assert_eq(&render(&p.forward));
    expect![[r#"
        4: recv 6 rows from 8 into H[0..6]
        4: broadcast over 4-5 from 4: 6 rows at H[0..6]
        5: broadcast over 4-5 from 4: 6 rows at H[0..6]
        6: recv 6 rows from 10 into H[0..6]
        6: broadcast over 6-7 from 6: 6 rows at H[0..6]
        7: broadcast over 6-7 from 6: 6 rows at H[0..6]
        8: send 6 rows to 4 from N[0..6]
        10: send 6 rows to 6 from N[0..6]
    "#]]
    .assert_eq(&render(&p.backward));
    // Striping over both TP ranks: each replica pair uses two links.
    let striped = plan(&enc, &llm, &m, Strategy::Leaders { stripes: 2 });
    let cross: Vec<String> = striped.forward.ops[&5].iter().map(ToString::to_string).collect();
    assert_eq!(cross, ["send 3 rows to 9 from H[3..6]"]);
    assert_eq!(plan(&enc, &llm, &m, Strategy::Exact).forward.traffic().total(), 24);
}

#[test]
fn case5_dp3_into_dp2_splits_the_middle_replica() {
    let enc = layout("vision", (0, 3), 1, 1, 1, false);
    let llm = layout("llm", (3, 7), 2, 1, 1, false);
    let m = manifest(6, 8, 1, 2);
    let p = plan(&enc, &llm, &m, Strategy::Leaders { stripes: 1 });
    let ops = |rank: usize, dir: Direction| -> Vec<String> {
        p.program(dir).ops[&rank].iter().map(ToString::to_string).collect()
    };
    assert_eq!(
        ops(1, Direction::Forward),
        ["send 2 rows to 3 from H[0..2]", "send 2 rows to 5 from H[2..4]"]
    );
    assert_eq!(
        ops(1, Direction::Backward),
        ["recv 2 rows from 3 into H[0..2]", "recv 2 rows from 5 into H[2..4]"]
    );
    assert_eq!(
        ops(3, Direction::Forward)[..2],
        ["recv 4 rows from 0 into N[0..4]", "recv 2 rows from 1 into N[4..6]"]
    );
}

/// One sample of `images` items of 4 rows at positions 1, 5, 9, ... in a 64-token sequence.
fn one_sample_with(images: usize) -> BatchManifest {
    let items = (0..images).map(|i| Item { edge: 0, pos: 1 + 4 * i, rows: 4 }).collect();
    BatchManifest::new(64, 1, 1, vec![Sample { len: 64, items }]).expect("valid manifest")
}

#[test]
fn case6_encoder_replicas_split_one_samples_items() {
    let enc = layout("vision", (0, 8), 1, 1, 1, false);
    let llm = layout("llm", (0, 8), 4, 2, 1, false);
    // Which items (by index in the sample) each encoder rank holds rows of.
    let items_of = |geo: &EdgeGeometry, rank: usize| -> Vec<usize> {
        let mut v: Vec<usize> = geo.held[&rank].iter().map(|&i| geo.rows[i].item).collect();
        v.dedup();
        v
    };
    let m = one_sample_with(12);
    let owned: Vec<_> = (0..8).map(|d| m.replica_items(0, 8, d, 0)).collect();
    assert_eq!(owned, [0..1, 1..3, 3..4, 4..6, 6..7, 7..9, 9..10, 10..12]);
    let geo = EdgeGeometry::new(&enc, &llm, &m, 0, 0);
    assert_eq!(geo.rows.len(), 48);
    assert_eq!(items_of(&geo, 1), [1, 2]);
    assert_eq!(items_of(&geo, 2), [3]);
    // Rank 1 holds rows 4..12 of sample 0 (images 1 and 2), in order.
    let held: Vec<RowId> = geo.held[&1].iter().map(|&i| geo.rows[i].id).collect();
    assert_eq!(held, (4..12).map(|token| RowId { sample: 0, token }).collect::<Vec<_>>());
    // Each LLM rank needs the rows at the positions its CP rank owns (chunks of 16: CP rank 0
    // owns 0-15 and 48-63, which touch images 0-3 and the last row of image 11; CP rank 1
    // owns 16-47); TP replicas need the same rows; each collects from several encoder ranks.
    let sources = |rank: usize| -> Vec<usize> {
        let mut v: Vec<usize> =
            geo.needed[&rank].iter().map(|&i| geo.rows[i].src_replica).collect();
        v.dedup();
        v
    };
    assert_eq!(sources(0), [0, 1, 2, 7]);
    assert_eq!(sources(4), [2, 3, 4, 5, 6, 7]);
    assert_eq!(geo.needed[&0], geo.needed[&3]);
    for s in [Strategy::Exact, Strategy::Gather] {
        plan(&enc, &llm, &m, s);
    }

    // Three images: replicas 2, 5 and 7 encode one each, the other five own nothing.
    let m = one_sample_with(3);
    let owned: Vec<_> = (0..8).map(|d| m.replica_items(0, 8, d, 0)).collect();
    assert_eq!(owned, [0..0, 0..0, 0..1, 1..1, 1..1, 1..2, 2..2, 2..3]);
    let geo = EdgeGeometry::new(&enc, &llm, &m, 0, 0);
    let busy: Vec<usize> = (0..8).filter(|&r| !geo.held[&r].is_empty()).collect();
    assert_eq!(busy, [2, 5, 7]);
    for s in [Strategy::Exact, Strategy::Gather] {
        let p = plan(&enc, &llm, &m, s);
        // The idle replicas still take part: the all-to-all spans every rank, and under
        // gather each idle rank whose LLM part needs rows (the CP-0 ranks: the three images
        // sit at positions 1-12) joins the gather of the busy ones.
        for r in [0, 1, 3, 4, 6] {
            let ops = &p.forward.ops[&r];
            let joins = ops.iter().any(|op| op.group().is_some());
            let needs = !geo.needed[&r].is_empty();
            assert_eq!(joins, s == Strategy::Exact || needs, "{s}: rank {r}: {ops:?}");
        }
    }
    // Across islands too: the same encoder on its own ranks, its empty replicas send nothing.
    let island = layout("vision", (8, 16), 1, 1, 1, false);
    let p = plan(&island, &llm, &m, Strategy::Leaders { stripes: 1 });
    let senders: Vec<usize> = (8..16).filter(|r| !p.forward.ops[r].is_empty()).collect();
    assert_eq!(senders, [10, 13, 15]);
}

#[test]
fn colocated_fan_out_moves_nothing_forward() {
    // One TP-replicated encoder replica feeds four LLM replicas on the same ranks: every
    // rank already holds its own samples, but must get back the gradients of the others.
    let enc = layout("vision", (0, 4), 4, 1, 1, false);
    let llm = layout("llm", (0, 4), 1, 1, 1, false);
    let m = manifest(4, 8, 0, 5);
    let p = plan(&enc, &llm, &m, Strategy::Exact);
    assert_eq!(moved(&p, Direction::Forward), 0);
    assert_eq!(moved(&p, Direction::Backward), 4 * 3 * 5);
}

#[test]
fn sequence_sharded_encoder_into_sp_llm() {
    // Encoder with SP over tp 2 (each row one holder) into an LLM tp2 cp2 with SP.
    let enc = layout("vision", (0, 4), 2, 1, 1, true);
    let llm = layout("llm", (0, 4), 2, 2, 1, true);
    let m = manifest(2, 16, 3, 9);
    for s in [Strategy::Exact, Strategy::Gather] {
        plan(&enc, &llm, &m, s);
    }
    let geo = EdgeGeometry::new(&enc, &llm, &m, 0, 0);
    assert!(geo.rows.iter().all(|r| geo.holders(r).len() == 1 && geo.needers(r).len() == 1));
}
