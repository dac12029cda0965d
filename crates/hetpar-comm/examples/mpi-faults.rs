//! Fault injection for the MPI backend, checked by CI: each case must end with a non-zero
//! exit and a message naming the rank and the operation, within the timeout.
//!
//! `mpirun -n 4 target/release/examples/mpi-faults CASE` with CASE one of `hang` (rank 1
//! never joins a barrier), `recv` (a receive with no send), `size` (a receive of the wrong
//! size), `batch` (a batched exchange one of whose receives is never sent), `panic` (rank 2
//! panics mid-step), `chain` (rank 1 stops for good, its process frozen; rank 0 waits for it
//! in a collective of the two, rank 2 for a message of rank 0's, and rank 2's timeout,
//! which fires first, names rank 1).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;
use std::time::Duration;

use hetpar_comm::mpi::{MpiOptions, abort_job, abort_on_panic, init};
use hetpar_comm::{CommExt, Communicator, P2p, ReduceOp};

fn main() -> ExitCode {
    let case = std::env::args().nth(1).unwrap_or_default();
    let opts = MpiOptions {
        timeout: Duration::from_secs(3),
        // Lines in one write each, so ranks sharing mpirun's output do not split them.
        on_fatal: Box::new(|e| {
            let line = format!("fatal: {e}\n");
            eprint!("{line}")
        }),
    };
    let world = init(opts).expect("MPI initializes");
    let rank = world.rank();
    abort_on_panic(rank, |line| eprint!("{line}"));
    let result = match case.as_str() {
        "hang" => {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(30));
            }
            world.barrier()
        }
        "recv" => {
            if rank == 0 {
                world.recv(&mut [0.0f32; 8], 1, 5)
            } else {
                std::thread::sleep(Duration::from_secs(5));
                Ok(())
            }
        }
        "size" => match rank {
            0 => world.send(&[1.0f64; 3], 1, 0),
            1 => world.recv(&mut [0.0f64; 2], 0, 0),
            _ => Ok(()),
        },
        "batch" => match rank {
            0 => {
                let (a, mut b) = ([1i64; 4], [0i64; 4]);
                world.batch_p2p(&mut [P2p::send(&a, 1, 6), P2p::recv(&mut b, 2, 7)])
            }
            1 => world.recv(&mut [0i64; 4], 0, 6),
            _ => {
                std::thread::sleep(Duration::from_secs(5));
                Ok(())
            }
        },
        "chain" => match rank {
            0 | 1 => {
                let pair = world.subgroup(&[0, 1]).expect("the pair's communicator");
                if rank == 1 {
                    // Frozen whole, its engine thread too: it answers no status query.
                    let me = std::process::id().to_string();
                    let stop = std::process::Command::new("kill").args(["-STOP", &me]).status();
                    assert!(stop.expect("kill runs").success(), "rank 1 stops itself");
                    Ok(())
                } else {
                    // Rank 2 has waited 1.5 s longer when its timeout fires.
                    std::thread::sleep(Duration::from_millis(1500));
                    pair.all_reduce(&mut [1.0f32], ReduceOp::Sum)
                }
            }
            2 => world.recv(&mut [0.0f32; 4], 0, 9),
            _ => {
                std::thread::sleep(Duration::from_secs(8));
                Ok(())
            }
        },
        "panic" => {
            if rank == 2 {
                panic!("injected fault on rank 2");
            }
            let mut x = [1.0f32];
            world.all_reduce(&mut x, ReduceOp::Sum).and_then(|_| world.barrier())
        }
        other => {
            eprintln!("unknown case {other:?}: use hang, recv, size, batch, panic or chain");
            return ExitCode::from(2);
        }
    };
    // A rank whose own part succeeded waits for the others, as a real program meets its
    // peers again, instead of finalizing MPI while mpirun tears the job down: OpenMPI 4's
    // mpirun can hang for good when one process exits normally during that teardown.
    match result.and_then(|()| world.barrier()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let line = format!("rank {rank}: error: {e}\n");
            eprint!("{line}");
            abort_job(1)
        }
    }
}
