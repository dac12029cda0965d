//! The executor's own cost: one module on one rank trained through the executor (the
//! schedule's actions, the stash, the job-wide sums, memory sampling) against a plain loop
//! that calls the same stage directly (forward, autograd, accumulate, norm, clip, AdamW).
//! Both start from the same initialization and must compute the same losses and norms,
//! bit for bit; the difference in time is the executor's.

use std::time::Instant;

use candle_core::DType;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{BatchManifest, ModelGraph};
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
