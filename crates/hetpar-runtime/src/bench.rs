//! The executor's own cost: one module on one rank trained through the executor (the
//! schedule's actions, the stash, the job-wide sums, memory sampling) against a plain loop
//! that calls the same stage directly (forward, autograd, accumulate, norm, clip, AdamW).
//! Both start from the same initialization and must compute the same losses and norms,
//! bit for bit; the difference in time is the executor's.
//!
//! And what a step's boundary plans cost: every rank's, as tools build them, against one
//! rank's share, as each rank of a run builds its own ([`plans_cost`]).

use std::time::Instant;

use candle_core::DType;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{BatchManifest, Direction, ModelGraph};
use hetpar_schedule::{Options, PipelineGraph, Schedule};

use crate::assemble::{Sources, build_stages};
use crate::error::RuntimeError;
use crate::executor::Executor;
use crate::optim::AdamState;
use crate::plans::StepPlans;
use crate::step::{Grads, clip_factor, norm_sq_share};
use crate::train::train_options;

/// Step times of the two ways, each the fastest of the timed steps (after one warm-up).
#[derive(Clone, Debug, PartialEq)]
pub struct Overhead {
    /// Seconds per step through the executor.
    pub executor_s: f64,
    /// Seconds per step of the plain loop.
    pub plain_s: f64,
    /// Every step's loss and gradient norm were bitwise equal.
    pub identical: bool,
    /// Steps run each way (including the warm-up).
    pub steps: usize,
}

impl Overhead {
    /// The executor's share of its step: `(executor - plain) / executor`.
    pub fn fraction(&self) -> f64 {
        (self.executor_s - self.plain_s) / self.executor_s
    }
}

/// Runs `graph` (one module on one rank) for `steps` steps both ways, alternating a step
/// of each so that both see the same machine.
pub fn executor_overhead(
    graph: &ModelGraph,
    dtype: DType,
    steps: usize,
) -> Result<Overhead, RuntimeError> {
    if graph.world != 1 || graph.modules.len() != 1 || steps < 2 {
        return Err(RuntimeError::Model(
            "the executor benchmark runs one module on one rank for at least 2 steps".into(),
        ));
    }
    let opts = LocalOptions { timeout: std::time::Duration::from_secs(600) };
    let mut out = launch(1, opts, |c| {
        let sources = Sources::synthetic(graph);
        let options = train_options(graph, steps);
        let schedule = Schedule::build(&PipelineGraph::from_model(graph), Options::default())
            .map_err(|e| RuntimeError::Model(e.to_string()))?;
        let actions = &schedule.ranks[&0];
        let mut exec = Executor::new(build_stages(c, graph, dtype, &sources)?, options.clone())?;
        let mut plain = build_stages(c, graph, dtype, &sources)?;
        let mut state = AdamState::new(&plain[0].params())?;
        let lr = options.lr[&0];
        let (mut best_exec, mut best_plain, mut identical) = (f64::MAX, f64::MAX, true);
        for step in 0..steps {
            let start = Instant::now();
            let plans = StepPlans::new(graph, BatchManifest::synthetic(graph, step as u64));
            let r = exec.step(c, actions, step, &plans)?;
            let t_exec = start.elapsed().as_secs_f64();

            let start = Instant::now();
            let manifest = BatchManifest::synthetic(graph, step as u64);
            let stage = plain[0].as_mut();
            stage.begin_step(step, &manifest)?;
            let mut grads = Grads::zeros(&stage.params())?;
            let mut loss = 0.0;
            for mb in 0..manifest.n_microbatches() {
                let f = stage.forward(0, mb, None, &[])?;
                loss += f.reported;
                let root = f.loss.ok_or_else(|| RuntimeError::Model("no loss".into()))?;
                grads.accumulate(&stage.params(), &root.backward()?)?;
            }
            let norm = norm_sq_share(stage.ctx(), &stage.params(), &grads)?.sqrt();
            let clip = clip_factor(norm, options.clip);
            state.update(&options.adam, &stage.params(), &grads, lr.at(step), clip)?;
            let t_plain = start.elapsed().as_secs_f64();

            identical &=
                r.loss.to_bits() == loss.to_bits() && r.grad_norm.to_bits() == norm.to_bits();
            if step > 0 {
                best_exec = best_exec.min(t_exec);
                best_plain = best_plain.min(t_plain);
            }
        }
        Ok::<_, RuntimeError>(Overhead {
            executor_s: best_exec,
            plain_s: best_plain,
            identical,
            steps,
        })
    })?;
    out.swap_remove(0)
}

/// What one step's boundary plans cost ([`plans_cost`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PlansCost {
    /// The synthetic manifest's step.
    pub step: u64,
    /// Boundary rows of the step, over edges and microbatches.
    pub rows: usize,
    /// Seconds to build every rank's plans ([`StepPlans::new`]), where they were built.
    pub whole_s: Option<f64>,
    /// Seconds to build each measured rank's share ([`StepPlans::for_rank`]), by rank.
    pub ranks: Vec<(usize, f64)>,
}

/// Times the boundary plans of the synthetic manifests of `steps`: with `whole`, every
/// rank's at once, then each of `ranks` alone, checking that each rank's share is its part
/// of every rank's plans, op for op (an error names the first that is not); without, the
/// shares alone (every rank's plans of tens of thousands of ranks outgrow a machine's
/// memory, where each share stays near its rank's rows).
pub fn plans_cost(
    graph: &ModelGraph,
    steps: std::ops::Range<u64>,
    ranks: &[usize],
    whole: bool,
) -> Result<Vec<PlansCost>, RuntimeError> {
    steps
        .map(|step| {
            let manifest = BatchManifest::synthetic(graph, step);
            let start = Instant::now();
            let every = whole.then(|| StepPlans::new(graph, manifest.clone()));
            let whole_s = whole.then(|| start.elapsed().as_secs_f64());
            let samples = 0..manifest.samples().len();
            let rows = (0..graph.edges.len())
                .flat_map(|e| samples.clone().map(move |s| (s, e)))
                .map(|(s, e)| manifest.edge_rows(s, e))
                .sum();
            let mut times = Vec::with_capacity(ranks.len());
            for &rank in ranks {
                let start = Instant::now();
                let share = StepPlans::for_rank(graph, manifest.clone(), rank);
                times.push((rank, start.elapsed().as_secs_f64()));
                if let Some(every) = &every {
                    same_part(every, &share, rank).map_err(|e| {
                        RuntimeError::Model(format!("step {step}, rank {rank}: {e}"))
                    })?;
                }
            }
            Ok(PlansCost { step, rows, whole_s, ranks: times })
        })
        .collect()
}

/// Whether `share` holds `rank`'s programs of `whole`, edge by edge and microbatch by
/// microbatch, and no other rank's.
fn same_part(whole: &StepPlans, share: &StepPlans, rank: usize) -> Result<(), String> {
    for e in 0..whole.edges.len() {
        for k in 0..whole.manifest.n_microbatches() {
            let (w, s) = (whole.plan(e, k), share.plan(e, k));
            let (w, s) = w.and_then(|w| Ok((w, s?))).map_err(|err| err.to_string())?;
            for (dir, name) in [(Direction::Forward, "forward"), (Direction::Backward, "backward")]
            {
                let (wp, sp) = (w.program(dir), s.program(dir));
                let others = sp.ops.keys().any(|&r| r != rank) && s.geometry.rank.is_some();
                if wp.ops.get(&rank) != sp.ops.get(&rank)
                    || wp.stage_rows.get(&rank) != sp.stage_rows.get(&rank)
                    || others
                {
                    return Err(format!(
                        "the {name} program of edge {} in microbatch {k} is not its part of every rank's",
                        whole.edge_name(e)
                    ));
                }
            }
        }
    }
    Ok(())
}
