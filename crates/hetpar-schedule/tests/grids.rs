//! Snapshots of the schedules people read, the 1F1B bubble formula, and a hand-broken
//! schedule's message.

use expect_test::expect_file;
use hetpar_layout::{Config, ModelGraph};
use hetpar_schedule::{
    Action, Options, PipelineGraph, Schedule, ScheduleKind, UnitDurations, held, text_grid,
    validate,
};

fn graph(toml: &str) -> PipelineGraph {
    let cfg = Config::from_toml(toml).expect("config parses");
    PipelineGraph::from_model(&ModelGraph::from_config(&cfg).expect("config is valid"))
}

const LLM: &str = r#"
[modules.llm]
kind = "llama"
vocab = 64
hidden = 32
layers = 8
heads = 4
ffn = 64
"#;

const VISION: &str = r#"
[modules.vision]
kind = "vit"
image_size = 16
patch_size = 8
hidden = 32
layers = 2
heads = 4
ffn = 64
"#;

fn llm_only(pp: usize, m: usize) -> PipelineGraph {
    graph(&format!(
        "name = \"t\"\n[train]\nglobal_batch = {m}\nmicrobatches = {m}\nseq_len = 32\n{LLM}[modules.llm.parallel]\nranks = [0, {pp}]\npp = {pp}\n"
    ))
}

fn grid(g: &PipelineGraph) -> String {
    let s = Schedule::build(g, Options::default()).expect("builds");
    let t = validate(&s, &UnitDurations).expect("valid");
    format!(
        "{}, step {} slots, bubble {:.4}\n{}",
        s.kind.name(),
        t.makespan,
        t.bubble_fraction(),
        text_grid(&s, &t)
    )
}

#[test]
fn one_f_one_b_pp4_m8() {
    expect_file!["snapshots/1f1b-pp4-m8.txt"].assert_eq(&grid(&llm_only(4, 8)));
}

#[test]
fn three_phase_with_llm_pp2() {
    let g = graph(&format!(
        "name = \"t\"\n[train]\nglobal_batch = 16\nmicrobatches = 4\nseq_len = 32\n{VISION}[modules.vision.parallel]\nranks = [0, 4]\noffload = true\n{LLM}[modules.llm.parallel]\nranks = [0, 4]\ntp = 2\npp = 2\n[[edges]]\nfrom = \"vision\"\nto = \"llm\"\n"
    ));
    assert_eq!(g.kind(), ScheduleKind::ThreePhase);
    expect_file!["snapshots/three-phase-llm-pp2.txt"].assert_eq(&grid(&g));
}

#[test]
fn vision_and_audio_into_llm_pp2() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/two-encoders-islands.toml"
    ))
    .expect("example");
    let g = graph(&text);
    assert_eq!(g.kind(), ScheduleKind::GraphAware);
    expect_file!["snapshots/graph-aware-vision-audio-llm-pp2.txt"].assert_eq(&grid(&g));
}

#[test]
fn plain_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for p in 1..=4 {
        for m in 1..=16 {
            let s = Schedule::build(&llm_only(p, m), Options { optimizer: false }).expect("builds");
            let t = validate(&s, &UnitDurations).expect("valid");
            let want = (p - 1) as f64 / (m + p - 1) as f64;
            assert!(
                (t.bubble_fraction() - want).abs() < 1e-12,
                "p {p} m {m}: {} vs {want}",
                t.bubble_fraction()
            );
            assert_eq!(t.makespan, 2.0 * (m + p - 1) as f64, "p {p} m {m}");
        }
    }
}

#[test]
fn interleaving_shrinks_the_bubble() {
    let plain = llm_only(4, 8);
    let mut modules = plain.modules().to_vec();
    modules[0].vpp = 2;
    let inter = PipelineGraph::new(modules, vec![], 8).expect("graph");
    let bubble = |g: &PipelineGraph| {
        let s = Schedule::build(g, Options { optimizer: false }).expect("builds");
        validate(&s, &UnitDurations).expect("valid").bubble_fraction()
    };
    // Each virtual stage does half the work, so per-chunk passes take half the time; with
    // unit durations per pass the comparison is in slots of half-stages.
    let (b_plain, b_inter) = (bubble(&plain), bubble(&inter));
    assert!(b_inter < b_plain, "interleaved {b_inter} vs plain {b_plain}");
}

#[test]
fn interleaving_refuses_microbatches_not_divisible_by_pp() {
    let plain = llm_only(4, 8);
    let mut modules = plain.modules().to_vec();
    modules[0].vpp = 2;
    let err = PipelineGraph::new(modules, vec![], 6).expect_err("6 microbatches over pp 4");
    assert!(
        err.to_string()
            .contains("interleaved 1F1B (vpp 2) needs microbatches(6) divisible by pp(4)"),
        "{err}"
    );
}

#[test]
fn a_dropped_receive_names_both_ranks() {
    let mut s = Schedule::build(&llm_only(4, 8), Options::default()).expect("builds");
    // Rank 1's first action receives stage 0's activation of microbatch 0; drop it.
    assert!(matches!(s.ranks[&1][0], Action::Comm(_)));
    s.ranks.get_mut(&1).expect("rank 1").remove(0);
    let err = validate(&s, &UnitDurations).expect_err("broken");
    assert_eq!(
        err.to_string(),
        "rank 0 action 1 (send activation of llm stage 0 mb 0 from rank 0 to rank 1): rank 1 never posts activation of llm stage 0 mb 0 from rank 0 to rank 1"
    );
}

#[test]
fn swapped_sends_deadlock_with_the_cycle_named() {
    let mut s = Schedule::build(&llm_only(2, 4), Options::default()).expect("builds");
    // Rank 0 sends activations of mb 0 and mb 1 in its first two communication actions.
    let comm: Vec<usize> = s.ranks[&0]
        .iter()
        .enumerate()
        .filter(|(_, a)| matches!(a, Action::Comm(_)))
        .map(|(i, _)| i)
        .collect();
    s.ranks.get_mut(&0).expect("rank 0").swap(comm[0], comm[1]);
    let err = validate(&s, &UnitDurations).expect_err("broken");
    assert_eq!(
        err.to_string(),
        "deadlock: rank 0 at action 1 (send activation of llm stage 0 mb 1 from rank 0 to rank 1 + recv gradient of llm stage 1 mb 0 from rank 1 to rank 0) waits for rank 1; rank 1 at action 0 (recv activation of llm stage 0 mb 0 from rank 0 to rank 1) waits for rank 0"
    );
}

/// 1F1B with pp 4 and 8 microbatches, each forward holding 1 until its backward: stage `s`
/// alone holds `pp - s` at its peak (its warm-up forwards and one more). Together, when
/// stage 0 holds its 4 and has received its first gradient, stage 1 has run its first backward
/// and holds at least 2, stage 2 at least 1, and the last stage may hold none: 7 in every
/// execution (steady 1F1B holds 4 + 3 + 2 + 1 when the stages keep pace).
#[test]
fn one_f_one_b_holds_its_warmup_per_stage() {
    let s = Schedule::build(&llm_only(4, 8), Options::default()).expect("builds");
    struct One;
    impl hetpar_schedule::Keeps for One {
        fn kept(&self, _: usize, _: &hetpar_schedule::Compute) -> f64 {
            1.0
        }
    }
    for stage in 0..4 {
        assert_eq!(held(&s, &[stage], &One).total, (4 - stage) as f64, "stage {stage}");
    }
    let all = held(&s, &[0, 1, 2, 3], &One);
    assert_eq!((all.total, all.rank, all.after), (7.0, 0, 8));
    assert_eq!(all.per_rank.values().copied().collect::<Vec<_>>(), [4.0, 2.0, 1.0, 0.0]);
}

/// A participant list out of order is named, even when every participant lists it alike:
/// membership is looked up by binary search, which needs the order.
#[test]
fn participants_out_of_order_are_named() {
    let g = graph(&format!(
        "name = \"t\"\n[train]\nglobal_batch = 4\nmicrobatches = 1\nseq_len = 32\n{VISION}[modules.vision.parallel]\nranks = [0, 4]\n{LLM}[modules.llm.parallel]\nranks = [0, 4]\ntp = 2\n[[edges]]\nfrom = \"vision\"\nto = \"llm\"\n"
    ));
    let mut s = Schedule::build(&g, Options::default()).expect("builds");
    let reversed: std::sync::Arc<[usize]> = [3, 2, 1, 0].into();
    for actions in s.ranks.values_mut() {
        for a in actions.iter_mut() {
            if let Action::Boundary(p) = a {
                p.participants = reversed.clone();
            }
        }
    }
    let err = validate(&s, &UnitDurations).expect_err("unsorted").to_string();
    assert!(
        err.contains("lists participants [3, 2, 1, 0] for") && err.ends_with("not ascending"),
        "{err}"
    );
}

/// A gradient reduction posted as a send rather than as a member is named.
#[test]
fn a_reduction_posted_as_a_send_is_named() {
    let mut s = Schedule::build(&llm_only(2, 2), Options::default()).expect("builds");
    let post = s
        .ranks
        .values_mut()
        .flatten()
        .find_map(|a| match a {
            Action::Reduce(p) => Some(p),
            _ => None,
        })
        .expect("a reduction");
    post.role = hetpar_schedule::Role::Send;
    let err = validate(&s, &UnitDurations).expect_err("wrong side").to_string();
    assert!(err.contains("has the wrong side of gradient reduction"), "{err}");
}
