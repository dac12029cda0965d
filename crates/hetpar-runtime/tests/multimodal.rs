//! A vision encoder into an LLM, trained through the executor with boundaries inside
//! autograd: colocated (three-phase) and non-colocated (graph-aware 1F1B) layouts run their
//! schedules' actions in order and match the one-rank run over three steps (loss and
//! gradient norm every step, every parameter of both modules after the last), f32 and f64.
//! The manifests carry several images in some samples and none in others.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::DType;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{BatchManifest, Config, ModelGraph, ModuleId};
use hetpar_nn::testing::{Global, RankReport, assemble, snapshot_values};
use hetpar_runtime::testing::{compare_steps, compare_values};
use hetpar_runtime::{
    AdamW, Executor, LrSchedule, OnNonFinite, Sources, StepPlans, StepReport, TrainOptions,
    build_stages, train_options,
};
use hetpar_schedule::{Options, PipelineGraph, Schedule};

const STEPS: usize = 3;

/// The test model with the vision encoder on `vision` (`[start, end)`, tp) and the LLM on
/// `llm` with its parallel settings (`tp = ..` lines) and more model lines (`experts = 4`),
/// the LLM with 2 layers (4 where it interleaves, `vpp = 2`).
fn config(vision: ([usize; 2], usize), llm: ([usize; 2], &str), model: &str) -> ModelGraph {
    parse(&config_text(vision, llm, model))
}

fn parse(text: &str) -> ModelGraph {
    ModelGraph::from_config(&Config::from_toml(text).unwrap()).unwrap()
}

/// The text of [`config`].
fn config_text(vision: ([usize; 2], usize), llm: ([usize; 2], &str), model: &str) -> String {
    let layers = if llm.1.contains("vpp") { 4 } else { 2 };
    format!(
        r#"
name = "t"
[train]
seed = 7
steps = 3
global_batch = 8
microbatches = 2
seq_len = 48
lr = 1e-3
[data]
max_items = 2
[modules.vision]
kind = "vit"
image_size = 16
patch_size = 4
hidden = 32
layers = 2
heads = 4
ffn = 48
[modules.vision.parallel]
ranks = [{}, {}]
tp = {}
[modules.llm]
kind = "llama"
vocab = 64
hidden = 32
layers = {}
heads = 4
kv_heads = 4
ffn = 48
{}
[modules.llm.parallel]
ranks = [{}, {}]
{}
[[edges]]
from = "vision"
to = "llm"
"#,
        vision.0[0], vision.0[1], vision.1, layers, model, llm.0[0], llm.0[1], llm.1
    )
}

struct Run {
    reports: Vec<StepReport>,
    /// Every stage's parameters after the last step, with its module.
    ranks: Vec<RankReport>,
    modules: Vec<ModuleId>,
    /// The same before the first step.
    initial: Vec<RankReport>,
}

impl Run {
    /// Module `m`'s parameters, reassembled, before and after the run.
    fn module_values(&self, m: ModuleId) -> (BTreeMap<String, Global>, BTreeMap<String, Global>) {
        let of = |r: &[RankReport]| {
            let mine: Vec<RankReport> = r
                .iter()
                .zip(&self.modules)
                .filter(|(_, x)| **x == m)
                .map(|(r, _)| r.clone())
                .collect();
            assemble(&mine, 0.0).unwrap()
        };
        (of(&self.initial), of(&self.ranks))
    }
}

/// Asserts that two runs agree bitwise: every step's loss and gradient norm, and every
/// parameter after the last step.
fn assert_bitwise(a: &Run, b: &Run, what: &str) {
    for (x, y) in a.reports.iter().zip(&b.reports) {
        assert_eq!(
            (x.loss.to_bits(), x.grad_norm.to_bits()),
            (y.loss.to_bits(), y.grad_norm.to_bits()),
            "{what}"
        );
    }
    assert_eq!(assemble(&a.ranks, 0.0).unwrap(), assemble(&b.ranks, 0.0).unwrap(), "{what}");
}

fn run(graph: &ModelGraph, dtype: DType) -> Run {
    let schedule = Schedule::build(&PipelineGraph::from_model(graph), Options::default()).unwrap();
    let sources = Sources::synthetic(graph);
    let out = launch(graph.world, LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let stages = build_stages(c, graph, dtype, &sources).unwrap();
        let initial: Vec<RankReport> =
            stages.iter().map(|s| snapshot_values(s.ctx(), &s.params()).unwrap()).collect();
        // Adam moves an element whose gradient is near zero by up to the learning rate
        // whatever its size, so f32 rounding in such gradients shows in the parameters in
        // proportion to the rate (f64 matches to 1e-10: the computation is the same).
        let lr = LrSchedule { peak: 1e-3, min: 1e-4, warmup: 1, total: STEPS };
        let opts = TrainOptions {
            adam: AdamW { weight_decay: 0.1, ..AdamW::default() },
            lr: (0..graph.modules.len()).map(|m| (m, lr)).collect::<BTreeMap<_, _>>(),
            clip: 1.0,
            on_nonfinite: OnNonFinite::Stop,
            ..train_options(graph, STEPS)
        };
        let mut exec = Executor::new(stages, opts).unwrap();
        let rank = hetpar_comm::CommExt::global_rank(c);
        let actions = &schedule.ranks[&rank];
        let reports: Vec<StepReport> = (0..STEPS)
            .map(|s| {
                // Each rank's own share of the plans, as a training rank builds them.
                let manifest = BatchManifest::synthetic(graph, s as u64);
                let plans = StepPlans::for_rank(graph, manifest, rank);
                let r =
                    exec.step(c, actions, s, &plans).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert_eq!(&r.executed, actions, "rank {rank} ran another order");
                r
            })
            .collect();
        let snaps: Vec<RankReport> =
            exec.stages().iter().map(|s| snapshot_values(s.ctx(), &s.params()).unwrap()).collect();
        let modules: Vec<ModuleId> = exec.stages().iter().map(|s| s.module()).collect();
        (reports, snaps, modules, initial)
    })
    .unwrap();
    let reports = out[0].0.clone();
    for (r, ..) in &out {
        let same =
            r.iter().zip(&reports).all(|(a, b)| a.loss == b.loss && a.grad_norm == b.grad_norm);
        assert!(same, "ranks disagree on the step's loss or norm");
    }
    let mut run = Run { reports, ranks: vec![], modules: vec![], initial: vec![] };
    for (_, ranks, modules, initial) in out {
        run.ranks.extend(ranks);
        run.modules.extend(modules);
        run.initial.extend(initial);
    }
    run
}

#[test]
fn a_moe_llm_matches_one_rank() {
    let moe = "experts = 4\ntop_k = 2";
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let reference = run(&config(([0, 1], 1), ([0, 1], "tp = 1"), moe), dtype);
        let want = assemble(&reference.ranks, 0.0).unwrap();
        for (what, vision, llm) in [
            ("colocated moe ep2", ([0, 2], 1), ([0, 2], "ep = 2")),
            ("islands moe ep2 tp2", ([0, 1], 1), ([1, 5], "ep = 2\ntp = 2\nsp = true")),
        ] {
            let what = format!("{what} {dtype:?}");
            let got = run(&config(vision, llm, moe), dtype);
            compare_steps(&what, &got.reports, &reference.reports, tol)
                .unwrap_or_else(|e| panic!("{e}"));
            compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Loss and gradient norms in f32 and f64, parameters in f64. In f32 one element of a
/// zero-initialized ViT bias whose Adam updates nearly cancel (its value after three steps
/// is 7e-5 where its neighbours' are 1e-3) ends 1.3e-7 from the reference's while every
/// other element agrees to 1e-10; over that small tensor's norm (8e-3) it is 1.6e-5, above
/// the 1e-5 bound. f64 agrees to 1e-10 everywhere, so the computation is the same.
#[test]
fn an_interleaved_llm_behind_a_colocated_encoder_matches_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let reference = run(&config(([0, 1], 1), ([0, 1], "vpp = 1"), ""), dtype);
        let got = run(&config(([0, 2], 1), ([0, 2], "pp = 2\nvpp = 2"), ""), dtype);
        let what = format!("colocated llm pp2 vpp2 {dtype:?}");
        compare_steps(&what, &got.reports, &reference.reports, tol)
            .unwrap_or_else(|e| panic!("{e}"));
        if dtype == DType::F64 {
            let want = assemble(&reference.ranks, 0.0).unwrap();
            compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

#[test]
fn recomputing_the_encoder_changes_no_number() {
    let mut g = config(([0, 4], 1), ([0, 4], "tp = 2\nsp = true"), "");
    let plain = run(&g, DType::F32);
    let vision = g.module_id("vision").unwrap();
    g.modules[vision].recompute = true;
    let again = run(&g, DType::F32);
    assert!(plain.reports.iter().all(|r| r.recomputed == 0));
    // Rank 0's vision replica runs a forward per microbatch, each again before its backward.
    assert!(
        again.reports.iter().all(|r| r.recomputed == 2),
        "{:?}",
        again.reports.iter().map(|r| r.recomputed).collect::<Vec<_>>()
    );
    assert_bitwise(&plain, &again, "encoder recomputed");
}

/// Recomputing the LLM's stages (each forward's activations dropped and computed again
/// before its backward): under tensor parallelism with SP, as a two-stage pipeline next to
/// a recomputed encoder, interleaved (pp 2, vpp 2), and as an MoE (ep 2 with tp 2 and SP,
/// its all-to-all and load-balancing loss run again), in f32 and f64: every loss, norm and
/// parameter is bitwise what it is without. Each forward rank 0 runs is run again.
#[test]
fn recomputing_the_llm_changes_no_number() {
    let moe = "experts = 4\ntop_k = 2";
    let cases = [
        ("tp 2 sp", "tp = 2\nsp = true", "", DType::F32, 2),
        ("pp 2", "pp = 2", "", DType::F64, 2),
        ("pp 2 vpp 2", "pp = 2\nvpp = 2", "", DType::F32, 4),
        ("moe ep 2 tp 2 sp", "ep = 2\ntp = 2\nsp = true", moe, DType::F32, 2),
    ];
    for (what, llm, model, dtype, each) in cases {
        let mut g = config(([0, 4], 1), ([0, 4], llm), model);
        let plain = run(&g, dtype);
        let (vision, llm_id) = (g.module_id("vision").unwrap(), g.module_id("llm").unwrap());
        g.modules[llm_id].recompute = true;
        let again = run(&g, dtype);
        assert!(plain.reports.iter().all(|r| r.recomputed == 0), "{what}");
        // Rank 0's LLM forwards (two microbatches, through each of its virtual stages).
        assert!(again.reports.iter().all(|r| r.recomputed == each), "{what}");
        assert_bitwise(&plain, &again, what);
        if what == "pp 2" {
            // And its vision replica's two forwards too.
            g.modules[vision].recompute = true;
            let both = run(&g, dtype);
            assert!(both.reports.iter().all(|r| r.recomputed == each + 2), "{what}");
            assert_bitwise(&plain, &both, what);
        }
    }
}

#[test]
fn the_same_run_twice_is_bitwise_equal() {
    let g = config(([0, 4], 1), ([0, 4], "tp = 2\nsp = true"), "");
    assert_bitwise(&run(&g, DType::F32), &run(&g, DType::F32), "the same run twice");
}

#[test]
fn every_manifest_has_images_and_text_only_samples() {
    let g = config(([0, 1], 1), ([0, 1], "tp = 1"), "");
    for s in 0..STEPS as u64 {
        let m = BatchManifest::synthetic(&g, s);
        let counts: Vec<usize> = m.samples().iter().map(|x| x.items.len()).collect();
        assert!(counts.contains(&0) || s > 0, "step {s}: {counts:?}");
        assert!(counts.iter().any(|&c| c > 0), "step {s}: {counts:?}");
    }
}

#[test]
fn vision_into_llm_matches_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let reference = run(&config(([0, 1], 1), ([0, 1], "tp = 1"), ""), dtype);
        let losses: Vec<f64> = reference.reports.iter().map(|r| r.loss).collect();
        assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{losses:?}");
        // Gradients reach the encoder through the boundary (modules in name order: llm 0,
        // vision 1).
        assert!(reference.reports.iter().all(|r| r.module_norms[1] > 1e-3 * r.module_norms[0]));
        let want = assemble(&reference.ranks, 0.0).unwrap();
        for (what, vision, llm) in [
            ("colocated encoder dp4, llm tp2 sp dp2", ([0, 4], 1), ([0, 4], "tp = 2\nsp = true")),
            ("colocated fan-in, llm tp4", ([0, 4], 1), ([0, 4], "tp = 4")),
            ("colocated llm cp2 dp2", ([0, 4], 1), ([0, 4], "cp = 2")),
            ("islands encoder dp2, llm tp2", ([0, 2], 1), ([2, 4], "tp = 2")),
            ("islands encoder tp2, llm pp2", ([0, 2], 2), ([2, 4], "pp = 2")),
            ("colocated encoder tp2 dp3, llm cp3 dp2 on 6 ranks", ([0, 6], 2), ([0, 6], "cp = 3")),
            ("islands llm cp2 sp tp2", ([0, 1], 1), ([1, 5], "cp = 2\ntp = 2\nsp = true")),
            // Four samples per microbatch, eight encoder replicas: some own no image.
            ("colocated encoder dp8, llm tp4 dp2", ([0, 8], 1), ([0, 8], "tp = 4")),
        ] {
            let what = format!("{what} {dtype:?}");
            let got = run(&config(vision, llm, ""), dtype);
            compare_steps(&what, &got.reports, &reference.reports, tol)
                .unwrap_or_else(|e| panic!("{e}"));
            compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn frozen(mut g: ModelGraph, name: &str) -> ModelGraph {
    let m = g.module_id(name).unwrap();
    g.modules[m].trainable = false;
    g
}

/// A frozen module's parameters stay bitwise what they were, its norm is zero, and the
/// rest trains as the one-rank run with the same module frozen: a frozen encoder runs no
/// backward at all (nothing trainable feeds it), a frozen LLM still carries gradients back
/// to the encoder that trains.
#[test]
fn a_frozen_module_keeps_its_parameters_and_the_rest_matches_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        for name in ["vision", "llm"] {
            let reference = run(&frozen(config(([0, 1], 1), ([0, 1], "tp = 1"), ""), name), dtype);
            let want = assemble(&reference.ranks, 0.0).unwrap();
            for (what, vision, llm) in [
                ("colocated encoder dp4, llm tp2 sp", ([0, 4], 1), ([0, 4], "tp = 2\nsp = true")),
                ("islands encoder dp2, llm pp2", ([0, 2], 1), ([2, 4], "pp = 2")),
            ] {
                let what = format!("{what}, {name} frozen, {dtype:?}");
                let g = frozen(config(vision, llm, ""), name);
                let m = g.module_id(name).unwrap();
                let other = 1 - m;
                let got = run(&g, dtype);
                let (before, after) = got.module_values(m);
                assert_eq!(before, after, "{what}: frozen parameters moved");
                let (before, after) = got.module_values(other);
                assert_ne!(before, after, "{what}: the trainable module did not train");
                for r in &got.reports {
                    assert_eq!(r.module_norms[m], 0.0, "{what}");
                    assert!(r.module_norms[other] > 0.0, "{what}");
                    let backwards = r.executed.iter().filter(|a| {
                        matches!(a, hetpar_schedule::Action::Compute(c)
                            if c.module == m && c.pass == hetpar_schedule::Pass::Backward)
                    });
                    // Only the frozen LLM (fed by a trainable encoder) runs backwards.
                    assert_eq!(
                        backwards.count() > 0,
                        name == "llm"
                            && r.executed.iter().any(|a| {
                                matches!(a, hetpar_schedule::Action::Compute(c) if c.module == m)
                            }),
                        "{what}"
                    );
                }
                compare_steps(&what, &got.reports, &reference.reports, tol)
                    .unwrap_or_else(|e| panic!("{e}"));
                compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

/// Offload and recompute on a colocated encoder next to an LLM pipeline (pp2 under the
/// three-phase schedule): the encoder's parameters, gradients and optimizer state (four
/// times its parameters) leave the working set while the LLM computes and sit in the host
/// buffer, every number is bitwise what it is without offload, and the run matches one
/// rank. Without recompute the phase-1 graphs reference the parameters, so they stay and
/// the other three parts go.
#[test]
fn offloading_the_encoder_frees_its_state_during_the_llm_phase_and_changes_no_number() {
    for (dtype, recompute) in [(DType::F32, true), (DType::F64, true), (DType::F32, false)] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let mut g = config(([0, 2], 1), ([0, 2], "pp = 2"), "");
        let v = g.module_id("vision").unwrap();
        g.modules[v].recompute = recompute;
        let kept = run(&g, dtype);
        g.modules[v].offload = true;
        let schedule = Schedule::build(&PipelineGraph::from_model(&g), Options::default()).unwrap();
        assert!(
            schedule.ranks[&0].iter().any(|a| matches!(a, hetpar_schedule::Action::Offload(_)))
        );
        let offloaded = run(&g, dtype);
        assert_bitwise(&kept, &offloaded, "offloaded");
        // Rank 0's copy of the encoder (dp2, whole on each rank).
        let elem = if dtype == DType::F64 { 8 } else { 4 };
        let params: u64 = kept.initial[kept.modules.iter().position(|&m| m == v).unwrap()]
            .params
            .iter()
            .map(|p| (p.values.len() * elem) as u64)
            .sum();
        let gone = if recompute { 4 * params } else { 3 * params };
        for (x, y) in kept.reports.iter().zip(&offloaded.reports) {
            let (a, b) = (x.resident[v], y.resident[v]);
            assert_eq!((a.host, b.host), (0, gone), "{a:?} {b:?}");
            assert_eq!(a.llm_phase - b.llm_phase, gone, "{a:?} {b:?}");
            assert!(b.llm_phase >= 4 * params - gone && b.peak == a.peak, "{a:?} {b:?}");
            // The LLM holds what it held.
            let llm = 1 - v;
            assert_eq!(x.resident[llm], y.resident[llm]);
            // The LLM (pp2, nothing else) has no collective; each encoder replica puts its
            // whole gradient into the data-parallel reduction.
            assert_eq!((x.collective_bytes[llm], x.collective_bytes[v]), (0, 2 * params));
        }
        if !recompute {
            continue;
        }
        let reference = run(&config(([0, 1], 1), ([0, 1], "tp = 1"), ""), dtype);
        let what = format!("colocated llm pp2, encoder offload and recompute, {dtype:?}");
        compare_steps(&what, &offloaded.reports, &reference.reports, tol)
            .unwrap_or_else(|e| panic!("{e}"));
        compare_values(&what, &offloaded.ranks, &assemble(&reference.ranks, 0.0).unwrap(), tol)
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The vision encoder as a two-stage pipeline (one layer each; the first stage embeds, the
/// second projects), on an island feeding the LLM and colocated with an LLM pipeline, with
/// multi-image and text-only samples: matches one rank.
#[test]
fn encoder_pipelines_match_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let reference = run(&config(([0, 1], 1), ([0, 1], "tp = 1"), ""), dtype);
        let want = assemble(&reference.ranks, 0.0).unwrap();
        for (what, vision, llm) in [
            ("islands encoder pp2, llm tp2", ([0, 2], 1), ([2, 4], "tp = 2")),
            ("islands encoder pp2 dp2, llm pp2", ([0, 4], 1), ([4, 6], "pp = 2")),
            ("colocated encoder pp2 dp2, llm tp2 pp2", ([0, 4], 1), ([0, 4], "tp = 2\npp = 2")),
        ] {
            let what = format!("{what} {dtype:?}");
            let text = config_text(vision, llm, "").replacen(
                "[modules.vision.parallel]\n",
                "[modules.vision.parallel]\npp = 2\n",
                1,
            );
            let g = parse(&text);
            assert_eq!(g.modules[g.module_id("vision").unwrap()].layout.pp(), 2, "{what}");
            let got = run(&g, dtype);
            compare_steps(&what, &got.reports, &reference.reports, tol)
                .unwrap_or_else(|e| panic!("{e}"));
            compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Between islands at tp2 the boundary can route exactly, through one leader per replica
/// or striped over two: only the route differs, so every number is bitwise the same.
#[test]
fn striping_on_and_off_is_bitwise_equal() {
    let base = config_text(([0, 2], 2), ([2, 4], "tp = 2"), "");
    let runs: Vec<(String, Run)> = [
        "strategy = \"exact\"",
        "strategy = \"leaders\"\nstripes = 1",
        "strategy = \"leaders\"\nstripes = 2",
    ]
    .iter()
    .map(|s| {
        let g = parse(&format!("{base}{s}\n"));
        let strategy = format!("{:?}", g.edges[0].strategy);
        (strategy, run(&g, DType::F32))
    })
    .collect();
    let names: Vec<&str> = runs.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(names.len(), 3);
    assert!(names[0] != names[1] && names[1] != names[2], "{names:?}");
    let (_, first) = &runs[0];
    for (name, r) in &runs[1..] {
        assert_bitwise(first, r, name);
    }
}

/// Islands whose data-parallel sizes relate every way: fan-out (encoder dp1 into LLM
/// dp2), fan-in (dp4 into dp1) and a ratio that divides neither way (dp3 into dp2).
#[test]
fn island_dp_ratios_match_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let reference = run(&config(([0, 1], 1), ([0, 1], "tp = 1"), ""), dtype);
        let want = assemble(&reference.ranks, 0.0).unwrap();
        for (what, vision, llm) in [
            ("fan-out dp1 -> dp2", ([0, 1], 1), ([1, 3], "tp = 1")),
            ("fan-in dp4 -> dp1", ([0, 4], 1), ([4, 5], "tp = 1")),
            ("dp3 -> dp2", ([0, 3], 1), ([3, 5], "tp = 1")),
        ] {
            let what = format!("islands {what} {dtype:?}");
            let got = run(&config(vision, llm, ""), dtype);
            compare_steps(&what, &got.reports, &reference.reports, tol)
                .unwrap_or_else(|e| panic!("{e}"));
            compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}
