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
        on_fatal: Box::new(|e| eprintln!("fatal: {e}")),
    };
    let world = init(opts).expect("MPI initializes");
    let rank = world.rank();
    abort_on_panic(rank, |line| eprintln!("{line}"));
    let devices: usize =
        std::env::var("HETPAR_GPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let comm = match hetpar_comm::nccl::init(Box::new(world), rank % devices.max(1)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rank {rank}: cannot start NCCL: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failures = 0i64;
    for (name, check) in SUITE {
        if let Err(e) = check(&comm) {
            eprintln!("FAILED {name}: {e}");
            failures += 1;
        }
    }
    let mut total = [failures];
    comm.all_reduce(&mut total, ReduceOp::Sum).expect("all-reduce");
    if rank == 0 {
        println!(
            "nccl conformance on {} ranks: {} checks, {} failures",
            comm.size(),
            SUITE.len(),
            total[0]
        );
    }
    if total[0] == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
