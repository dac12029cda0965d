//! Search invariants: the lower bound never exceeds the simulated step and a module's own
//! work never exceeds the lower bound (so pruning by either loses nothing), every answer is runnable and fits, emitted configs validate, and the
//! simulator reproduces the 1F1B bubble.

use hetpar_layout::{Config, ModelGraph};
use hetpar_plan::candidate::{Candidate, Choice, Kind};
use hetpar_plan::hardware::builtin;
use hetpar_plan::validation::workload;
use hetpar_plan::{Evaluator, Workload, emit, search};
use proptest::prelude::*;

fn choice(start: usize, end: usize, tp: usize, cp: usize, pp: usize) -> Choice {
    Choice { start, end, tp, cp, pp, vpp: 1, ep: 1, recompute: 0, offload: false }
}

fn small() -> Workload {
    workload("mm-1b-14b-8k").expect("workload")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn lower_bound_never_exceeds_the_simulated_step_and_accepted_layouts_emit(
        kind in 0usize..3,
        ltp in prop::sample::select(vec![1usize, 2, 4, 8]),
        lpp in prop::sample::select(vec![1usize, 2, 4]),
        etp in prop::sample::select(vec![1usize, 2, 4]),
        epp in prop::sample::select(vec![1usize, 2]),
        island in prop::sample::select(vec![8usize, 16, 32]),
        m_pow in 0u32..5,
        rc in 0u8..=4,
        few_kv in any::<bool>(),
    ) {
        let mut wl = small();
        if few_kv {
            // 40 query heads over 4 key/value heads: tp 8 splits the queries but not the
            // key/value heads, which a config refuses, so the cost model must too.
            wl.llm.kv_heads = 4;
            wl.llm_sizes.kv_heads = Some(4);
        }
        let hw = builtin("h100").expect("h100");
        let n = wl.gpus;
        let kind = Kind::ALL[kind];
        let (llm, enc) = match kind {
            Kind::NonColocated => (choice(island, n, ltp, 1, lpp), choice(0, island, etp, 1, epp)),
            _ => (choice(0, n, ltp, 1, lpp), choice(0, n, etp, 1, 1)),
        };
        let c = Candidate {
            kind,
            llm: Choice { recompute: rc, ..llm },
            encoders: vec![enc],
            microbatches: 1 << m_pow,
        };
        let mut ev = Evaluator::new(&wl, &hw);
        if let Ok(p) = ev.prepare(&c) {
            // Whatever the cost model accepts (and the LLM's dp divides the microbatch),
            // hetpar runs.
            if c.runnable(&wl) {
                let cfg = emit::config(&wl, &c);
                prop_assert!(cfg.is_ok(), "{:?}: {}", c, cfg.expect_err("checked"));
            }
            let bound = p.lower_bound;
            // The search leaves out islands and LLM layouts by their own work, which no
            // candidate's bound falls below, at any recomputation.
            if kind == Kind::NonColocated {
                let m = c.microbatches;
                let island = ev.island_bound(0, &c.encoders[0], m);
                let llm = ev.llm_bound(&c.llm, m);
                prop_assert!(island <= bound && llm <= bound, "{island} {llm} > {bound}");
            }
            let pred = ev.finish(p).expect("a valid candidate simulates");
            prop_assert!(bound <= pred.step_time_s * (1.0 + 1e-9), "bound {} > step {}", bound, pred.step_time_s);
        }
    }
}

#[test]
fn a_single_pipeline_shows_the_1f1b_bubble() {
    // LLM only: pp stages of equal work, m microbatches: idle share (p-1)/(m+p-1).
    let text = r#"
name = "pipe"
[workload]
seq_len = 4096
global_batch = 128
[cluster]
gpus = 32
[modules.llm]
kind = "llama"
vocab = 256
hidden = 4096
layers = 32
heads = 32
ffn = 11008
"#;
    let wl = Workload::from_toml(text).expect("valid");
    let hw = builtin("h100").expect("h100");
    let mut ev = Evaluator::new(&wl, &hw);
    for (pp, m) in [(4usize, 8usize), (4, 16), (8, 16)] {
        let c = Candidate {
            kind: Kind::Homogeneous,
            llm: choice(0, 32, 1, 1, pp),
            encoders: vec![],
            microbatches: m,
        };
        let p = ev.evaluate(&c).expect("simulates");
        let formula = (pp - 1) as f64 / (m + pp - 1) as f64;
        // A tiny vocabulary keeps the stages equal; pipeline messages and the optimizer
        // step add a little: within three points of the formula.
        assert!((p.bubble - formula).abs() < 0.03, "pp {pp} m {m}: idle {} vs {formula}", p.bubble);
    }
}

#[test]
fn every_answer_is_runnable_fits_and_emits_a_valid_config() {
    let hw = builtin("h100").expect("h100");
    for name in ["mm-3b-14b-8k", "mm-1b-7b-64k", "mm-6b-gptoss120b"] {
        let wl = workload(name).expect("workload");
        let plan = search(&wl, &hw, 3).expect("a plan");
        assert!(plan.simulated <= plan.fitting && plan.fitting <= plan.considered);
        for (kind, ranked) in &plan.best {
            assert!(!ranked.is_empty(), "{name}: no {kind:?}");
            for w in ranked.windows(2) {
                assert!(w[0].prediction.step_time_s <= w[1].prediction.step_time_s);
            }
            for r in ranked {
                assert_eq!(r.candidate.kind, *kind);
                assert!(r.candidate.runnable(&wl), "{name}: {:?}", r.candidate);
                assert!(r.prediction.fits);
                let cfg = emit::config(&wl, &r.candidate).expect("emits");
                let back = Config::from_toml(&cfg.to_toml()).expect("round trips");
                let graph = ModelGraph::from_config(&back).expect("validates");
                assert_eq!(graph.world, wl.gpus);
            }
        }
    }
}

#[test]
fn a_workload_too_big_for_the_cluster_says_so() {
    let mut wl = workload("mm-3b-70b-8k").expect("workload");
    wl.gpus = 2;
    let hw = builtin("h100").expect("h100");
    let err = search(&wl, &hw, 1).expect_err("70B does not fit two GPUs");
    assert!(err.0.contains("no layout"), "{err}");
}

#[test]
fn the_explanation_names_what_holds_back_the_loser() {
    let hw = builtin("h100").expect("h100");
    // 1B + 14B at 8K on 64 GPUs: the colocated encoder takes tp 1 on all 64 ranks (its
    // replicas split the items of 16-sample microbatches), as published, and wins.
    let wl = small();
    let plan = search(&wl, &hw, 1).expect("a plan");
    let winner = plan.winner().expect("a winner");
    assert_eq!(winner.candidate.kind, Kind::Colocated);
    assert_eq!((winner.candidate.encoders[0].tp, winner.candidate.encoders[0].dp()), (1, 64));
    assert!(winner.candidate.runnable(&wl));
    let lines = hetpar_plan::explain::explain(&wl, &hw, &plan);
    assert!(lines[0].starts_with("homogeneous is limited by: "), "{lines:?}");
    assert!(lines[1].starts_with("colocated wins by +"), "{lines:?}");
    assert!(lines[1].contains("vision runs tp1 cp1 dp64"), "{lines:?}");
    // 1B + 7B at 64K: colocated wins and says which layouts changed (the encoder leaves the
    // LLM's tp 8 for tp 1 on all 32 ranks) and what that saves.
    let wl = workload("mm-1b-7b-64k").expect("workload");
    let plan = search(&wl, &hw, 1).expect("a plan");
    let lines = hetpar_plan::explain::explain(&wl, &hw, &plan);
    assert!(lines[1].starts_with("colocated wins by +"), "{lines:?}");
    assert!(
        lines[1].contains("vision runs tp1 cp1 dp32 pp1 instead of the LLM's tp8"),
        "{lines:?}"
    );
    assert!(lines[1].contains("encoder time on the busiest rank"), "{lines:?}");
}

/// A family without a candidate is explained as having no valid layout (no split of the
/// model and the GPUs) or none that fits memory, whichever holds.
#[test]
fn a_family_without_a_candidate_says_whether_none_is_valid_or_none_fits() {
    let mut hw = builtin("h100").expect("h100");
    let mut wl = workload("mm-1b-7b-8k").expect("workload");
    // 7 GPUs: no tp, cp and pp of the LLM split 7 ranks, so only islands exist.
    wl.gpus = 7;
    let plan = search(&wl, &hw, 1).expect("a plan");
    assert_eq!(plan.considered_of.get(&Kind::Homogeneous), None);
    let lines = hetpar_plan::explain::explain(&wl, &hw, &plan);
    assert_eq!(
        lines.last().map(String::as_str),
        Some("non_colocated wins (no valid homogeneous layout on these GPUs)"),
        "{lines:?}"
    );
    // 8 GPUs of 26 GiB: the heterogeneous layouts exist, and none fits.
    wl.gpus = 8;
    hw.memory_gib = 26.0;
    let plan = search(&wl, &hw, 1).expect("a plan");
    assert!(
        plan.considered_of[&Kind::Colocated] > 0 && plan.considered_of[&Kind::NonColocated] > 0
    );
    let lines = hetpar_plan::explain::explain(&wl, &hw, &plan);
    assert_eq!(
        lines.last().map(String::as_str),
        Some("homogeneous wins: no heterogeneous layout fits memory"),
        "{lines:?}"
    );
}

#[test]
fn a_pin_nothing_can_satisfy_is_named() {
    let mut wl = small();
    wl.llm_pinned.tp = Some(3);
    let hw = builtin("h100").expect("h100");
    let err = search(&wl, &hw, 1).expect_err("tp 3 splits neither 40 heads nor 64 GPUs");
    assert!(
        err.0.contains("no valid layout of mm-1b-14b-8k on 64 GPUs (llm pinned to tp 3)"),
        "{err}"
    );
}

/// A sequence shorter than the shortest chunk context parallelism is searched at still
/// plans (cp 1 splits nothing): LLaVA-style 2K workloads had no valid layout at all.
#[test]
fn a_short_sequence_plans_without_context_parallelism() {
    let hw = builtin("h100").expect("h100");
    let mut wl = workload("mm-1b-7b-8k").expect("workload");
    wl.gpus = 8;
    for seq in [2048, 3072, 4095] {
        wl.seq_len = seq;
        let plan = search(&wl, &hw, 1).unwrap_or_else(|e| panic!("seq {seq}: {e}"));
        assert_eq!(plan.best.len(), 3, "seq {seq}: every family has a layout");
        for ranked in plan.best.values() {
            assert!(ranked.iter().all(|r| r.candidate.llm.cp == 1), "seq {seq}");
        }
    }
}

/// A homogeneous candidate's encoders are written on the LLM's grid, cp included: with the
/// LLM at tp 4 cp 2, the audio encoder's 1,500 rows per clip do not split into 8 parts, so
/// no homogeneous layout is offered (one was, and its emitted config was refused).
#[test]
fn every_homogeneous_answer_emits_a_config_under_context_parallelism() {
    let hw = builtin("h100").expect("h100");
    let mut wl = workload("vision-audio-8b").expect("workload");
    wl.llm_pinned.tp = Some(4);
    wl.llm_pinned.cp = Some(2);
    let plan = search(&wl, &hw, 2).expect("a plan");
    for ranked in plan.best.values() {
        for r in ranked {
            let cfg = emit::config(&wl, &r.candidate).expect("emits");
            ModelGraph::from_config(&cfg).expect("validates");
        }
    }
    assert!(plan.best.get(&Kind::Homogeneous).is_none_or(Vec::is_empty));
}
