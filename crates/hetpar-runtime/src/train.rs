//! Training one rank of a model graph: its stages, the optimizer from `[train]`, the
//! step's schedule, and per step the data's manifest, its plans and the executor; held-out
//! loss and answer accuracy by forward passes through the same stages.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::DType;
use hetpar_comm::{CommExt, Communicator, ReduceOp};
use hetpar_layout::{BatchManifest, Direction, ModelGraph};
use hetpar_schedule::{Options, PipelineGraph, Schedule};

use crate::assemble::{Sources, build_stages};
use crate::data::{BatchSource, HELDOUT};
use crate::error::RuntimeError;

/// How long ranks wait for one another while a checkpoint is saved or loaded, unless
/// [`Trainer::set_io_timeout`] says otherwise: an hour.
pub const DEFAULT_IO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);
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
    /// Each module's learning rate this step, by module index (`None`: frozen).
    pub module_lrs: Vec<Option<f64>>,
    /// Tokens of the step (every sample's length, text and encoder rows).
    pub tokens: usize,
    /// Wall time of the step on this rank, seconds.
    pub seconds: f64,
    /// Bytes each edge's transforms move in the step over all ranks, forward and backward
    /// (`src -> dst`, forward, backward), from the step's plans.
    pub boundary_bytes: Vec<(String, u64, u64)>,
    /// Seconds this rank waited for data in the step (building the manifest, payloads the
    /// loader had not decoded yet).
    pub data_wait: f64,
    /// The step's manifest.
    pub manifest: BatchManifest,
    /// Payloads (images, clips) each rank has decoded since the process started, by global
    /// rank: the items its encoder replicas ran (in training steps and held-out batches)
    /// and those of the next step decoded ahead; zero on a rank that runs no encoder's
    /// first stage.
    pub decodes: Vec<u64>,
    /// Of those, the clips longer than their audio encoder's input (`frames * 160`
    /// samples), cut to it, by global rank.
    pub cuts: Vec<u64>,
}

/// Held-out loss and answer accuracy, the same on every rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EvalReport {
    /// Loss over every held-out target token.
    pub loss: f64,
    /// Target tokens.
    pub targets: usize,
    /// Of them, the model's top token.
    pub correct_tokens: usize,
    /// Answers (assistant turns) and how many were right, by the kind of question
    /// ("image", "audio", "text"). An answer is right when every one of its tokens, the
    /// closing marker included, is the model's top token given the reference before it:
    /// exactly when greedy decoding from the question reproduces it (a tie for the top
    /// logit counts as right; greedy decoding would break it one way).
    pub answers: BTreeMap<&'static str, Tally>,
    /// Every answer, in held-out order, with the model's top tokens.
    pub answered: Vec<Answered>,
}

/// One held-out answer: its tokens and the model's top token at each of their positions,
/// given the reference before it (the conversation, earlier answers as the record has
/// them). Up to the first token that differs, the model's are what greedy decoding from
/// that conversation emits, and that token is the one it emits there; after it, greedy
/// decoding would go its own way. Where the answer's token ties for the top, it is the
/// model's.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Answered {
    /// "image", "audio" or "text": what the question was about.
    pub kind: &'static str,
    /// The answer's tokens, its closing marker included.
    pub expected: Vec<u32>,
    /// The model's top token at each of their positions (the expected one where it ties
    /// for the top; [`crate::NO_TOP`] where the logits have no maximum).
    pub model: Vec<u32>,
}

impl Answered {
    /// Whether it counts as right in [`EvalReport::answers`]: every token the top one.
    pub fn right(&self) -> bool {
        self.model == self.expected
    }

    /// What greedy decoding emits, as far as the reference shows it: the model's tokens up
    /// to and including the first that is not the reference's (the whole answer where it
    /// is right).
    pub fn greedy(&self) -> &[u32] {
        match self.expected.iter().zip(&self.model).position(|(e, m)| e != m) {
            Some(i) => &self.model[..=i],
            None => &self.model,
        }
    }
}

/// Answers of one kind of question.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Tally {
    /// Answers.
    pub answers: usize,
    /// Of them, right.
    pub right: usize,
    /// Their tokens.
    pub tokens: usize,
    /// Of them, the model's top token.
    pub right_tokens: usize,
}

impl EvalReport {
    /// Answers right over answers, every kind together.
    pub fn accuracy(&self) -> f64 {
        let (n, right) =
            self.answers.values().fold((0, 0), |(n, r), t| (n + t.answers, r + t.right));
        if n == 0 { 0.0 } else { right as f64 / n as f64 }
    }
}

/// The optimizer options `[train]` and the modules ask for, with `steps` steps. A module's
/// `lr` replaces `train.lr` as its peak; its floor keeps the ratio `train.min_lr / train.lr`
/// (a tenth by default). The warmup is the config's even where the run is shorter: its
/// rates are then the first of a longer run's, and never reach the peak.
pub fn train_options(graph: &ModelGraph, steps: usize) -> TrainOptions {
    let t = &graph.train;
    let floor = if t.lr > 0.0 { t.min_lr.map_or(0.1, |m| m / t.lr) } else { 0.0 };
    let lr = |m: &hetpar_layout::Module| {
        let peak = m.lr.unwrap_or(t.lr);
        LrSchedule { peak, min: peak * floor, warmup: t.warmup, total: steps }
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
    /// Forward passes only, every module: for held-out batches.
    eval_schedule: Schedule,
    data: Arc<dyn BatchSource>,
    exec: Executor,
    lr: LrSchedule,
    /// Each module's schedule, by module index (`None`: frozen).
    module_lr: Vec<Option<LrSchedule>>,
    config_text: Option<String>,
    tokenizer_sha256: Option<String>,
    io_timeout: std::time::Duration,
    machine: String,
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
        // Held-out batches run the forward half of the step.
        let eval_schedule = schedule.forward_only();
        let stages = build_stages(world, graph, dtype, sources)?;
        let opts = train_options(graph, steps);
        let llm = PipelineGraph::from_model(graph).sink();
        let lr = opts.lr[&llm];
        let module_lr = (0..graph.modules.len())
            .map(|m| opts.lr.get(&m).filter(|_| !opts.frozen.contains(&m)).copied())
            .collect();
        let exec = Executor::new(stages, opts)?;
        Ok(Trainer {
            graph: graph.clone(),
            dtype,
            schedule,
            eval_schedule,
            data: sources.batches.clone(),
            exec,
            lr,
            module_lr,
            config_text: None,
            tokenizer_sha256: None,
            io_timeout: DEFAULT_IO_TIMEOUT,
            machine: String::new(),
        })
    }

    /// Runs step `step` on this rank (a skipped step too: [`Trainer::within_skips`] says
    /// whether skipping may go on). Its error names the step ([`RuntimeError::InStep`]).
    pub fn step(&mut self, world: &dyn Communicator, step: usize) -> Result<StepLog, RuntimeError> {
        self.run_step(world, step)
            .map_err(|e| RuntimeError::InStep { step: step + 1, error: Box::new(e) })
    }

    fn run_step(&mut self, world: &dyn Communicator, step: usize) -> Result<StepLog, RuntimeError> {
        let start = Instant::now();
        let waited = self.data.waited();
        let manifest = self.data.manifest(step)?;
        let tokens = manifest.samples().iter().map(|s| s.len).sum();
        let rank = world.global_rank();
        let plans = StepPlans::for_rank(&self.graph, manifest.clone(), rank);
        let received = self.boundary_rows(&plans, rank);
        let actions = self.schedule.ranks.get(&rank).ok_or_else(|| {
            RuntimeError::Model(format!("rank {rank} has no place in the schedule"))
        })?;
        let report = self.exec.step(world, actions, step, &plans)?;
        let seconds = start.elapsed().as_secs_f64();
        let data_wait = self.data.waited() - waited;
        // Each rank's decodes and its cut clips (in its own entries), then the boundary rows
        // it received per edge and direction, summed over ranks in one reduction: each rank
        // planned its own share of the moves, and the sum is the step's.
        let n = world.size();
        let mut counts = vec![0.0f64; 2 * n];
        counts[world.rank()] = self.data.decodes() as f64;
        counts[n + world.rank()] = self.data.cuts() as f64;
        counts.extend(received.iter().flat_map(|&(f, b)| [f as f64, b as f64]));
        world.all_reduce(&mut counts, ReduceOp::Sum)?;
        let rows = counts.split_off(2 * n);
        let boundary_bytes = self.boundary_bytes(&plans, &rows);
        let mut decodes: Vec<u64> = counts.into_iter().map(|d| d as u64).collect();
        let cuts = decodes.split_off(n);
        Ok(StepLog {
            step,
            report,
            lr: self.lr.at(step),
            module_lrs: self.module_lr.iter().map(|l| l.map(|l| l.at(step))).collect(),
            tokens,
            seconds,
            boundary_bytes,
            data_wait,
            manifest,
            decodes,
            cuts,
        })
    }

    /// An error once more steps were skipped for non-finite gradients than
    /// `train.max_skips` allows: a training loop checks it after each step it has recorded
    /// (so the step that crosses the limit is logged too) and stops.
    pub fn within_skips(&self) -> Result<(), RuntimeError> {
        let max = self.graph.train.max_skips;
        let n = self.exec.skipped();
        if n > max {
            let were = if n == 1 { "step was" } else { "steps were" };
            return Err(RuntimeError::Model(format!(
                "{n} {were} skipped for non-finite values, more than train.max_skips({max}) (each skipped step's line says where: the loss, a module's gradients or an edge's rows)",
            )));
        }
        Ok(())
    }

    /// Whether the data has a held-out split to evaluate.
    pub fn has_heldout(&self) -> bool {
        self.data.heldout_batches() > 0
    }

    /// Held-out loss and answer accuracy with the current parameters: every held-out
    /// batch forwards only through the same stages and layout; every rank calls it.
    pub fn evaluate(&mut self, world: &dyn Communicator) -> Result<EvalReport, RuntimeError> {
        let batches = self.data.heldout_batches();
        if batches == 0 {
            return Err(RuntimeError::Data(
                "no held-out records to evaluate (data.heldout, or heldout.json next to data.path)"
                    .into(),
            ));
        }
        let rank = world.global_rank();
        let actions = self.eval_schedule.ranks.get(&rank).cloned().unwrap_or_default();
        let mut out = EvalReport::default();
        let mut loss_sum = 0.0;
        // No backward follows: keep no autograd graph of any module.
        self.exec.set_evaluating(true);
        let result = self.evaluate_batches(world, &actions, batches, &mut out, &mut loss_sum);
        self.exec.set_evaluating(false);
        result?;
        out.loss = loss_sum / out.targets.max(1) as f64;
        Ok(out)
    }

    fn evaluate_batches(
        &mut self,
        world: &dyn Communicator,
        actions: &[hetpar_schedule::Action],
        batches: usize,
        out: &mut EvalReport,
        loss_sum: &mut f64,
    ) -> Result<(), RuntimeError> {
        for h in 0..batches {
            let batch = HELDOUT + h;
            let manifest = self.data.manifest(batch)?;
            let (n, seq) = (manifest.samples().len(), manifest.seq_len());
            let plans = StepPlans::for_rank(&self.graph, manifest, world.global_rank());
            let report = self.exec.step(world, actions, batch, &plans)?;
            // Per position: [targets scored, of them correct, the target, the model's top
            // token], summed over the job (each target is scored by one rank; token ids
            // are exact in f64).
            let at = |k: usize, s: &crate::Scored| k * n * seq + s.sample * seq + s.pos;
            let mut marks = vec![0.0f64; 4 * n * seq];
            for s in &report.scored {
                marks[at(0, s)] += 1.0;
                marks[at(1, s)] += f64::from(u8::from(s.correct()));
                marks[at(2, s)] += f64::from(s.target);
                marks[at(3, s)] += f64::from(s.top);
            }
            world.all_reduce(&mut marks, ReduceOp::Sum)?;
            let (scored, rest) = marks.split_at(n * seq);
            let (correct, rest) = rest.split_at(n * seq);
            let (target, top) = rest.split_at(n * seq);
            let targets = scored.iter().sum::<f64>() as usize;
            out.targets += targets;
            out.correct_tokens += correct.iter().sum::<f64>() as usize;
            *loss_sum += report.loss * targets as f64;
            for (s, answers) in self.data.answers(batch)?.iter().enumerate() {
                for a in answers {
                    let tokens = |of: &[f64]| -> Vec<u32> {
                        a.positions.clone().map(|p| of[s * seq + p] as u32).collect()
                    };
                    let good = a.positions.clone().filter(|p| correct[s * seq + p] > 0.5).count();
                    let (expected, model) = (tokens(target), tokens(top));
                    out.answered.push(Answered { kind: a.kind, expected, model });
                    let t = out.answers.entry(a.kind).or_default();
                    t.answers += 1;
                    t.right += usize::from(good == a.positions.len());
                    t.tokens += a.positions.len();
                    t.right_tokens += good;
                }
            }
        }
        Ok(())
    }

    /// Rows this rank's programs receive per edge, `(forward, backward)` over the step's
    /// microbatches: its share of what the edge moves (no backward out of a module that runs
    /// forwards only).
    fn boundary_rows(&self, plans: &StepPlans, rank: usize) -> Vec<(u64, u64)> {
        (0..plans.edges.len())
            .map(|e| {
                let back = self.schedule.backward[plans.edges[e].0];
                let mut moved = (0u64, 0u64);
                for mb in 0..plans.manifest.n_microbatches() {
                    if let Ok(p) = plans.plan(e, mb) {
                        let mine = |dir| {
                            p.program(dir).traffic().received.get(&rank).map_or(0, |&r| r as u64)
                        };
                        moved.0 += mine(Direction::Forward);
                        moved.1 += if back { mine(Direction::Backward) } else { 0 };
                    }
                }
                moved
            })
            .collect()
    }

    /// Bytes each edge moves in a step: `rows` (the step's forward and backward rows of
    /// each edge in turn, summed over ranks) times the row width (the destination's hidden
    /// size) times the element size.
    fn boundary_bytes(&self, plans: &StepPlans, rows: &[f64]) -> Vec<(String, u64, u64)> {
        let elem = if self.dtype == DType::F64 { 8 } else { 4 };
        (0..plans.edges.len())
            .map(|e| {
                let width = self.graph.modules[plans.edges[e].1].dims.hidden as u64;
                let (f, b) = (rows[2 * e] as u64, rows[2 * e + 1] as u64);
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

    /// Keeps the SHA-256 of the tokenizer the run's data read, recorded in each checkpoint's
    /// manifest so a later run with another tokenizer is refused.
    pub fn set_tokenizer_sha256(&mut self, sha256: Option<String>) {
        self.tokenizer_sha256 = sha256;
    }

    /// How long ranks wait for one another while a checkpoint is saved or loaded
    /// ([`DEFAULT_IO_TIMEOUT`] unless set): the communicator's timeout is for
    /// communication, and writing, hashing and reading a large model's files takes longer.
    pub fn set_io_timeout(&mut self, timeout: std::time::Duration) {
        self.io_timeout = timeout;
    }

    /// Names the machine (and the view of its files: a container's mount namespace) this
    /// rank runs on: ranks naming the same one must see the same files at a path. A resume
    /// checks each checkpoint file once per name, by one of the ranks there that read it,
    /// instead of on every rank. Unset, every rank checks the files it reads.
    pub fn set_machine(&mut self, id: String) {
        self.machine = id;
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
    ) -> Result<crate::checkpoint::Saved, RuntimeError> {
        let at = crate::checkpoint::SaveAt {
            root,
            step: steps_done,
            schedule_steps: self.lr.total,
            keep,
            config: self.config_text.as_deref(),
            tokenizer_sha256: self.tokenizer_sha256.as_deref(),
        };
        world.with_timeout(self.io_timeout, || {
            crate::checkpoint::save_checkpoint(world, &self.graph, &self.exec, at)
        })
    }

    /// Loads checkpoint `dir` (saved under any layout) into this rank's stages and
    /// optimizer state; every rank calls it. The run goes on at the manifest's `step`.
    pub fn resume(
        &mut self,
        world: &dyn Communicator,
        dir: &std::path::Path,
    ) -> Result<crate::checkpoint::Loaded, RuntimeError> {
        let (graph, exec, machine) = (&self.graph, &mut self.exec, self.machine.as_str());
        world.with_timeout(self.io_timeout, || {
            crate::checkpoint::load_checkpoint(world, graph, exec, dir, machine)
        })
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

    #[test]
    fn a_run_shorter_than_its_warmup_takes_the_warmups_first_rates() {
        let g = ModelGraph::from_config(
            &Config::from_toml(include_str!("../../../examples/demo.toml")).unwrap(),
        )
        .unwrap();
        assert_eq!(g.train.warmup, 10);
        let (short, long) = (train_options(&g, 4), train_options(&g, 500));
        let llm = g.module_id("llm").unwrap();
        let rates = |o: &super::TrainOptions| (0..4).map(|i| o.lr[&llm].at(i)).collect::<Vec<_>>();
        assert_eq!(rates(&short), rates(&long));
        assert!((short.lr[&llm].at(3) - g.train.lr * 0.4).abs() < 1e-15);
    }
}
