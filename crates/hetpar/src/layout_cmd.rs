//! `hetpar layout CONFIG`: module grids and boundary plans as text or JSON.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;

use hetpar_layout::plan::rank_list;
use hetpar_layout::{
    BatchManifest, Direction, EdgePlan, EdgeReport, ModelGraph, Module, StepTraffic, Strategy,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

/// Arguments of `hetpar layout`.
#[derive(clap::Args)]
pub struct Args {
    /// Config file (TOML).
    config: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also print every rank's forward and backward program for microbatch 0 (each rank's
    /// own share, as the rank plans it to run a step). Text only: not with --json.
    #[arg(long, conflicts_with = "json")]
    programs: bool,
    /// With `--programs`: print only these ranks' programs (comma-separated or repeated),
    /// e.g. one rank of a planner config of thousands.
    #[arg(long, value_delimiter = ',', requires = "programs")]
    rank: Vec<usize>,
    /// Which training step to plan (its items and rows vary per step): the records the
    /// run draws for it from the config's data, or the synthetic source's draw.
    #[arg(long, default_value_t = 0)]
    step: u64,
    /// Override a config value before validation (repeatable): a dotted key and a TOML
    /// value, e.g. `--set train.lr=1e-4 --set modules.llm.parallel.tp=2`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let graph = crate::load_graph(&args.config, &args.set)?;
    if let Some(r) = args.rank.iter().find(|&&r| r >= graph.world) {
        anyhow::bail!("--rank {r}: outside the config's world of {}", plural(graph.world, "rank"));
    }
    let (manifest, drawn) = crate::data_open::step_manifest(&graph, args.step, &|l| {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("{l}");
        }
    })?;
    // Seconds to minutes at thousands of ranks: a bar on a terminal, nothing elsewhere.
    let work: usize = (0..graph.edges.len()).map(|e| EdgeReport::work(&graph, e, &manifest)).sum();
    let bar = ProgressBar::new(work as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} rank shares planned, {eta} left")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let tick = |n: usize| bar.inc(n as u64);
    let reports: Vec<EdgeReport> =
        (0..graph.edges.len()).map(|e| EdgeReport::new(&graph, e, &manifest, &tick)).collect();
    bar.finish_and_clear();
    let out = if args.json {
        serde_json::to_string_pretty(&to_json(&graph, &reports, &drawn))? + "\n"
    } else {
        render(&graph, (&manifest, &drawn), &reports, args)
    };
    #[allow(clippy::print_stdout)]
    {
        print!("{out}");
    }
    Ok(())
}

pub(crate) fn plural(n: usize, word: &str) -> String {
    let suffix = match (n, word.ends_with('h')) {
        (1, _) => "",
        (_, true) => "es",
        _ => "s",
    };
    format!("{n} {word}{suffix}")
}

/// One table per pipeline stage: a row per replica, a column per (cp, tp) position.
fn render_grid(out: &mut String, m: &Module) {
    let l = &m.layout;
    let mut line = format!(
        "module {} ({}): ranks {}, {}",
        m.name,
        m.kind().name(),
        rank_list(&l.span().ranks().collect::<Vec<_>>()),
        l.describe()
    );
    if l.ep() > 1 || l.etp() != l.tp() {
        write!(line, "; experts etp{} ep{} edp{}", l.etp(), l.ep(), l.edp()).expect("string");
    }
    writeln!(out, "{line}").expect("string");
    let headers: Vec<String> = (0..l.cp())
        .flat_map(|c| {
            (0..l.tp())
                .map(move |t| if l.cp() > 1 { format!("c{c}t{t}") } else { format!("tp{t}") })
        })
        .collect();
    let width =
        headers.iter().map(String::len).max().unwrap_or(3).max(l.span().end.to_string().len());
    for pp in 0..l.pp() {
        let mut head = format!("  stage {pp:<3}");
        for h in &headers {
            write!(head, " {h:>width$}").expect("string");
        }
        writeln!(out, "{head}").expect("string");
        for dp in 0..l.dp() {
            let mut row = format!("    dp{dp:<6}");
            for r in l.stage_ranks(dp, pp) {
                write!(row, " {r:>width$}").expect("string");
            }
            writeln!(out, "{row}").expect("string");
        }
    }
}

fn traffic_line(name: &str, t: &StepTraffic, row_bytes: usize) -> String {
    let (moved, bound) = (t.total(), t.total_lower_bound());
    let ratio = if bound == 0 {
        if moved == 0 { "at the bound".to_string() } else { "bound is 0".to_string() }
    } else {
        format!("{:.2}x the bound", moved as f64 / bound as f64)
    };
    let crossing = if t.crossing > 0 {
        format!(
            "; {} rows = {} cross the island boundary",
            t.crossing,
            crate::human(t.crossing * row_bytes)
        )
    } else {
        String::new()
    };
    format!(
        "  {name:<9} moves {} rows = {}, lower bound {} rows = {} ({ratio}){crossing}",
        moved,
        crate::human(moved * row_bytes),
        bound,
        crate::human(bound * row_bytes)
    )
}

fn render_edge(out: &mut String, graph: &ModelGraph, r: &EdgeReport) {
    let e = &graph.edges[r.edge];
    let (sl, dl) = (&graph.modules[e.src].layout, &graph.modules[e.dst].layout);
    writeln!(
        out,
        "edge {} -> {}: {}, {} (dp {} -> {}), strategy {}",
        r.src,
        r.dst,
        r.mode.name().replace('_', "-"),
        r.relation,
        sl.dp(),
        dl.dp(),
        r.strategy
    )
    .expect("string");
    writeln!(
        out,
        "  {} this step ({} without any), {} each",
        plural(r.rows, "row"),
        plural(r.empty_samples, "sample"),
        crate::human(r.row_bytes)
    )
    .expect("string");
    if let Some(leaders) = &r.leaders {
        let fmt =
            |v: &Vec<Vec<usize>>| v.iter().map(|l| rank_list(l)).collect::<Vec<_>>().join(" | ");
        writeln!(
            out,
            "  leaders: {} [{}] -> {} [{}]",
            r.src,
            fmt(&leaders.src),
            r.dst,
            fmt(&leaders.dst)
        )
        .expect("string");
    }
    render_items(out, r);
    writeln!(out, "{}", traffic_line("forward", &r.forward, r.row_bytes)).expect("string");
    writeln!(out, "{}", traffic_line("backward", &r.backward, r.row_bytes)).expect("string");
    writeln!(
        out,
        "  {:>6} {:>11} {:>11} {:>11} {:>11}",
        "rank", "fwd sent", "fwd recv", "bwd sent", "bwd recv"
    )
    .expect("string");
    for (&rank, &fr) in &r.forward.received {
        let cells = [r.forward.sent[&rank], fr, r.backward.sent[&rank], r.backward.received[&rank]];
        if cells.iter().all(|&c| c == 0) {
            continue;
        }
        let mut row = format!("  {rank:>6}");
        for c in cells {
            write!(row, " {:>11}", crate::human(c * r.row_bytes)).expect("string");
        }
        writeln!(out, "{row}").expect("string");
    }
    let alts: Vec<String> = r
        .alternatives
        .iter()
        .map(|(s, f, b)| {
            let cross = if f.crossing + b.crossing > 0 {
                format!(
                    " ({}/{} across)",
                    crate::human(f.crossing * r.row_bytes),
                    crate::human(b.crossing * r.row_bytes)
                )
            } else {
                String::new()
            };
            format!(
                "{s} {}/{}{cross}",
                crate::human(f.total() * r.row_bytes),
                crate::human(b.total() * r.row_bytes)
            )
        })
        .collect();
    writeln!(out, "  strategies (forward/backward): {}", alts.join(", ")).expect("string");
}

/// Which items each source replica owns, per microbatch: `mb 0, 3 items (samples 0 0 1):
/// dp0 -, dp1 0, dp2 1-2` (item positions in canonical order).
fn render_items(out: &mut String, r: &EdgeReport) {
    writeln!(out, "  items per {} replica (canonical order: by sample, then position):", r.src)
        .expect("string");
    for (k, mb) in r.items.iter().enumerate() {
        let owners: Vec<String> = mb
            .replicas
            .iter()
            .enumerate()
            .map(|(d, range)| {
                let own = match range.len() {
                    0 => "-".to_string(),
                    1 => range.start.to_string(),
                    _ => format!("{}-{}", range.start, range.end - 1),
                };
                format!("dp{d} {own}")
            })
            .collect();
        let samples: Vec<String> = mb.samples.iter().map(ToString::to_string).collect();
        let of = if samples.is_empty() {
            String::new()
        } else {
            format!(" (samples {})", samples.join(" "))
        };
        writeln!(
            out,
            "    mb {k}, {}{of}: {}",
            plural(mb.samples.len(), "item"),
            owners.join(", ")
        )
        .expect("string");
    }
}

/// The programs of microbatch 0 on `edge` of every rank of its two modules, or of `only`:
/// each rank's share planned on its own ([`EdgePlan::for_rank`], op for op its part of the
/// whole plans), one rank at a time, so no rank's plan holds the world's. Every rank's
/// `gather` programs come from the whole plans instead: each rank's share walks its whole
/// group, which for every rank would be the square of the group's views.
fn render_programs(
    out: &mut String,
    graph: &ModelGraph,
    manifest: &BatchManifest,
    edge: usize,
    only: &[usize],
) {
    let e = &graph.edges[edge];
    let (src, dst) = (&graph.modules[e.src], &graph.modules[e.dst]);
    let on_edge = |r: &usize| src.layout.span().contains(*r) || dst.layout.span().contains(*r);
    let ranks: BTreeSet<usize> = if only.is_empty() {
        src.layout.span().ranks().chain(dst.layout.span().ranks()).collect()
    } else {
        only.iter().copied().collect()
    };
    let whole = (only.is_empty() && e.strategy == Strategy::Gather)
        .then(|| EdgePlan::for_edge(graph, edge, manifest, 0));
    let mut text = [String::new(), String::new()];
    for &rank in &ranks {
        if !on_edge(&rank) {
            continue;
        }
        let share;
        let plan = match &whole {
            Some(plan) => plan,
            None => {
                share = EdgePlan::for_rank(graph, edge, manifest, 0, rank);
                &share
            }
        };
        for (t, dir) in text.iter_mut().zip([Direction::Forward, Direction::Backward]) {
            for op in plan.program(dir).ops.get(&rank).into_iter().flatten() {
                writeln!(t, "    {rank:>4}: {op}").expect("string");
            }
        }
    }
    let off: Vec<usize> = ranks.iter().copied().filter(|r| !on_edge(r)).collect();
    if !off.is_empty() {
        let (word, verb) = if off.len() == 1 { ("rank", "is") } else { ("ranks", "are") };
        let (a, b) = (&src.name, &dst.name);
        writeln!(out, "  {word} {} {verb} in neither {a} nor {b}", rank_list(&off))
            .expect("string");
    }
    for (t, dir) in text.iter().zip([Direction::Forward, Direction::Backward]) {
        writeln!(out, "  {dir:?} program, microbatch 0:").expect("string");
        out.push_str(t);
    }
}

fn render(
    graph: &ModelGraph,
    (manifest, drawn): (&BatchManifest, &str),
    reports: &[EdgeReport],
    args: &Args,
) -> String {
    let mut out = String::new();
    let t = &graph.train;
    writeln!(
        out,
        "{}: {}, {}, {}",
        graph.name,
        plural(graph.world, "rank"),
        plural(graph.modules.len(), "module"),
        plural(graph.edges.len(), "edge")
    )
    .expect("string");
    writeln!(
        out,
        "step {}: {} in {} of {}, seq_len {}, {}; {drawn}",
        args.step,
        plural(t.global_batch, "sample"),
        plural(t.microbatches, "microbatch"),
        manifest.microbatch_size(),
        t.seq_len,
        t.dtype.name()
    )
    .expect("string");
    for id in graph.topo_order() {
        writeln!(out).expect("string");
        render_grid(&mut out, &graph.modules[id]);
    }
    for r in reports {
        writeln!(out).expect("string");
        render_edge(&mut out, graph, r);
        if args.programs {
            render_programs(&mut out, graph, manifest, r.edge, &args.rank);
        }
    }
    out
}

fn to_json(graph: &ModelGraph, reports: &[EdgeReport], drawn: &str) -> serde_json::Value {
    let modules: Vec<_> = graph
        .modules
        .iter()
        .map(|m| {
            let l = &m.layout;
            json!({
                "name": m.name, "kind": m.kind().name(),
                "ranks": [l.span().start, l.span().end],
                "tp": l.tp(), "cp": l.cp(), "dp": l.dp(), "pp": l.pp(),
                "ep": l.ep(), "etp": l.etp(), "edp": l.edp(), "sp": l.sp(),
            })
        })
        .collect();
    let edges: Vec<_> = reports
        .iter()
        .map(|r| {
            let b = r.row_bytes;
            let per_rank: Vec<_> = r
                .forward
                .received
                .keys()
                .map(|rank| {
                    json!({
                        "rank": rank,
                        "fwd_sent": r.forward.sent[rank] * b, "fwd_recv": r.forward.received[rank] * b,
                        "bwd_sent": r.backward.sent[rank] * b, "bwd_recv": r.backward.received[rank] * b,
                        "fwd_min": r.forward.lower_bound[rank] * b, "bwd_min": r.backward.lower_bound[rank] * b,
                    })
                })
                .collect();
            let strategies: Vec<_> = r
                .alternatives
                .iter()
                .map(|(s, f, bw)| {
                    json!({
                        "strategy": s.name(), "stripes": s.stripes(),
                        "bytes_fwd": f.total() * b, "bytes_bwd": bw.total() * b,
                        "bytes_fwd_cross": f.crossing * b, "bytes_bwd_cross": bw.crossing * b,
                    })
                })
                .collect();
            let items: Vec<_> = r
                .items
                .iter()
                .enumerate()
                .map(|(k, mb)| {
                    let replicas: Vec<[usize; 2]> =
                        mb.replicas.iter().map(|x| [x.start, x.end]).collect();
                    json!({ "microbatch": k, "samples": mb.samples, "replicas": replicas })
                })
                .collect();
            json!({
                "src": r.src, "dst": r.dst,
                "items": items,
                "mode": r.mode.name(), "relation": r.relation.name(), "strategy": r.strategy.name(), "stripes": r.strategy.stripes(),
                "rows": r.rows, "row_bytes": b,
                "bytes_fwd": r.forward.total() * b, "bytes_bwd": r.backward.total() * b,
                "bytes_fwd_min": r.forward.total_lower_bound() * b, "bytes_bwd_min": r.backward.total_lower_bound() * b,
                "bytes_fwd_cross": r.forward.crossing * b, "bytes_bwd_cross": r.backward.crossing * b,
                "leaders": r.leaders.as_ref().map(|l| json!({"src": l.src, "dst": l.dst})),
                "per_rank": per_rank,
                "strategies": strategies,
            })
        })
        .collect();
    json!({
        "name": graph.name,
        "world": graph.world,
        "microbatches": graph.train.microbatches,
        "items_from": drawn,
        "modules": modules,
        "edges": edges,
    })
}
