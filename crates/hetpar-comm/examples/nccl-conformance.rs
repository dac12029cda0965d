//! The conformance suite on the NCCL backend, one GPU per rank:
//! `mpirun -n N target/release/examples/nccl-conformance` on a machine with N GPUs (rank r
//! uses GPU r modulo the GPUs present). Compiled in CI; run where a GPU exists.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::time::Duration;

use hetpar_comm::conformance::SUITE;
use hetpar_comm::mpi::{MpiOptions, abort_on_panic, init};
use hetpar_comm::{CommExt, Communicator, ReduceOp};

fn main() -> ExitCode {
    let opts = MpiOptions {
        timeout: Duration::from_secs(60),
        // Lines in one write each, so ranks sharing mpirun's output do not split them.
        on_fatal: Box::new(|e| {
            let line = format!("fatal: {e}\n");
            eprint!("{line}")
        }),
    };
    let world = init(opts).expect("MPI initializes");
    let rank = world.rank();
    abort_on_panic(rank, |line| eprint!("{line}"));
    let devices: usize =
        std::env::var("HETPAR_GPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let comm = match hetpar_comm::nccl::init(Box::new(world), rank % devices.max(1)) {
        Ok(c) => c,
        Err(e) => {
            let line = format!("rank {rank}: cannot start NCCL: {e}\n");
            eprint!("{line}");
            return ExitCode::FAILURE;
        }
    };
    let mut failures = 0i64;
    // NCCL sums in its own order (deterministic for one topology, not the members' order
    // the local and MPI backends keep), so the order checks do not apply to it.
    // Nor does the length check of a message: NCCL's receives take the bytes they ask for.
    let suite: Vec<_> = SUITE
        .iter()
        .filter(|(name, _)| !name.starts_with("sum_order") && *name != "message_lengths")
        .collect();
    for (name, check) in &suite {
        if let Err(e) = check(&comm) {
            let line = format!("FAILED {name}: {e}\n");
            eprint!("{line}");
            failures += 1;
        }
    }
    let mut total = [failures];
    comm.all_reduce(&mut total, ReduceOp::Sum).expect("all-reduce");
    if rank == 0 {
        println!(
            "nccl conformance on {} ranks: {} checks, {} failures",
            comm.size(),
            suite.len(),
            total[0]
        );
    }
    if total[0] == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
