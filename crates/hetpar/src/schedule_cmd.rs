//! `hetpar schedule CONFIG`: the per-rank action timeline of one step, validated.

use std::path::PathBuf;

use anyhow::Context;
use hetpar_schedule::{Options, PipelineGraph, Schedule, UnitDurations, svg, text_grid, validate};

/// Arguments of `hetpar schedule`.
#[derive(clap::Args)]
pub struct Args {
    /// Config file (TOML).
    config: PathBuf,
    /// Also write an SVG timeline to this file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let graph = crate::load_graph(&args.config)?;
    let pipeline = PipelineGraph::from_model(&graph);
    let schedule = Schedule::build(&pipeline, Options::default())
        .with_context(|| format!("{}: cannot schedule", args.config.display()))?;
    let timeline = validate(&schedule, &UnitDurations).with_context(|| {
        format!("{}: the {} schedule is invalid", args.config.display(), schedule.kind.name())
    })?;
    let n_ranks = schedule.ranks.len();
    let slots = timeline.makespan;
    let idle = timeline.bubble_fraction() * n_ranks as f64 * slots;
    let mut out = format!(
        "{}: {} schedule, {} ranks, {} microbatches (unit durations: a pass, a boundary transform, a reduction, a step = 1 slot)\n\n",
        graph.name,
        schedule.kind.name(),
        n_ranks,
        schedule.microbatches
    );
    out.push_str(&text_grid(&schedule, &timeline));
    out.push_str(&format!(
        "\nvalid: every message matched, no deadlock, every forward before its backward, every boundary forward with its backward\nstep {slots} slots, bubble {:.1}% ({idle:.0} idle of {:.0} rank-slots)\n",
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
