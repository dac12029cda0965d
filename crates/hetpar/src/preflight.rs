//! The memory preflight of `hetpar train` and `hetpar eval`: a run whose ranks on a
//! machine would need more than it has available is refused in one line before anything
//! is allocated, counting weights, gradients and AdamW moments, and when training a floor
//! of the activations the step's schedule makes those ranks hold at once.

use anyhow::bail;
use candle_core::DType;
use hetpar_comm::{CommExt, Communicator};
use hetpar_layout::{BatchManifest, ModelGraph};
use hetpar_runtime::ActivationFloor;
use hetpar_schedule::{
    Action, Compute, Held, Keeps, Options as ScheduleOptions, Pass, PipelineGraph, Schedule,
};

use crate::data_open::RunData;
use crate::train_cmd::machine_id;

/// What a run holds besides its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds<'a> {
    /// Training: gradients, AdamW moments, and the activations a backward needs, the
    /// encoders' counted from the manifest of the first step the run takes (where given).
    Training(Option<&'a BatchManifest>),
    /// Evaluation: no backward (the weights, gradients and moments of a checkpoint are
    /// counted as training does, the activations not).
    Evaluation,
}

/// Refuses a run whose ranks in this process (`ranks`: all of a local run) would hold more
/// than the machine has memory available, before anything is allocated: the allocation
/// would otherwise end the process without a message. It counts the weights, gradients and
/// AdamW moments, and when training a floor of the activations: what the step's schedule
/// makes these ranks hold at once in any execution
/// ([`hetpar_runtime::activations_held`] over [`ActivationFloor`]). Everything else comes
/// on top, so passing says little and failing is certain.
pub fn fits_memory(
    graph: &ModelGraph,
    dtype: DType,
    ranks: &[usize],
    holds: Holds<'_>,
) -> anyhow::Result<()> {
    fits_memory_of(graph, (dtype, holds), ranks, "in this process", " (--backend mpi)")
}

/// The manifest of `step` of `data`, for the preflight's encoder activations; `None` where
/// it cannot be read now (the run will say why when it reads it).
pub fn first_manifest(graph: &ModelGraph, data: &RunData, step: usize) -> Option<BatchManifest> {
    data.sources(graph, 0).batches.manifest(step).ok()
}

/// [`fits_memory`] under MPI, for the processes of `world` on this machine together (those
/// reporting its boot id; MPI places several ranks on a host, and they share its memory).
/// Every rank of `world` calls it.
pub(crate) fn fits_memory_mpi(
    world: &dyn Communicator,
    graph: &ModelGraph,
    dtype: DType,
    holds: Holds<'_>,
) -> anyhow::Result<()> {
    let me = machine_id();
    let ids = world.all_gather_any(me.as_bytes())?;
    let here: Vec<usize> = if me.is_empty() {
        vec![world.rank()]
    } else {
        (0..ids.len()).filter(|&r| ids[r] == me.as_bytes()).collect()
    };
    let at = format!("on this machine (ranks {})", hetpar_layout::plan::rank_list(&here));
    fits_memory_of(graph, (dtype, holds), &here, &at, "")
}

/// Bytes of the weights, gradients and AdamW moments of `ranks` (each of the parameters'
/// type).
pub(crate) fn states_bytes(graph: &ModelGraph, dtype: DType, ranks: &[usize]) -> f64 {
    let per_param = 4.0 * dtype.size_in_bytes() as f64;
    let params = crate::flops::StepFlops::new(graph).module_params();
    let mut states = 0.0;
    for (m, module) in graph.modules.iter().enumerate() {
        let l = &module.layout;
        let here = ranks.iter().filter(|&&r| l.span().contains(r)).count();
        states += params[m] / (l.tp() * l.pp()) as f64 * per_param * here as f64;
    }
    states
}

/// The floor of the activations `ranks` hold at once in a step, with the schedule and the
/// per-pass bytes it came from.
pub(crate) fn activations_floor<'g>(
    graph: &'g ModelGraph,
    dtype: DType,
    manifest: Option<&BatchManifest>,
    ranks: &[usize],
) -> anyhow::Result<(Schedule, ActivationFloor<'g>, Held)> {
    let schedule = Schedule::build(&PipelineGraph::from_model(graph), ScheduleOptions::default())
        .map_err(|e| anyhow::anyhow!("{}: {e}", graph.name))?;
    let floor = ActivationFloor::new(graph, manifest, dtype.size_in_bytes());
    let held = hetpar_runtime::activations_held(&schedule, &floor, ranks);
    Ok((schedule, floor, held))
}

fn fits_memory_of(
    graph: &ModelGraph,
    (dtype, holds): (DType, Holds<'_>),
    ranks: &[usize],
    at: &str,
    how: &str,
) -> anyhow::Result<()> {
    let Some(available) = crate::meminfo_bytes("MemAvailable") else { return Ok(()) };
    let states = states_bytes(graph, dtype, ranks);
    // Sizes in their own unit: a machine short of memory may have well under a GiB.
    let size = |b: f64| crate::human(b as usize);
    if states > available {
        bail!(
            "{}: its weights, gradients and AdamW moments on {} rank(s) {at} need about {}, more than the {} this machine has available; use smaller sizes or more machines{how}",
            graph.name,
            ranks.len(),
            size(states),
            size(available)
        );
    }
    let Holds::Training(manifest) = holds else { return Ok(()) };
    let (schedule, floor, held) = activations_floor(graph, dtype, manifest, ranks)?;
    if states + held.total > available {
        // The moment: the rank whose passes set it, and what it holds then.
        let mut pending: Vec<Compute> = Vec::new();
        for a in &schedule.ranks[&held.rank][..held.after] {
            match a {
                Action::Compute(c)
                    if schedule.backward[c.module]
                        && c.pass == Pass::Forward
                        && floor.kept(held.rank, c) > 0.0 =>
                {
                    pending.push(*c)
                }
                Action::Compute(c) if c.pass == Pass::Backward => {
                    pending.retain(|p| (p.module, p.vstage, p.mb) != (c.module, c.vstage, c.mb))
                }
                _ => {}
            }
        }
        let llm = graph.modules.iter().position(|m| m.rows_per_item().is_none()).unwrap_or(0);
        let llm_passes: Vec<&Compute> = pending.iter().filter(|c| c.module == llm).collect();
        let what = match llm_passes.iter().map(|c| floor.layers(llm, c.vstage)).max() {
            Some(_) if graph.modules[llm].recompute => format!(
                ", {} of them the LLM's (recomputed: the hidden states each received and passed on)",
                llm_passes.len()
            ),
            Some(layers) => format!(
                ", {} of them the LLM's, each {} tokens a rank through up to {layers} layers",
                llm_passes.len(),
                floor.rows(llm, held.rank, 0)
            ),
            None => String::new(),
        };
        let rebuilds = match schedule.ranks[&held.rank].get(held.after) {
            Some(Action::Compute(c)) if held.during > 0.0 => {
                format!(
                    ", and rebuilds {}'s activations for a backward",
                    graph.modules[c.module].name
                )
            }
            _ => String::new(),
        };
        // Recomputation is the first thing to try where some module keeps its graphs.
        let recompute = if graph.modules.iter().any(|m| !m.recompute) {
            "recompute = true on the modules, "
        } else {
            ""
        };
        bail!(
            "{}: on {} rank(s) {at} its weights, gradients and AdamW moments need about {} and the activations at least {} more (the most the step's schedule makes these ranks hold at once: rank {} then keeps {} forward passes for their backward{what}{rebuilds}), more than the {} this machine has available; use {recompute}a shorter seq_len, more microbatches, fewer pipeline stages, smaller sizes or more machines{how}",
            graph.name,
            ranks.len(),
            size(states),
            size(held.total),
            held.rank,
            pending.len(),
            size(available)
        );
    }
    Ok(())
}
