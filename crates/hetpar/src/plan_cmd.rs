//! `hetpar plan WORKLOAD` (best homogeneous, colocated and non-colocated layouts, and why)
//! and `hetpar calibrate` (this machine as a hardware spec for `--hardware local`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hetpar_data::files::read_capped_text;
use hetpar_plan::explain::{explain, layouts};
use hetpar_plan::hardware::{GIB, Hardware, builtin, parse};
use hetpar_plan::{Efficiency, Kind, Plan, Ranked, Workload, search};
use serde_json::json;

/// Where `hetpar calibrate` writes and `--hardware local` reads.
const LOCAL_SPEC: &str = ".hetpar/hardware-local.toml";

/// Arguments of `hetpar plan`.
#[derive(clap::Args)]
pub struct Args {
    /// Workload file (modules with real sizes, [workload], [cluster]).
    workload: PathBuf,
    /// GPUs in the cluster (default: the workload's cluster.gpus).
    #[arg(long)]
    gpus: Option<usize>,
    /// Accelerator: h100, h200, a100, local (measured by `hetpar calibrate`), or a TOML file
    /// holding one hardware table (as `hetpar calibrate` writes; `examples/hardware/`).
    #[arg(long)]
    hardware: Option<String>,
    /// Candidates shown per placement family.
    #[arg(long, default_value_t = 1)]
    top: usize,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Write the winner as a config `hetpar train` accepts.
    #[arg(long, value_name = "FILE")]
    emit_config: Option<PathBuf>,
    /// Override a workload value before validation (repeatable): a dotted key and a TOML
    /// value, e.g. `--set workload.seq_len=16384 --set modules.llm.layers=48`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[allow(clippy::print_stdout)]
fn say(s: &str) {
    println!("{s}");
}

#[allow(clippy::print_stderr)]
fn note(s: &str) {
    eprintln!("{s}");
}

/// The hardware spec `name` (`local` reads what `hetpar calibrate` wrote; a name ending in
/// `.toml` is a file holding one hardware table).
fn hardware(name: &str) -> anyhow::Result<Hardware> {
    if name.ends_with(".toml") {
        let table = read_tables(name, " (a hardware file)")?;
        if table.len() != 1 {
            let names: Vec<&str> = table.keys().map(String::as_str).collect();
            bail!(
                "{name}: {} hardware tables ({}); a hardware file holds one",
                table.len(),
                names.join(", ")
            );
        }
        return Ok(table.into_values().next().expect("one table"));
    }
    if name != "local" {
        return Ok(builtin(name)?);
    }
    let mut table = read_tables(
        LOCAL_SPEC,
        ": run `hetpar calibrate` on this machine first (it writes this path under the current directory; or pass --hardware FILE)",
    )?;
    table.remove("local").with_context(|| format!("{LOCAL_SPEC} has no [local] table"))
}

/// The hardware tables in the file at `path`; `hint` follows a read error.
fn read_tables(path: &str, hint: &str) -> anyhow::Result<BTreeMap<String, Hardware>> {
    let text = read_capped_text(Path::new(path), crate::config_load::MAX_CONFIG_BYTES)
        .with_context(|| format!("cannot read {path}{hint}"))?;
    parse(&text).with_context(|| path.to_string())
}

/// A step time in seconds: three decimals, or three significant digits under 0.1 s (a
/// small workload's steps, which three decimals would all show as 0.000).
fn step_s(s: f64) -> String {
    if s >= 0.1 { format!("{s:.3}") } else { hetpar_plan::explain::digits(s) }
}

fn row(r: &Ranked, wl: &Workload) -> String {
    let p = &r.prediction;
    format!(
        "{:<14} {:>9} {:>11} {:>11.0} {:>8}  {}",
        r.candidate.kind.name(),
        step_s(p.step_time_s),
        hetpar_plan::explain::digits(p.tflops_per_gpu),
        p.tokens_per_s,
        hetpar_plan::explain::digits(p.memory.total() / GIB),
        layouts(wl, &r.candidate)
    )
}

fn candidate_json(r: &Ranked, wl: &Workload) -> serde_json::Value {
    let c = &r.candidate;
    let p = &r.prediction;
    let mut modules = Vec::new();
    for (e, ch) in wl.encoders.iter().zip(&c.encoders) {
        let ch = match c.kind {
            Kind::Homogeneous => hetpar_plan::Choice { tp: c.llm.tp, cp: c.llm.cp, pp: 1, ..*ch },
            _ => *ch,
        };
        modules.push(module_json(&e.shape.name, &ch, c.kind == Kind::Homogeneous));
    }
    modules.push(module_json(&wl.llm_name, &c.llm, false));
    json!({
        "kind": c.kind.name(),
        "modules": modules,
        "microbatches": c.microbatches,
        "step_time_s": p.step_time_s,
        "tflops_per_gpu": p.tflops_per_gpu,
        "tokens_per_s": p.tokens_per_s,
        "mem_gib_per_gpu": p.memory.total() / GIB,
        "memory_gib": {
            "states": p.memory.states / GIB,
            "activations": p.memory.activations / GIB,
            "buffers": p.memory.buffers / GIB,
            "overhead": p.memory.overhead / GIB,
        },
        "idle_fraction": p.bubble,
        "boundary_s": p.boundary_s,
    })
}

fn module_json(name: &str, c: &hetpar_plan::Choice, on_llm_first_stage: bool) -> serde_json::Value {
    json!({
        "name": name,
        "ranks": [c.start, c.end],
        "tp": c.tp,
        "cp": c.cp,
        "dp": if on_llm_first_stage { serde_json::Value::Null } else { c.dp().into() },
        "pp": c.pp,
        "vpp": c.vpp,
        "ep": c.ep,
        "recompute_quarters": c.recompute,
        "offload": c.offload,
    })
}

/// A workload error's where and what, as `hetpar_plan` joins them (`line 3, in
/// [workload]: unknown field ...`, `workload: seq_len ... must be at least 1`).
fn where_what(e: &str) -> (String, String) {
    match e.split_once(": ") {
        Some((at, what)) => (at.to_string(), what.to_string()),
        None => (String::new(), e.to_string()),
    }
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let text = read_capped_text(&a.workload, crate::config_load::MAX_CONFIG_BYTES)
        .with_context(|| format!("cannot read workload {}", a.workload.display()))?;
    // A training config given to plan: said as such, not as its first unknown table.
    if let Ok(t) = toml::from_str::<toml::Table>(&text)
        && t.contains_key("train")
        && !t.contains_key("workload")
    {
        bail!(
            "{}: a training config ([train]), where hetpar plan takes a workload: the same [modules.*] with [workload] seq_len, global_batch, vision_token_fraction, tokens_per_image and [cluster] gpus (examples/workloads/); train, check, layout and schedule take this file",
            a.workload.display()
        );
    }
    let (mut wl, name) = crate::config_load::parse_with_sets(
        &text,
        &a.workload.display().to_string(),
        &a.set,
        |t| Workload::from_toml(t).map_err(|e| where_what(&e.0)),
    )?;
    if let Some(n) = a.gpus {
        wl = wl.with_gpus(n).context("--gpus")?;
    }
    match &a.hardware {
        Some(h) => wl.hardware = h.clone(),
        // A hardware file the workload names sits next to it.
        None if wl.hardware.ends_with(".toml") => {
            let dir = a.workload.parent().unwrap_or(Path::new(""));
            wl.hardware = dir.join(&wl.hardware).display().to_string();
        }
        None => {}
    }
    if a.top == 0 {
        bail!("--top must be at least 1");
    }
    let mut hw = hardware(&wl.hardware)?;
    if let Some(g) = wl.gpus_per_node
        && g != hw.gpus_per_node
    {
        hw.gpus_per_node = g;
        hw.description = format!("{}; here {g} per node, as the workload says", hw.description);
    }
    let start = Instant::now();
    let searched = search(&wl, &hw, a.top);
    let elapsed = start.elapsed();
    // Fewer GPUs may run the same global batch faster: an awkward count's round count
    // below it (some GPUs idle), and past what the batch can use, half as many nodes
    // (`fewer_gpus`). Each is searched while it is faster than every count above it (or
    // nothing above plans), and the fastest is named.
    let mut best_step =
        searched.as_ref().ok().and_then(Plan::winner).map(|w| w.prediction.step_time_s);
    let mut fewer: Option<Fewer> = None;
    let mut next = fewer_gpus(wl.gpus, hw.gpus_per_node);
    while let Some(m) = next {
        let found = wl.clone().with_gpus(m).ok().and_then(|w| {
            let plan = search(&w, &hw, 1).ok()?;
            let best = plan.winner()?;
            Some(Fewer {
                gpus: m,
                kind: best.candidate.kind.name(),
                step_s: best.prediction.step_time_s,
            })
        });
        match found {
            Some(f) if best_step.is_none_or(|s| f.step_s < s) => {
                best_step = Some(f.step_s);
                fewer = Some(f);
            }
            // Nothing above plans, nor this: a smaller count may.
            None if best_step.is_none() => {}
            _ => break,
        }
        next = fewer_gpus(m, hw.gpus_per_node);
    }
    let plan = match searched {
        Ok(plan) => plan,
        Err(e) => {
            let hint = fewer.as_ref().map_or_else(String::new, |f| {
                format!(
                    " ({} of them plan: {} at {} s a step, --gpus {})",
                    f.gpus,
                    f.kind,
                    step_s(f.step_s),
                    f.gpus
                )
            });
            return Err(anyhow::anyhow!("{e}{hint}")).with_context(|| name.clone());
        }
    };
    let mut why = explain(&wl, &hw, &plan);
    if let (Some(f), Some(w)) = (&fewer, plan.winner()) {
        why.push(format!(
            "on {} of the {} GPUs ({} idle) the best layout, {}, takes {} s a step against {} s on all of them: --gpus {} plans it",
            f.gpus,
            wl.gpus,
            wl.gpus - f.gpus,
            f.kind,
            step_s(f.step_s),
            step_s(w.prediction.step_time_s),
            f.gpus
        ));
    }
    if let Some(path) = &a.emit_config {
        emit(&wl, &plan, path)?;
    }
    if a.json {
        let candidates: Vec<serde_json::Value> = Kind::ALL
            .iter()
            .flat_map(|k| plan.best.get(k).into_iter().flatten())
            .map(|r| candidate_json(r, &wl))
            .collect();
        let out = json!({
            "workload": wl.name,
            "gpus": wl.gpus,
            "hardware": wl.hardware,
            "searched": plan.considered,
            "fitting": plan.fitting,
            "simulated": plan.simulated,
            "search_s": elapsed.as_secs_f64(),
            "candidates": candidates,
            "winner": plan.winner().map(|r| r.candidate.kind.name()),
            "why": why,
        });
        say(&serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print_table(&wl, &hw, &plan, elapsed, &why);
    Ok(())
}

/// The best layout on fewer GPUs than asked for, where it is faster.
struct Fewer {
    gpus: usize,
    kind: &'static str,
    step_s: f64,
}

/// The next GPU count below `n` worth planning: the whole nodes of an awkward `n` (`per_node`
/// GPUs each), or below one node the largest power of two below it; of two nodes or more,
/// half the nodes, rounded up (5 nodes: 3, then 2); of one node or less, half a power of
/// two, else the largest power of two below it. `None` below 2 GPUs.
fn fewer_gpus(n: usize, per_node: usize) -> Option<usize> {
    let per_node = per_node.max(1);
    let nodes = n / per_node;
    match n {
        0 | 1 => None,
        _ if nodes >= 1 && !n.is_multiple_of(per_node) => Some(nodes * per_node),
        _ if nodes >= 2 => Some(nodes.div_ceil(2) * per_node),
        _ if n.is_power_of_two() => Some(n / 2),
        _ => Some(1 << n.ilog2()),
    }
}

fn print_table(wl: &Workload, hw: &Hardware, plan: &Plan, elapsed: Duration, why: &[String]) {
    say(&format!(
        "{}: {} x {} ({}), sequence {}, global batch {}",
        wl.name, wl.gpus, wl.hardware, hw.description, wl.seq_len, wl.global_batch
    ));
    say(&format!(
        "searched {} layouts, {} fit {:.0} GiB, simulated {} schedules in {:.2} s",
        plan.considered,
        plan.fitting,
        hw.memory_gib,
        plan.simulated,
        elapsed.as_secs_f64()
    ));
    say("");
    say(&format!(
        "{:<14} {:>9} {:>11} {:>11} {:>8}  layouts",
        "placement", "step (s)", "TFLOPS/GPU", "tokens/s", "GiB/GPU"
    ));
    for kind in Kind::ALL {
        match plan.best.get(&kind) {
            Some(v) if !v.is_empty() => {
                for r in v {
                    say(&row(r, wl));
                }
            }
            _ if kind != Kind::Homogeneous && wl.encoders.is_empty() => {}
            _ if plan.has_valid(kind) => {
                say(&format!("{:<14} no layout fits", kind.name()));
            }
            _ => say(&format!("{:<14} no valid layout", kind.name())),
        }
    }
    say("");
    for line in why {
        say(line);
    }
}

fn emit(wl: &Workload, plan: &Plan, path: &Path) -> anyhow::Result<()> {
    let w = plan.winner().context("no candidate to emit")?;
    let cfg = hetpar_plan::emit::config(wl, &w.candidate)?;
    let mut text = format!(
        "# Written by `hetpar plan` for workload {} on {} x {}: the {} candidate,\n# predicted {} s per step, {} TFLOPS/GPU, {} GiB per GPU.\n",
        wl.name,
        wl.gpus,
        wl.hardware,
        w.candidate.kind.name(),
        step_s(w.prediction.step_time_s),
        hetpar_plan::explain::digits(w.prediction.tflops_per_gpu),
        hetpar_plan::explain::digits(w.prediction.memory.total() / GIB)
    );
    // What the config cannot say: recomputation of part of an encoder's layers (`recompute
    // = true` recomputes them all), or of the LLM's layer by layer (the LLM's `recompute =
    // true` keeps each stage's edges and rebuilds the stage's whole graph before its
    // backward: it frees the microbatches in flight, not the one being differentiated).
    let unsaid: Vec<String> = wl
        .encoders
        .iter()
        .map(|e| e.shape.name.clone())
        .zip(w.candidate.encoders.iter().map(|c| c.recompute))
        .filter(|(_, q)| (1..4).contains(q))
        .chain(
            std::iter::once((wl.llm_name.clone(), w.candidate.llm.recompute))
                .filter(|(_, q)| *q > 0),
        )
        .map(|(n, q)| format!("{n} {q}/4 of its layers"))
        .collect();
    if !unsaid.is_empty() {
        text += &format!(
            "# The prediction assumes activation recomputation layer by layer ({}), which this\n# config cannot say: recompute = true recomputes all of an encoder's layers, and on\n# the LLM it rebuilds each pipeline stage's whole graph before its backward (it frees\n# the microbatches in flight, not the one being differentiated).\n",
            unsaid.join(", ")
        );
    }
    let c = &w.candidate;
    if c.kind == Kind::Homogeneous && c.llm.pp > 1 && !wl.encoders.is_empty() {
        text += &format!(
            "# The prediction places the encoders on the LLM's first pipeline stage, as Megatron's
# homogeneous layout does; a config cannot say that (a module's ranks are the LLM's
# span or apart from it), so here each encoder spans the LLM's grid, its layers split
# over the LLM's {} pipeline stages.
",
            c.llm.pp
        );
    }
    // The synthetic source draws no item a quarter of the time, else 1..=max_items, and
    // at most what the sequence holds: its mean may fall short of the workload's.
    let k = cfg.data.max_items;
    let drawn = 3.0 * (k + 1) as f64 / 8.0;
    let costed = wl.encoders.iter().map(|e| e.items_per_sample).fold(0.0, f64::max);
    if drawn < 0.9 * costed {
        text += &format!(
            "# Its synthetic data draws 0..={k} items per sample and encoder ({drawn:.2} on average, where the
# prediction costs {costed:.2}): a larger max_items could draw more than seq_len holds. A run
# of it moves fewer encoder rows than predicted; the prediction is the workload's.
"
        );
    }
    text += &cfg.to_toml();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    note(&format!("wrote {} ({} candidate)", path.display(), w.candidate.kind.name()));
    Ok(())
}

/// Arguments of `hetpar calibrate`.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// Where to write the spec (the default is relative to the current directory, where
    /// `hetpar plan --hardware local` reads it; elsewhere give plan the file's path).
    #[arg(long, default_value = LOCAL_SPEC)]
    out: PathBuf,
    /// Timed repetitions per measurement (the best is kept).
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

/// Measures this machine: one rank is one core's share (memory, bandwidth).
pub fn calibrate(a: &CalibrateArgs) -> anyhow::Result<()> {
    use candle_core::DType;
    use hetpar_comm::bench::{BenchOp, BenchResult, bench, memcpy_bandwidth};
    use hetpar_comm::{LocalOptions, launch};
    use hetpar_nn::bench::{attention_gflops, matmul_gflops};

    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all cores".into());
    note(&format!(
        "calibrating: matmul, attention, memcpy and local collectives (threads: {threads})"
    ));
    // GEMM rate at two widths gives the peak and the half-rate width of `rate = peak * w / (w + w0)`.
    let (w1, w2) = (128.0f64, 1024.0f64);
    let r1 = matmul_gflops(w1 as usize, 20 * a.iters, DType::F32)?;
    let r2 = matmul_gflops(w2 as usize, 2 * a.iters, DType::F32)?;
    // r1 / r2 = w1 (w2 + w0) / (w2 (w1 + w0))  =>  w0 = w1 w2 (r2 - r1) / (r1 w2 - r2 w1)
    let w0 = (w1 * w2 * (r2 - r1) / (r1 * w2 - r2 * w1)).max(0.0);
    let peak = r2 * (w2 + w0) / w2;
    note(&format!(
        "  matmul: {r1:.1} GFLOP/s at 128, {r2:.1} at 1024: peak {peak:.1}, half rate at width {w0:.0} (rate = peak * w / (w + {w0:.0}) for a product of width w{})",
        if w0 == 0.0 { "; as fast at 128 as at 1024, so no narrow-product penalty" } else { "" }
    ));
    let attn = attention_gflops(512, 64, 4, a.iters, DType::F32)?;
    note(&format!("  attention core (512 x 64, 4 heads): {attn:.1} GFLOP/s"));
    let memcpy = memcpy_bandwidth(256 << 20, a.iters);
    note(&format!("  memcpy: {:.2} GB/s", memcpy / 1e9));
    let opts = LocalOptions { timeout: Duration::from_secs(600) };
    let measure = |op: BenchOp, bytes: usize| -> anyhow::Result<BenchResult> {
        let out = launch(2, opts, |c| bench(c, op, bytes, a.iters)).context("local world")?;
        out.into_iter().next().context("one rank")?.context("benchmark")
    };
    let all_reduce = measure(BenchOp::AllReduce, 64 << 20)?.busbw;
    let all_to_all = measure(BenchOp::AllToAllV, 64 << 20)?.busbw;
    let latency = measure(BenchOp::AllReduce, 8)?.seconds;
    note(&format!(
        "  local 2-rank all-reduce: {:.2} GB/s bus bandwidth, all-to-all-v {:.2} GB/s, 8-byte all-reduce {:.1} us",
        all_reduce / 1e9,
        all_to_all / 1e9,
        latency * 1e6
    ));
    let mem_total =
        crate::meminfo_bytes("MemTotal").context("cannot read MemTotal from /proc/meminfo")?;
    let defaults = Efficiency::default();
    let hw = Hardware {
        description: format!(
            "this machine ({cores} cores, one rank per core), measured by hetpar calibrate"
        ),
        peak_tflops: peak / 1e3,
        memory_gib: mem_total / cores as f64 / GIB,
        hbm_gbps: 2.0 * memcpy / 1e9,
        gpus_per_node: cores,
        intra_node_gbps: all_reduce / 1e9,
        inter_node_gbps: all_reduce / 1e9,
        latency_us: latency * 1e6 / 2.0,
        host_gbps: memcpy / 1e9,
        efficiency: Efficiency {
            gemm: 1.0,
            gemm_half_width: w0,
            // At most the matmul's rate, which stands for the peak here.
            attention: (attn / peak).min(1.0),
            // hetpar's collectives block inside autograd, and gradients are reduced after
            // the backward: nothing overlaps.
            tp_overlap: 0.0,
            dp_overlap: 0.0,
            all_to_all: (all_to_all / all_reduce).min(1.0),
            overhead_gib: 0.0,
            // Not measured: a property of the layers' kernels, kept from the fit.
            elementwise_bytes: defaults.elementwise_bytes,
            // Not measured either; the fitted H100 ring-attention slowdown belongs to that
            // GPU stack, so this machine's spec assumes none (and the blocking exchange).
            cp_attention: 1.0,
            cp_step: 0.0,
            cp_overlap: 0.0,
        },
    };
    // `--hardware local` reads the default file; another is named by its path.
    let flag = match a.out == Path::new(LOCAL_SPEC) {
        true => "local".to_string(),
        false => a.out.display().to_string(),
    };
    let mut text = format!(
        "# This machine as a planner hardware spec: `hetpar plan WORKLOAD --hardware {flag}`.\n"
    );
    text += &toml::to_string_pretty(&BTreeMap::from([("local", &hw)]))?;
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(&a.out, &text).with_context(|| format!("cannot write {}", a.out.display()))?;
    say(&text);
    note(&format!("wrote {}", a.out.display()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::fewer_gpus;

    #[test]
    fn fewer_gpus_rounds_an_awkward_count_down_and_halves_a_round_ones_nodes() {
        let chain =
            |n: usize| std::iter::successors(Some(n), |&m| fewer_gpus(m, 8)).collect::<Vec<_>>();
        assert_eq!(chain(33), [33, 32, 16, 8, 4, 2, 1]);
        assert_eq!(chain(40), [40, 24, 16, 8, 4, 2, 1]);
        assert_eq!(chain(6 * 8 + 3), [51, 48, 24, 16, 8, 4, 2, 1]);
        assert_eq!(chain(6), [6, 4, 2, 1]);
        assert_eq!(chain(2048)[..3], [2048, 1024, 512]);
        assert_eq!(fewer_gpus(48, 8), Some(24));
        assert_eq!(fewer_gpus(1, 8), None);
        assert_eq!(fewer_gpus(12, 1), Some(6));
    }
}
