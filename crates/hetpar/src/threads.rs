//! How the ranks that share this machine share its threads. Products split over each
//! rank's share (`hetpar_nn::kernels::share_threads`, set on every rank's thread); candle
//! runs its own element-wise ops of 64K elements or more on a process-wide pool, sized
//! here before it starts.
#![allow(unsafe_code)]

/// Sizes candle's pool for element-wise ops (candle 0.11's `barrier_pool`: as many
/// threads as `CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS` or the physical cores, the
/// caller among them; its workers spin before they sleep) for the `ranks` rank threads of
/// this process. With several, 1: they would all queue on the one pool, while its workers
/// spin on cores the ranks need (the demo's 40 steps took 7.8-10.4 s with the shared pool
/// and 7.1-8.9 s without, BENCHMARKS.md); each rank then runs its element-wise ops on its
/// own thread. With one rank, candle's default. A `CANDLE_NUM_THREADS` already set wins.
///
/// Call it on the main thread before any other thread starts: candle reads the variable
/// when the pool is first used, and setting one is only sound while no other thread can
/// read the environment.
pub fn size_candle_pool(ranks: usize) {
    if ranks > 1 {
        set_candle_threads(1);
    }
}

/// Sizes candle's pool ([`size_candle_pool`]) for an MPI process, one rank, to the
/// process's share of its host's threads, and gives the products that share too. The
/// ranks on the host are as mpirun tells each process (Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH Hydra's `MPI_LOCALNRANKS`), 1 when it does not say.
/// (MPI's shared-memory split would ask MPI itself, but Open MPI 4.1 crashes in it where
/// two hosts share a hostname and only TCP joins them, as in `scripts/netns-mpi.sh`.)
/// Call it on the main thread before MPI starts its engine thread.
#[cfg(feature = "mpi")]
pub fn share_host() {
    let ranks = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
        .unwrap_or(1);
    set_candle_threads(hetpar_nn::kernels::share_threads(ranks));
}

fn set_candle_threads(n: usize) {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY: called on the main thread before any other thread exists (see the
        // callers' contract), so nothing reads the environment meanwhile.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", n.to_string()) };
    }
}
