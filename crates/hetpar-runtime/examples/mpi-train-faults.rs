//! Training faults under MPI, one case per run (`.ci/run` checks each):
//! `mpirun -n 2 target/release/examples/mpi-train-faults encoder-panic`.
//!
//! - `encoder-panic` (2 ranks, colocated): an encoder's input panics in step 0;
//! - `island-panic` (3 ranks): the encoder island, the edge's only source rank, panics in
//!   step 1;
//! - `llm-error` (3 ranks): the LLM's data fails with an error on rank 2 in step 1;
//! - `unmatched` (3 ranks): the encoder island never runs its first boundary transform;
//! - `nan-stop` / `nan-skip` (2 ranks, colocated): NaN pixels in step 1 reach a boundary row.
//!
//! A failing rank prints `error: rank R: ...` and ends the job (a panic prints `rank R
//! panicked ...` and does the same), so every process exits non-zero at once; a clean run
//! prints each step's loss and whether it was applied.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;
use hetpar_comm::mpi::{MpiOptions, abort_job, abort_on_panic, init};
use hetpar_comm::{CommExt, Communicator};
use hetpar_layout::BatchManifest;
use hetpar_runtime::stages::encoder::ItemSource;
use hetpar_runtime::stages::llama::TextSource;
use hetpar_runtime::synthetic::Synthetic;
use hetpar_runtime::testing::{FailingText, Faulty, fault_graph};
use hetpar_runtime::{
    Executor, OnNonFinite, RuntimeError, Sources, StepPlans, build_stages, train_options,
};
use hetpar_schedule::{Action, Options, PipelineGraph, Schedule};

fn main() -> ExitCode {
    let case = std::env::args().nth(1).unwrap_or_default();
    let opts = MpiOptions {
        timeout: Duration::from_secs(3),
        // Lines in one write each, so ranks sharing mpirun's output do not split them.
        on_fatal: Box::new(|e| {
            let line = format!("error: {e}\n");
            eprint!("{line}")
        }),
    };
    let world = init(opts).expect("MPI initializes");
    let rank = world.rank();
    abort_on_panic(rank, |line| eprint!("{line}"));
    match run(&world, &case) {
        Ok(lines) => {
            if rank == 0 {
                for l in lines {
                    println!("{l}");
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let line = format!("error: rank {rank}: {e}\n");
            eprint!("{line}");
            abort_job(1)
        }
    }
}

fn run(world: &dyn Communicator, case: &str) -> Result<Vec<String>, RuntimeError> {
    let rank = world.global_rank();
    let islands = matches!(case, "island-panic" | "llm-error" | "unmatched");
    let g = fault_graph(islands);
    if world.size() != g.world {
        return Err(RuntimeError::Model(format!(
            "case {case:?} runs on {} ranks, mpirun started {}",
            g.world,
            world.size()
        )));
    }
    let plain = || Synthetic::new(&g);
    let items: Arc<dyn ItemSource> = match case {
        "encoder-panic" => Arc::new(Faulty { inner: plain(), at: 0, panic: true }),
        "island-panic" => Arc::new(Faulty { inner: plain(), at: 1, panic: true }),
        "nan-stop" | "nan-skip" => Arc::new(Faulty { inner: plain(), at: 1, panic: false }),
        "llm-error" | "unmatched" => Arc::new(plain()),
        other => {
            return Err(RuntimeError::Model(format!(
                "unknown case {other:?}: encoder-panic, island-panic, llm-error, unmatched, nan-stop, nan-skip"
            )));
        }
    };
    let text: Arc<dyn TextSource> = if case == "llm-error" && rank == 2 {
        Arc::new(FailingText { inner: plain(), at: 1 })
    } else {
        Arc::new(plain())
    };
    let mut schedule = Schedule::build(&PipelineGraph::from_model(&g), Options::default())
        .map_err(|e| RuntimeError::Model(e.to_string()))?;
    if case == "unmatched" {
        let actions = schedule.ranks.get_mut(&0).expect("rank 0");
        let first = actions.iter().position(Action::has_boundary).expect("a boundary action");
        actions.remove(first);
    }
    let stages =
        build_stages(world, &g, DType::F32, &Sources { batches: Arc::new(plain()), text, items })?;
    let mut opts = train_options(&g, 2);
    opts.on_nonfinite = if case == "nan-skip" { OnNonFinite::Skip } else { OnNonFinite::Stop };
    let mut exec = Executor::new(stages, opts)?;
    let actions = &schedule.ranks[&rank];
    (0..2)
        .map(|s| {
            let plans = StepPlans::new(&g, BatchManifest::synthetic(&g, s as u64));
            let r = exec.step(world, actions, s, &plans)?;
            let what = if r.applied { "applied" } else { "skipped" };
            Ok(format!("step {s}: loss {:.6}, {what}", r.loss))
        })
        .collect()
}
