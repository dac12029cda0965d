//! The executor on LLM pipelines: every layout runs the actions its schedule lists, in
//! order, and three steps match the one-rank run (loss and gradient norm every step, the
//! parameters after the last by the norm of the difference over the norm), in f32 and f64.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{BatchManifest, LayoutSpec, ModuleLayout, Sample, Span};
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::llama::LlamaConfig;
use hetpar_nn::testing::{RankReport, assemble, snapshot_values};
use hetpar_nn::{Build, ParallelCtx};
use hetpar_runtime::stages::llama::{LlamaStage, TextBatch, TextSource};
use hetpar_runtime::testing::{compare_steps, compare_values};
use hetpar_runtime::{
    AdamW, Executor, LrSchedule, OnNonFinite, RuntimeError, StepPlans, StepReport, TrainOptions,
};
use hetpar_schedule::{Options, PipeModule, PipelineGraph, Schedule};

const SEQ: usize = 16;
const SAMPLES: usize = 8;
const STEPS: usize = 3;

fn cfg() -> LlamaConfig {
    LlamaConfig {
        vocab: 64,
        hidden: 32,
        layers: 4,
        heads: 8,
        kv_heads: 4,
        ffn: 48,
        experts: 0,
        top_k: 2,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        aux_coef: 0.0,
        cp_mode: CpMode::AllGather,
    }
}

/// Next-token prediction on a pattern, with some positions taking no loss.
struct Pattern;

impl TextSource for Pattern {
    fn text(&self, step: usize, _: &BatchManifest) -> Result<TextBatch, RuntimeError> {
        let tok = |i: usize| ((i * 7 + step * 13 + (i / SEQ) * 5) % 64) as u32;
        let tokens: Vec<u32> = (0..SAMPLES * SEQ).map(tok).collect();
        let targets = (0..SAMPLES * SEQ)
            .map(|i| {
                let p = i % SEQ;
                if p + 1 == SEQ || (i + step).is_multiple_of(5) {
                    -1
                } else {
                    i64::from(tokens[i + 1])
                }
            })
            .collect();
        Ok(TextBatch { seq: SEQ, tokens, targets, score: false })
    }
}

struct Run {
    reports: Vec<StepReport>,
    ranks: Vec<RankReport>,
}

fn run(spec: LayoutSpec, world: usize, vpp: usize, microbatches: usize, dtype: DType) -> Run {
    let layout = ModuleLayout::new("llm", Span::new(0, world), spec).unwrap();
    let module = PipeModule {
        name: "llm".into(),
        layout: layout.clone(),
        vpp,
        offload: false,
        trainable: true,
    };
    let graph = PipelineGraph::new(vec![module], vec![], microbatches).unwrap();
    let schedule = Schedule::build(&graph, Options::default()).unwrap();
    let out = launch(world, LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let ctx = ParallelCtx::new(c, &layout).unwrap();
        let b = Build::new(ctx.clone(), 11, dtype);
        let stage =
            LlamaStage::new(&b, 0, cfg(), vpp, microbatches, SEQ, Arc::new(Pattern)).unwrap();
        let opts = TrainOptions {
            // Adam's eps well above f32 rounding of a gradient: an element whose gradient
            // lies near eps moves by up to lr / (4 eps) times that gradient's rounding (7.5e4
            // at the default 1e-8), and on an AVX2-only CPU (other products, other rounding)
            // one element of layers.3's up_proj, its gradient about 1e-8, ended 8.7e-6 from
            // the one-rank run's, 1.02e-5 of the tensor's norm, with every other element
            // within 2.4e-7. At 1e-6 every parameter of every layout agrees within 1e-8
            // (measured there), so a layout's own error shows far below the bound.
            adam: AdamW { weight_decay: 0.1, eps: 1e-6, ..AdamW::default() },
            lr: BTreeMap::from([(
                0,
                LrSchedule { peak: 3e-3, min: 3e-4, warmup: 1, total: STEPS },
            )]),
            clip: 1.0,
            on_nonfinite: OnNonFinite::Stop,
            recompute: Default::default(),
            frozen: Default::default(),
            forward_only: Default::default(),
        };
        let mut exec = Executor::new(vec![Box::new(stage)], opts).unwrap();
        let actions = &schedule.ranks[&ctx.rank];
        let samples = vec![Sample { len: SEQ, items: Vec::new() }; SAMPLES];
        let manifest = BatchManifest::new(SEQ, microbatches, 0, samples).unwrap();
        let plans = StepPlans::without_edges(manifest, vec!["llm".into()]);
        let reports: Vec<StepReport> =
            (0..STEPS).map(|s| exec.step(c, actions, s, &plans).unwrap()).collect();
        for r in &reports {
            assert_eq!(&r.executed, actions, "rank {} ran another order", ctx.rank);
        }
        (reports, snapshot_values(&ctx, &exec.stages()[0].params()).unwrap())
    })
    .unwrap();
    let reports = out[0].0.clone();
    for (r, _) in &out {
        let same =
            r.iter().zip(&reports).all(|(a, b)| a.loss == b.loss && a.grad_norm == b.grad_norm);
        assert!(same, "ranks disagree on the step's loss or norm");
    }
    Run { reports, ranks: out.into_iter().map(|(_, r)| r).collect() }
}

#[test]
fn pipelines_match_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let reference = run(LayoutSpec::default(), 1, 1, 4, dtype);
        let losses: Vec<f64> = reference.reports.iter().map(|r| r.loss).collect();
        assert!(losses[2] < losses[0], "the loss falls: {losses:?}");
        let want = assemble(&reference.ranks, 0.0).unwrap();
        let pp = |pp: usize| LayoutSpec { pp, ..LayoutSpec::default() };
        for (what, spec, world, vpp) in [
            ("pp2", pp(2), 2, 1),
            ("pp4", pp(4), 4, 1),
            ("pp2 vpp2", pp(2), 2, 2),
            ("tp2 sp pp2", LayoutSpec { tp: 2, sp: true, pp: 2, ..LayoutSpec::default() }, 4, 1),
            ("cp2 pp2", LayoutSpec { cp: 2, pp: 2, ..LayoutSpec::default() }, 4, 1),
            ("dp2 pp2", pp(2), 4, 1),
            ("tp2 dp2", LayoutSpec { tp: 2, ..LayoutSpec::default() }, 4, 1),
        ] {
            let what = format!("{what} {dtype:?}");
            let got = run(spec, world, vpp, 4, dtype);
            compare_steps(&what, &got.reports, &reference.reports, tol)
                .unwrap_or_else(|e| panic!("{e}"));
            compare_values(&what, &got.ranks, &want, tol).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Through the executor or as a plain loop over the same stage (forward, autograd,
/// accumulate, norm, clip, AdamW), one module on one rank computes the same losses and
/// norms, bit for bit: the executor adds bookkeeping, never arithmetic.
#[test]
fn the_executor_computes_what_a_plain_loop_over_the_stage_computes() {
    let text = r#"
name = "plain"
[train]
global_batch = 4
microbatches = 2
seq_len = 16
[modules.llm]
kind = "llama"
vocab = 64
hidden = 32
layers = 2
heads = 4
kv_heads = 2
ffn = 48
[modules.llm.parallel]
ranks = [0, 1]
"#;
    let g =
        hetpar_layout::ModelGraph::from_config(&hetpar_layout::Config::from_toml(text).unwrap())
            .unwrap();
    for dtype in [DType::F32, DType::F64] {
        let o = hetpar_runtime::bench::executor_overhead(&g, dtype, 3).unwrap();
        assert!(o.identical, "{dtype:?}: {o:?}");
        assert!(o.executor_s > 0.0 && o.plain_s > 0.0);
    }
}
