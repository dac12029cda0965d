//! `hetpar check CONFIG`: parity. Trains CONFIG and a reference (by default the same model,
//! data and initialization on one rank; `--reference CONFIG2` for another) step by step
//! through the same executor, prints both losses and gradient norms with their relative
//! differences, and fails past the tolerance (f32 1e-5, f64 1e-10, bf16 2^-8, or `--tol`).

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, bail};
use hetpar_layout::config::{Dtype, ParallelConfig, StrategyName};
use hetpar_layout::{Config, ModelGraph};
use indicatif::{ProgressBar, ProgressStyle};

use crate::say;
use crate::train_cmd::{dtype, load, precision, timeout, train_local, train_mpi};

#[derive(clap::Args)]
pub struct Args {
    /// Config file (TOML).
    pub config: PathBuf,
    /// The reference config (default: CONFIG with every module on rank 0 alone).
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// Steps to compare.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Element type: f32, f64 or bf16 (bf16 products, f32 weights). Default f32, whatever
    /// the config trains in: parity judges a layout at f32's tolerance.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Relative tolerance (default: 1e-5 in f32, 1e-10 in f64, 2^-8 for bf16 products).
    #[arg(long, allow_negative_numbers = true)]
    pub tol: Option<f64>,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Seconds a rank waits in a communication call before the run fails naming it and what
    /// the ranks it waited for were doing (in which call, or computing: raise it for steps
    /// whose work takes longer). On the local backend, a rank still computing this long
    /// after another failed, and at least 10 s, is named and left behind as the process
    /// exits.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// `local` (one thread per rank) or `mpi` (CONFIG with one process per rank under
    /// mpirun, build with --features mpi; rank 0 runs the reference and reports).
    #[arg(long, default_value = "local")]
    pub backend: String,
    /// Override a config value before validation (repeatable): a dotted key and a TOML
    /// value (applied to CONFIG and the reference), e.g. `--set train.lr=1e-4 --set modules.llm.parallel.tp=2`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// `cfg` with every module on rank 0 alone: no tp, cp, pp, ep or SP, no offload or
/// recomputation, the default boundary strategy.
pub fn one_rank(cfg: &Config) -> Config {
    let mut r = cfg.clone();
    for m in r.modules.values_mut() {
        m.parallel = ParallelConfig {
            ranks: [0, 1],
            tp: 1,
            cp: 1,
            pp: 1,
            ep: 1,
            etp: None,
            sp: false,
            vpp: 1,
            offload: false,
            recompute: false,
        };
    }
    for e in &mut r.edges {
        e.strategy = StrategyName::Auto;
        e.stripes = 1;
    }
    r
}

/// `hetpar check --dtype bf16`'s default tolerance: bf16's unit roundoff, 2^-8.
const BF16_TOL: f64 = 1.0 / 256.0;

/// Keys a reference may set apart from the config it checks: its name, and what the check
/// itself decides or what does not change a step's numbers beyond rounding (the
/// microbatching of a step, what a non-finite step does).
const REFERENCE_MAY_DIFFER: [&str; 6] = [
    "name",
    "train.steps",
    "train.dtype",
    "train.microbatches",
    "train.on_nonfinite",
    "train.max_skips",
];

/// Refuses a reference that trains another model, on other data or with other settings
/// than `cfg` (layouts aside): its losses could not match, and a failed check would read as
/// a layout bug.
fn same_training(cfg: &Config, reference: &Config, path: &std::path::Path) -> anyhow::Result<()> {
    let value =
        |c: &Config| toml::Value::try_from(one_rank(c)).context("the config does not serialize");
    let (here, there) = (value(cfg)?, value(reference)?);
    let differ = crate::train_cmd::value_changes(&here, &there, &REFERENCE_MAY_DIFFER);
    if differ.is_empty() {
        return Ok(());
    }
    // A module or edge on one side only is named once, not by each of its keys.
    let mut said: Vec<String> = Vec::new();
    for (k, a, b) in &differ {
        let parts: Vec<&str> = k.split('.').collect();
        let whole = (1..parts.len()).find_map(|n| {
            let root = &parts[..n];
            match (lookup(&here, root).is_some(), lookup(&there, root).is_some()) {
                (true, false) => Some(format!("{} only here", root.join("."))),
                (false, true) => Some(format!("{} only in the reference", root.join("."))),
                _ => None,
            }
        });
        let line = whole.unwrap_or_else(|| format!("{k} {a} here, {b} in the reference"));
        if !said.contains(&line) {
            said.push(line);
        }
    }
    const SHOWN: usize = 8;
    let more = said.len().saturating_sub(SHOWN);
    said.truncate(SHOWN);
    if more > 0 {
        said.push(format!("and {more} more"));
    }
    bail!(
        "--reference {}: it must train the same model on the same data with the same settings, in another layout; it differs in {}",
        path.display(),
        said.join("; ")
    )
}

/// The value at `path` (table keys, or indices into arrays) under `v`.
fn lookup<'v>(v: &'v toml::Value, path: &[&str]) -> Option<&'v toml::Value> {
    path.iter().try_fold(v, |v, p| match v {
        toml::Value::Table(t) => t.get(*p),
        toml::Value::Array(a) => a.get(p.parse::<usize>().ok()?),
        _ => None,
    })
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let (cfg, mut graph) = load(Some(&a.config), &a.set)?;
    let mut reference: ModelGraph = match &a.reference {
        Some(p) => {
            let (ref_cfg, ref_graph) = load(Some(p), &a.set)?;
            same_training(&cfg, &ref_cfg, p)?;
            ref_graph
        }
        None => ModelGraph::from_config(&one_rank(&cfg))
            .context("the one-rank reference of this config does not validate")?,
    };
    let trains_in = graph.train.dtype.name();
    let dt = dtype(Some(a.dtype.as_deref().unwrap_or("f32")), &mut graph)?;
    // The reference multiplies as the run does.
    reference.train.dtype = graph.train.dtype;
    crate::steps_flag("--steps", a.steps)?;
    if a.steps == 0 {
        bail!("--steps 0: nothing to compare");
    }
    // The contract's tolerances (f32 1e-5, f64 1e-10) judge a layout. bf16 products round
    // their operands, and a layout's f32 sums move an operand across a rounding boundary now
    // and then, which moves that product by up to twice bf16's unit roundoff (2^-8
    // relative): the default bf16 tolerance is that roundoff. It would let a layout bug
    // of that size through, so a layout is judged correct in f32.
    let tol = a.tol.unwrap_or(match graph.train.dtype {
        Dtype::F64 => 1e-10,
        Dtype::Bf16 => BF16_TOL,
        Dtype::F32 => 1e-5,
    });
    let timeout = timeout(a.timeout)?;
    if !(tol.is_finite() && tol >= 0.0) {
        bail!("--tol {tol}: use a non-negative number");
    }
    // On a terminal, a bar over both runs' steps (the run's, then the reference's).
    let bar = (a.backend == "local" && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::new(2 * a.steps as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
                .expect("a valid template"),
        );
        b
    });
    let phase = |msg: String| bar.iter().for_each(|b| b.set_message(msg.clone()));
    let tick = |_: &hetpar_runtime::StepLog| {
        bar.iter().for_each(|b| b.inc(1));
        Ok(())
    };
    let what = || format!("{} on {} ranks", graph.name, graph.world);
    let got = match a.backend.as_str() {
        "local" => {
            crate::threads::size_candle_pool(graph.world);
            phase(format!("{} on {} ranks", graph.name, graph.world));
            train_local(&graph, dt, a.steps, timeout, &tick).with_context(what)?
        }
        "mpi" => match train_mpi((&cfg, &graph), dt, a.steps, timeout).with_context(what)? {
            Some(logs) => logs,
            // Ranks other than 0 are done: rank 0 compares and reports.
            None => return Ok(()),
        },
        other => bail!("{}", crate::unknown_backend(other)),
    };
    // Rank 0 alone gets here under MPI.
    if a.dtype.is_none() && trains_in != "f32" {
        note(&format!(
            "note: {} trains in {trains_in}; check compares in f32 (--dtype {trains_in} to compare that)",
            a.config.display(),
        ));
    }
    let n = reference.world;
    phase(format!("the reference on {n} rank{}", if n == 1 { "" } else { "s" }));
    let want = train_local(&reference, dt, a.steps, timeout, &tick)
        .with_context(|| format!("the reference on {} ranks", reference.world))?;
    bar.iter().for_each(ProgressBar::finish_and_clear);
    let rows: Vec<(usize, f64, f64, f64, f64)> = got
        .iter()
        .zip(&want)
        .map(|(g, w)| {
            (g.step, g.report.loss, w.report.loss, g.report.grad_norm, w.report.grad_norm)
        })
        .collect();
    let max_loss = rows.iter().map(|r| rel(r.1, r.2)).fold(0.0, f64::max);
    let max_norm = rows.iter().map(|r| rel(r.3, r.4)).fold(0.0, f64::max);
    let applied = got.iter().zip(&want).all(|(g, w)| g.report.applied == w.report.applied);
    let pass = max_loss <= tol && max_norm <= tol && applied;
    if a.json {
        let steps: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"step": r.0, "loss": r.1, "ref_loss": r.2, "grad_norm": r.3, "ref_grad_norm": r.4})
            })
            .collect();
        let out = serde_json::json!({
            "config": graph.name,
            "ranks": graph.world,
            "reference_ranks": reference.world,
            "dtype": graph.train.dtype.name(),
            "tol": tol,
            "steps": steps,
            "max_loss_rel_diff": max_loss,
            "max_grad_norm_rel_diff": max_norm,
            "pass": pass,
        });
        say(&out.to_string());
    } else {
        say(&format!(
            "{} on {} ranks against the reference on {} ({}, tolerance {tol:e})",
            graph.name,
            graph.world,
            reference.world,
            precision(dt, &graph)
        ));
        say("step        loss    ref loss   rel diff   grad norm    ref norm   rel diff");
        for r in &rows {
            say(&format!(
                "{:>4}  {:>10.6}  {:>10.6}  {:>9.2e}  {:>10.6}  {:>10.6}  {:>9.2e}",
                r.0,
                r.1,
                r.2,
                rel(r.1, r.2),
                r.3,
                r.4,
                rel(r.3, r.4)
            ));
        }
        say(&format!(
            "{}: largest relative difference {max_loss:.2e} in loss, {max_norm:.2e} in gradient norm",
            if pass { "pass" } else { "FAIL" }
        ));
    }
    if !applied {
        bail!("parity fails: the runs skipped different steps for non-finite gradients");
    }
    if !pass {
        if let Some(hint) = growth_hint(&rows, tol, graph.train.dtype, (&a.config, a.steps)) {
            note(&hint);
        }
        let over: Vec<String> = [(max_loss, "loss"), (max_norm, "gradient norm")]
            .iter()
            .filter(|(d, _)| d.is_nan() || *d > tol)
            .map(|(d, what)| format!("{d:.2e} in {what}"))
            .collect();
        bail!("parity fails: the relative difference {} exceeds {tol:e}", over.join(" and "));
    }
    Ok(())
}

/// The relative difference of `x` from the reference's `y`; a NaN or infinity on either
/// side is no match (a skipped step reports a NaN norm).
fn rel(x: f64, y: f64) -> f64 {
    match (x.is_finite() && y.is_finite(), x == y) {
        (false, _) => f64::INFINITY,
        (true, true) => 0.0,
        (true, false) => (x - y).abs() / y.abs(),
    }
}

/// Where an f32 check agrees at its first step and fails later, a note that training
/// amplifies rounding step by step (a step whose gradient norm jumps is sensitive to its
/// parameters' last bits), and how to tell that from a layout bug: in f64 rounding is some
/// nine digits smaller, and a layout bug fails as before.
fn growth_hint(
    rows: &[(usize, f64, f64, f64, f64)],
    tol: f64,
    dtype: Dtype,
    (config, steps): (&std::path::Path, usize),
) -> Option<String> {
    let off = |r: &(usize, f64, f64, f64, f64)| rel(r.1, r.2).max(rel(r.3, r.4));
    let first = rows.iter().position(|r| off(r) > tol)?;
    if dtype != Dtype::F32 || first == 0 {
        return None;
    }
    let (before, at) = (&rows[first - 1], &rows[first]);
    let jump = if at.4 > 2.0 * before.4 {
        format!(", where the reference's gradient norm jumps {:.1}x", at.4 / before.4)
    } else {
        String::new()
    };
    Some(format!(
        "note: the first {first} step{} agree within {tol:e} and step {} does not{jump}. Training amplifies f32 rounding from step to step, so a layout that computes each step right can drift past the tolerance over many steps; `hetpar check {} --dtype f64 --steps {steps}` tells the two apart: f64 rounds some nine digits finer and such drift stays within its 1e-10, where a layout bug fails as in f32",
        if first == 1 { "" } else { "s" },
        at.0,
        config.display(),
    ))
}

/// A line on stderr, kept out of the table and the JSON.
fn note(line: &str) {
    crate::stderr_line(line);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_after_agreeing_steps_is_named_with_the_f64_check_to_run() {
        let row = |step, norm: f64, off: f64| (step, 5.0, 5.0, norm * (1.0 + off), norm);
        let drift = [row(0, 3.0, 1e-8), row(1, 2.9, 2e-7), row(2, 11.0, 6e-5), row(3, 2.8, 3e-6)];
        let cfg = std::path::Path::new("examples/demo.toml");
        let hint = growth_hint(&drift, 1e-5, Dtype::F32, (cfg, 4)).expect("a hint");
        assert!(
            hint.starts_with(
                "note: the first 2 steps agree within 1e-5 and step 2 does not, where the reference's gradient norm jumps 3.8x."
            ),
            "{hint}"
        );
        assert!(hint.contains("`hetpar check examples/demo.toml --dtype f64 --steps 4`"), "{hint}");
        // A first step past the tolerance is no drift; f64 and bf16 have their own reasons.
        let wrong = [row(0, 3.0, 1e-3), row(1, 2.9, 1e-3)];
        assert_eq!(growth_hint(&wrong, 1e-5, Dtype::F32, (cfg, 2)), None);
        assert_eq!(growth_hint(&drift, 1e-10, Dtype::F64, (cfg, 4)), None);
        assert_eq!(growth_hint(&drift, 1.0 / 256.0, Dtype::Bf16, (cfg, 4)), None);
    }
}
