//! Training one rank of a model graph: its stages, the optimizer from `[train]`, the
//! step's schedule, and per step the synthetic manifest, its plans and the executor.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::DType;
use hetpar_comm::{CommExt, Communicator};
use hetpar_layout::{BatchManifest, ModelGraph};
use hetpar_schedule::{Options, PipelineGraph, Schedule};

use crate::assemble::{Sources, build_stages};
use crate::error::RuntimeError;
use crate::executor::{Executor, OnNonFinite, StepReport, TrainOptions};
use crate::optim::{AdamW, LrSchedule};
use crate::plans::StepPlans;
use crate::stage::Stage;

/// What one step did, as every rank sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLog {
    /// Step index (0-based).
    pub step: usize,
    /// The executor's report (loss, norms, whether applied, the actions run).
    pub report: StepReport,
    /// Learning rate of the LLM this step.
    pub lr: f64,
    /// Tokens of the step (every sample's length, text and encoder rows).
    pub tokens: usize,
    /// Wall time of the step on this rank, seconds.
    pub seconds: f64,
    /// Bytes each edge's transforms move in the step over all ranks, forward and backward
    /// (`src -> dst`, forward, backward), from the step's plans.
    pub boundary_bytes: Vec<(String, u64, u64)>,
}

/// The optimizer options `[train]` and the modules ask for, with `steps` steps. A module's
/// `lr` replaces `train.lr` as its peak; its floor keeps the ratio `train.min_lr / train.lr`
/// (a tenth by default).
pub fn train_options(graph: &ModelGraph, steps: usize) -> TrainOptions {
    let t = &graph.train;
    let floor = if t.lr > 0.0 { t.min_lr.map_or(0.1, |m| m / t.lr) } else { 0.0 };
    let lr = |m: &hetpar_layout::Module| {
        let peak = m.lr.unwrap_or(t.lr);
        LrSchedule { peak, min: peak * floor, warmup: t.warmup.min(steps), total: steps }
    };
    let pipe = PipelineGraph::from_model(graph);
    let modules = || 0..graph.modules.len();
    TrainOptions {
        adam: AdamW { weight_decay: t.weight_decay, ..AdamW::default() },
        lr: modules().map(|m| (m, lr(&graph.modules[m]))).collect::<BTreeMap<_, _>>(),
        clip: t.clip_grad,
        on_nonfinite: match t.on_nonfinite {
            hetpar_layout::OnNonFinite::Stop => OnNonFinite::Stop,
            hetpar_layout::OnNonFinite::Skip => OnNonFinite::Skip,
        },
        recompute: modules().filter(|&m| graph.modules[m].recompute).collect(),
        frozen: modules().filter(|&m| !graph.modules[m].trainable).collect(),
        forward_only: modules().filter(|&m| !pipe.has_backward(m)).collect(),
    }
}

/// One rank of a training run.
pub struct Trainer {
    graph: ModelGraph,
    dtype: DType,
    schedule: Schedule,
    exec: Executor,
    lr: LrSchedule,
    config_text: Option<String>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Trainer({}, {:?})", self.graph.name, self.exec)
    }
}

impl Trainer {
    /// This rank's part of `graph` in `dtype`, for `steps` steps; every rank of the world
    /// calls it.
    pub fn new(
        world: &dyn Communicator,
        graph: &ModelGraph,
        dtype: DType,
        steps: usize,
        sources: &Sources,
    ) -> Result<Trainer, RuntimeError> {
        let schedule = Schedule::build(&PipelineGraph::from_model(graph), Options::default())
            .map_err(|e| RuntimeError::Model(format!("schedule: {e}")))?;
        let stages = build_stages(world, graph, dtype, sources)?;
        let opts = train_options(graph, steps);
        let llm = PipelineGraph::from_model(graph).sink();
        let lr = opts.lr[&llm];
        let exec = Executor::new(stages, opts)?;
        Ok(Trainer { graph: graph.clone(), dtype, schedule, exec, lr, config_text: None })
    }

    /// Runs step `step` on this rank.
    pub fn step(&mut self, world: &dyn Communicator, step: usize) -> Result<StepLog, RuntimeError> {
        let start = Instant::now();
        let manifest = BatchManifest::synthetic(&self.graph, step as u64);
        let tokens = manifest.samples().iter().map(|s| s.len).sum();
        let plans = StepPlans::new(&self.graph, manifest);
        let boundary_bytes = self.boundary_bytes(&plans);
        let rank = world.global_rank();
        let actions = self.schedule.ranks.get(&rank).ok_or_else(|| {
            RuntimeError::Model(format!("rank {rank} has no place in the schedule"))
        })?;
        let report = self.exec.step(world, actions, step, &plans)?;
        let max = self.graph.train.max_skips;
        if self.exec.skipped() > max {
            return Err(RuntimeError::Model(format!(
                "{} steps were skipped for non-finite gradients, more than train.max_skips({max})",
                self.exec.skipped()
            )));
        }
        let seconds = start.elapsed().as_secs_f64();
        Ok(StepLog { step, report, lr: self.lr.at(step), tokens, seconds, boundary_bytes })
    }

    /// Bytes each edge moves in a step: rows of its programs times the row width (the
    /// destination's hidden size) times the element size.
    fn boundary_bytes(&self, plans: &StepPlans) -> Vec<(String, u64, u64)> {
        let elem = if self.dtype == DType::F64 { 8 } else { 4 };
        (0..plans.edges.len())
            .map(|e| {
                let width = self.graph.modules[plans.edges[e].1].dims.hidden as u64;
                // An edge out of a module that runs forwards only carries no gradients.
                let back = self.schedule.backward[plans.edges[e].0];
                let (mut f, mut b) = (0u64, 0u64);
                for mb in 0..plans.manifest.n_microbatches() {
                    if let Ok(p) = plans.plan(e, mb) {
                        f += p.forward.traffic().total() as u64;
                        b += if back { p.backward.traffic().total() as u64 } else { 0 };
                    }
                }
                (plans.edge_name(e), f * width * elem, b * width * elem)
            })
            .collect()
    }

    /// This rank's stages.
    pub fn stages(&self) -> &[Box<dyn Stage>] {
        self.exec.stages()
    }

    /// Keeps the run's resolved config (TOML) to save with each checkpoint, so the
    /// checkpoint alone describes the model (`hetpar export` reads it).
    pub fn set_config_text(&mut self, text: String) {
        self.config_text = Some(text);
    }

    /// The executor (stages and optimizer state).
    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// Commits a checkpoint of the state after `steps_done` steps under `root`, keeping the
    /// `keep` newest (0: all); every rank calls it.
    pub fn save(
        &self,
        world: &dyn Communicator,
        steps_done: usize,
        root: &std::path::Path,
        keep: usize,
    ) -> Result<std::path::PathBuf, RuntimeError> {
        let at = crate::checkpoint::SaveAt {
            root,
            step: steps_done,
            schedule_steps: self.lr.total,
            keep,
            config: self.config_text.as_deref(),
        };
        crate::checkpoint::save_checkpoint(world, &self.graph, &self.exec, at)
    }

    /// Loads checkpoint `dir` (saved under any layout) into this rank's stages and
    /// optimizer state; every rank calls it. The run goes on at the manifest's `step`.
    pub fn resume(
        &mut self,
        world: &dyn Communicator,
        dir: &std::path::Path,
    ) -> Result<crate::checkpoint::Loaded, RuntimeError> {
        crate::checkpoint::load_checkpoint(world, &self.graph, &mut self.exec, dir)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use hetpar_layout::{Config, ModelGraph};

    use super::train_options;

    #[test]
    fn a_module_learning_rate_scales_its_floor_and_frozen_encoders_run_forwards_only() {
        let text = include_str!("../../../examples/demo.toml").replacen(
            "kind = \"vit\"",
            "kind = \"vit\"\nlr = 1e-4\ntrainable = false",
            1,
        );
        let g = ModelGraph::from_config(&Config::from_toml(&text).unwrap()).unwrap();
        let o = train_options(&g, 10);
        let (vision, llm) = (g.module_id("vision").unwrap(), g.module_id("llm").unwrap());
        let (v, l) = (o.lr[&vision], o.lr[&llm]);
        assert_eq!((v.peak, l.peak), (1e-4, g.train.lr));
        assert!((v.min / v.peak - l.min / l.peak).abs() < 1e-15);
        assert!(o.frozen.contains(&vision) && o.forward_only.contains(&vision));
        assert!(!o.frozen.contains(&llm) && !o.forward_only.contains(&llm));
    }
}
