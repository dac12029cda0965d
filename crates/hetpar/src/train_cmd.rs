//! `hetpar train [CONFIG]`: trains a model graph (the built-in demo without a config) on
//! the local backend (one thread per rank) or under MPI, with a progress bar on a terminal
//! (plain lines otherwise), `metrics.jsonl` and the resolved config under `--out`.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use candle_core::DType;
use hetpar_comm::{CommExt, Communicator};
use hetpar_data::files::read_regular_text;
use hetpar_layout::{Config, Dtype, ModelGraph};
use hetpar_runtime::checkpoint::Saved;
use hetpar_runtime::{EvalReport, Resident, RunFacts, RuntimeError, StepLog, Trainer};

use crate::data_open::RunData;
use crate::preflight::{self, Holds, first_manifest, fits_memory, fits_memory_mpi};
use crate::say;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct Args {
    /// Config file (TOML); without one, the built-in demo (examples/demo.toml): a vision
    /// encoder colocated with the LLM and an audio encoder on its own rank, trained on the
    /// synthetic LLaVA set (generated once into the cache).
    pub config: Option<PathBuf>,
    /// The step to train to, counted from the run's start (default: the config's
    /// train.steps): a run resumed at step 40 with --steps 100 trains 60 more.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Element type: f32, f64, or bf16 (f32 weights and activations, bf16 products in the
    /// linear layers and the attention core; default: the config's).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Where metrics.jsonl, the resolved config and the checkpoints go (default:
    /// runs/<name>). A run that does not go on from OUT's own checkpoints (a fresh one, or
    /// one resumed from another run's) moves the metrics and checkpoints of a run OUT holds
    /// to OUT/earlier-N as it writes its first line (a run refused or failing before that
    /// leaves them in place).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// `local` (one thread per rank in this process) or `mpi` (one process per rank under
    /// mpirun; build with --features mpi).
    #[arg(long, default_value = "local")]
    pub backend: String,
    /// Seconds a rank waits in a communication call before the run fails naming it and what
    /// the ranks it waited for were doing (in which call, or computing: raise it for steps
    /// whose work takes longer). On the local backend, a rank still computing this long
    /// after another failed, and at least 10 s, is named and left behind as the process
    /// exits.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// Seconds a rank waits for the others while a checkpoint is written or read (writing,
    /// hashing and loading a large model's files takes longer than any communication).
    #[arg(long, value_name = "SECONDS", default_value_t = 3600.0)]
    pub io_timeout: f64,
    /// Also commit a checkpoint every N steps (one is always committed at the end) under
    /// OUT/checkpoints.
    #[arg(long, value_name = "N")]
    pub save_every: Option<usize>,
    /// Keep the K newest checkpoints (0: all).
    #[arg(long, value_name = "K", default_value_t = 3)]
    pub keep: usize,
    /// Resume from a checkpoint: `auto` takes the latest committed one under
    /// OUT/checkpoints (or starts fresh and says so), a checkpoint directory takes that one,
    /// a run's OUT (or its checkpoints/) its latest. It may have been saved under another
    /// layout and placement.
    #[arg(long, value_name = "auto|DIR")]
    pub resume: Option<String>,
    /// Peak of the whole job in TFLOP/s, for MFU in metrics.jsonl (default: measured at
    /// start, a matmul on each core the ranks compute on; under MPI, rank 0's times the
    /// ranks).
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
    /// Evaluate held-out loss and answer accuracy every N steps (default: a quarter of the
    /// run; 0: only before the first step and after the last, which every run with a
    /// held-out split evaluates). Runs whose data has a held-out split only.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<usize>,
    /// Override a config value before validation (repeatable): a dotted key and a TOML
    /// value, e.g. `--set train.lr=1e-4 --set modules.llm.parallel.tp=2`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// The config and its graph: the file's, or the demo's, with `--set` overrides.
pub fn load(config: Option<&PathBuf>, sets: &[String]) -> anyhow::Result<(Config, ModelGraph)> {
    crate::config_load::load(config.map(PathBuf::as_path), sets)
}

/// The parameters' element type: `--dtype`, else the config's. bf16 trains f32 parameters
/// with bf16 products in the linear layers and the attention core; `graph.train.dtype` is
/// set to what the flag chose, which is what the runtime reads for the products and what
/// the saved config says.
pub fn dtype(flag: Option<&str>, graph: &mut ModelGraph) -> anyhow::Result<DType> {
    let (params, compute) = match flag.unwrap_or(graph.train.dtype.name()) {
        "f32" => (DType::F32, Dtype::F32),
        "f64" => (DType::F64, Dtype::F64),
        "bf16" => (DType::F32, Dtype::Bf16),
        other => bail!("--dtype {other:?}: use f32, f64 or bf16"),
    };
    graph.train.dtype = compute;
    Ok(params)
}

/// How a run multiplies, for its log lines: the parameters' type, or bf16 products on f32
/// parameters with the kernel this machine runs them on.
pub fn precision(dtype: DType, graph: &ModelGraph) -> String {
    match graph.train.dtype {
        Dtype::Bf16 => {
            format!("bf16 products ({}), f32 weights", hetpar_nn::kernels::bf16::kernel())
        }
        Dtype::F32 | Dtype::F64 => format!("{dtype:?}"),
    }
}

/// How many threads each rank's products split over, for the log: the share of this
/// machine's threads each of its ranks gets (under MPI, set when MPI started).
fn threads_per_rank(mpi: bool, world: usize) -> String {
    let n = if mpi { hetpar_nn::kernels::threads() } else { hetpar_nn::kernels::share_of(world) };
    format!("{n} thread{} per rank", if n == 1 { "" } else { "s" })
}

/// The error that started a failure: a rank's own error (one naming a parameter or an edge
/// first) rather than the others' reports of its failure.
fn first_cause(errors: Vec<RuntimeError>) -> RuntimeError {
    errors.into_iter().min_by_key(cause_rank).expect("at least one error")
}

/// How far from the first cause an error is likely to be: a non-finite value first, then
/// a rank's own error, a note that another rank failed, and a failed peer's echo last.
fn cause_rank(e: &RuntimeError) -> u8 {
    let s = e.to_string();
    match e.cause() {
        RuntimeError::NonFinite { .. } | RuntimeError::UpdateOverflow { .. } => 0,
        _ if s.contains(" failed: ") || s.contains("failed peer") => 3,
        _ if s.contains("on another rank") => 2,
        _ => 1,
    }
}

/// Ends the process when a rank is still running `grace` after another failed (stuck
/// where no communication timeout reaches it: its own compute, a read that never
/// returns): prints the likeliest first cause and the stuck ranks, and exits 1 (a thread
/// cannot be stopped).
fn abandon_stuck(
    timeout: Duration,
    grace: Duration,
) -> impl FnOnce(&[(usize, &RuntimeError)], &[usize]) {
    move |errors, stuck| {
        let cause = errors.iter().min_by_key(|(_, e)| cause_rank(e)).map_or_else(
            || "a rank panicked".to_string(),
            |(r, e)| format!("rank {r}: {}", with_timeout_hint(&e.to_string(), Some(timeout))),
        );
        let ranks: Vec<String> = stuck.iter().map(usize::to_string).collect();
        crate::stderr_line(&format!(
            "error: {cause}; rank{} {} still running {:.0} s after it (in its own compute or a read, where no timeout reaches), so the process exits without {}",
            if stuck.len() == 1 { "" } else { "s" },
            ranks.join(", "),
            grace.as_secs_f64(),
            if stuck.len() == 1 { "it" } else { "them" },
        ));
        std::process::exit(1);
    }
}

/// A `--timeout` in seconds, checked.
pub fn timeout(secs: f64) -> anyhow::Result<Duration> {
    seconds("--timeout", secs)
}

/// A positive number of seconds given to `flag`, checked.
fn seconds(flag: &str, secs: f64) -> anyhow::Result<Duration> {
    // At most about 31 years: a deadline must fit an `Instant`.
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if !d.is_zero() && secs <= 1e9 => Ok(d),
        _ => bail!("{flag} {secs}: use a positive number of seconds, at most 1e9"),
    }
}

/// What a run's files are made from ([`Report::files`]).
struct Pending {
    /// The run's directory (`--out`).
    out: PathBuf,
    /// The resolved config, written as `config.toml`.
    resolved: String,
    /// The metrics of the run this one goes on from, whose lines before `start` it keeps.
    history: Option<PathBuf>,
    /// The first step this run takes.
    start: usize,
    /// An earlier run's files under `out`, moved aside just before the run's own are made:
    /// a run that fails before its first line leaves them where they were.
    aside: Option<Aside>,
}

/// The lines of `history` (a run's metrics) before step `start`, and its checkpoint
/// committed after `start` steps: what a run resumed from step `start` keeps, so that no
/// step appears twice. Read before the run's own metrics are made (the files may be the same).
fn kept_lines(history: Option<&Path>, start: usize) -> Vec<String> {
    let Some(history) = history else { return Vec::new() };
    read_regular_text(history)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            // Steps and evaluations before `start`, and the checkpoint resumed from
            // (committed after `start` steps).
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { return false };
            v["step"].as_u64().is_some_and(|s| {
                (s as usize) < start || (s as usize == start && v.get("checkpoint").is_some())
            })
        })
        .map(str::to_string)
        .collect()
}

struct Report {
    bar: Option<ProgressBar>,
    /// `metrics.jsonl` and the TensorBoard event file, made when the first step, save or
    /// evaluation is written ([`Report::files`]): a run that fails before it (a checkpoint
    /// refused by its checksums) leaves `--out` as it was.
    files: Mutex<Option<Files>>,
    /// What makes them.
    pending: Pending,
    /// Where `metrics.jsonl` is, for errors.
    metrics_path: PathBuf,
    names: Vec<String>,
    steps: usize,
    start: Instant,
    flops: crate::flops::StepFlops,
    /// The job's peak FLOP/s.
    peak: f64,
    /// Model FLOPs and seconds of the steps so far (for the summary's MFU).
    done: Mutex<(f64, f64)>,
    /// Evaluations so far: after how many steps, and what they found.
    evals: Mutex<Vec<(usize, EvalReport)>>,
    /// The audio encoders' input in seconds (one value where they agree).
    clip_seconds: Option<f64>,
    /// Whether the note that clips were cut was printed.
    cut_noted: AtomicBool,
}

/// "loss 2.31, answers 41/100 right (image 20/60, audio 9/25, text 12/15), tokens 71.2%".
pub fn describe_eval(e: &EvalReport) -> String {
    let (n, right) = e.answers.values().fold((0, 0), |(n, r), t| (n + t.answers, r + t.right));
    let kinds: Vec<String> = e
        .answers
        .iter()
        .map(|(k, t)| {
            let pct = 100.0 * t.right_tokens as f64 / t.tokens.max(1) as f64;
            format!("{k} {}/{} ({pct:.0}% of tokens)", t.right, t.answers)
        })
        .collect();
    format!(
        "loss {:.4}, answers {right}/{n} right ({:.1}%: {}), top token right on {:.1}% of {} target tokens",
        e.loss,
        100.0 * e.accuracy(),
        kinds.join(", "),
        100.0 * e.correct_tokens as f64 / e.targets.max(1) as f64,
        e.targets
    )
}

/// A run's `metrics.jsonl` and TensorBoard event file.
struct Files {
    metrics: std::fs::File,
    events: crate::tensorboard::Events,
}

impl Report {
    /// `f` on the run's files, made on first use: an earlier run's files moved aside, then
    /// `--out` with the resolved config, the metrics kept from the run this one goes on
    /// with, and a new event file.
    fn files<R>(&self, f: impl FnOnce(&mut Files) -> anyhow::Result<R>) -> anyhow::Result<R> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        let files = match &mut *files {
            Some(made) => made,
            none => {
                let Pending { out, resolved, history, start, aside } = &self.pending;
                let (moved, branch) = match aside {
                    Some(a) => a.carry_out(out, &|l| self.println(l))?,
                    None => (None, None),
                };
                // A checkpoint kept elsewhere in `out` goes on with the metrics just moved
                // (`history` names them by the checkpoint's resolved path, `out` as given).
                let outs = |h: &Path| {
                    h.file_name().is_some_and(|n| n == "metrics.jsonl")
                        && h.parent().is_some_and(|p| same_dir(p, out))
                };
                let history = match (history, moved) {
                    (Some(h), Some(to)) if outs(h) => Some(to.join("metrics.jsonl")),
                    (h, _) => h.clone(),
                };
                let kept = kept_lines(history.as_deref(), *start);
                std::fs::create_dir_all(out)
                    .with_context(|| format!("cannot create {}", out.display()))?;
                std::fs::write(out.join("config.toml"), resolved).with_context(|| {
                    format!("cannot write {}", out.join("config.toml").display())
                })?;
                let path = &self.metrics_path;
                let mut metrics = std::fs::File::create(path)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                for l in kept {
                    writeln!(metrics, "{l}")
                        .with_context(|| format!("cannot write {}", path.display()))?;
                }
                let from = history.as_deref().and_then(Path::parent);
                let events = continue_events(out, (from, *start), branch.as_deref())?;
                none.insert(Files { metrics, events })
            }
        };
        f(files)
    }

    /// Prints `text` above the progress bar, or as a line where there is none.
    fn println(&self, text: &str) {
        match &self.bar {
            Some(b) => b.println(text),
            None => say(text),
        }
    }

    /// Appends `line` to `metrics.jsonl`.
    fn metrics_line(&self, line: &serde_json::Value) -> anyhow::Result<()> {
        self.files(|f| {
            writeln!(f.metrics, "{line}")
                .with_context(|| format!("cannot write {}", self.metrics_path.display()))
        })
    }

    /// Appends `scalars` of `step` to the TensorBoard event file.
    fn event(&self, step: usize, scalars: &[(&str, f64)]) -> anyhow::Result<()> {
        self.files(|f| {
            f.events.scalars(step, scalars).context("cannot write the TensorBoard events")
        })
    }

    /// Writes and prints an evaluation after `done` steps.
    fn eval(&self, done: usize, e: &EvalReport) -> anyhow::Result<()> {
        let kinds = serde_json::to_value(&e.answers).context("cannot write the evaluation")?;
        let token_accuracy = e.correct_tokens as f64 / e.targets.max(1) as f64;
        let mut line = serde_json::json!({
            "step": done,
            "heldout": {
                "loss": if e.loss.is_finite() { serde_json::json!(e.loss) } else { serde_json::Value::Null },
                "answer_accuracy": e.accuracy(),
                "token_accuracy": token_accuracy,
                "targets": e.targets,
                "by_kind": kinds,
            },
        });
        if !e.loss.is_finite() {
            line["nonfinite"] = serde_json::json!(["heldout.loss"]);
        }
        self.metrics_line(&line)?;
        let scalars = [
            ("heldout/loss", e.loss),
            ("heldout/answer_accuracy", e.accuracy()),
            ("heldout/token_accuracy", token_accuracy),
        ];
        self.event(done, &scalars)?;
        self.evals.lock().unwrap_or_else(|e| e.into_inner()).push((done, e.clone()));
        let text = format!("held-out after {done} steps: {}", describe_eval(e));
        self.println(&text);
        Ok(())
    }

    /// Shows a save beginning on the progress bar; writes and prints a committed one.
    fn save(&self, save: Save<'_>) -> anyhow::Result<()> {
        let (done, saved, seconds) = match save {
            Save::Begins(done) => {
                if let Some(b) = &self.bar {
                    b.set_message(format!("saving a checkpoint after step {done}"));
                }
                return Ok(());
            }
            Save::Committed { done, saved, seconds } => (done, saved, seconds),
        };
        if let Some(b) = &self.bar {
            b.set_message(format!("checkpoint after step {done} committed"));
        }
        let line = serde_json::json!({
            "step": done,
            "checkpoint": {
                // Absolute, so the line names it from wherever the metrics are read.
                "dir": std::path::absolute(&saved.dir).unwrap_or_else(|_| saved.dir.clone()).display().to_string(),
                "files": saved.files,
                "bytes": saved.bytes,
                "seconds": seconds,
            },
        });
        self.metrics_line(&line)?;
        let text = format!(
            "checkpoint after step {done} committed: {} ({:.2} MiB in {} files, {seconds:.2} s)",
            saved.dir.display(),
            saved.bytes as f64 / (1u64 << 20) as f64,
            saved.files
        );
        self.println(&text);
        Ok(())
    }

    fn step(&self, log: &StepLog) -> anyhow::Result<()> {
        let r = &log.report;
        let tps = log.tokens as f64 / log.seconds.max(1e-9);
        let norms: serde_json::Map<String, serde_json::Value> =
            self.names.iter().zip(&r.module_norms).map(|(n, v)| (n.clone(), (*v).into())).collect();
        let bytes: serde_json::Map<String, serde_json::Value> = log
            .boundary_bytes
            .iter()
            .map(|(e, f, b)| (e.clone(), serde_json::json!({"forward": f, "backward": b})))
            .collect();
        let per_module = |f: &dyn Fn(usize) -> serde_json::Value| -> serde_json::Value {
            self.names.iter().enumerate().map(|(m, n)| (n.clone(), f(m))).collect()
        };
        let collective = per_module(&|m| r.collective_bytes[m].into());
        let flops = self.flops.per_module(&log.manifest);
        let total: f64 = flops.iter().sum();
        let model_flops = per_module(&|m| flops[m].into());
        {
            let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
            d.0 += total;
            d.1 += log.seconds;
        }
        let mfu = total / log.seconds.max(1e-9) / self.peak;
        let resident = per_module(&|m| {
            let x = r.resident[m];
            serde_json::json!({"peak": x.peak, "llm_phase": x.llm_phase, "host": x.host})
        });
        let line = serde_json::json!({
            "step": log.step,
            "loss": r.loss,
            "grad_norm": r.grad_norm,
            "module_grad_norms": norms,
            "lr": log.lr,
            "module_lrs": per_module(&|m| log.module_lrs[m].into()),
            "tokens": log.tokens,
            "tokens_per_s": tps,
            "step_s": log.seconds,
            "applied": r.applied,
            "seconds": r.seconds,
            "boundary_bytes": bytes,
            "collective_bytes": collective,
            "resident_bytes": resident,
            "model_flops": model_flops,
            "tflops": total / log.seconds.max(1e-9) / 1e12,
            "mfu": mfu,
            "data_wait_s": log.data_wait,
            "rank_peak_bytes": r.rank_peaks,
            "decodes_per_rank": log.decodes,
            "clips_cut_per_rank": log.cuts,
        });
        // JSON has no NaN: a non-finite value is written as null and named here.
        let mut line = line;
        let nonfinite: Vec<&str> = [("loss", r.loss), ("grad_norm", r.grad_norm)]
            .iter()
            .filter(|(_, v)| !v.is_finite())
            .map(|(k, _)| *k)
            .collect();
        if !nonfinite.is_empty() {
            line["nonfinite"] = serde_json::json!(nonfinite);
        }
        if !r.applied {
            line["nonfinite_at"] = serde_json::json!(r.nonfinite_at);
        }
        let scalars = [
            ("loss", r.loss),
            ("grad_norm", r.grad_norm),
            ("lr", log.lr),
            ("tokens_per_s", tps),
            ("tflops", total / log.seconds.max(1e-9) / 1e12),
            ("mfu", mfu),
            ("data_wait_s", log.data_wait),
        ];
        self.event(log.step, &scalars)?;
        self.metrics_line(&line)?;
        let skipped = if r.applied {
            String::new()
        } else {
            format!("  (skipped: non-finite in {})", r.nonfinite_at.join(", "))
        };
        if log.cuts.iter().any(|&c| c > 0) && !self.cut_noted.swap(true, Ordering::Relaxed) {
            let input = self.clip_seconds.map(|s| format!(" ({s:.2} s)")).unwrap_or_default();
            let note = format!(
                "note: some clips are longer than the audio encoder's input{input} and are cut to it; `hetpar data check` counts them (clips_cut_per_rank in metrics.jsonl)"
            );
            self.println(&note);
        }
        let text = format!(
            "loss {:.4}  grad norm {:.3}  lr {:.2e}  {:.0} tokens/s{skipped}",
            r.loss, r.grad_norm, log.lr, tps,
        );
        match &self.bar {
            Some(b) => {
                b.set_position(log.step as u64 + 1);
                b.set_message(text);
            }
            None => crate::stderr_line(&format!("step {}/{}  {text}", log.step + 1, self.steps)),
        }
        Ok(())
    }
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let (mut cfg, mut graph) = load(a.config.as_ref(), &a.set)?;
    let dtype = dtype(a.dtype.as_deref(), &mut graph)?;
    // The saved config (and every checkpoint's) multiplies as this run does, so a resume
    // or `hetpar eval` of it does too.
    cfg.train.dtype = graph.train.dtype;
    let steps = a.steps.unwrap_or(graph.train.steps);
    crate::steps_flag("--steps", steps)?;
    if steps == 0 {
        let from = if a.steps.is_some() { "--steps 0" } else { "train.steps = 0" };
        bail!("{from}: nothing to train");
    }
    // The learning-rate schedule runs over `steps`: the saved config names them, so that
    // training it again runs the same schedule.
    cfg.train.steps = steps;
    let timeout = timeout(a.timeout)?;
    if let Some(t) = a.peak_tflops
        && !(t.is_finite() && t > 0.0)
    {
        bail!("--peak-tflops {t}: use a positive number");
    }
    // Under MPI only rank 0 writes files and prints.
    let mpi = match a.backend.as_str() {
        "local" => {
            crate::threads::size_candle_pool(graph.world);
            None
        }
        "mpi" => Some(open_mpi(timeout, &graph)?),
        other => bail!("{}", crate::unknown_backend(other)),
    };
    let result = run_on(a, (cfg, graph), (dtype, steps, timeout), mpi.as_deref());
    match (result, &mpi) {
        // Once MPI is up, an error on one process ends every process at once, printed
        // (returned, it would wait in MPI's finalize, unprinted, until the others timed out).
        (Err(e), Some(world)) => {
            fail_job(world.rank(), RuntimeError::Model(format!("{e:#}")))?;
            Ok(())
        }
        (result, _) => result,
    }
}

/// [`run`] once the backend is up (`mpi`: this process's world under MPI).
fn run_on(
    a: &Args,
    (cfg, graph): (Config, ModelGraph),
    (dtype, steps, timeout): (DType, usize, Duration),
    mpi: Option<&dyn Communicator>,
) -> anyhow::Result<()> {
    let lead = mpi.is_none_or(|w| w.rank() == 0);
    let out = a.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(&graph.name));
    not_under_a_file(&out)?;
    run_files_fit(&out)?;
    let root = out.join("checkpoints");
    let resume = resume_dir(a.resume.as_deref(), &root, lead)?;
    // Whether the run goes on with the one whose checkpoints `out` holds (rather than
    // starting fresh or from another run's checkpoint), and the metrics it goes on from.
    // The checkpoint is resolved first (a link to it, a path relative to where the command
    // runs): its run is where it really lies.
    let real = resume.as_ref().map(|d| d.canonicalize().unwrap_or_else(|_| d.clone()));
    let continues = real.as_ref().is_some_and(|d| d.parent().is_some_and(|p| same_dir(p, &root)));
    let history = match &real {
        Some(_) if continues => Some(out.join("metrics.jsonl")),
        Some(d) => d.parent().and_then(Path::parent).map(|run| run.join("metrics.jsonl")),
        None => None,
    };
    // The checkpoint resumed from: its directory, its config's model and the SHA-256 of
    // the tokenizer its run read.
    let mut resumed_config = None;
    let start = match &resume {
        Some(dir) => {
            let m = hetpar_runtime::checkpoint::read_manifest(dir, &graph)
                .map_err(|e| anyhow::anyhow!("--resume: {e}"))?;
            let saved_text = checkpoint_config(dir)?;
            // Its model, for its tokenizer (a config this build cannot read has none).
            resumed_config = saved_text.as_ref().and_then(|(text, _)| {
                let (_, g) =
                    crate::config_load::load_text(text.clone(), String::new(), &[]).ok()?;
                Some(Resumed {
                    dir: dir.clone(),
                    trained: g,
                    tokenizer: m.tokenizer_sha256.clone(),
                })
            });
            let saved_cfg = saved_text.as_ref().map(|(_, v)| v);
            let ran = graph.train.dtype.name();
            if let Some(saved) = saved_precision(&m, saved_cfg)
                && saved != ran
            {
                bail!(
                    "--resume {}: the checkpoint was trained in {saved} and this run asks for \
                     {ran}; continue it with --dtype {saved} (in another precision it would \
                     not go on as it ran)",
                    dir.display()
                );
            }
            // A finished run submitted again (a requeued job) has nothing to do: it ends
            // at once, successfully, writing nothing.
            if m.step >= steps {
                if lead {
                    say(&format!(
                        "{}: the checkpoint is at step {} and --steps is {steps}: nothing to train (a larger --steps goes on from it)",
                        dir.display(),
                        m.step
                    ));
                }
                return Ok(());
            }
            if lead {
                say(&resumed_from(dir, &m, steps));
                let changed = match saved_cfg {
                    Some(saved) => config_changes(saved, &cfg)?,
                    None => Vec::new(),
                };
                if !changed.is_empty() {
                    say(&format!(
                        "note: this run's config differs from the checkpoint's in {} key{}: {}",
                        changed.len(),
                        if changed.len() == 1 { "" } else { "s" },
                        changed.join("; ")
                    ));
                }
                for name in unfrozen(&graph, resumed_config.as_ref()) {
                    say(&format!(
                        "note: modules.{name} was frozen when saved and trains from here: its AdamW moments start at zero"
                    ));
                }
            }
            m.step
        }
        None => 0,
    };
    let resolved = toml::to_string(&cfg).context("cannot write the resolved config")?;
    let mut ckpt = Some(Checkpoints {
        root,
        every: a.save_every.unwrap_or(0),
        keep: a.keep,
        resume,
        start,
        stop: {
            crate::stop_when_output_closes();
            stop_on_signals()?
        },
        config: resolved.clone(),
        tokenizer_sha256: None,
        io_timeout: seconds("--io-timeout", a.io_timeout)?,
    });
    // A tokenizer other than the checkpoint's is named before its records are read (they
    // may not even fit the sequence under it).
    let tokenizer = crate::data_open::tokenizer_file(&graph);
    same_tokenizer(resumed_config.as_ref(), tokenizer.as_deref())?;
    // The data first: a record it refuses is reported before the run's description (the
    // resolved config is some 80 lines).
    let opened = crate::data_open::open(&graph, &|l| {
        if lead {
            say(l)
        }
    });
    let data = match (opened, mpi) {
        (Ok(d), _) => d,
        // One process failing to open the data ends the whole job at once.
        (Err(e), Some(world)) => {
            fail_job(world.rank(), RuntimeError::Data(format!("{e:#}")))?;
            return Ok(());
        }
        (Err(e), None) => return Err(e),
    };
    // A synth set not yet generated had no tokenizer to compare: it has one now.
    if tokenizer.is_none() {
        same_tokenizer(resumed_config.as_ref(), data.tokenizer())?;
    }
    // Each checkpoint records the tokenizer's bytes, for a later resume or evaluation to
    // check (a tokenizer replaced at the same path changes no config).
    if let (Some(k), Some(tok)) = (ckpt.as_mut(), data.tokenizer()) {
        let (sha, _) = hetpar_runtime::checkpoint::sha256(tok)
            .with_context(|| format!("cannot read the tokenizer {}", tok.display()))?;
        k.tokenizer_sha256 = Some(sha);
    }
    if lead {
        for idle in crate::config_load::idle_keys(&graph) {
            say(&format!("note: {idle}"));
        }
    }
    if lead && graph.train.warmup > steps {
        say(&format!(
            "note: the learning rate warms up over {} steps, and this run has {steps}: it never reaches train.lr {}",
            graph.train.warmup, graph.train.lr
        ));
    }
    if lead {
        say(&format!(
            "training {} on {} ranks ({} backend, {}, {}) for {steps} step{}; metrics in {}",
            graph.name,
            graph.world,
            a.backend,
            precision(dtype, &graph),
            threads_per_rank(mpi.is_some(), graph.world),
            if steps == 1 { "" } else { "s" },
            out.join("metrics.jsonl").display()
        ));
        for m in &graph.modules {
            let l = &m.layout;
            // What the layout does besides its sizes.
            let mut also = String::new();
            for (on, what) in [
                (l.sp(), " sp".to_string()),
                (m.vpp > 1, format!(" vpp{}", m.vpp)),
                (m.recompute, " recompute".to_string()),
                (m.offload, " offload".to_string()),
            ] {
                if on {
                    also += &what;
                }
            }
            say(&format!(
                "  {} ({}): tp{} cp{} dp{} pp{} ep{}{also} on ranks {}",
                m.name,
                m.kind().name(),
                l.tp(),
                l.cp(),
                l.dp(),
                l.pp(),
                l.ep(),
                l.span()
            ));
        }
        say(&format!(
            "resolved config (written to {} as training begins):",
            out.join("config.toml").display()
        ));
        for line in resolved.lines().filter(|l| !l.trim().is_empty()) {
            say(&format!("  {line}"));
        }
        let frozen: Vec<&str> =
            graph.modules.iter().filter(|m| !m.trainable).map(|m| m.name.as_str()).collect();
        if !frozen.is_empty() {
            say(&format!("frozen (trainable = false): {}", frozen.join(", ")));
        }
    }
    if let Some(world) = mpi {
        // Before anything is written under --out: a refused job leaves an earlier run's
        // metrics as they were.
        // The flags that decide which steps every rank saves and evaluates on are
        // compared too: ranks disagreeing there would enter different collectives.
        let when = [
            ("run.save_every", ckpt.as_ref().map_or(0, |k| k.every).to_string()),
            ("run.eval_every", a.eval_every.unwrap_or(steps.div_ceil(4)).to_string()),
            ("run.io_timeout", format!("{} s", a.io_timeout)),
        ];
        agree_mpi(world, (&cfg, &graph), (dtype, steps), &data, (&ckpt, &when))?;
    }
    // The cores this process's ranks compute on: each rank's threads, together at most
    // the machine's (the demo's three ranks share two cores).
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let peak_cores = match mpi {
        None => graph.world * hetpar_nn::kernels::share_of(graph.world),
        Some(_) => hetpar_nn::kernels::threads(),
    }
    .min(cores);
    let report = if lead {
        let peak = match a.peak_tflops {
            Some(t) => t * 1e12,
            None => {
                // As `hetpar bench nn` measures it (a few 512^3 products alone moved the
                // peak by a quarter run to run), on as many cores as the ranks here compute
                // on, however many threads candle would use.
                let how = match graph.train.dtype {
                    Dtype::Bf16 => hetpar_nn::kernels::linear::Matmul::Bf16,
                    Dtype::F32 | Dtype::F64 => hetpar_nn::kernels::linear::Matmul::Native,
                };
                let one = hetpar_nn::bench::peak_on_cores(peak_cores, 10, dtype, how)? * 1e9;
                one * mpi.map_or(1, |w| w.size()) as f64
            }
        };
        // A signal so far (the data opening, the peak's products) stops the run before it
        // moves or writes anything under --out: an earlier run there stays where it was.
        // (Under MPI the error ends every process.)
        if ckpt.as_ref().is_some_and(|k| k.stopping()) {
            return Err(stopped_at_start(&out));
        }
        // An earlier run's files under --out are moved aside when this run writes its
        // first line (after its checkpoint is loaded and checked, and its first step or
        // evaluation done); what could refuse the move is checked now.
        let aside = if continues {
            // Gone back to an earlier checkpoint of the run: the ones past it are another
            // branch, kept apart so that `--keep` and `--resume auto` see only this one.
            past_branch(&out, start)?;
            Some(Aside::Past(start))
        } else {
            earlier_run(&out)?.then(|| {
                Aside::Whole(
                    match (ckpt.as_ref().and_then(|k| k.resume.as_ref()), a.resume.as_deref()) {
                        (Some(d), _) => format!("this run goes on from {} instead", d.display()),
                        (None, Some(_)) => {
                            "it had no committed checkpoint to go on from".to_string()
                        }
                        (None, None) => "--resume auto continues a run instead".to_string(),
                    },
                )
            })
        };
        Some(Report::create(
            &out,
            &resolved,
            &graph,
            (steps, start, history.as_deref()),
            peak,
            aside,
        ))
    } else {
        None
    };
    let on_step = |log: &StepLog| report.as_ref().map_or(Ok(()), |r| r.step(log));
    let on_save = |save: Save<'_>| report.as_ref().map_or(Ok(()), |r| r.save(save));
    let hooks = Hooks { on_step: &on_step, on_save: &on_save };
    let on_eval = |done: usize, e: &EvalReport| report.as_ref().map_or(Ok(()), |r| r.eval(done, e));
    let every = a.eval_every.unwrap_or(steps.div_ceil(4));
    let evals = Some(Evals { every, on_eval: &on_eval });
    let heldout = matches!(&data, RunData::Files { heldout: Some(_), .. });
    if a.eval_every.is_some() && !heldout && lead {
        say(
            "note: --eval-every has nothing to evaluate: this run's data has no held-out split (data.heldout, or a heldout.json next to the records)",
        );
    }
    // Seconds by kind of action, per rank (under MPI gathered from every process).
    let per_rank = |ranks: &[Vec<StepLog>]| -> Vec<std::collections::BTreeMap<String, f64>> {
        ranks
            .iter()
            .map(|logs| {
                let mut m = std::collections::BTreeMap::new();
                for l in logs {
                    for (k, v) in &l.report.seconds {
                        *m.entry((*k).to_string()).or_default() += v;
                    }
                }
                m
            })
            .collect()
    };
    let (logs, seconds) = match mpi {
        None => {
            let run = LocalRun { data: &data, hooks, evals, ckpt: &ckpt };
            let ranks = local_ranks(&graph, (dtype, steps), timeout, &run)?;
            let seconds = per_rank(&ranks);
            (ranks.into_iter().next().expect("rank 0"), seconds)
        }
        Some(world) => match rank_run(world, &graph, &data, (dtype, steps), hooks, evals, &ckpt) {
            Ok(logs) => {
                let mine = per_rank(std::slice::from_ref(&logs));
                let mine = serde_json::to_vec(&mine[0])?;
                let seconds = world
                    .all_gather_any(&mine)?
                    .iter()
                    .map(|m| serde_json::from_slice(m))
                    .collect::<Result<_, _>>()?;
                (logs, seconds)
            }
            Err(e) => (fail_job(world.rank(), e)?, Vec::new()),
        },
    };
    let Some(report) = report else { return Ok(()) };
    if let Some(b) = &report.bar {
        b.finish();
    }
    let done = start + logs.len();
    if logs.is_empty() {
        return Err(stopped_at_start(&out));
    }
    // What this process held at its peak, next to the preflight's count for its ranks
    // (under MPI, rank 0's alone: the preflight counted each machine's together).
    let here: Vec<usize> = if mpi.is_some() { vec![0] } else { (0..graph.world).collect() };
    let first = first_manifest(&graph, &data, start);
    let memory = crate::process_peak_bytes().map(|peak| Memory {
        peak,
        states: preflight::states_bytes(&graph, dtype, &here),
        activations: preflight::activations_floor(&graph, dtype, first.as_ref(), &here)
            .map(|f| f.2.total)
            .ok(),
        ranks: here,
    });
    summary(&graph, &logs, report.start.elapsed(), memory.as_ref());
    let evals = report.evals.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if let (Some(first), Some(last)) = (evals.first(), evals.last())
        && evals.len() > 1
    {
        say(&format!(
            "held-out: loss {:.4} -> {:.4}, answer accuracy {:.1}% -> {:.1}% (after {} -> {} steps)",
            first.1.loss,
            last.1.loss,
            100.0 * first.1.accuracy(),
            100.0 * last.1.accuracy(),
            first.0,
            last.0
        ));
    }
    let loss = crate::plots::loss_curve(&out, &graph.name)?;
    let time = crate::plots::time_bars(&out, &graph.name, &seconds)?;
    say(&format!(
        "pictures: {} (loss), {} (time per rank by action)",
        loss.display(),
        time.display()
    ));
    let events = report.files(|f| Ok(f.events.path().to_path_buf()))?;
    say(&format!(
        "TensorBoard events: {} (tensorboard --logdir {})",
        events.display(),
        out.display()
    ));
    let (flops, secs) = *report.done.lock().unwrap_or_else(|e| e.into_inner());
    let rate = |f: f64| {
        if f >= 1e12 {
            format!("{:.2} TFLOP/s", f / 1e12)
        } else {
            format!("{:.1} GFLOP/s", f / 1e9)
        }
    };
    say(&format!(
        "model FLOPs: {} over the steps, MFU {:.1}% of a {} peak{}",
        rate(flops / secs.max(1e-9)),
        100.0 * flops / secs.max(1e-9) / report.peak,
        rate(report.peak),
        match (a.peak_tflops, mpi) {
            (Some(_), _) => " (--peak-tflops)".to_string(),
            (None, None) => format!(
                " (matmul on {peak_cores} core{} measured at start)",
                if peak_cores == 1 { "" } else { "s" }
            ),
            (None, Some(w)) => format!(
                " (matmul on rank 0's {peak_cores} core{} measured at start, times {} ranks)",
                if peak_cores == 1 { "" } else { "s" },
                w.size()
            ),
        }
    ));
    if let Some(k) = &ckpt {
        let dir = k.root.join(hetpar_runtime::checkpoint::dir_name(done));
        say(&format!("checkpoint committed: {}", dir.display()));
        if done < steps {
            say(&format!(
                "stopped by {} after step {done} of {steps}; continue with --resume auto (same --out)",
                stop_cause()
            ));
        }
    }
    Ok(())
}

/// The error of a run a signal stopped before its first step: nothing moved or written.
fn stopped_at_start(out: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "stopped by {} before the first step began; nothing under {} was moved or written",
        stop_cause(),
        out.display()
    )
}

/// What stopped a run: its output closing (`hetpar train | head`), else a signal.
fn stop_cause() -> &'static str {
    if crate::output_closed() { "its output closing" } else { "a signal" }
}

/// Where a run saves and resumes.
pub struct Checkpoints {
    /// OUT/checkpoints.
    pub root: PathBuf,
    /// Save every N steps (0: only at the end).
    pub every: usize,
    /// Newest checkpoints kept (0: all).
    pub keep: usize,
    /// The checkpoint to load first.
    pub resume: Option<PathBuf>,
    /// The first step the run takes (the resumed checkpoint's, else 0).
    pub start: usize,
    /// Set by SIGTERM, SIGINT, SIGUSR1 or SIGUSR2: every rank finishes its step, the job
    /// commits a checkpoint and stops.
    pub stop: Arc<AtomicBool>,
    /// The resolved config, saved in each checkpoint.
    pub config: String,
    /// SHA-256 of the tokenizer the run's data read, recorded in each checkpoint (set once
    /// the data is open).
    pub tokenizer_sha256: Option<String>,
    /// How long ranks wait for one another's checkpoint files (`--io-timeout`).
    pub io_timeout: Duration,
}

impl Checkpoints {
    /// Whether this process was asked to stop: by a signal, or by its output closing.
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || crate::output_closed()
    }

    /// No checkpoints (check and bench runs).
    pub fn none() -> Option<Checkpoints> {
        None
    }
}

/// A flag SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 set (instead of ending the process), so the
/// run commits a checkpoint after the current step and stops cleanly; a second signal ends
/// the process at once (exit 130), for a run stuck in its step. Under mpirun, SIGUSR1 and
/// SIGUSR2 are the ones to send: mpirun passes them on to every process, where a SIGTERM
/// it follows with SIGKILL a second later.
#[allow(unsafe_code)]
fn stop_on_signals() -> anyhow::Result<Arc<AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    const SECOND: &[u8] = b"error: a second signal: stopping at once, without committing a checkpoint (exit 130); --resume auto goes on from the latest committed one\n";
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [SIGTERM, SIGINT, SIGUSR1, SIGUSR2] {
        let seen = flag.clone();
        // SAFETY: the action only swaps an atomic, writes a static buffer with write(2) and
        // calls _exit, each async-signal-safe.
        unsafe {
            signal_hook::low_level::register(sig, move || {
                if seen.swap(true, Ordering::SeqCst) {
                    libc::write(2, SECOND.as_ptr().cast(), SECOND.len());
                    signal_hook::low_level::exit(130);
                }
            })
        }
        .context("cannot handle SIGTERM, SIGINT, SIGUSR1 and SIGUSR2")?;
    }
    Ok(flag)
}

/// The checkpoint `--resume` names: `auto` the latest under `root` (none: start fresh,
/// said by the lead), else a checkpoint or a run directory holding one.
fn resume_dir(flag: Option<&str>, root: &Path, lead: bool) -> anyhow::Result<Option<PathBuf>> {
    let (latest, note) = match flag {
        None => return Ok(None),
        Some("auto") => hetpar_runtime::checkpoint::latest_noted(root)?,
        // A checkpoint, or a run's --out or its checkpoints/ (their latest), as eval and
        // export take them.
        Some(dir) => crate::export_cmd::checkpoint(Path::new(dir))
            .map(|(dir, note)| (Some(dir), note))
            .map_err(|e| anyhow::anyhow!("--resume {e:#}; or --resume auto"))?,
    };
    if let Some(note) = note.filter(|_| lead) {
        say(&format!("note: {note}"));
    }
    if latest.is_none() && lead {
        // A run moved aside by a fresh run into the same --out may be the one meant.
        let moved = root.parent().and_then(|out| {
            earlier_runs(out).into_iter().rev().map(|(_, d)| d).find(|d| {
                hetpar_runtime::checkpoint::latest(&d.join("checkpoints"))
                    .is_ok_and(|l| l.is_some())
            })
        });
        let hint = moved.map_or_else(String::new, |d| {
            format!(
                " ({} holds an earlier run's checkpoints: --resume {} goes on from its latest)",
                d.display(),
                d.display()
            )
        });
        say(&format!(
            "--resume auto: no committed checkpoint under {}, starting fresh{hint}",
            root.display()
        ));
    }
    Ok(latest)
}

/// How the directories an earlier run's files are moved to are named (`earlier-1`, ...).
const EARLIER: &str = "earlier-";

/// Whether `a` and `b` are the same directory (either may be relative, or not exist).
fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The runs moved aside under `out`, `(N, out/earlier-N)` by N (the order they were moved).
fn earlier_runs(out: &Path) -> Vec<(usize, PathBuf)> {
    let mut runs: Vec<(usize, PathBuf)> = std::fs::read_dir(out)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().strip_prefix(EARLIER)?.parse().ok()?;
                    Some((n, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    runs.sort();
    runs
}

/// A new `out/earlier-N` for a run's files, numbered after every one there.
fn new_earlier(out: &Path) -> anyhow::Result<PathBuf> {
    let n = earlier_runs(out).last().map_or(1, |(n, _)| n + 1);
    let to = out.join(format!("{EARLIER}{n}"));
    std::fs::create_dir(&to).with_context(|| format!("cannot create {}", to.display()))?;
    Ok(to)
}

/// Refuses to move `root` where it is a link (to a scratch filesystem, say): renaming the
/// link would have the next checkpoints written beside it, off the filesystem it points at.
fn not_a_link(root: &Path) -> anyhow::Result<()> {
    if std::fs::symlink_metadata(root).is_ok_and(|m| m.file_type().is_symlink()) {
        bail!(
            "{} is a link and holds an earlier run's checkpoints, which a fresh run would mix with its own: --resume auto continues that run; otherwise move them out of the directory it links to first",
            root.display()
        );
    }
    Ok(())
}

/// Refuses `out` (before anything runs) where the nearest part of it that exists is not a
/// directory, or is a link to nothing: the run's directory is made (or found) under it.
fn not_under_a_file(out: &Path) -> anyhow::Result<()> {
    // Without a trailing slash, whose lookup fails as "not a directory" on a file.
    let whole: PathBuf = out.components().collect();
    for p in whole.ancestors().filter(|p| !p.as_os_str().is_empty()) {
        let refuse = |what: &str| {
            anyhow::anyhow!(
                "--out {}: {} is {what} (--out names the run's directory, made where missing)",
                out.display(),
                p.display()
            )
        };
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => return Ok(()),
            Ok(_) => return Err(refuse("not a directory")),
            Err(_) if std::fs::symlink_metadata(p).is_ok() => {
                return Err(refuse("a link to nothing"));
            }
            // Missing, or under a file (found on the way up).
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) => {}
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("--out {}: cannot read {}", out.display(), p.display())
                });
            }
        }
    }
    Ok(())
}

/// Renames each `(from, to)` in order, or none: where one fails (a mount point cannot be
/// renamed, nor anything across filesystems, bind mounts included), those already moved
/// go back before the error returns, which ends with `advice`.
fn move_all(moves: &[(PathBuf, PathBuf)], advice: &str) -> anyhow::Result<()> {
    for (n, (from, to)) in moves.iter().enumerate() {
        if let Err(e) = std::fs::rename(from, to) {
            let stuck: Vec<String> = moves[..n]
                .iter()
                .rev()
                .filter(|(f, t)| std::fs::rename(t, f).is_err())
                .map(|(_, t)| t.display().to_string())
                .collect();
            let left = match stuck.is_empty() {
                true => "nothing was moved".to_string(),
                false => format!("these could not be moved back: {}", stuck.join(", ")),
            };
            return Err(e).with_context(|| {
                format!(
                    "cannot move {} to {} ({left}; a mount point, or a directory on another filesystem, cannot be renamed): {advice}",
                    from.display(),
                    to.display()
                )
            });
        }
    }
    Ok(())
}

/// Whether `a` and `b` (links followed) lie on one filesystem, so that a rename moves one's
/// entries into the other. Where either cannot be read, whether they are one path.
fn same_filesystem(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    // A relative path's empty parent is the working directory.
    let or_dot = |p: &Path| match p.as_os_str().is_empty() {
        true => PathBuf::from("."),
        false => p.to_path_buf(),
    };
    match (std::fs::metadata(or_dot(a)), std::fs::metadata(or_dot(b))) {
        (Ok(x), Ok(y)) => x.dev() == y.dev(),
        _ => a == b,
    }
}

/// Writes `lines` to `path` whole or not at all (a temporary file renamed over it).
fn write_whole(path: &Path, lines: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, lines)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// `metrics`' checkpoint lines with the directories under `from` (the checkpoints as they
/// were, however the run spelt its `--out`) that `moved` keeps named under `to`.
fn rebase_checkpoints(
    metrics: &str,
    (from, to): (&Path, &Path),
    moved: &dyn Fn(&std::ffi::OsStr) -> bool,
) -> String {
    let from = from.canonicalize().unwrap_or_else(|_| from.to_path_buf());
    metrics
        .lines()
        .map(|l| {
            let mut v = serde_json::from_str::<serde_json::Value>(l).ok();
            let dir = v.as_mut().and_then(|v| v.pointer_mut("/checkpoint/dir"));
            let under = |d: &str| {
                let d = Path::new(d);
                let parent = d.parent()?.canonicalize().ok()?;
                let name = d.file_name()?;
                let now = to.join(name);
                let now = std::path::absolute(&now).unwrap_or(now);
                (parent == from && moved(name)).then(|| now.display().to_string())
            };
            match dir.and_then(|d| Some((under(d.as_str()?)?, d))) {
                Some((now, d)) => {
                    *d = serde_json::Value::String(now);
                    format!("{}\n", v.expect("parsed"))
                }
                None => format!("{l}\n"),
            }
        })
        .collect()
}

/// The committed checkpoints under `out/checkpoints` past step `start` (a branch of the run
/// that a resume from step `start` leaves), refused where they could not be moved aside
/// ([`set_aside_past`]): on another filesystem than `out`.
fn past_branch(out: &Path, start: usize) -> anyhow::Result<Vec<(usize, PathBuf)>> {
    let root = out.join("checkpoints");
    let past: Vec<(usize, PathBuf)> = hetpar_runtime::checkpoint::committed(&root)
        .with_context(|| format!("cannot read {}", root.display()))?
        .into_iter()
        .filter(|(s, _)| *s > start)
        .collect();
    // Step directories move by rename, which cannot cross filesystems: a linked or mounted
    // checkpoints/ elsewhere keeps them, and this run would prune or resume among them.
    if let Some((newest, _)) = past.last()
        && !same_filesystem(&root, out)
    {
        bail!(
            "going back to step {start} leaves {} later checkpoint{} under {} (newest: step {newest}), which would be moved aside to {}, but {} is on another filesystem (a link or a mount point): move or delete the checkpoints past step {start} first, or resume from the latest",
            past.len(),
            if past.len() == 1 { "" } else { "s" },
            root.display(),
            out.join("earlier-N").display(),
            root.display()
        );
    }
    Ok(past)
}

/// Moves the checkpoints under `out/checkpoints` past step `start` (a branch of the run
/// that a resume from step `start` leaves) to a new `out/earlier-N/checkpoints`, with a
/// copy of the run's metrics so far; the number moved. `None` where there are none.
fn set_aside_past(out: &Path, start: usize) -> anyhow::Result<Option<(PathBuf, usize)>> {
    let root = out.join("checkpoints");
    let past = past_branch(out, start)?;
    let Some((newest, _)) = past.last() else { return Ok(None) };
    let to = new_earlier(out)?;
    let moved = to.join("checkpoints");
    std::fs::create_dir(&moved).with_context(|| format!("cannot create {}", moved.display()))?;
    let metrics = out.join("metrics.jsonl");
    if let Ok(text) = read_regular_text(&metrics) {
        let past_dir = |n: &std::ffi::OsStr| past.iter().any(|(_, d)| d.file_name() == Some(n));
        write_whole(
            &to.join("metrics.jsonl"),
            &rebase_checkpoints(&text, (&root, &moved), &past_dir),
        )?;
    }
    let moves: Vec<(PathBuf, PathBuf)> = past
        .iter()
        .map(|(_, dir)| (dir.clone(), moved.join(dir.file_name().expect("a step directory"))))
        .collect();
    let advice = format!(
        "move or delete the checkpoints past step {start} first, or resume from the latest"
    );
    if let Err(e) = move_all(&moves, &advice) {
        // The new directory goes where it holds only the metrics' copy (every checkpoint
        // went back); one that could not go back stays in it.
        let _ = std::fs::remove_file(to.join("metrics.jsonl"));
        let _ = std::fs::remove_dir(&moved).and_then(|()| std::fs::remove_dir(&to));
        return Err(e);
    }
    std::fs::write(moved.join("latest"), hetpar_runtime::checkpoint::dir_name(*newest))
        .with_context(|| format!("cannot write {}", moved.join("latest").display()))?;
    Ok(Some((to, past.len())))
}

/// Refuses `out` (before anything runs) where a name the run writes there is taken by
/// something of another kind: a `checkpoints` that is not a directory (the run would train
/// up to its first checkpoint and fail there), or a file's name held by a directory, a
/// device or a FIFO (`/dev/full` in `metrics.jsonl`'s place never ends when read).
fn run_files_fit(out: &Path) -> anyhow::Result<()> {
    for name in RUN_FILES {
        let path = out.join(name);
        // Missing (or a link to nothing): made where it is written.
        let Ok(m) = std::fs::metadata(&path) else { continue };
        let dir = name == "checkpoints";
        if (dir && m.is_dir()) || (!dir && m.is_file()) {
            continue;
        }
        let what = if dir { "its checkpoints in a directory" } else { "a file" };
        bail!(
            "--out {}: {} is {}, where the run keeps {what} of that name; move it, or give another --out",
            out.display(),
            path.display(),
            hetpar_data::files::describe(m.file_type())
        );
    }
    Ok(())
}

/// What a run writes under its `--out`, besides TensorBoard's event files.
const RUN_FILES: [&str; 5] =
    ["checkpoints", "metrics.jsonl", "config.toml", "loss.svg", "time.svg"];

/// Whether `out` holds an earlier run's metrics or a committed checkpoint, which
/// [`set_aside`] moves aside; refused where it could not: checkpoints under a link.
fn earlier_run(out: &Path) -> anyhow::Result<bool> {
    let root = out.join("checkpoints");
    let saved = !hetpar_runtime::checkpoint::committed(&root)
        .with_context(|| format!("cannot read {}", root.display()))?
        .is_empty();
    if saved {
        not_a_link(&root)?;
    }
    Ok(saved || out.join("metrics.jsonl").exists())
}

/// An earlier run's files under a run's `--out`, to move aside before the run writes there.
enum Aside {
    /// The checkpoints past this step, a branch this run leaves ([`set_aside_past`]).
    Past(usize),
    /// A whole run this run does not go on with ([`set_aside`]), and why not.
    Whole(String),
}

impl Aside {
    /// Moves the files aside from `out`, telling `say` where they went; where a whole run
    /// went, and where a branch past the checkpoint resumed from went.
    fn carry_out(
        &self,
        out: &Path,
        say: &dyn Fn(&str),
    ) -> anyhow::Result<(Option<PathBuf>, Option<PathBuf>)> {
        match self {
            Aside::Past(start) => {
                if let Some((moved, past)) = set_aside_past(out, *start)? {
                    say(&format!(
                        "note: {} held {past} checkpoint{} past step {start}, the one this run goes on from; moved {} to {} with the run's metrics so far, so that this run's checkpoints do not mix with them",
                        out.join("checkpoints").display(),
                        if past == 1 { "" } else { "s" },
                        if past == 1 { "it" } else { "them" },
                        moved.display()
                    ));
                    return Ok((None, Some(moved)));
                }
            }
            Aside::Whole(why) => {
                if let Some(moved) = set_aside(out)? {
                    say(&format!(
                        "note: {} held an earlier run; moved it to {} so that this run's checkpoints and metrics do not mix with it ({why})",
                        out.display(),
                        moved.display()
                    ));
                    return Ok((Some(moved), None));
                }
            }
        }
        Ok((None, None))
    }
}

/// The run's new TensorBoard event file in `out`, holding first what hetpar's event files
/// in `from` (the directory of the metrics the run goes on from) hold before step `start`,
/// so that TensorBoard shows the run's history with no step twice. Where `from` is `out`
/// itself, those files then go: to `branch` where the run left a branch past `start` there
/// ([`set_aside_past`]), with its checkpoints and metrics, else deleted (what they hold past
/// `start` is being trained again); another run's stay where they are. Other writers' event
/// files are not touched.
fn continue_events(
    out: &Path,
    (from, start): (Option<&Path>, usize),
    branch: Option<&Path>,
) -> anyhow::Result<crate::tensorboard::Events> {
    let earlier = match from {
        Some(dir) => crate::tensorboard::ours(dir)
            .with_context(|| format!("cannot read {}", dir.display()))?,
        None => Vec::new(),
    };
    let what = || format!("cannot write a TensorBoard event file in {}", out.display());
    let mut events = crate::tensorboard::Events::create(out).with_context(what)?;
    events.carry(&earlier, start).with_context(what)?;
    if !from.is_some_and(|dir| same_dir(dir, out)) {
        return Ok(events);
    }
    for path in earlier.iter().filter(|p| p.as_path() != events.path()) {
        let gone = match (branch, path.file_name()) {
            (Some(to), Some(name)) => std::fs::rename(path, to.join(name)),
            _ => std::fs::remove_file(path),
        };
        gone.with_context(|| format!("cannot move {} out of the way", path.display()))?;
    }
    Ok(events)
}

/// Moves an earlier run's files out of `out` into a new `out/earlier-N` ([`new_earlier`]), where
/// `out` holds its metrics or a committed checkpoint and this run does not go on with it
/// (it starts fresh, or from another run's checkpoint): it would otherwise write its
/// metrics over them, and its checkpoints would sit beside the earlier run's, where
/// `--resume auto` could take the earlier run's latest and `--keep` could delete this run's.
/// The moved directory is a run's `--out` as `eval`, `export` and `--resume` read one, and
/// its metrics name its checkpoints where they now are. `None` where there was nothing to
/// move.
fn set_aside(out: &Path) -> anyhow::Result<Option<PathBuf>> {
    if !earlier_run(out)? {
        return Ok(None);
    }
    let root = out.join("checkpoints");
    // The checkpoints' lines are named where they will be, while they are still there.
    let metrics = read_regular_text(&out.join("metrics.jsonl")).ok();
    let to = new_earlier(out)?;
    let metrics =
        metrics.map(|m| rebase_checkpoints(&m, (&root, &to.join("checkpoints")), &|_| true));
    let events = std::fs::read_dir(out)
        .with_context(|| format!("cannot read {}", out.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(crate::tensorboard::PREFIX));
    let moves: Vec<(PathBuf, PathBuf)> = RUN_FILES
        .iter()
        .map(|n| n.to_string())
        .chain(events)
        .map(|name| (out.join(&name), to.join(&name)))
        .filter(|(from, _)| std::fs::symlink_metadata(from).is_ok())
        .collect();
    let advice = "--resume auto continues the run there; otherwise move it out of the way first";
    if let Err(e) = move_all(&moves, advice) {
        // Empty again where everything went back.
        let _ = std::fs::remove_dir(&to);
        return Err(e);
    }
    if let Some(m) = metrics {
        write_whole(&to.join("metrics.jsonl"), &m)?;
    }
    Ok(Some(to))
}

/// The modules `graph` trains that the resumed checkpoint's config froze.
fn unfrozen<'a>(graph: &'a ModelGraph, resumed: Option<&Resumed>) -> Vec<&'a str> {
    let Some(r) = resumed else { return Vec::new() };
    let was_frozen =
        |name: &str| r.trained.module_id(name).is_some_and(|i| !r.trained.modules[i].trainable);
    graph
        .modules
        .iter()
        .filter(|m| m.trainable && was_frozen(&m.name))
        .map(|m| m.name.as_str())
        .collect()
}

/// The checkpoint a run resumes from, as its tokenizer check reads it.
struct Resumed {
    /// Its directory.
    dir: PathBuf,
    /// Its saved config's model.
    trained: ModelGraph,
    /// The SHA-256 of the tokenizer its run read, where its manifest recorded one.
    tokenizer: Option<String>,
}

/// Refuses a resume whose tokenizer `used` holds other bytes than the one the checkpoint's
/// run read.
fn same_tokenizer(resumed: Option<&Resumed>, used: Option<&Path>) -> anyhow::Result<()> {
    let Some(Resumed { dir, trained, tokenizer }) = resumed else { return Ok(()) };
    let changed = crate::data_open::changed_tokenizer(tokenizer.as_deref(), trained, used)?;
    if let (Some(trained), Some(used)) = (changed, used) {
        bail!(
            "--resume {}: this run's tokenizer {} is not the one the checkpoint was trained \
             with ({trained}): the token ids would not mean what the model learned (go on \
             with data tokenized as before, or start a new run)",
            dir.display(),
            used.display(),
        );
    }
    Ok(())
}

/// The config checkpoint `dir` was saved with, its text and as TOML; `None` where it holds
/// none.
fn checkpoint_config(dir: &Path) -> anyhow::Result<Option<(String, toml::Value)>> {
    let path = dir.join(hetpar_runtime::checkpoint::CONFIG_FILE);
    let Some(text) = hetpar_runtime::checkpoint::saved_config(dir)
        .map_err(|e| anyhow::anyhow!("--resume: {e}"))?
    else {
        return Ok(None);
    };
    let config = toml::from_str(&text)
        .with_context(|| format!("--resume: {} is not a config", path.display()))?;
    Ok(Some((text, config)))
}

/// The precision a checkpoint (manifest `m`, config `saved`) was trained in, as `--dtype`
/// names it: f64 where its tensors are f64 (checkpoints saved before a config could say
/// `dtype = "f64"` have them under an "f32" config), else its saved config's
/// `train.dtype`; `None` where the checkpoint holds no config.
fn saved_precision(
    m: &hetpar_runtime::checkpoint::Manifest,
    saved: Option<&toml::Value>,
) -> Option<String> {
    if m.dtype == "f64" {
        return Some("f64".into());
    }
    let dtype = saved?.get("train").and_then(|t| t.get("dtype")).and_then(toml::Value::as_str);
    Some(dtype.unwrap_or("f32").to_string())
}

/// The keys whose values `cfg` changes from the config a checkpoint was saved with
/// (`saved`), each as `key old -> new` (`(unset)` where one side has none), in key order.
/// `train.steps` is left to the resume's own line, which says how far the run goes and
/// over how many steps each schedule runs ([`resumed_from`]).
fn config_changes(saved: &toml::Value, cfg: &Config) -> anyhow::Result<Vec<String>> {
    let now = toml::Value::try_from(cfg).context("the resolved config does not serialize")?;
    Ok(value_changes(saved, &now, &["train.steps"])
        .into_iter()
        .map(|(k, a, b)| format!("{k} {a} -> {b}"))
        .collect())
}

/// Every dotted key (but those in `skip`) whose value differs between configs `was` and
/// `is`, with both values (`(unset)` where one side has none), in key order. A module's
/// `trainable` and `lr` count by what they do: unset is `true` and `train.lr` (shown so).
pub(crate) fn value_changes(
    was: &toml::Value,
    is: &toml::Value,
    skip: &[&str],
) -> Vec<(String, String, String)> {
    let (mut a, mut b) = (Default::default(), Default::default());
    flatten("", &effective(was), &mut a);
    flatten("", &effective(is), &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| !skip.contains(&k.as_str()) && a.get(*k) != b.get(*k))
        .map(|k| {
            // A module's learning rate is unset where it is train.lr's (on a side that has
            // the module).
            let lr_of = k.strip_prefix("modules.").and_then(|m| m.strip_suffix(".lr"));
            let unset = |side: &std::collections::BTreeMap<String, String>| {
                let has = |m: &str| side.keys().any(|x| x.starts_with(&format!("modules.{m}.")));
                if lr_of.is_some_and(has) { "train.lr" } else { "(unset)" }.to_string()
            };
            let (x, y) = (a.get(k).cloned(), b.get(k).cloned());
            (k.clone(), x.unwrap_or_else(|| unset(&a)), y.unwrap_or_else(|| unset(&b)))
        })
        .collect()
}

/// Config `v` with each module's `trainable` as it acts (`true` where unset), and without a
/// module `lr` equal to `train.lr` (which an unset one takes).
fn effective(v: &toml::Value) -> toml::Value {
    let mut v = v.clone();
    // The keys a resolved config leaves out under another data source, at their defaults
    // (configs saved before it left them out wrote them).
    if let Some(data) = v.get_mut("data").and_then(toml::Value::as_table_mut) {
        let samples = hetpar_layout::config::DataConfig::SYNTH_SAMPLES as i64;
        data.entry("samples").or_insert(toml::Value::Integer(samples));
        data.entry("max_items").or_insert(toml::Value::Integer(1));
    }
    let lr = v.get("train").and_then(|t| t.get("lr")).cloned();
    if let Some(modules) = v.get_mut("modules").and_then(toml::Value::as_table_mut) {
        for (_, m) in modules.iter_mut() {
            let Some(m) = m.as_table_mut() else { continue };
            m.entry("trainable").or_insert(toml::Value::Boolean(true));
            if lr.is_some() && m.get("lr") == lr.as_ref() {
                m.remove("lr");
            }
        }
    }
    v
}

/// Every value under `v` by its dotted key (arrays of tables, such as `edges`, by index).
fn flatten(key: &str, v: &toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
    let join = |k: &str| if key.is_empty() { k.to_string() } else { format!("{key}.{k}") };
    match v {
        toml::Value::Table(t) => t.iter().for_each(|(k, v)| flatten(&join(k), v, out)),
        toml::Value::Array(a) if a.iter().any(toml::Value::is_table) => {
            a.iter().enumerate().for_each(|(i, v)| flatten(&join(&i.to_string()), v, out));
        }
        v => {
            out.insert(key.to_string(), v.to_string());
        }
    }
}

/// What a resume says it loads: the step, the layout it was saved under, the files.
fn resumed_from(dir: &Path, m: &hetpar_runtime::checkpoint::Manifest, steps: usize) -> String {
    let layouts: Vec<String> = m
        .modules
        .iter()
        .map(|l| format!("{} {} on ranks {}..{}", l.module, l.layout, l.ranks[0], l.ranks[1]))
        .collect();
    let files: Vec<String> = m
        .files
        .iter()
        .filter(|f| !f.tensors.is_empty())
        .map(|f| format!("{} ({} bytes)", f.file, f.bytes))
        .collect();
    let schedule = if m.schedule_steps == steps {
        String::new()
    } else {
        format!(
            " (its learning-rate schedule ran over {} steps, this run's over {steps})",
            m.schedule_steps
        )
    };
    format!(
        "resuming from {}: {} of {steps} steps done{schedule}, saved under {}; files {}, each to be checked against its SHA-256 before any tensor is read",
        dir.display(),
        m.step,
        layouts.join(", "),
        files.join(", ")
    )
}

impl Report {
    /// The report of a run into `out` with the resolved config `resolved`, and the progress
    /// bar when stderr is a terminal; its files are made when the first line is written.
    /// A resumed run keeps the lines of the steps before `start_step` from `history` (the
    /// metrics of the run it goes on from); `aside` is moved out of the way first.
    fn create(
        out: &Path,
        resolved: &str,
        graph: &ModelGraph,
        (steps, start_step, history): (usize, usize, Option<&Path>),
        peak: f64,
        aside: Option<Aside>,
    ) -> Report {
        let path = out.join("metrics.jsonl");
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(steps as u64);
            b.set_position(start_step as u64);
            b.set_style(
                ProgressStyle::with_template("{bar:30} step {pos}/{len}  {msg}  ETA {eta}")
                    .expect("a valid template"),
            );
            b
        });
        Report {
            bar,
            files: Mutex::new(None),
            pending: Pending {
                out: out.to_path_buf(),
                resolved: resolved.to_string(),
                history: history.filter(|_| start_step > 0).map(Path::to_path_buf),
                start: start_step,
                aside,
            },
            metrics_path: path,
            names: graph.modules.iter().map(|m| m.name.clone()).collect(),
            steps,
            start: Instant::now(),
            flops: crate::flops::StepFlops::new(graph),
            peak,
            done: Mutex::new((0.0, 0.0)),
            evals: Mutex::new(Vec::new()),
            clip_seconds: clip_seconds(graph),
            cut_noted: AtomicBool::new(false),
        }
    }
}

/// The length in seconds of the clips `graph`'s audio encoders take, where they all take
/// the same.
fn clip_seconds(graph: &ModelGraph) -> Option<f64> {
    let mut frames = graph.modules.iter().filter_map(|m| match m.spec {
        hetpar_layout::ModuleSpec::Audio { frames, .. } => Some(frames),
        _ => None,
    });
    let first = frames.next()?;
    let rate = f64::from(hetpar_data::mel::SAMPLE_RATE);
    frames.all(|f| f == first).then(|| hetpar_data::mel::clip_samples(first) as f64 / rate)
}

/// A process's memory at the end of a run, with what the preflight counted for its ranks.
struct Memory {
    /// Its peak resident bytes.
    peak: f64,
    /// Weights, gradients and AdamW moments of its ranks.
    states: f64,
    /// The floor of their activations (`None` where the schedule could not be built).
    activations: Option<f64>,
    /// Its ranks.
    ranks: Vec<usize>,
}

fn summary(graph: &ModelGraph, logs: &[StepLog], wall: Duration, memory: Option<&Memory>) {
    let (first, last) = (&logs[0].report, &logs[logs.len() - 1].report);
    let tokens: usize = logs.iter().map(|l| l.tokens).sum();
    // The rate is the steps': evaluations, checkpoints and the start are in the wall time.
    let secs: f64 = logs.iter().map(|l| l.seconds).sum();
    let wall = wall.as_secs_f64();
    let mut phases: std::collections::BTreeMap<&str, f64> = std::collections::BTreeMap::new();
    for l in logs {
        for (k, v) in &l.report.seconds {
            *phases.entry(k).or_default() += v;
        }
    }
    let busy: f64 = phases.values().sum();
    let parts: Vec<String> = phases
        .iter()
        .map(|(k, v)| format!("{k} {:.1} s ({:.0}%)", v, 100.0 * v / busy.max(1e-9)))
        .collect();
    say(&format!("time on rank 0 by action: {}", parts.join(", ")));
    let n = logs.len() as f64;
    let edges: Vec<String> = logs[0]
        .boundary_bytes
        .iter()
        .enumerate()
        .map(|(i, (e, _, _))| {
            let (f, b) = logs.iter().fold((0u64, 0u64), |(f, b), l| {
                (f + l.boundary_bytes[i].1, b + l.boundary_bytes[i].2)
            });
            format!(
                "{e} {:.1} KiB forward, {:.1} KiB backward",
                f as f64 / n / 1024.0,
                b as f64 / n / 1024.0
            )
        })
        .collect();
    if !edges.is_empty() {
        say(&format!("boundary bytes per step (all ranks): {}", edges.join("; ")));
    }
    let size = |b: f64| {
        if b >= (1u64 << 30) as f64 {
            format!("{:.2} GiB", b / (1u64 << 30) as f64)
        } else if b >= 1024.0 * 1024.0 {
            format!("{:.2} MiB", b / (1024.0 * 1024.0))
        } else {
            format!("{:.1} KiB", b / 1024.0)
        }
    };
    let modules: Vec<String> = graph
        .modules
        .iter()
        .enumerate()
        .map(|(m, module)| {
            let peak =
                logs.iter().map(|l| l.report.resident[m]).fold(Default::default(), Resident::max);
            let coll = logs.iter().map(|l| l.report.collective_bytes[m]).sum::<u64>() as f64 / n;
            let host = if peak.host > 0 {
                format!(", {} on the host during the LLM phase", size(peak.host as f64))
            } else {
                String::new()
            };
            format!(
                "{} {} peak per rank{host}, {} of collectives per step",
                module.name,
                size(peak.peak as f64),
                size(coll)
            )
        })
        .collect();
    say(&format!("memory and collectives: {}", modules.join("; ")));
    let ranks = logs[0].report.rank_peaks.len();
    let per_rank: Vec<String> = (0..ranks)
        .map(|r| {
            let peak = logs.iter().map(|l| l.report.rank_peaks[r]).max().unwrap_or(0);
            format!("rank {r} {}", size(peak as f64))
        })
        .collect();
    say(&format!("peak held per rank (all its modules): {}", per_rank.join(", ")));
    if let Some(m) = memory {
        let acts = m
            .activations
            .map_or(String::new(), |a| format!(" and at least {} of activations", size(a)));
        say(&format!(
            "memory of this process (rank{} {}): {} resident at its peak; for these ranks the preflight counts {} of weights, gradients and moments{acts}",
            if m.ranks.len() == 1 { "" } else { "s" },
            hetpar_layout::plan::rank_list(&m.ranks),
            size(m.peak),
            size(m.states),
        ));
    }
    say(&format!(
        "{}: loss {:.4} -> {:.4} over {} steps, {:.0} tokens/s ({} tokens in {:.1} s of steps; {:.1} s in all, with setup, evaluations and checkpoints), {} steps skipped",
        graph.name,
        first.loss,
        last.loss,
        logs.len(),
        tokens as f64 / secs.max(1e-9),
        tokens,
        secs,
        wall,
        logs.iter().filter(|l| !l.report.applied).count()
    ));
}

/// Reports a step (rank 0 calls it).
pub type OnStep<'a> = &'a (dyn Fn(&StepLog) -> anyhow::Result<()> + Sync);

/// A checkpoint save as rank 0 reports it: when it begins, and once it is committed.
pub enum Save<'s> {
    /// Every rank starts writing the checkpoint after this many steps.
    Begins(usize),
    /// Committed after `done` steps, `seconds` after it began.
    Committed { done: usize, saved: &'s Saved, seconds: f64 },
}

/// Reports a checkpoint save (rank 0 calls it).
pub type OnSave<'a> = &'a (dyn Fn(Save<'_>) -> anyhow::Result<()> + Sync);

/// What rank 0 reports as a run goes.
#[derive(Clone, Copy)]
pub struct Hooks<'a> {
    /// After each step.
    pub on_step: OnStep<'a>,
    /// Around each checkpoint save.
    pub on_save: OnSave<'a>,
}

impl<'a> Hooks<'a> {
    /// Steps only: a run without checkpoints.
    pub fn steps(on_step: OnStep<'a>) -> Self {
        fn unheard(_: Save<'_>) -> anyhow::Result<()> {
            Ok(())
        }
        Hooks { on_step, on_save: &unheard }
    }
}

/// Reports an evaluation after the given number of steps (rank 0 calls it).
pub type OnEval<'a> = &'a (dyn Fn(usize, &EvalReport) -> anyhow::Result<()> + Sync);

/// Held-out evaluation of a run: when, and who hears of it.
#[derive(Clone, Copy)]
pub struct Evals<'a> {
    /// Every N steps besides before the first and after the last (0: those two only).
    pub every: usize,
    /// Called on rank 0.
    pub on_eval: OnEval<'a>,
}

/// Trains one rank of `graph` up to step `steps` on `data`, reporting through `hooks` on
/// rank 0; with `ckpt`, first loads its checkpoint and commits checkpoints as it asks;
/// with `evals` and held-out data, evaluates as it asks.
fn rank_run(
    c: &dyn Communicator,
    graph: &ModelGraph,
    data: &RunData,
    (dtype, steps): (DType, usize),
    hooks: Hooks<'_>,
    evals: Option<Evals<'_>>,
    ckpt: &Option<Checkpoints>,
) -> Result<Vec<StepLog>, RuntimeError> {
    let sources = data.sources(graph, c.global_rank());
    let mut trainer = Trainer::new(c, graph, dtype, steps, &sources)?;
    let mut start = 0;
    if let Some(k) = ckpt {
        trainer.set_config_text(k.config.clone());
        trainer.set_tokenizer_sha256(k.tokenizer_sha256.clone());
        trainer.set_io_timeout(k.io_timeout);
        trainer.set_machine(files_view());
        if let Some(dir) = &k.resume {
            start = trainer.resume(c, dir)?.manifest.step;
        }
    }
    // A signal during start-up after rank 0's own check (the checkpoint's load among it):
    // the ranks agree to stop before the first step, which leaves --out as it was (nothing
    // is written or moved before a step's or an evaluation's line).
    if let Some(k) = ckpt {
        let mut stop = [if k.stopping() { 1.0 } else { 0.0 }];
        c.all_reduce(&mut stop, hetpar_comm::ReduceOp::Max)?;
        if stop[0] > 0.0 {
            return Ok(Vec::new());
        }
    }
    let evals = evals.filter(|_| trainer.has_heldout());
    let evaluate = |trainer: &mut Trainer, done: usize| -> Result<(), RuntimeError> {
        let Some(e) = evals else { return Ok(()) };
        let report = trainer.evaluate(c)?;
        if c.global_rank() == 0 {
            (e.on_eval)(done, &report).map_err(|e| RuntimeError::Model(format!("{e:#}")))?;
        }
        Ok(())
    };
    let mut logs = Vec::with_capacity(steps - start);
    let mut stopped = false;
    for step in start..steps {
        if step == start || evals.is_some_and(|e| e.every > 0 && step.is_multiple_of(e.every)) {
            evaluate(&mut trainer, step)?;
        }
        let log = trainer.step(c, step)?;
        if c.global_rank() == 0 {
            (hooks.on_step)(&log).map_err(|e| RuntimeError::Model(format!("{e:#}")))?;
        }
        logs.push(log);
        trainer.within_skips()?;
        if let Some(k) = ckpt {
            let done = step + 1;
            // A signal reaches ranks at different moments: they agree after each step.
            let mut stop = [if k.stopping() { 1.0 } else { 0.0 }];
            c.all_reduce(&mut stop, hetpar_comm::ReduceOp::Max)?;
            let stop = stop[0] > 0.0;
            if stop || done == steps || (k.every > 0 && done.is_multiple_of(k.every)) {
                let lead = c.global_rank() == 0;
                let heard =
                    |r: anyhow::Result<()>| r.map_err(|e| RuntimeError::Model(format!("{e:#}")));
                if lead {
                    heard((hooks.on_save)(Save::Begins(done)))?;
                }
                let began = Instant::now();
                let saved = trainer.save(c, done, &k.root, k.keep)?;
                if lead {
                    let seconds = began.elapsed().as_secs_f64();
                    heard((hooks.on_save)(Save::Committed { done, saved: &saved, seconds }))?;
                }
            }
            if stop {
                stopped = true;
                break;
            }
        }
    }
    // After the last step, even when a signal came during it.
    if !stopped || start + logs.len() == steps {
        evaluate(&mut trainer, steps)?;
    }
    Ok(logs)
}

/// Trains `graph` with one thread per rank; rank 0's logs, or the error that started a
/// failure.
pub fn train_local(
    graph: &ModelGraph,
    dtype: DType,
    steps: usize,
    timeout: Duration,
    on_step: OnStep<'_>,
) -> anyhow::Result<Vec<StepLog>> {
    let data = crate::data_open::open(graph, &|_| {})?;
    let run = LocalRun {
        data: &data,
        hooks: Hooks::steps(on_step),
        evals: None,
        ckpt: &Checkpoints::none(),
    };
    Ok(local_ranks(graph, (dtype, steps), timeout, &run)?.swap_remove(0))
}

/// Trains with this process as one rank of an MPI job (`--backend mpi`); the logs on
/// rank 0, `None` on the others. A rank's error ends the whole job, printed.
/// `cfg` is the config `graph` came from, which every rank must have been given alike.
pub fn train_mpi(
    (cfg, graph): (&Config, &ModelGraph),
    dtype: DType,
    steps: usize,
    timeout: Duration,
) -> anyhow::Result<Option<Vec<StepLog>>> {
    let world = open_mpi(timeout, graph)?;
    let rank = world.rank();
    let data = match crate::data_open::open(graph, &|_| {}) {
        Ok(d) => d,
        Err(e) => {
            fail_job(rank, RuntimeError::Data(format!("{e:#}")))?;
            return Ok(None);
        }
    };
    let facts = run_facts(cfg, graph.train.dtype.name(), steps, &data, None)
        .map_err(|e| RuntimeError::Data(format!("{e:#}")));
    if let Err(e) = facts.and_then(|f| hetpar_runtime::agree(world.as_ref(), &f)) {
        fail_job(rank, e)?;
        return Ok(None);
    }
    let first = first_manifest(graph, &data, 0);
    if let Err(e) = fits_memory_mpi(world.as_ref(), graph, dtype, Holds::Training(first.as_ref())) {
        fail_job(rank, RuntimeError::Model(format!("{e:#}")))?;
        return Ok(None);
    }
    let logs = match rank_run(
        world.as_ref(),
        graph,
        &data,
        (dtype, steps),
        Hooks::steps(&|_| Ok(())),
        None,
        &None,
    ) {
        Ok(logs) => logs,
        Err(e) => fail_job(rank, e)?,
    };
    Ok((rank == 0).then_some(logs))
}

/// What this process was started with, which every process of an MPI job must share
/// (`hetpar_runtime::agree`): the commit hetpar was built from, every key of the resolved
/// config (after `--set`), the dtype, the steps, the data it read and the manifest of the
/// checkpoint it resumes from. Paths and `--out` may differ between hosts; what they hold
/// may not.
pub fn run_facts(
    cfg: &Config,
    dtype: &str,
    steps: usize,
    data: &RunData,
    resume: Option<&Path>,
) -> anyhow::Result<RunFacts> {
    fn flatten(key: &str, v: &toml::Value, facts: &mut RunFacts) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if key.is_empty() { k.clone() } else { format!("{key}.{k}") };
                    flatten(&key, v, facts);
                }
            }
            // Where the data lies may differ between hosts; its digests are compared.
            _ if ["data.path", "data.image_root", "data.tokenizer", "data.heldout"]
                .contains(&key) => {}
            other => facts.set(key, other),
        }
    }
    let mut facts = RunFacts::new();
    facts.set("hetpar.version", env!("CARGO_PKG_VERSION"));
    // The commit it was built from and its uncommitted edits (build.rs): a host left on an
    // older build, or with other local edits, is named.
    facts.set("hetpar.build", env!("HETPAR_BUILD"));
    let config = toml::Value::try_from(cfg).context("cannot write the resolved config")?;
    flatten("", &config, &mut facts);
    facts.set("run.dtype", dtype);
    facts.set("run.steps", steps);
    match resume {
        Some(dir) => {
            let path = dir.join(hetpar_runtime::checkpoint::MANIFEST_FILE);
            let (sha, _) = hetpar_runtime::checkpoint::sha256(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            facts.set("run.resume", format!("manifest sha256 {sha}"));
        }
        None => facts.set("run.resume", "none"),
    }
    data.facts(&mut facts)?;
    Ok(facts)
}

/// Under MPI, before anything is written: every process started alike
/// (`hetpar_runtime::agree`), the memory of the processes on each machine, and, for
/// checkpoints, every process seeing rank 0's checkpoint directory. A failure ends the
/// whole job, printed.
fn agree_mpi(
    world: &dyn Communicator,
    (cfg, graph): (&Config, &ModelGraph),
    (dtype, steps): (DType, usize),
    data: &RunData,
    (ckpt, when): (&Option<Checkpoints>, &[(&str, String)]),
) -> anyhow::Result<()> {
    let rank = world.rank();
    let resume = ckpt.as_ref().and_then(|k| k.resume.as_deref());
    let facts = run_facts(cfg, graph.train.dtype.name(), steps, data, resume)
        .map(|mut f| {
            for (k, v) in when {
                f.set(*k, v);
            }
            f
        })
        .map_err(|e| RuntimeError::Data(format!("{e:#}")));
    match facts.and_then(|f| hetpar_runtime::agree(world, &f).map(|()| f)) {
        Ok(f) if rank == 0 => say(&format!(
            "all {} processes were started alike: config, dtype, steps, data and checkpoint (sha256 {})",
            world.size(),
            &f.digest()[..16]
        )),
        Ok(_) => {}
        Err(e) => {
            fail_job(rank, e)?;
        }
    }
    let first = first_manifest(graph, data, ckpt.as_ref().map_or(0, |k| k.start));
    if let Err(e) = fits_memory_mpi(world, graph, dtype, Holds::Training(first.as_ref())) {
        fail_job(rank, RuntimeError::Model(format!("{e:#}")))?;
    }
    if let Some(k) = ckpt
        && let Err(e) = hetpar_runtime::checkpoint::check_shared(world, &k.root)
    {
        fail_job(rank, e)?;
    }
    Ok(())
}

/// Every rank's logs of a local run without checkpoints, by rank (`bench train`'s). What
/// opening the data says (a synth set generated on first use, the records read) goes to
/// stderr, away from the report.
pub fn train_local_ranks(
    graph: &ModelGraph,
    dtype: DType,
    steps: usize,
    timeout: Duration,
    on_step: OnStep<'_>,
) -> anyhow::Result<Vec<Vec<StepLog>>> {
    let data = crate::data_open::open(graph, &crate::stderr_line)?;
    let run = LocalRun {
        data: &data,
        hooks: Hooks::steps(on_step),
        evals: None,
        ckpt: &Checkpoints::none(),
    };
    local_ranks(graph, (dtype, steps), timeout, &run)
}

/// What every rank of a local run shares.
struct LocalRun<'a> {
    data: &'a RunData,
    hooks: Hooks<'a>,
    evals: Option<Evals<'a>>,
    ckpt: &'a Option<Checkpoints>,
}

/// This machine's boot id (empty where the system does not say): processes reporting the
/// same one share its memory.
pub fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The machine and mount namespace this process sees files through (empty where the system
/// does not say): processes reporting the same one see the same files at a path, where
/// containers on one machine need not. A resume checks each checkpoint file once per view.
pub fn files_view() -> String {
    let ns = std::fs::read_link("/proc/self/ns/mnt").map(|l| l.display().to_string());
    match (machine_id(), ns) {
        (boot, Ok(ns)) if !boot.is_empty() => format!("{boot} {ns}"),
        _ => String::new(),
    }
}

/// `error`, and when it is a timeout that found a rank computing (which may be slow rather
/// than stuck), how to give it longer. Boundary and stage errors wrap the communicator's,
/// so its words are what is left to go by.
pub(crate) fn with_timeout_hint(error: &str, timeout: Option<Duration>) -> String {
    if error.contains(" timed out after ")
        && error.contains("is computing (not in a communication call)")
    {
        let limit = timeout.map_or("the timeout".into(), |t| format!("{} s", t.as_secs_f64()));
        format!("{error}; if that rank's work takes longer than {limit}, raise --timeout")
    } else {
        error.to_string()
    }
}

/// Every rank's logs of a local run, by rank.
fn local_ranks(
    graph: &ModelGraph,
    (dtype, steps): (DType, usize),
    timeout: Duration,
    run: &LocalRun<'_>,
) -> anyhow::Result<Vec<Vec<StepLog>>> {
    let first = first_manifest(graph, run.data, run.ckpt.as_ref().map_or(0, |k| k.start));
    let holds = Holds::Training(first.as_ref());
    fits_memory(graph, dtype, &(0..graph.world).collect::<Vec<_>>(), holds)?;
    let opts = hetpar_comm::LocalOptions { timeout };
    // Ranks computing when another fails notice at their next call; a rank still running
    // past the timeout (and at least 10 s: a short timeout is no bound on compute) is
    // stuck.
    let grace = timeout.max(Duration::from_secs(10));
    let results = hetpar_comm::launch_watched(
        graph.world,
        opts,
        grace,
        |c| {
            hetpar_nn::kernels::share_threads(graph.world);
            rank_run(c, graph, run.data, (dtype, steps), run.hooks, run.evals, run.ckpt)
        },
        abandon_stuck(timeout, grace),
    )?;
    every_rank_or_cause(results, timeout)
}

/// Every rank's result of a local run, by rank, or where any failed the error that started
/// the failure ([`first_cause`]: a rank's own, not the others' reports of it).
pub(crate) fn every_rank_or_cause<T>(
    results: Vec<Result<T, RuntimeError>>,
    timeout: Duration,
) -> anyhow::Result<Vec<T>> {
    let (mut ok, mut errors) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(v) => ok.push(v),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        bail!("{}", with_timeout_hint(&first_cause(errors).to_string(), Some(timeout)));
    }
    Ok(ok)
}

#[cfg(feature = "mpi")]
pub(crate) fn open_mpi(
    timeout: Duration,
    graph: &ModelGraph,
) -> anyhow::Result<Box<dyn Communicator>> {
    use hetpar_comm::mpi::{MpiOptions, abort_on_panic, init};
    // The ranks mpirun started on this host share its cores.
    crate::threads::share_host();
    let on_fatal = move |e: &hetpar_comm::CommError| {
        let line = with_timeout_hint(&e.to_string(), Some(timeout));
        crate::stderr_line(&format!("error: {line}"));
    };
    let opts = MpiOptions { timeout, on_fatal: Box::new(on_fatal) };
    let world = init(opts)?;
    #[allow(clippy::print_stderr)]
    abort_on_panic(world.rank(), |l| eprint!("{l}"));
    if world.size() != graph.world {
        bail!("the config places ranks 0..{}, mpirun started {}", graph.world, world.size());
    }
    Ok(Box::new(world))
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn open_mpi(_: Duration, _: &ModelGraph) -> anyhow::Result<Box<dyn Communicator>> {
    bail!(
        "this hetpar was built without MPI: rebuild with `cargo build --release --features mpi` and run under mpirun"
    )
}

/// A rank's error under MPI: printed, and the whole job ends at once.
#[cfg(feature = "mpi")]
pub(crate) fn fail_job(rank: usize, e: RuntimeError) -> anyhow::Result<Vec<StepLog>> {
    crate::stderr_line(&format!("error: rank {rank}: {}", with_timeout_hint(&e.to_string(), None)));
    hetpar_comm::mpi::abort_job(1)
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn fail_job(rank: usize, e: RuntimeError) -> anyhow::Result<Vec<StepLog>> {
    Err(anyhow::anyhow!("rank {rank}: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A module's `trainable` and `lr` compare by what they do: `trainable = true` and an
    /// `lr` equal to `train.lr` are no change from leaving them unset, and an unset one is
    /// shown as its value.
    #[test]
    fn unset_trainable_and_lr_compare_as_their_defaults() {
        let cfg = |module: &str| -> toml::Value {
            toml::from_str(&format!(
                "[train]\nlr = 0.001\n[modules.vision]\nkind = \"vit\"\n{module}"
            ))
            .unwrap()
        };
        let changes = |a: &str, b: &str| value_changes(&cfg(a), &cfg(b), &[]);
        assert!(changes("", "trainable = true\nlr = 0.001").is_empty());
        let shown = |k: &str, a: &str, b: &str| vec![(k.to_string(), a.to_string(), b.to_string())];
        assert_eq!(
            changes("trainable = false", ""),
            shown("modules.vision.trainable", "false", "true")
        );
        assert_eq!(
            changes("lr = 0.0001", "lr = 0.001"),
            shown("modules.vision.lr", "0.0001", "train.lr")
        );
        // An earlier build's config wrote the data keys another source reads at their
        // defaults; one without them is the same config.
        let data = |d: &str| -> toml::Value { toml::from_str(&format!("[data]\n{d}")).unwrap() };
        let old = data("source = \"synthetic\"\nsamples = 1000\nmax_items = 1");
        assert!(value_changes(&old, &data("source = \"synthetic\""), &[]).is_empty());
        assert_eq!(
            value_changes(&old, &data("source = \"synthetic\"\nmax_items = 2"), &[]),
            shown("data.max_items", "1", "2")
        );
    }

    /// A linked checkpoints/ is not renamed; a move that fails part way puts back what it
    /// moved; `/proc` is on another filesystem than `/` on every Linux system.
    #[test]
    fn a_linked_checkpoints_directory_is_not_moved_and_a_failed_move_is_undone() {
        let dir = std::env::temp_dir().join(format!("hetpar-not-a-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("real")).unwrap();
        let link = dir.join("checkpoints");
        std::os::unix::fs::symlink(dir.join("real"), &link).unwrap();
        let e = not_a_link(&link).unwrap_err().to_string();
        assert!(e.contains("checkpoints is a link and holds") && e.contains("links to"), "{e}");
        assert!(not_a_link(&dir.join("real")).is_ok());
        assert!(same_filesystem(&dir, &link) && same_filesystem(Path::new(""), Path::new(".")));
        assert!(!same_filesystem(Path::new("/proc"), Path::new("/")));
        std::fs::create_dir(dir.join("to")).unwrap();
        std::fs::write(dir.join("a"), "a").unwrap();
        std::fs::write(dir.join("b"), "b").unwrap();
        let moves = [(dir.join("a"), dir.join("to/a")), (dir.join("b"), dir.join("missing/b"))];
        let e = format!("{:#}", move_all(&moves, "advice").unwrap_err());
        assert!(e.contains("/b to ") && e.contains("(nothing was moved; a mount point"), "{e}");
        assert!(e.contains("cannot be renamed): advice: "), "{e}");
        assert!(dir.join("a").exists() && !dir.join("to/a").exists() && dir.join("b").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn run_facts_compare_what_the_data_paths_hold_not_the_paths() {
        let facts = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| (*s).to_string()).collect();
            let (cfg, _) = load(None, &sets).unwrap();
            run_facts(&cfg, "f32", 3, &RunData::Synthetic, None).unwrap()
        };
        let llava = "data.source=\"llava\"";
        let here = facts(&[llava, "data.path=\"/a/train.json\"", "data.image_root=\"/a\""]);
        let there = facts(&[llava, "data.path=\"/b/train.json\"", "data.image_root=\"/b\""]);
        assert_eq!(here, there);
        assert!(here.text().contains("train.lr = 0.001\n"), "{}", here.text());
        assert_ne!(here, facts(&["train.lr=1e-2"]));
    }
}
