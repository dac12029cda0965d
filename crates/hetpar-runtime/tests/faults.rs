//! Faults on the local backend: a NaN in one boundary activation (caught that step under
//! `stop`, the step skipped under `skip`, saying where), a rank that panics inside an encoder, a boundary
//! transform one side never runs; every rank ends within the timeout and the error names
//! what failed.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::DType;
use hetpar_comm::{CommExt, LocalOptions, launch};
use hetpar_layout::{BatchManifest, ModelGraph};
use hetpar_runtime::stages::encoder::ItemSource;
use hetpar_runtime::stages::llama::TextSource;
use hetpar_runtime::synthetic::Synthetic;
use hetpar_runtime::testing::{FailingText, Faulty, fault_graph as graph};
use hetpar_runtime::{
    Executor, OnNonFinite, RuntimeError, Sources, StepPlans, StepReport, build_stages,
    train_options,
};
use hetpar_schedule::{Action, Options, PipelineGraph, Schedule};

/// Two steps of `graph` with `items` as the encoder input and `drop` removed from the
/// schedule of the rank it names; each rank's reports or error.
fn run(
    g: &ModelGraph,
    items: Arc<dyn ItemSource>,
    policy: OnNonFinite,
    drop: Option<(usize, usize)>,
) -> Result<Vec<Result<Vec<StepReport>, RuntimeError>>, hetpar_comm::CommError> {
    run_with(g, Arc::new(Synthetic::new(g)), items, policy, drop)
}

fn run_with(
    g: &ModelGraph,
    text: Arc<dyn TextSource>,
    items: Arc<dyn ItemSource>,
    policy: OnNonFinite,
    drop: Option<(usize, usize)>,
) -> Result<Vec<Result<Vec<StepReport>, RuntimeError>>, hetpar_comm::CommError> {
    let mut schedule = Schedule::build(&PipelineGraph::from_model(g), Options::default()).unwrap();
    if let Some((rank, index)) = drop {
        schedule.ranks.get_mut(&rank).unwrap().remove(index);
    }
    let sources = Sources { batches: Arc::new(Synthetic::new(g)), text, items };
    launch(g.world, LocalOptions { timeout: Duration::from_secs(3) }, |c| {
        let stages = build_stages(c, g, DType::F32, &sources)?;
        let mut opts = train_options(g, 2);
        opts.on_nonfinite = policy;
        let mut exec = Executor::new(stages, opts)?;
        let actions = &schedule.ranks[&c.global_rank()];
        (0..2)
            .map(|s| {
                exec.step(c, actions, s, &StepPlans::new(g, BatchManifest::synthetic(g, s as u64)))
            })
            .collect()
    })
}

#[test]
fn a_nan_in_a_boundary_row_stops_the_step_naming_the_edge() {
    let g = graph(false);
    let items = Arc::new(Faulty { inner: Synthetic::new(&g), at: 1, panic: false });
    let out = run(&g, items, OnNonFinite::Stop, None).unwrap();
    let errors: Vec<String> =
        out.iter().filter_map(|r| r.as_ref().err()).map(|e| e.to_string()).collect();
    assert!(!errors.is_empty());
    assert!(
        errors.iter().any(|e| e
            .contains("boundary vision -> llm microbatch 0: a non-finite activation reached rank")),
        "{errors:?}"
    );
}

#[test]
fn a_nan_in_a_boundary_row_skips_the_step_under_skip() {
    let g = graph(false);
    let items = Arc::new(Faulty { inner: Synthetic::new(&g), at: 1, panic: false });
    let out = run(&g, items, OnNonFinite::Skip, None).unwrap();
    for r in out {
        let reports = r.unwrap();
        assert!(reports[0].applied && !reports[1].applied, "step 1 skipped");
        assert!(reports[1].grad_norm.is_nan());
        // Every rank says where: the loss, both modules' gradients and the edge the NaN
        // crossed.
        assert!(reports[0].nonfinite_at.is_empty());
        assert_eq!(reports[1].collective_bytes.len(), 2, "one entry per module");
        assert_eq!(reports[1].nonfinite_at, ["loss", "llm", "vision", "boundary vision -> llm"]);
    }
}

#[test]
fn a_panic_in_an_encoder_fails_every_rank_fast_naming_it() {
    let g = graph(false);
    let items = Arc::new(Faulty { inner: Synthetic::new(&g), at: 0, panic: true });
    let start = Instant::now();
    let e = run(&g, items, OnNonFinite::Stop, None).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(3), "within the timeout");
    assert!(e.contains("panicked: injected fault in the encoder"), "{e}");
    assert!(e.starts_with("rank 0 failed") || e.starts_with("rank 1 failed"), "{e}");
}

#[test]
fn a_transform_one_side_skips_is_an_error_naming_the_edge_and_microbatch() {
    let g = graph(true);
    // The encoder island (rank 0) never runs its first boundary forward.
    let schedule = Schedule::build(&PipelineGraph::from_model(&g), Options::default()).unwrap();
    let index = schedule.ranks[&0].iter().position(Action::has_boundary).unwrap();
    let items = Arc::new(Synthetic::new(&g));
    let out = run(&g, items, OnNonFinite::Stop, Some((0, index))).unwrap();
    let errors: Vec<String> =
        out.iter().filter_map(|r| r.as_ref().err()).map(|e| e.to_string()).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("boundary vision -> llm: microbatch 0, Forward transform: ")
                && e.contains("recv from rank 0")),
        "{errors:?}"
    );
}

#[test]
fn an_error_in_the_llm_ends_every_rank_naming_it() {
    let g = graph(true);
    let text = Arc::new(FailingText { inner: Synthetic::new(&g), at: 1 });
    let start = Instant::now();
    let out = run_with(&g, text, Arc::new(Synthetic::new(&g)), OnNonFinite::Stop, None);
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    let text = match out {
        Ok(ranks) => ranks.iter().filter_map(|r| r.as_ref().err()).map(|e| e.to_string()).collect(),
        Err(e) => vec![e.to_string()],
    };
    assert!(text.iter().any(|e| e.contains("injected error in the LLM's data")), "{text:?}");
}
