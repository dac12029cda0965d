//! The `recording` wrapper: forwards every call to another communicator and logs what it
//! moved, so tests can assert what a layout communicates ("no TP all-reduce in the encoder",
//! "the boundary moves exactly the plan's bytes").
//!
//! Bytes are counted per rank and logically, the way plans count them: a point-to-point
//! message is sent by one rank and received by the other; an all-gather-v member sends its
//! part to every other member and receives every other part; a broadcast root sends to every
//! other member; an all-to-all-v member sends and receives what its counts say, not counting
//! itself; all-reduce and reduce-scatter count the ring algorithm's `(n-1)/n` of the data
//! per pass (two passes for all-reduce).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::comm::{Communicator, P2p};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

/// Operation kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpKind {
    /// Barrier.
    Barrier,
    /// All-reduce.
    AllReduce,
    /// Broadcast.
    Broadcast,
    /// All-gather(-v).
    AllGatherV,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all-v.
    AllToAllV,
    /// Point-to-point send.
    Send,
    /// Point-to-point receive.
    Recv,
}

/// One logged call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpRecord {
    /// What was called.
    pub kind: OpKind,
    /// World rank that called it.
    pub rank: usize,
    /// World ranks of the communicator.
    pub group: Vec<usize>,
    /// World rank of the peer, for point-to-point.
    pub peer: Option<usize>,
    /// Bytes this rank sent.
    pub sent: u64,
    /// Bytes this rank received.
    pub received: u64,
    /// Point-to-point: the index of the batched call ([`Communicator::batch_p2p`]) this
    /// rank posted the message in (counted from 0 per communicator handle); `None` for a lone call.
    pub batch: Option<u64>,
}

/// A shared log; one per recorded world (every rank and subgroup appends to it).
#[derive(Clone, Debug, Default)]
pub struct Log(Arc<Mutex<Vec<OpRecord>>>);

impl Log {
    /// A new, empty log.
    pub fn new() -> Log {
        Log::default()
    }

    fn push(&self, r: OpRecord) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(r);
    }

    /// Every record so far.
    pub fn records(&self) -> Vec<OpRecord> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets everything.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Calls per kind.
    pub fn count_by_kind(&self) -> BTreeMap<OpKind, usize> {
        let mut m = BTreeMap::new();
        for r in self.records() {
            *m.entry(r.kind).or_insert(0) += 1;
        }
        m
    }

    /// `(sent, received)` bytes per calling rank.
    pub fn bytes_by_rank(&self) -> BTreeMap<usize, (u64, u64)> {
        let mut m = BTreeMap::new();
        for r in self.records() {
            let e = m.entry(r.rank).or_insert((0, 0));
            e.0 += r.sent;
            e.1 += r.received;
        }
        m
    }

    /// Bytes sent per group (world ranks), summed over members.
    pub fn bytes_by_group(&self) -> BTreeMap<Vec<usize>, u64> {
        let mut m = BTreeMap::new();
        for r in self.records() {
            *m.entry(r.group.clone()).or_insert(0) += r.sent;
        }
        m
    }

    /// Bytes sent per `(from, to)` world-rank pair, point-to-point only.
    pub fn bytes_by_peer(&self) -> BTreeMap<(usize, usize), u64> {
        let mut m = BTreeMap::new();
        for r in self.records() {
            if let (OpKind::Send, Some(p)) = (r.kind, r.peer) {
                *m.entry((r.rank, p)).or_insert(0) += r.sent;
            }
        }
        m
    }
}

/// A communicator that logs every call to a [`Log`].
pub struct Recording<'a> {
    inner: Box<dyn Communicator + 'a>,
    log: Log,
    batches: AtomicU64,
}

impl std::fmt::Debug for Recording<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Recording({} rank {} of {})",
            self.inner.backend(),
            self.inner.rank(),
            self.inner.size()
        )
    }
}

impl<'a> Recording<'a> {
    /// Wraps `inner` (owned, or a reference: `&C` is a communicator too), logging to `log`.
    pub fn new(inner: Box<dyn Communicator + 'a>, log: Log) -> Recording<'a> {
        Recording { inner, log, batches: AtomicU64::new(0) }
    }

    fn record(&self, kind: OpKind, peer: Option<usize>, sent: usize, received: usize) {
        self.record_in(kind, peer, sent, received, None);
    }

    fn record_in(
        &self,
        kind: OpKind,
        peer: Option<usize>,
        sent: usize,
        received: usize,
        batch: Option<u64>,
    ) {
        self.log.push(OpRecord {
            kind,
            rank: self.inner.global_ranks()[self.inner.rank()],
            group: self.inner.global_ranks().to_vec(),
            peer: peer.map(|p| self.inner.global_ranks()[p]),
            sent: sent as u64,
            received: received as u64,
            batch,
        });
    }

    /// Records an all-gather of `send` bytes into `recv` bytes.
    fn record_all_gather(&self, send: usize, recv: usize) {
        let n = self.inner.size();
        self.record(OpKind::AllGatherV, None, send * (n - 1), recv.saturating_sub(send));
    }

    /// Records a reduce-scatter of `send` bytes (a ring's traffic each way).
    fn record_reduce_scatter(&self, send: usize) {
        let b = self.ring(send);
        self.record(OpKind::ReduceScatter, None, b, b);
    }

    fn ring(&self, bytes: usize) -> usize {
        let n = self.inner.size();
        bytes * (n - 1) / n
    }
}

impl Communicator for Recording<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn global_ranks(&self) -> &[usize] {
        self.inner.global_ranks()
    }
    fn backend(&self) -> &'static str {
        "recording"
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }

    fn barrier(&self) -> Result<()> {
        self.record(OpKind::Barrier, None, 0, 0);
        self.inner.barrier()
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let b = 2 * self.ring(data.len());
        self.record(OpKind::AllReduce, None, b, b);
        self.inner.all_reduce_bytes(data, dtype, op)
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        let n = self.inner.size();
        let (s, r) =
            if self.inner.rank() == root { (data.len() * (n - 1), 0) } else { (0, data.len()) };
        self.record(OpKind::Broadcast, None, s, r);
        self.inner.broadcast_bytes(data, root)
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        self.record_all_gather(send.len(), recv.len());
        self.inner.all_gather_v_bytes(send, recv, counts)
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.record_reduce_scatter(send.len());
        self.inner.reduce_scatter_bytes(send, recv, dtype, op)
    }

    /// Recorded as the all-gather it is: the same kind and bytes.
    fn all_gather_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        outer: usize,
    ) -> Result<()> {
        self.record_all_gather(send.len(), recv.len());
        self.inner.all_gather_interleaved_bytes(send, recv, outer)
    }

    /// Recorded as the reduce-scatter it is: the same kind and bytes.
    fn reduce_scatter_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        how: (DType, ReduceOp),
        outer: usize,
    ) -> Result<()> {
        self.record_reduce_scatter(send.len());
        self.inner.reduce_scatter_interleaved_bytes(send, recv, how, outer)
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        let me = self.inner.rank();
        let others = |c: &[usize]| {
            c.iter().enumerate().filter(|(j, _)| *j != me).map(|(_, v)| v).sum::<usize>()
        };
        self.record(OpKind::AllToAllV, None, others(sc), others(rc));
        self.inner.all_to_all_v_bytes(send, sc, recv, rc)
    }

    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        self.record(OpKind::Send, Some(dst), data.len(), 0);
        self.inner.send_bytes(data, dst, tag)
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        self.record(OpKind::Recv, Some(src), 0, data.len());
        self.inner.recv_bytes(data, src, tag)
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
        self.record(OpKind::Send, Some(dst), send.len(), 0);
        self.record(OpKind::Recv, Some(src), 0, recv.len());
        self.inner.send_recv_bytes(send, dst, st, recv, src, rt)
    }

    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let index = self.batches.fetch_add(1, Ordering::Relaxed);
        for op in ops.iter() {
            match op {
                P2p::Send { data, peer, .. } => {
                    self.record_in(OpKind::Send, Some(*peer), data.len(), 0, Some(index))
                }
                P2p::Recv { data, peer, .. } => {
                    self.record_in(OpKind::Recv, Some(*peer), 0, data.len(), Some(index))
                }
            }
        }
        self.inner.batch_p2p(ops)
    }

    fn subgroup(&self, ranks: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(Recording::new(self.inner.subgroup(ranks)?, self.log.clone())))
    }
}
