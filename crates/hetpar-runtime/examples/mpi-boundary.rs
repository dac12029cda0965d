//! The boundary executor under MPI on a fixed set of plans:
//! `mpirun -n 8 target/release/examples/mpi-boundary`. Every rank checks its received rows
//! and gradients bitwise against the symbolic executor and its bytes against the plan.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::time::Duration;

use hetpar_comm::mpi::{MpiOptions, abort_on_panic, init};
use hetpar_comm::{CommExt, Communicator, ReduceOp};
use hetpar_runtime::testing::{check_boundary, fixed_plans};

fn main() -> ExitCode {
    let opts = MpiOptions {
        timeout: Duration::from_secs(30),
        // Lines in one write each, so ranks sharing mpirun's output do not split them.
        on_fatal: Box::new(|e| {
            let line = format!("fatal: {e}\n");
            eprint!("{line}")
        }),
    };
    let world = init(opts).expect("MPI initializes");
    let rank = world.rank();
    abort_on_panic(rank, |line| eprint!("{line}"));
    let plans = fixed_plans(world.size());
    let mut failures = 0i64;
    for (name, plan) in &plans {
        if let Err(e) = check_boundary(&world, plan, name) {
            let line = format!("FAILED {e}\n");
            eprint!("{line}");
            failures += 1;
        }
    }
    let mut total = [failures];
    world.all_reduce(&mut total, ReduceOp::Sum).expect("all-reduce");
    if rank == 0 {
        println!(
            "mpi boundary executor on {} ranks: {} plans, {} failures",
            world.size(),
            plans.len(),
            total[0]
        );
    }
    if total[0] == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
