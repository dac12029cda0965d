//! The `Communicator` trait: what every backend provides, on bytes tagged with a type, and
//! [`CommExt`], the typed API everything above this crate calls.
//!
//! Conventions, shared by all backends:
//! - ranks in arguments are indices in this communicator (`0..size`); `global_ranks` maps
//!   them to world ranks, and errors always name world ranks;
//! - every member calls the collectives of a communicator in the same order;
//! - every blocking call returns [`CommError::Timeout`] after `timeout()` instead of hanging;
//! - counts in the byte-level methods are in bytes, in the typed methods in elements.

use std::time::Duration;

use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};

/// A group of ranks that can talk. Object safe: code above this crate holds
/// `&dyn Communicator` or `Arc<dyn Communicator>`. `Send + Sync` so that autograd ops can
/// hold one (candle requires it); backends whose handles are thread-bound keep them on an
/// engine thread.
pub trait Communicator: Send + Sync {
    /// This rank's index in the communicator.
    fn rank(&self) -> usize;
    /// Number of members.
    fn size(&self) -> usize;
    /// World rank of each member, by index.
    fn global_ranks(&self) -> &[usize];
    /// Backend name: `local`, `mpi`, `nccl`, `recording(...)`.
    fn backend(&self) -> &'static str;
    /// How long a blocking call may wait.
    fn timeout(&self) -> Duration;
    /// Sets how long this rank's blocking calls may wait, in this communicator and every
    /// other of this rank in the job (its world and groups share one setting per rank).
    /// [`CommExt::with_timeout`] is the scoped form.
    fn set_timeout(&self, timeout: Duration);

    /// Waits until every member has arrived.
    fn barrier(&self) -> Result<()>;
    /// Reduces `data` elementwise over all members; everyone gets the result.
    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;
    /// Copies `root`'s `data` to every member.
    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()>;
    /// Member `i` contributes `counts[i]` bytes (`send`); everyone receives the
    /// concatenation in member order (`recv`, `sum(counts)` bytes).
    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()>;
    /// `send` holds `size` equal blocks; member `i` receives block `i` reduced over all.
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;
    /// Sends `send_counts[j]` bytes (consecutive in `send`) to member `j` and receives
    /// `recv_counts[j]` bytes from member `j` (consecutive in `recv`).
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()>;
    /// An all-gather along a middle dimension: `send` is `outer` equal runs, and `recv`
    /// holds, run after run, every member's run in member order (`[outer, size, run]`;
    /// `recv.len() == size * send.len()`). The gathered rows of a row-major tensor split
    /// along a dimension that is not its first. The default gathers into a buffer of its own
    /// and reorders; a backend that writes each run in place overrides it.
    fn all_gather_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        outer: usize,
    ) -> Result<()> {
        args::interleaved(self, "all-gather-interleaved", send.len(), recv.len(), outer)?;
        let n = self.size();
        let mut all = vec![0u8; recv.len()];
        self.all_gather_v_bytes(send, &mut all, &vec![send.len(); n])?;
        let run = send.len() / outer.max(1);
        for o in 0..outer {
            for m in 0..n {
                let from = m * send.len() + o * run;
                recv[(o * n + m) * run..][..run].copy_from_slice(&all[from..from + run]);
            }
        }
        Ok(())
    }
    /// A reduce-scatter along a middle dimension: `send` is `outer` runs of `size` equal
    /// blocks, and member `i` receives block `i` of every run reduced over all members, run
    /// after run (`recv`, `[outer, block]`; `send.len() == size * recv.len()`). The default
    /// packs the blocks member by member into a buffer of its own; a backend that reduces
    /// them in place overrides it. Either way each element is reduced in member order, as
    /// [`Self::reduce_scatter_bytes`] reduces it.
    fn reduce_scatter_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        (dtype, op): (DType, ReduceOp),
        outer: usize,
    ) -> Result<()> {
        let what = "reduce-scatter-interleaved";
        args::interleaved(self, what, recv.len(), send.len(), outer)?;
        let (n, block) = (self.size(), recv.len() / outer.max(1));
        if !block.is_multiple_of(dtype.size()) {
            return Err(CommError::Usage(format!(
                "{what} on rank {}: blocks of {block} bytes are not whole {} elements",
                self.global_rank(),
                dtype.name()
            )));
        }
        let mut packed = Vec::with_capacity(send.len());
        for m in 0..n {
            for o in 0..outer {
                packed.extend_from_slice(&send[(o * n + m) * block..][..block]);
            }
        }
        self.reduce_scatter_bytes(&packed, recv, dtype, op)
    }
    /// Sends `data` to member `dst` with `tag`. Messages between a pair with one tag arrive
    /// in order.
    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()>;
    /// Receives exactly `data.len()` bytes from member `src` with `tag`; a message of
    /// another length is a [`CommError::Mismatch`].
    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()>;
    /// Sends to `dst` and receives from `src` at once; never deadlocks against a matching
    /// `send_recv` on the peer.
    fn send_recv_bytes(
        &self,
        send: &[u8],
        dst: usize,
        send_tag: u32,
        recv: &mut [u8],
        src: usize,
        recv_tag: u32,
    ) -> Result<()>;
    /// Posts every message of `ops` at once and returns when all of them have completed:
    /// non-blocking sends and receives then a wait for all (MPI), one group call (NCCL).
    /// It never deadlocks against peers' batches that post the matching messages, in
    /// whatever order either side lists them. Messages between a pair with one tag match in
    /// the order listed; a message to this rank itself is a local copy. A receive of another
    /// length than its message is a [`CommError::Mismatch`]. Every peer is checked before
    /// any byte moves.
    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()>;
    /// A communicator of the members listed (indices in this communicator, ascending, this
    /// rank among them). Only the listed members call it, with the same list; a member's
    /// `k`-th call with a given list matches the others' `k`-th call.
    fn subgroup(&self, ranks: &[usize]) -> Result<Box<dyn Communicator>>;
}

/// One message of a [`Communicator::batch_p2p`] call; peers are member indices.
#[derive(Debug)]
pub enum P2p<'a> {
    /// Sends `data` to `peer` with `tag`.
    Send {
        /// The bytes.
        data: &'a [u8],
        /// Destination.
        peer: usize,
        /// Tag.
        tag: u32,
    },
    /// Receives exactly `data.len()` bytes from `peer` with `tag`.
    Recv {
        /// Where the bytes land.
        data: &'a mut [u8],
        /// Source.
        peer: usize,
        /// Tag.
        tag: u32,
    },
}

impl<'a> P2p<'a> {
    /// A typed send.
    pub fn send<T: Element>(data: &'a [T], peer: usize, tag: u32) -> P2p<'a> {
        P2p::Send { data: bytes(data), peer, tag }
    }

    /// A typed receive (`data.len()` elements).
    pub fn recv<T: Element>(data: &'a mut [T], peer: usize, tag: u32) -> P2p<'a> {
        P2p::Recv { data: bytes_mut(data), peer, tag }
    }

    /// The peer.
    pub fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }

    /// The tag.
    pub fn tag(&self) -> u32 {
        match self {
            P2p::Send { tag, .. } | P2p::Recv { tag, .. } => *tag,
        }
    }

    /// Bytes this message moves.
    pub fn len(&self) -> usize {
        match self {
            P2p::Send { data, .. } => data.len(),
            P2p::Recv { data, .. } => data.len(),
        }
    }

    /// Whether it moves no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks every peer of a batch, and returns a name for it in errors and status replies
/// ("batch of 2 sends to ranks [1, 3] and 1 receive from ranks [2]", world ranks).
pub fn check_batch(comm: &dyn Communicator, ops: &[P2p<'_>]) -> Result<String> {
    let (mut to, mut from) = (Vec::new(), Vec::new());
    for op in ops {
        check_peer(comm, op.peer(), "batched point-to-point")?;
        let world = comm.global_ranks()[op.peer()];
        match op {
            P2p::Send { .. } => to.push(world),
            P2p::Recv { .. } => from.push(world),
        }
    }
    let plural = |n: usize, one: &str| if n == 1 { one.to_string() } else { format!("{one}s") };
    to.dedup();
    from.dedup();
    let (ns, nr) = (
        ops.iter().filter(|o| matches!(o, P2p::Send { .. })).count(),
        ops.iter().filter(|o| matches!(o, P2p::Recv { .. })).count(),
    );
    Ok(format!(
        "batch of {ns} {} to ranks {to:?} and {nr} {} from ranks {from:?}",
        plural(ns, "send"),
        plural(nr, "receive")
    ))
}

/// The mismatch error of a receive of `want` bytes by member `me` of `members` (world
/// ranks) that found a message of `got` bytes from member `src`.
pub(crate) fn length_mismatch(
    members: &[usize],
    me: usize,
    src: usize,
    tag: u32,
    got: usize,
    want: usize,
) -> CommError {
    CommError::Mismatch {
        op: format!("recv from rank {} (tag {tag})", members[src]),
        group: members.to_vec(),
        detail: format!(
            "rank {} sent {got} bytes, rank {} expects {want}",
            members[src], members[me]
        ),
    }
}

impl std::fmt::Debug for dyn Communicator + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} communicator, rank {} of world ranks {:?}",
            self.backend(),
            self.rank(),
            self.global_ranks()
        )
    }
}

/// A reference to a communicator is a communicator (so wrappers can borrow one).
impl<C: Communicator + ?Sized> Communicator for &C {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn global_ranks(&self) -> &[usize] {
        (**self).global_ranks()
    }
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        (**self).set_timeout(timeout)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        (**self).all_reduce_bytes(data, dtype, op)
    }
    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        (**self).broadcast_bytes(data, root)
    }
    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        (**self).all_gather_v_bytes(send, recv, counts)
    }
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        (**self).reduce_scatter_bytes(send, recv, dtype, op)
    }
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        (**self).all_to_all_v_bytes(send, sc, recv, rc)
    }
    fn all_gather_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        outer: usize,
    ) -> Result<()> {
        (**self).all_gather_interleaved_bytes(send, recv, outer)
    }
    fn reduce_scatter_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        how: (DType, ReduceOp),
        outer: usize,
    ) -> Result<()> {
        (**self).reduce_scatter_interleaved_bytes(send, recv, how, outer)
    }
    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        (**self).send_bytes(data, dst, tag)
    }
    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        (**self).recv_bytes(data, src, tag)
    }
    fn send_recv_bytes(
        &self,
        send: &[u8],
        dst: usize,
        st: u32,
        recv: &mut [u8],
        src: usize,
        rt: u32,
    ) -> Result<()> {
        (**self).send_recv_bytes(send, dst, st, recv, src, rt)
    }
    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        (**self).batch_p2p(ops)
    }
    fn subgroup(&self, ranks: &[usize]) -> Result<Box<dyn Communicator>> {
        (**self).subgroup(ranks)
    }
}

/// Checks a subgroup list: ascending, in range, containing the caller.
pub fn check_subgroup(comm: &dyn Communicator, ranks: &[usize]) -> Result<()> {
    let ok =
        ranks.windows(2).all(|w| w[0] < w[1]) && ranks.last().is_some_and(|&r| r < comm.size());
    if !ok || !ranks.contains(&comm.rank()) {
        return Err(CommError::Usage(format!(
            "subgroup {ranks:?} of a communicator of {} must be ascending, in range and contain the caller (rank {})",
            comm.size(),
            comm.rank()
        )));
    }
    Ok(())
}

/// Checks that `peer` is a member index.
pub fn check_peer(comm: &dyn Communicator, peer: usize, what: &str) -> Result<()> {
    if peer >= comm.size() {
        return Err(CommError::Usage(format!(
            "{what}: rank {peer} is not in a communicator of {} (world ranks {:?})",
            comm.size(),
            comm.global_ranks()
        )));
    }
    Ok(())
}

fn bytes<T: Element>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn bytes_mut<T: Element>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

fn scaled<T: Element>(counts: &[usize]) -> Vec<usize> {
    counts.iter().map(|c| c * T::DTYPE.size()).collect()
}

/// A timeout the communicators of one rank share and may change (in nanoseconds).
#[derive(Debug)]
pub(crate) struct SharedTimeout(std::sync::atomic::AtomicU64);

impl SharedTimeout {
    pub(crate) fn new(t: Duration) -> SharedTimeout {
        SharedTimeout(std::sync::atomic::AtomicU64::new(nanos(t)))
    }

    pub(crate) fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub(crate) fn set(&self, t: Duration) {
        self.0.store(nanos(t), std::sync::atomic::Ordering::Relaxed);
    }
}

fn nanos(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
}

/// The typed API, for every communicator (including `dyn Communicator`).
pub trait CommExt: Communicator {
    /// Typed [`Communicator::all_reduce_bytes`].
    fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(bytes_mut(data), T::DTYPE, op)
    }

    /// Typed [`Communicator::broadcast_bytes`].
    fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(bytes_mut(data), root)
    }

    /// All-gather with equal contributions: `recv.len() == size * send.len()`.
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let counts = vec![send.len() * T::DTYPE.size(); self.size()];
        self.all_gather_v_bytes(bytes(send), bytes_mut(recv), &counts)
    }

    /// Typed [`Communicator::all_gather_v_bytes`]; `counts` in elements.
    fn all_gather_v<T: Element>(&self, send: &[T], recv: &mut [T], counts: &[usize]) -> Result<()> {
        self.all_gather_v_bytes(bytes(send), bytes_mut(recv), &scaled::<T>(counts))
    }

    /// Runs `f` with this rank's blocking calls allowed to wait `timeout` (or the current
    /// timeout where that is longer), then restores the timeout: for phases where members
    /// wait on one another's disks rather than on communication, such as writing a
    /// checkpoint. Every member calls it around the same calls.
    fn with_timeout<R>(&self, timeout: Duration, f: impl FnOnce() -> R) -> R {
        let before = self.timeout();
        self.set_timeout(timeout.max(before));
        let out = f();
        self.set_timeout(before);
        out
    }

    /// All-gather of byte strings of any length, their lengths exchanged first: every
    /// member's bytes, in member order.
    fn all_gather_any(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut lens = vec![0i64; self.size()];
        self.all_gather(&[mine.len() as i64], &mut lens)?;
        let counts: Vec<usize> = lens.iter().map(|&l| usize::try_from(l).unwrap_or(0)).collect();
        let mut all = vec![0u8; counts.iter().sum()];
        self.all_gather_v_bytes(mine, &mut all, &counts)?;
        let mut at = 0;
        Ok(counts
            .iter()
            .map(|&k| {
                at += k;
                all[at - k..at].to_vec()
            })
            .collect())
    }

    /// Typed [`Communicator::reduce_scatter_bytes`].
    fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_bytes(bytes(send), bytes_mut(recv), T::DTYPE, op)
    }

    /// Typed [`Communicator::all_gather_interleaved_bytes`].
    fn all_gather_interleaved<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        outer: usize,
    ) -> Result<()> {
        // In elements first: a run must be whole elements, which bytes cannot tell.
        args::interleaved(self, "all-gather-interleaved", send.len(), recv.len(), outer)?;
        self.all_gather_interleaved_bytes(bytes(send), bytes_mut(recv), outer)
    }

    /// Typed [`Communicator::reduce_scatter_interleaved_bytes`].
    fn reduce_scatter_interleaved<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        outer: usize,
    ) -> Result<()> {
        args::interleaved(self, "reduce-scatter-interleaved", recv.len(), send.len(), outer)?;
        self.reduce_scatter_interleaved_bytes(bytes(send), bytes_mut(recv), (T::DTYPE, op), outer)
    }

    /// Typed [`Communicator::all_to_all_v_bytes`]; counts in elements.
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_bytes(
            bytes(send),
            &scaled::<T>(send_counts),
            bytes_mut(recv),
            &scaled::<T>(recv_counts),
        )
    }

    /// Typed [`Communicator::send_bytes`].
    fn send<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        self.send_bytes(bytes(data), dst, tag)
    }

    /// Typed [`Communicator::recv_bytes`].
    fn recv<T: Element>(&self, data: &mut [T], src: usize, tag: u32) -> Result<()> {
        self.recv_bytes(bytes_mut(data), src, tag)
    }

    /// Typed [`Communicator::send_recv_bytes`].
    fn send_recv<T: Element>(
        &self,
        send: &[T],
        dst: usize,
        send_tag: u32,
        recv: &mut [T],
        src: usize,
        recv_tag: u32,
    ) -> Result<()> {
        self.send_recv_bytes(bytes(send), dst, send_tag, bytes_mut(recv), src, recv_tag)
    }

    /// This rank's world rank.
    fn global_rank(&self) -> usize {
        self.global_ranks()[self.rank()]
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}

/// Checks the argument sizes of a collective before any byte moves, so every backend
/// rejects bad calls the same way.
pub(crate) mod args {
    use super::*;

    pub fn all_gather_v(
        comm: &dyn Communicator,
        send: &[u8],
        recv: &[u8],
        counts: &[usize],
    ) -> Result<()> {
        if counts.len() != comm.size()
            || counts[comm.rank()] != send.len()
            || counts.iter().sum::<usize>() != recv.len()
        {
            return Err(CommError::Usage(format!(
                "all-gather-v on rank {}: {} counts for {} members, own count {:?} for {} bytes sent, counts sum to {} for {} bytes of receive buffer",
                comm.global_rank(),
                counts.len(),
                comm.size(),
                counts.get(comm.rank()),
                send.len(),
                counts.iter().sum::<usize>(),
                recv.len()
            )));
        }
        Ok(())
    }

    pub fn reduce_scatter(
        comm: &dyn Communicator,
        send: &[u8],
        recv: &[u8],
        dtype: DType,
    ) -> Result<()> {
        if send.len() != recv.len() * comm.size() || !recv.len().is_multiple_of(dtype.size()) {
            return Err(CommError::Usage(format!(
                "reduce-scatter on rank {}: {} bytes sent must be {} members x {} bytes received, whole {} elements",
                comm.global_rank(),
                send.len(),
                comm.size(),
                recv.len(),
                dtype.name()
            )));
        }
        Ok(())
    }

    pub fn all_to_all_v(
        comm: &dyn Communicator,
        send: &[u8],
        sc: &[usize],
        recv: &[u8],
        rc: &[usize],
    ) -> Result<()> {
        let n = comm.size();
        if sc.len() != n
            || rc.len() != n
            || sc.iter().sum::<usize>() != send.len()
            || rc.iter().sum::<usize>() != recv.len()
        {
            return Err(CommError::Usage(format!(
                "all-to-all-v on rank {}: send counts {sc:?} for {} bytes, receive counts {rc:?} for {} bytes, {n} members",
                comm.global_rank(),
                send.len(),
                recv.len()
            )));
        }
        Ok(())
    }

    /// An interleaved all-gather's (`part` sent, `whole` received) or reduce-scatter's
    /// (`part` received, `whole` sent) sizes: `whole` is `size` parts, and `part` splits
    /// into `outer` equal runs (`outer` 0 only for nothing at all).
    pub fn interleaved<C: Communicator + ?Sized>(
        comm: &C,
        op: &str,
        part: usize,
        whole: usize,
        outer: usize,
    ) -> Result<()> {
        let runs = if outer == 0 { part == 0 } else { part.is_multiple_of(outer) };
        if whole != part * comm.size() || !runs {
            return Err(CommError::Usage(format!(
                "{op} on rank {}: {whole} must be {} members x {part}, and {part} split into {outer} equal runs",
                comm.global_rank(),
                comm.size()
            )));
        }
        Ok(())
    }

    pub fn elements(comm: &dyn Communicator, op: &str, len: usize, dtype: DType) -> Result<()> {
        if !len.is_multiple_of(dtype.size()) {
            return Err(CommError::Usage(format!(
                "{op} on rank {}: {len} bytes are not whole {} elements",
                comm.global_rank(),
                dtype.name()
            )));
        }
        Ok(())
    }
}
