//! `hetpar bench train CONFIG`: a training step measured per rank by kind of action, each
//! rank's measured idle fraction next to the one the schedule predicts when simulated with
//! the measured compute durations; `hetpar bench executor`: the executor's own cost
//! against a plain loop over the same stage; and `hetpar bench plans`: what a step's
//! boundary plans cost every rank at once and one rank alone.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::bail;
use hetpar_runtime::StepLog;
use hetpar_schedule::{Action, Durations, MsgId, Options, PipelineGraph, Schedule, simulate};

use crate::say;
use crate::train_cmd::{dtype, load, timeout, train_local_ranks};

/// Arguments of `hetpar bench train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The config (default: the built-in demo).
    pub config: Option<PathBuf>,
    /// Timed steps (after the warm-up ones).
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// f32, f64 or bf16 (bf16 products, f32 weights; default: the config's).
    #[arg(long)]
    pub dtype: Option<String>,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Override a config value before validation (repeatable): a dotted key and a TOML
    /// value, e.g. `--set train.microbatches=4`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// Kinds of action in the order the table shows them.
const KINDS: [&str; 7] =
    ["forward", "backward", "pipeline", "boundary", "reduce", "optimizer", "offload"];

/// Kinds that are a rank's own work; the rest (messages, transforms, reductions) include
/// waiting for others.
fn is_work(kind: &str) -> bool {
    matches!(kind, "forward" | "backward" | "optimizer" | "offload")
}

/// What the executor timed per action, averaged over the timed steps: compute, step,
/// offload and reload take their measured time; communication takes none (its cost in the
/// measurement is mostly waiting, which is what the simulation derives).
struct Measured {
    seconds: HashMap<(usize, Action), f64>,
}

impl Durations for Measured {
    fn action(&self, rank: usize, action: &Action) -> f64 {
        self.seconds.get(&(rank, action.clone())).copied().unwrap_or(0.0)
    }

    fn message(&self, _msg: &MsgId) -> f64 {
        0.0
    }
}

fn own_work(a: &Action) -> bool {
    matches!(a, Action::Compute(_) | Action::Step(_) | Action::Offload(_) | Action::Reload(_))
}

pub fn run_train(a: &TrainArgs) -> anyhow::Result<()> {
    let (_, mut graph) = load(a.config.as_ref(), &a.set)?;
    let dtype = dtype(a.dtype.as_deref(), &mut graph)?;
    crate::steps_flag("--steps", a.steps)?;
    crate::steps_flag("--warmup", a.warmup)?;
    if a.steps == 0 {
        bail!("--steps 0: nothing to measure");
    }
    let total = a.warmup + a.steps;
    let mut g = graph.clone();
    g.train.steps = total;
    if g.train.warmup > total {
        g.train.warmup = total;
    }
    crate::threads::size_candle_pool(g.world);
    let ranks = train_local_ranks(&g, dtype, total, timeout(600.0)?, &|_| Ok(()))?;
    let timed: Vec<&[StepLog]> = ranks.iter().map(|l| &l[a.warmup..]).collect();
    let n = a.steps as f64;
    let schedule = Schedule::build(&PipelineGraph::from_model(&g), Options::default())
        .map_err(|e| anyhow::anyhow!("schedule: {e}"))?;
    // Per rank: mean step time and seconds per kind.
    let step_s: Vec<f64> =
        timed.iter().map(|l| l.iter().map(|s| s.seconds).sum::<f64>() / n).collect();
    let makespan = step_s.iter().copied().fold(0.0, f64::max);
    let mut seconds = HashMap::new();
    let mut rows = Vec::new();
    for (rank, logs) in timed.iter().enumerate() {
        let mut kinds: BTreeMap<&str, f64> = BTreeMap::new();
        for l in logs.iter() {
            for (k, v) in &l.report.seconds {
                *kinds.entry(k).or_default() += v / n;
            }
            for (act, d) in l.report.executed.iter().zip(&l.report.durations) {
                if own_work(act) {
                    *seconds.entry((rank, act.clone())).or_insert(0.0) += d / n;
                }
            }
        }
        let work: f64 = kinds.iter().filter(|(k, _)| is_work(k)).map(|(_, v)| v).sum();
        let modules: Vec<&str> = g
            .modules
            .iter()
            .filter(|m| m.layout.span().contains(rank))
            .map(|m| m.name.as_str())
            .collect();
        rows.push((rank, modules.join(","), step_s[rank], kinds, 1.0 - work / makespan));
    }
    let timeline = simulate(&schedule, &Measured { seconds })
        .map_err(|e| anyhow::anyhow!("simulating the schedule: {e}"))?;
    let predicted = |r: usize| {
        if timeline.makespan > 0.0 { 1.0 - timeline.busy(r) / timeline.makespan } else { 0.0 }
    };
    let measured_bubble = rows.iter().map(|r| r.4).sum::<f64>() / rows.len() as f64;
    if a.json {
        let ranks: Vec<serde_json::Value> = rows
            .iter()
            .map(|(rank, modules, step, kinds, idle)| {
                serde_json::json!({
                    "rank": rank, "modules": modules, "step_s": step, "seconds": kinds,
                    "idle": idle, "predicted_idle": predicted(*rank),
                })
            })
            .collect();
        let out = serde_json::json!({
            "config": g.name, "ranks": ranks, "step_s": makespan,
            "bubble": measured_bubble, "predicted_bubble": timeline.bubble_fraction(),
            "predicted_step_s": timeline.makespan, "timed_steps": a.steps,
        });
        say(&out.to_string());
        return Ok(());
    }
    let threads = hetpar_nn::kernels::share_of(g.world);
    say(&format!(
        "{}: {} ranks on the local backend ({}, {} timed step{} after {} warm-up; threads per rank: {threads}; {} cores)",
        g.name,
        g.world,
        crate::train_cmd::precision(dtype, &g),
        a.steps,
        if a.steps == 1 { "" } else { "s" },
        a.warmup,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    ));
    let mut header = format!("{:>4}  {:<14} {:>8}", "rank", "modules", "step ms");
    for k in KINDS {
        header.push_str(&format!(" {k:>9}"));
    }
    header.push_str(&format!(" {:>6} {:>10}", "idle", "predicted"));
    say(&header);
    for (rank, modules, step, kinds, idle) in &rows {
        let mut line = format!("{rank:>4}  {modules:<14} {:>8.1}", step * 1e3);
        for k in KINDS {
            line.push_str(&format!(" {:>9.1}", kinds.get(k).copied().unwrap_or(0.0) * 1e3));
        }
        line.push_str(&format!(" {:>5.1}% {:>9.1}%", idle * 100.0, predicted(*rank) * 100.0));
        say(&line);
    }
    say(&format!(
        "step {:.1} ms measured, {:.1} ms simulated from the measured compute; bubble (idle over all ranks) {:.1}% measured, {:.1}% predicted by the {} schedule",
        makespan * 1e3,
        timeline.makespan * 1e3,
        measured_bubble * 100.0,
        timeline.bubble_fraction() * 100.0,
        schedule.kind.name()
    ));
    say(
        "(times per kind are ms per step; idle is the step minus the rank's own compute, optimizer and offload; more ranks than cores inflate both)",
    );
    Ok(())
}

/// Arguments of `hetpar bench executor`.
#[derive(clap::Args)]
pub struct ExecutorArgs {
    /// Steps each way (the first is a warm-up; the fastest of the rest counts).
    #[arg(long, default_value_t = 9)]
    pub steps: usize,
    /// f32, f64 or bf16 (bf16 products, f32 weights).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

/// The benchmark's model: one Llama on one rank, four microbatches.
const EXECUTOR_MODEL: &str = r#"
name = "executor-overhead"
[train]
seed = 3
global_batch = 8
microbatches = 4
seq_len = 128
lr = 1e-3
[modules.llm]
kind = "llama"
vocab = 2048
hidden = 256
layers = 4
heads = 4
kv_heads = 2
ffn = 688
[modules.llm.parallel]
ranks = [0, 1]
"#;

pub fn run_executor(a: &ExecutorArgs) -> anyhow::Result<()> {
    let cfg = hetpar_layout::Config::from_toml(EXECUTOR_MODEL)?;
    let mut graph = hetpar_layout::ModelGraph::from_config(&cfg)?;
    let dtype = dtype(Some(&a.dtype), &mut graph)?;
    if a.steps < 2 {
        bail!("--steps {}: the executor benchmark needs a warm-up step and a timed one", a.steps);
    }
    let o = hetpar_runtime::bench::executor_overhead(&graph, dtype, a.steps)?;
    if !o.identical {
        bail!(
            "the executor and the plain loop computed different losses or norms: a bug, not a timing"
        );
    }
    let threads = hetpar_nn::kernels::share_of(1);
    say(&format!(
        "one Llama (hidden 256, 4 layers, seq 128, 4 microbatches of 2) on one rank, {}, threads: {threads}; fastest of {} steps each",
        crate::train_cmd::precision(dtype, &graph),
        a.steps - 1
    ));
    say(&format!(
        "executor {:.1} ms, plain loop {:.1} ms per step: the executor {} (losses and norms bitwise equal)",
        o.executor_s * 1e3,
        o.plain_s * 1e3,
        match o.fraction() {
            f if f >= 0.0 => format!("adds {:.1}%", f * 100.0),
            f => format!(
                "takes {:.1}% less: timing noise, since it runs the loop's arithmetic and its own bookkeeping",
                -f * 100.0
            ),
        }
    ));
    Ok(())
}

/// Arguments of `hetpar bench plans`.
#[derive(clap::Args)]
pub struct PlansArgs {
    /// The config (default: the built-in demo).
    pub config: Option<PathBuf>,
    /// Steps whose synthetic manifests are planned (row counts vary per step).
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Ranks whose own share is timed (comma-separated; default: every rank up to 16, else
    /// 16 spread over the world, the last included).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Vec<usize>,
    /// Time only the ranks' shares, without every rank's plans to compare them with (those
    /// of tens of thousands of ranks outgrow a machine's memory; a share stays near its
    /// rank's rows).
    #[arg(long)]
    pub shares_only: bool,
    /// Override a config value before validation (repeatable): a dotted key and a TOML
    /// value, e.g. `--set train.global_batch=64`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// Ranks `bench plans` times by default: all up to 16, else 16 spread evenly with the last.
fn spread_ranks(world: usize) -> Vec<usize> {
    const MOST: usize = 16;
    if world <= MOST {
        return (0..world).collect();
    }
    let mut ranks: Vec<usize> = (0..MOST - 1).map(|i| i * world / (MOST - 1)).collect();
    ranks.push(world - 1);
    ranks
}

pub fn run_plans(a: &PlansArgs) -> anyhow::Result<()> {
    let (_, graph) = load(a.config.as_ref(), &a.set)?;
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let ranks = if a.ranks.is_empty() { spread_ranks(graph.world) } else { a.ranks.clone() };
    if let Some(r) = ranks.iter().find(|&&r| r >= graph.world) {
        bail!("--ranks: rank {r} is outside the config's world of {} ranks", graph.world);
    }
    // A rank named twice is timed once (its share is the same).
    let ranks: Vec<usize> = ranks
        .iter()
        .enumerate()
        .filter(|(i, r)| !ranks[..*i].contains(r))
        .map(|(_, &r)| r)
        .collect();
    let strategies: Vec<String> = graph
        .edges
        .iter()
        .map(|e| {
            let (s, d) = (&graph.modules[e.src].name, &graph.modules[e.dst].name);
            format!("{s} -> {d} {}", e.strategy)
        })
        .collect();
    say(&format!(
        "boundary plans of {} ({} ranks; {}), synthetic steps 0-{}; one rank's share timed on {}",
        graph.name,
        graph.world,
        if strategies.is_empty() { "no edges".into() } else { strategies.join(", ") },
        a.steps - 1,
        crate::layout_cmd::plural(ranks.len(), "rank")
    ));
    say("step        rows   every rank's (ms)   one rank's share (ms: fastest / median / slowest)");
    let costs = hetpar_runtime::bench::plans_cost(&graph, 0..a.steps, &ranks, !a.shares_only)?;
    for c in &costs {
        let mut t: Vec<f64> = c.ranks.iter().map(|&(_, s)| s * 1e3).collect();
        t.sort_by(f64::total_cmp);
        let (lo, mid, hi) = (t[0], t[t.len() / 2], t[t.len() - 1]);
        let whole = c.whole_s.map_or_else(|| "-".to_string(), |s| format!("{:.3}", s * 1e3));
        say(&format!("{:>4} {:>11} {whole:>19}   {lo:.3} / {mid:.3} / {hi:.3}", c.step, c.rows));
    }
    if a.shares_only {
        say("every rank's plans not built (--shares-only): the shares were not compared with them");
    } else {
        say(&format!(
            "each rank's share is its part of every rank's plans, op for op ({} ranks x {} steps)",
            ranks.len(),
            a.steps
        ));
    }
    Ok(())
}
