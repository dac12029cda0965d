//! A wrapper that counts what one rank puts into a communicator and every subgroup made
//! from it: the bytes it contributes to each collective (its buffer of an all-reduce or
//! broadcast, its part of an all-gather, its input of a reduce-scatter, what it sends in an
//! all-to-all) and the bytes it sends point to point. Unlike [`crate::Recording`] it keeps
//! no log, only two counters, so it can stay on for a whole run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::comm::{Communicator, P2p};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;

/// Bytes and calls counted by a [`Counted`] communicator and its subgroups.
#[derive(Debug, Default)]
pub struct Traffic {
    bytes: AtomicU64,
    calls: AtomicU64,
}

impl Traffic {
    /// Bytes this rank has put in so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Operations this rank has called so far (a batch of messages is one).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

/// `inner`, counting into a shared [`Traffic`].
pub struct Counted<'a> {
    inner: Box<dyn Communicator + 'a>,
    traffic: Arc<Traffic>,
}

impl std::fmt::Debug for Counted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Counted({} rank {} of {})", self.inner.backend(), self.rank(), self.size())
    }
}

impl<'a> Counted<'a> {
    /// Wraps `inner` (owned, or a reference: `&C` is a communicator too), counting into
    /// `traffic`.
    pub fn new(inner: Box<dyn Communicator + 'a>, traffic: Arc<Traffic>) -> Counted<'a> {
        Counted { inner, traffic }
    }
}

impl Communicator for Counted<'_> {
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
        self.inner.backend()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn barrier(&self) -> Result<()> {
        self.traffic.add(0);
        self.inner.barrier()
    }
    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.traffic.add(data.len());
        self.inner.all_reduce_bytes(data, dtype, op)
    }
    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        self.traffic.add(if self.rank() == root { data.len() } else { 0 });
        self.inner.broadcast_bytes(data, root)
    }
    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        self.traffic.add(send.len());
        self.inner.all_gather_v_bytes(send, recv, counts)
    }
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.traffic.add(send.len());
        self.inner.reduce_scatter_bytes(send, recv, dtype, op)
    }
    fn all_gather_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        outer: usize,
    ) -> Result<()> {
        self.traffic.add(send.len());
        self.inner.all_gather_interleaved_bytes(send, recv, outer)
    }
    fn reduce_scatter_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        how: (DType, ReduceOp),
        outer: usize,
    ) -> Result<()> {
        self.traffic.add(send.len());
        self.inner.reduce_scatter_interleaved_bytes(send, recv, how, outer)
    }
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.traffic.add(send.len());
        self.inner.all_to_all_v_bytes(send, send_counts, recv, recv_counts)
    }
    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        self.traffic.add(data.len());
        self.inner.send_bytes(data, dst, tag)
    }
    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        self.traffic.add(0);
        self.inner.recv_bytes(data, src, tag)
    }
    fn send_recv_bytes(
        &self,
        send: &[u8],
        dst: usize,
        send_tag: u32,
        recv: &mut [u8],
        src: usize,
        recv_tag: u32,
    ) -> Result<()> {
        self.traffic.add(send.len());
        self.inner.send_recv_bytes(send, dst, send_tag, recv, src, recv_tag)
    }
    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let sent = ops
            .iter()
            .map(|op| match op {
                P2p::Send { data, .. } => data.len(),
                P2p::Recv { .. } => 0,
            })
            .sum();
        self.traffic.add(sent);
        self.inner.batch_p2p(ops)
    }
    fn subgroup(&self, ranks: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(Counted::new(self.inner.subgroup(ranks)?, self.traffic.clone())))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::time::Duration;

    use super::{Counted, Traffic};
    use crate::comm::{CommExt, Communicator};
    use crate::dtype::ReduceOp;
    use crate::local::{LocalOptions, launch};

    #[test]
    fn counts_what_each_rank_puts_in_also_through_subgroups() {
        let out = launch(3, LocalOptions { timeout: Duration::from_secs(10) }, |c| {
            let traffic = Arc::new(Traffic::default());
            let counted = Counted::new(Box::new(c), traffic.clone());
            let mut x = vec![1.0f64; 4];
            counted.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            if counted.rank() < 2 {
                let g = counted.subgroup(&[0, 1]).unwrap();
                let mut y = vec![0f32; 2 * 3];
                g.all_gather(&[1.0f32; 3], &mut y).unwrap();
            }
            (x[0], traffic.bytes(), traffic.calls())
        })
        .unwrap();
        assert_eq!(out[0], (3.0, 32 + 12, 2));
        assert_eq!(out[2], (3.0, 32, 1));
    }
}
