//! `hetpar check CONFIG`: parity. Trains CONFIG and a reference (by default the same model,
//! data and initialization on one rank; `--reference CONFIG2` for another) step by step
//! through the same executor, prints both losses and gradient norms with their relative
//! differences, and fails past the tolerance (f32 1e-5, f64 1e-10, bf16 2^-8, or `--tol`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use hetpar_layout::config::{Dtype, ParallelConfig, StrategyName};
use hetpar_layout::{Config, ModelGraph};

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
    #[arg(long)]
    pub tol: Option<f64>,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Seconds a rank waits in a communication call before the run fails naming it and what
    /// the ranks it waited for were doing (in which call, or computing: raise it for steps
    /// whose work takes longer).
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

pub fn run(a: &Args) -> anyhow::Result<()> {
    let (cfg, mut graph) = load(Some(&a.config), &a.set)?;
    let mut reference: ModelGraph = match &a.reference {
        Some(p) => load(Some(p), &a.set)?.1,
        None => ModelGraph::from_config(&one_rank(&cfg))
            .context("the one-rank reference of this config does not validate")?,
    };
    let trains_in = graph.train.dtype.name();
    let dt = dtype(Some(a.dtype.as_deref().unwrap_or("f32")), &mut graph)?;
    // The reference multiplies as the run does.
    reference.train.dtype = graph.train.dtype;
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
    let quiet = |_: &hetpar_runtime::StepLog| Ok(());
    let what = || format!("{} on {} ranks", graph.name, graph.world);
    let got = match a.backend.as_str() {
        "local" => {
            crate::threads::size_candle_pool(graph.world);
            train_local(&graph, dt, a.steps, timeout, &quiet).with_context(what)?
        }
        "mpi" => match train_mpi((&cfg, &graph), dt, a.steps, timeout).with_context(what)? {
            Some(logs) => logs,
            // Ranks other than 0 are done: rank 0 compares and reports.
            None => return Ok(()),
        },
        other => bail!("--backend {other:?}: use local or mpi"),
    };
    // Rank 0 alone gets here under MPI.
    if a.dtype.is_none() && trains_in != "f32" {
        note(&format!(
            "note: {} trains in {trains_in}; check compares in f32 (--dtype {trains_in} to compare that)",
            a.config.display(),
        ));
    }
    let want = train_local(&reference, dt, a.steps, timeout, &quiet)
        .with_context(|| format!("the reference on {} ranks", reference.world))?;
    // A NaN or infinity on either side is no match (a skipped step reports a NaN norm).
    let rel = |x: f64, y: f64| match (x.is_finite() && y.is_finite(), x == y) {
        (false, _) => f64::INFINITY,
        (true, true) => 0.0,
        (true, false) => (x - y).abs() / y.abs(),
    };
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
        bail!(
            "parity fails: relative differences {max_loss:.2e} (loss) and {max_norm:.2e} (gradient norm) exceed {tol:e}"
        );
    }
    Ok(())
}

fn say(line: &str) {
    #[allow(clippy::print_stdout)]
    {
        println!("{line}");
    }
}

/// A line on stderr, kept out of the table and the JSON.
#[allow(clippy::print_stderr)]
fn note(line: &str) {
    eprintln!("{line}");
}
