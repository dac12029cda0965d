//! `hetpar schedule CONFIG`: the per-rank action timeline of one step, validated.

use std::path::PathBuf;

use anyhow::Context;
use hetpar_layout::plan::rank_list;
use hetpar_schedule::{
    Options, PipelineGraph, Schedule, UnitDurations, Work, WorkDurations, svg, text_grid, validate,
};

/// Arguments of `hetpar schedule`.
#[derive(clap::Args)]
pub struct Args {
    /// Config file (TOML).
    config: PathBuf,
    /// Also write an SVG timeline to this file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Which training step's items decide the encoder replicas without items: the records
    /// the run draws for it from the config's data, or the synthetic source's draw.
    #[arg(long, default_value_t = 0)]
    step: u64,
    /// Override a config value before validation (repeatable): a dotted key and a TOML
    /// value, e.g. `--set train.lr=1e-4 --set modules.llm.parallel.tp=2`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let graph = crate::load_graph(&args.config, &args.set)?;
    let pipeline = PipelineGraph::from_model(&graph);
    let schedule = Schedule::build(&pipeline, Options::default())
        .with_context(|| format!("{}: cannot schedule", args.config.display()))?;
    // Encoder replicas that own no item in a microbatch pass empty (no time) but keep
    // their place in every transform and reduction.
    let (manifest, drawn) = crate::data_open::step_manifest(&graph, args.step, &|l| {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("{l}");
        }
    })?;
    let work = Work::from_manifest(&pipeline, &manifest);
    let durations = WorkDurations { inner: UnitDurations, work: &work, graph: &pipeline };
    let timeline = validate(&schedule, &durations).with_context(|| {
        format!("{}: the {} schedule is invalid", args.config.display(), schedule.kind.name())
    })?;
    let n_ranks = schedule.ranks.len();
    let slots = timeline.makespan;
    let idle = timeline.bubble_fraction() * n_ranks as f64 * slots;
    let mut out = format!(
        "{}: {} schedule, {} ranks, {} microbatches (unit durations: a pass, a boundary transform, a reduction, a step = 1 slot; a pass of an encoder replica with no item = 0)\nstep {}: {drawn}\n\n",
        graph.name,
        schedule.kind.name(),
        n_ranks,
        schedule.microbatches,
        args.step
    );
    out.push_str(&text_grid(&schedule, &timeline));
    out.push_str(&empty_replicas(&pipeline, &work, args.step));
    out.push_str(&format!(
        "\nvalid: every message matched, no deadlock, every forward before its backward, every boundary forward with its backward\nstep {slots} slots, bubble {:.1}% ({idle:.0} idle of {:.0} rank-slots, replicas without items included)\n",
        100.0 * timeline.bubble_fraction(),
        n_ranks as f64 * slots
    ));
    if let Some(path) = &args.svg {
        let title = format!(
            "{}: {} ({} microbatches)",
            graph.name,
            schedule.kind.name(),
            schedule.microbatches
        );
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        std::fs::write(path, svg(&schedule, &timeline, &title))
            .with_context(|| format!("cannot write {}", path.display()))?;
        out.push_str(&format!("wrote {}\n", path.display()));
    }
    #[allow(clippy::print_stdout)]
    {
        print!("{out}");
    }
    Ok(())
}

/// One line per encoder whose replicas own no item in some microbatch of the step.
fn empty_replicas(pipeline: &PipelineGraph, work: &Work, step: u64) -> String {
    let mut out = String::new();
    for (id, m) in pipeline.modules().iter().enumerate() {
        let per_mb: Vec<String> = (0..pipeline.microbatches())
            .filter_map(|mb| {
                let mut idle: Vec<usize> = (0..m.layout.dp())
                    .filter(|&d| work.items(id, d, mb) == Some(0))
                    .flat_map(|d| (0..m.layout.pp()).flat_map(move |p| m.layout.stage_ranks(d, p)))
                    .collect();
                idle.sort_unstable();
                (!idle.is_empty()).then(|| format!("mb {mb} on ranks {}", rank_list(&idle)))
            })
            .collect();
        if !per_mb.is_empty() {
            out.push_str(&format!(
                "\n{}: replicas with no item in step {step} pass empty (idle) but take part in every transform and reduction: {}\n",
                m.name,
                per_mb.join("; ")
            ));
        }
    }
    out
}
