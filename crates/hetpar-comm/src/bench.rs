//! Communication benchmarks: time per operation and bus bandwidth with the nccl-tests
//! conventions, so numbers compare across backends, group sizes and published reports.
//!
//! With `S` the message size and `t` the slowest rank's time per call, `algbw = S / t` and
//! - all-reduce (S per rank): `busbw = algbw * 2(n-1)/n`;
//! - all-gather (S gathered in total): `busbw = algbw * (n-1)/n`;
//! - all-to-all-v (S sent per rank, equal parts): `busbw = algbw * (n-1)/n`;
//! - point-to-point (S sent and S received per rank, a ring of send-recv): `busbw = algbw`.
//!
//! `busbw` is the bandwidth each rank's link sustains; on one machine its ceiling is memory
//! bandwidth, which [`memcpy_bandwidth`] measures.

use std::time::Instant;

use crate::comm::{CommExt, Communicator};
use crate::dtype::ReduceOp;
use crate::error::Result;

/// Benchmarked operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    /// All-reduce (sum, f32).
    AllReduce,
    /// All-gather.
    AllGather,
    /// All-to-all-v with equal parts.
    AllToAllV,
    /// Send-recv around a ring.
    PointToPoint,
}

impl BenchOp {
    /// Every operation.
    pub const ALL: [BenchOp; 4] =
        [BenchOp::AllReduce, BenchOp::AllGather, BenchOp::AllToAllV, BenchOp::PointToPoint];

    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all-reduce",
            BenchOp::AllGather => "all-gather",
            BenchOp::AllToAllV => "all-to-all-v",
            BenchOp::PointToPoint => "send-recv",
        }
    }

    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::AllToAllV => (n - 1.0) / n,
            BenchOp::PointToPoint => 1.0,
        }
    }
}

/// One measurement.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BenchResult {
    /// Operation.
    pub op: BenchOp,
    /// Members.
    pub ranks: usize,
    /// Message size `S` in bytes.
    pub bytes: usize,
    /// Slowest rank's seconds per call.
    pub seconds: f64,
    /// `S / seconds`, bytes per second.
    pub algbw: f64,
    /// Bus bandwidth, bytes per second.
    pub busbw: f64,
}

/// Times `iters` calls of `op` with `bytes` per message on `comm` (after one warm-up call);
/// every member must call it with the same arguments. Returns the same result on every rank.
pub fn bench(
    comm: &dyn Communicator,
    op: BenchOp,
    bytes: usize,
    iters: usize,
) -> Result<BenchResult> {
    let n = comm.size();
    let elems = (bytes / 4).max(n) / n * n; // f32 elements, divisible by n
    let part = elems / n;
    let mut data = vec![1.0f32; elems];
    let mut out = vec![0.0f32; elems];
    let counts = vec![part; n];
    let (me, next, prev) = (comm.rank(), (comm.rank() + 1) % n, (comm.rank() + n - 1) % n);
    let mut run = || -> Result<()> {
        match op {
            BenchOp::AllReduce => comm.all_reduce(&mut data, ReduceOp::Sum),
            BenchOp::AllGather => comm.all_gather(&data[me * part..(me + 1) * part], &mut out),
            BenchOp::AllToAllV => comm.all_to_all_v(&data, &counts, &mut out, &counts),
            BenchOp::PointToPoint => comm.send_recv(&data, next, 0, &mut out, prev, 0),
        }
    };
    run()?;
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        run()?;
    }
    let mut slowest = [start.elapsed().as_secs_f64() / iters as f64];
    comm.all_reduce(&mut slowest, ReduceOp::Max)?;
    let size = elems * 4;
    let algbw = size as f64 / slowest[0];
    Ok(BenchResult {
        op,
        ranks: n,
        bytes: size,
        seconds: slowest[0],
        algbw,
        busbw: algbw * op.bus_factor(n),
    })
}

/// Bytes per second each of `threads` threads copies when all copy `bytes` at once, each
/// between buffers of its own (the best of `iters` rounds, the slowest thread's time in
/// each): with the C library's `memcpy`, or, `streamed`, as the local backend copies from
/// another member's buffer (non-temporal stores from 32 MiB on x86-64, `crate::local`'s
/// `copy.rs`). Two threads show what the copies of a 2-rank collective get at once.
pub fn copy_bandwidth(bytes: usize, threads: usize, iters: usize, streamed: bool) -> f64 {
    let threads = threads.max(1);
    let start = std::sync::Barrier::new(threads);
    let times: Vec<Vec<f64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let start = &start;
                scope.spawn(move || {
                    let src = vec![1u8; bytes];
                    let mut dst = vec![0u8; bytes];
                    (0..iters.max(1) + 1)
                        .map(|_| {
                            start.wait();
                            let t = Instant::now();
                            if streamed {
                                crate::local::copy::copy(&mut dst, &src);
                            } else {
                                dst.copy_from_slice(&src);
                            }
                            std::hint::black_box(&mut dst);
                            t.elapsed().as_secs_f64()
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a copying thread")).collect()
    });
    // Round 0 touches the pages; each later round counts at its slowest thread's time.
    let best = (1..=iters.max(1))
        .map(|r| times.iter().map(|t| t[r]).fold(0.0, f64::max))
        .fold(f64::INFINITY, f64::min);
    bytes as f64 / best
}

/// Single-thread memcpy bandwidth (bytes copied per second) over a buffer of `bytes`, the
/// best of `iters` copies after one that touches the pages: the ceiling for moving bytes
/// between threads of one machine ([`copy_bandwidth`] on one thread, by `memcpy`).
pub fn memcpy_bandwidth(bytes: usize, iters: usize) -> f64 {
    copy_bandwidth(bytes, 1, iters, false)
}
