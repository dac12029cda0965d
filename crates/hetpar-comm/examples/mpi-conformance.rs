//! The conformance suite on the MPI backend:
//! `mpirun -n 4 target/release/examples/mpi-conformance`. Exits non-zero on any failure.
//! `--piece BYTES` cuts messages and all-reduces into pieces of that size instead of 1 GiB,
//! so the suite's messages exercise the pieces.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::time::Duration;

use hetpar_comm::conformance::SUITE;
use hetpar_comm::mpi::{MpiOptions, abort_on_panic, init, set_piece_bytes};
use hetpar_comm::{CommExt, Communicator, ReduceOp};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let piece = match args.get(1..).unwrap_or_default() {
        [] => None,
        [flag, n] if flag == "--piece" && n.parse::<usize>().is_ok_and(|n| n > 0) => n.parse().ok(),
        _ => {
            eprintln!("usage: mpi-conformance [--piece BYTES]");
            return ExitCode::FAILURE;
        }
    };
    if let Some(p) = piece {
        set_piece_bytes(p);
    }
    let opts = MpiOptions {
        timeout: Duration::from_secs(30),
        // Lines in one write each, so ranks sharing mpirun's output do not split them.
        on_fatal: Box::new(|e| {
            let line = format!("fatal: {e}\n");
            eprint!("{line}")
        }),
    };
    let world = match init(opts) {
        Ok(w) => w,
        Err(e) => {
            let line = format!("error: {e}\n");
            eprint!("{line}");
            return ExitCode::FAILURE;
        }
    };
    let rank = world.rank();
    abort_on_panic(rank, |line| eprint!("{line}"));
    let mut failures = 0i64;
    for (name, check) in SUITE {
        if let Err(e) = check(&world) {
            let line = format!("FAILED {name}: {e}\n");
            eprint!("{line}");
            failures += 1;
        }
    }
    let mut total = [failures];
    if let Err(e) = world.all_reduce(&mut total, ReduceOp::Sum) {
        let line = format!("error: {e}\n");
        eprint!("{line}");
        return ExitCode::FAILURE;
    }
    if rank == 0 {
        let pieces = piece.map_or_else(String::new, |p| format!(" (pieces of {p} bytes)"));
        println!(
            "mpi conformance on {} ranks{pieces}: {} checks, {} failures",
            world.size(),
            SUITE.len(),
            total[0]
        );
    }
    if total[0] == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
