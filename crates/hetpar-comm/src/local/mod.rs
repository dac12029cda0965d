//! The `local` backend: N ranks as threads of one process.
//!
//! [`launch`] runs a closure on every rank with its world communicator. Collectives deposit
//! contributions in a shared slot and combine them in member order, so results are bitwise
//! identical from run to run; all-reduce reduces one chunk per member (reduce-scatter) and
//! then gathers the chunks, so each rank touches the data about twice. Sends are buffered
//! (they never block); receives wait. A rank that panics or returns makes every rank waiting
//! on it fail at once with its rank in the error.

mod state;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use self::state::{CallSite, Shared, Signature};
use crate::comm::{
    Communicator, P2p, args, check_batch, check_peer, check_subgroup, length_mismatch,
};
use crate::dtype::{DType, ReduceOp, reduce_into, reduce_onto};
use crate::error::{CommError, Result};

/// Options of a local world.
#[derive(Clone, Copy, Debug)]
pub struct LocalOptions {
    /// How long a blocking call waits before failing.
    pub timeout: Duration,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions { timeout: Duration::from_secs(60) }
    }
}

/// Runs `f` on `world` ranks (threads named `rank-N`) and returns their results in rank
/// order. If a rank panics, every other rank's pending and later communication fails with
/// [`CommError::PeerFailed`] naming it, and `launch` returns that error.
pub fn launch<R, F>(world: usize, opts: LocalOptions, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(&LocalComm) -> R + Sync,
{
    assert!(world > 0, "a world needs at least one rank");
    let shared = Arc::new(Shared::new(world, opts.timeout));
    let results: Vec<Option<R>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (shared, f) = (shared.clone(), &f);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let comm = LocalComm::world(shared.clone(), rank, world);
                        match catch_unwind(AssertUnwindSafe(|| f(&comm))) {
                            Ok(v) => {
                                shared.exit(rank, None);
                                Some(v)
                            }
                            Err(payload) => {
                                shared.exit(rank, Some(panic_message(payload.as_ref())));
                                None
                            }
                        }
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(None)).collect()
    });
    if let Some((failed, message)) = shared.first_failure() {
        return Err(CommError::PeerFailed { failed, message: format!("panicked: {message}") });
    }
    Ok(results.into_iter().map(|r| r.expect("no rank panicked")).collect())
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// A communicator of the local backend.
#[derive(Debug)]
pub struct LocalComm {
    shared: Arc<Shared>,
    group_id: u64,
    members: Vec<usize>,
    me: usize,
    seq: AtomicU64,
    created: Mutex<HashMap<Vec<usize>, usize>>,
}

impl LocalComm {
    fn world(shared: Arc<Shared>, rank: usize, world: usize) -> Self {
        LocalComm {
            shared,
            group_id: 0,
            members: (0..world).collect(),
            me: rank,
            seq: AtomicU64::new(0),
            created: Mutex::new(HashMap::new()),
        }
    }

    fn site(&self, op: &'static str) -> CallSite<'_> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        CallSite { group_id: self.group_id, seq, members: &self.members, me: self.me, op }
    }

    /// Deposits, waits for all, runs `read` on every deposit, frees the slot.
    fn exchange<T>(
        &self,
        op: &'static str,
        sig: Signature,
        data: Vec<u8>,
        counts: Option<Vec<usize>>,
        read: impl FnOnce(&[Arc<Vec<u8>>], &[Option<Vec<usize>>]) -> Result<T>,
    ) -> Result<T> {
        let site = self.site(op);
        let (deposits, counts) = self.shared.gather_deposits(&site, sig, Arc::new(data), counts)?;
        let out = read(&deposits, &counts);
        drop(deposits);
        self.shared.finish(&site);
        out
    }
}

fn chunk(len_elems: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    i * len_elems / parts..(i + 1) * len_elems / parts
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn global_ranks(&self) -> &[usize] {
        &self.members
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Signature::new("barrier"), Vec::new(), None, |_, _| Ok(()))
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        args::elements(self, "all-reduce", data.len(), dtype)?;
        let sig = Signature {
            dtype: Some(dtype),
            reduce: Some(op),
            len: Some(data.len()),
            ..Signature::new("all-reduce")
        };
        let site = self.site("all-reduce");
        let (deposits, _) = self.shared.gather_deposits(
            &site,
            sig,
            Arc::new(self.shared.pool.copy_of(data)),
            None,
        )?;
        // Reduce my chunk over all members in member order, then gather every chunk.
        let (n, es) = (self.size(), dtype.size());
        let mine = chunk(data.len() / es, n, self.me);
        let parts: Vec<&[u8]> =
            deposits.iter().map(|d| &d[mine.start * es..mine.end * es]).collect();
        let mut reduced = self.shared.pool.copy_of(parts[0]);
        reduce_onto(&mut reduced, &parts[1..], dtype, op);
        drop(parts);
        drop(deposits);
        // The reduced chunks are copied out and dropped before `finish` so they recycle.
        let outcome = self.shared.gather_second(&site, Arc::new(reduced)).map(|parts| {
            for (i, part) in parts.iter().enumerate() {
                let c = chunk(data.len() / es, n, i);
                data[c.start * es..c.end * es].copy_from_slice(part);
            }
        });
        self.shared.finish(&site);
        outcome
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        check_peer(self, root, "broadcast root")?;
        let sig =
            Signature { len: Some(data.len()), root: Some(root), ..Signature::new("broadcast") };
        let mine = if self.me == root { self.shared.pool.copy_of(data) } else { Vec::new() };
        self.exchange("broadcast", sig, mine, None, |d, _| {
            if self.me != root {
                data.copy_from_slice(&d[root]);
            }
            Ok(())
        })
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        args::all_gather_v(self, send, recv, counts)?;
        let sig = Signature { counts: Some(counts.to_vec()), ..Signature::new("all-gather-v") };
        self.exchange("all-gather-v", sig, self.shared.pool.copy_of(send), None, |d, _| {
            let mut at = 0;
            for part in d {
                recv[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            Ok(())
        })
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        args::reduce_scatter(self, send, recv, dtype)?;
        let sig = Signature {
            dtype: Some(dtype),
            reduce: Some(op),
            len: Some(send.len()),
            ..Signature::new("reduce-scatter")
        };
        let block = recv.len();
        self.exchange("reduce-scatter", sig, self.shared.pool.copy_of(send), None, |d, _| {
            if block > 0 {
                let parts: Vec<&[u8]> =
                    d.iter().map(|p| &p[self.me * block..(self.me + 1) * block]).collect();
                reduce_into(recv, &parts, dtype, op);
            }
            Ok(())
        })
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        args::all_to_all_v(self, send, sc, recv, rc)?;
        let sig = Signature::new("all-to-all-v");
        let seq = self.seq.load(Ordering::Relaxed);
        self.exchange(
            "all-to-all-v",
            sig,
            self.shared.pool.copy_of(send),
            Some(sc.to_vec()),
            |d, counts| {
                let mut at = 0;
                for (j, (data, their)) in d.iter().zip(counts).enumerate() {
                    let their = their.as_ref().expect("all-to-all-v deposits counts");
                    let offset: usize = their[..self.me].iter().sum();
                    let len = their[self.me];
                    if len != rc[j] {
                        return Err(CommError::Mismatch {
                            op: format!("all-to-all-v #{seq}"),
                            group: self.members.clone(),
                            detail: format!(
                                "rank {} sends {len} bytes to rank {}, which expects {}",
                                self.members[j], self.members[self.me], rc[j]
                            ),
                        });
                    }
                    recv[at..at + len].copy_from_slice(&data[offset..offset + len]);
                    at += len;
                }
                Ok(())
            },
        )
    }

    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        check_peer(self, dst, "send")?;
        self.shared.post(self.group_id, self.me, dst, tag, self.shared.pool.copy_of(data));
        Ok(())
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        check_peer(self, src, "recv")?;
        let msg = self.shared.take(self.group_id, &self.members, src, self.me, tag)?;
        if msg.len() != data.len() {
            let (got, want) = (msg.len(), data.len());
            self.shared.pool.give(msg);
            return Err(length_mismatch(&self.members, self.me, src, tag, got, want));
        }
        data.copy_from_slice(&msg);
        self.shared.pool.give(msg);
        Ok(())
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
        self.send_bytes(send, dst, st)?;
        self.recv_bytes(recv, src, rt)
    }

    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        check_batch(self, ops)?;
        // Sends are buffered here: post them all, then take each receive in turn.
        for op in ops.iter() {
            if let P2p::Send { data, peer, tag } = op {
                self.shared.post(
                    self.group_id,
                    self.me,
                    *peer,
                    *tag,
                    self.shared.pool.copy_of(data),
                );
            }
        }
        for op in ops.iter_mut() {
            if let P2p::Recv { data, peer, tag } = op {
                self.recv_bytes(data, *peer, *tag)?;
            }
        }
        Ok(())
    }

    fn subgroup(&self, ranks: &[usize]) -> Result<Box<dyn Communicator>> {
        check_subgroup(self, ranks)?;
        let occurrence = {
            let mut created = self.created.lock().unwrap_or_else(|e| e.into_inner());
            let n = created.entry(ranks.to_vec()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let members: Vec<usize> = ranks.iter().map(|&i| self.members[i]).collect();
        let group_id = self.shared.group_id(self.group_id, members.clone(), occurrence);
        let me = ranks.iter().position(|&i| i == self.me).expect("caller is a member");
        Ok(Box::new(LocalComm {
            shared: self.shared.clone(),
            group_id,
            members,
            me,
            seq: AtomicU64::new(0),
            created: Mutex::new(HashMap::new()),
        }))
    }
}
