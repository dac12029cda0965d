//! The `local` backend: N ranks as threads of one process.
//!
//! [`launch`] runs a closure on every rank with its world communicator. Collectives combine
//! contributions in member order, so results are bitwise identical from run to run.
//! The collectives are direct: each member posts its own buffer and the others read it in
//! place, one copy per byte instead of a copy into shared memory and another out of it (the
//! single-copy transfers of MPI's shared-memory transports). All-reduce reduces one chunk
//! per member (in place where member order allows, else block by block through a
//! cache-sized accumulator) and then copies the other chunks from their owners. Sends are
//! buffered (they never block); receives wait; a send-receive lends its send buffer while
//! it receives (when the world has no more ranks than cores), so a receiver that takes it
//! meanwhile copies it once. A rank that panics or returns makes every rank waiting on it
//! fail at once with its rank in the error. Copies of 32 MiB or more, from another
//! member's buffer or into a send's buffer, are written past the caches ([`copy`]).
//!
//! Reading a peer's buffer in place needs its address, hence `unsafe` here (and in
//! `copy.rs`, for its SIMD stores). [`state::Region`] and `Shared::direct` hold the
//! protocol that keeps it sound: a buffer is posted only while its owner is inside the
//! call, phases are separated by waits for every member and touch disjoint ranges, and no
//! member leaves, on success, error or panic, while another is inside a phase.

#![allow(unsafe_code)]

pub(crate) mod copy;
mod state;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use self::copy::copy;
use self::state::{CallSite, Letter, Region, Shared, Signature};
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
                    .spawn_scoped(scope, move || run_rank(&shared, rank, world, f))
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

/// As [`launch`], for ranks that return a `Result`, with a watch for ranks that never
/// return. Once a rank has returned an error or panicked, the others normally fail within
/// the communication timeout (their calls with it fail); a rank still running `grace`
/// later is stuck where no timeout reaches (in its own compute, or a read that never
/// returns). Then `abandon` is called with the errors so far (by rank) and the stuck ranks:
/// a thread cannot be stopped, so it should end the process (the binary prints the first
/// error and exits). If it returns, the ranks are waited for as by [`launch`].
pub fn launch_watched<T, E, F, A>(
    world: usize,
    opts: LocalOptions,
    grace: Duration,
    f: F,
    abandon: A,
) -> Result<Vec<std::result::Result<T, E>>>
where
    T: Send,
    E: Send,
    F: Fn(&LocalComm) -> std::result::Result<T, E> + Sync,
    A: FnOnce(&[(usize, &E)], &[usize]),
{
    assert!(world > 0, "a world needs at least one rank");
    let shared = Arc::new(Shared::new(world, opts.timeout));
    let (tx, rx) = std::sync::mpsc::channel::<(usize, bool)>();
    let results: Vec<Option<std::result::Result<T, E>>> = std::thread::scope(|scope| {
        let mut handles: Vec<_> = (0..world)
            .map(|rank| {
                let (shared, f, tx) = (shared.clone(), &f, tx.clone());
                let h = std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let r = run_rank(&shared, rank, world, f);
                        // The watch may be gone (it stopped watching): nothing to tell.
                        let _ = tx.send((rank, !matches!(r, Some(Ok(_)))));
                        r
                    })
                    .expect("spawning a rank thread");
                Some(h)
            })
            .collect();
        drop(tx);
        let mut results: Vec<Option<Option<std::result::Result<T, E>>>> =
            (0..world).map(|_| None).collect();
        let mut deadline: Option<std::time::Instant> = None;
        let mut running = world;
        while running > 0 {
            let got = match deadline {
                None => rx.recv().map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_timeout(d.saturating_duration_since(std::time::Instant::now())),
            };
            match got {
                Ok((rank, failed)) => {
                    running -= 1;
                    let h = handles[rank].take().expect("a rank reports once");
                    results[rank] = Some(h.join().unwrap_or(None));
                    if failed && deadline.is_none() {
                        deadline = Some(std::time::Instant::now() + grace);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let stuck: Vec<usize> = (0..world).filter(|&r| handles[r].is_some()).collect();
                    let errors: Vec<(usize, &E)> = results
                        .iter()
                        .enumerate()
                        .filter_map(|(r, v)| match v {
                            Some(Some(Err(e))) => Some((r, e)),
                            _ => None,
                        })
                        .collect();
                    abandon(&errors, &stuck);
                    break;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        // What is left: ranks `abandon` gave back, or a rank whose report was lost.
        for (rank, h) in handles.iter_mut().enumerate() {
            if let Some(h) = h.take() {
                results[rank] = Some(h.join().unwrap_or(None));
            }
        }
        results.into_iter().map(|r| r.flatten()).collect()
    });
    if let Some((failed, message)) = shared.first_failure() {
        return Err(CommError::PeerFailed { failed, message: format!("panicked: {message}") });
    }
    Ok(results.into_iter().map(|r| r.expect("no rank panicked")).collect())
}

/// Rank `rank`'s run of `f` on its world communicator; `None` if it panicked. Either way
/// the rank leaves the world, so that ranks waiting on it fail at once.
fn run_rank<R>(
    shared: &Arc<Shared>,
    rank: usize,
    world: usize,
    f: &(impl Fn(&LocalComm) -> R + Sync),
) -> Option<R> {
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
}

/// Bytes reduced at a time: a block of the accumulator stays in the L1 cache.
const BLOCK: usize = 32 << 10;

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
        self.shared.timeouts[self.members[self.me]].get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.shared.timeouts[self.members[self.me]].set(timeout);
    }

    fn barrier(&self) -> Result<()> {
        // A direct collective of no phase: every member posts (an empty buffer) and waits
        // until all have.
        let site = self.site("barrier");
        self.shared.direct(
            &site,
            Signature::new("barrier"),
            (Region::of(&[]), None),
            0,
            |_, _, _| Ok(()),
        )
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        args::elements(self, "all-reduce", data.len(), dtype)?;
        let sig = Signature {
            dtype: Some(dtype),
            reduce: Some(op),
            len: Some(data.len()),
            ..Signature::new("all-reduce")
        };
        let (n, es, me) = (self.size(), dtype.size(), self.me);
        let elems = data.len() / es;
        let bytes = |i: usize| {
            let c = chunk(elems, n, i);
            c.start * es..c.end * es
        };
        let own = Region::of_mut(data);
        // Phase 0 reduces my chunk of every member's buffer, in member order, into mine;
        // phase 1 copies every other chunk from its owner.
        // The accumulator of the block path (made there only).
        let mut block: Vec<u64> = Vec::new();
        self.shared.direct(&self.site("all-reduce"), sig, (own, None), 2, |phase, regions, _| {
            if phase == 0 && (me == 0 || (n == 2 && op == ReduceOp::Sum)) {
                // In place: my values come first in member order, or the one other
                // member's sum with mine commutes exactly (IEEE addition of two operands
                // commutes; only which NaN payload survives two NaNs may differ).
                let mine = bytes(me);
                // SAFETY: in phase 0 chunk `me` of every buffer is touched by this member
                // alone; the peers' parts and my own part are distinct buffers.
                let peers: Vec<&[u8]> = regions
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| i != me)
                    .map(|(_, g)| unsafe { g.bytes(mine.clone()) })
                    .collect();
                reduce_onto(unsafe { own.bytes_mut(mine.clone()) }, &peers, dtype, op);
            } else if phase == 0 {
                let mine = bytes(me);
                let mut at = mine.start;
                while at < mine.end {
                    let r = at..(at + BLOCK).min(mine.end);
                    if block.is_empty() {
                        block = vec![0u64; BLOCK / 8];
                    }
                    let acc = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut block)[..r.len()];
                    // SAFETY: in phase 0 chunk `me` of every buffer is touched by this
                    // member alone (each member reduces its own chunk).
                    let parts: Vec<&[u8]> =
                        regions.iter().map(|g| unsafe { g.bytes(r.clone()) }).collect();
                    acc.copy_from_slice(parts[0]);
                    reduce_onto(acc, &parts[1..], dtype, op);
                    drop(parts);
                    // SAFETY: as above; the reads of this range have ended.
                    unsafe { own.bytes_mut(r.clone()) }.copy_from_slice(acc);
                    at = r.end;
                }
            } else {
                for (i, g) in regions.iter().enumerate().filter(|&(i, _)| i != me) {
                    // SAFETY: in phase 1 chunk `i` is final in member i's buffer and only
                    // read; this member writes chunks other than its own in its buffer,
                    // which nobody reads in this phase.
                    copy(unsafe { own.bytes_mut(bytes(i)) }, unsafe { g.bytes(bytes(i)) });
                }
            }
            Ok(())
        })
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        check_peer(self, root, "broadcast root")?;
        let sig =
            Signature { len: Some(data.len()), root: Some(root), ..Signature::new("broadcast") };
        let (site, me) = (self.site("broadcast"), self.me);
        let own = Region::of_mut(data);
        self.shared.direct(&site, sig, (own, None), 1, |_, regions, _| {
            if me != root {
                let len = regions[root].len();
                // SAFETY: the root's buffer is only read in this phase, and this member
                // writes only its own.
                copy(unsafe { own.bytes_mut(0..len) }, unsafe { regions[root].bytes(0..len) });
            }
            Ok(())
        })
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        args::all_gather_v(self, send, recv, counts)?;
        let sig = Signature { counts: Some(counts.to_vec()), ..Signature::new("all-gather-v") };
        let site = self.site("all-gather-v");
        self.shared.direct(&site, sig, (Region::of(send), None), 1, |_, regions, _| {
            let mut at = 0;
            for (g, &len) in regions.iter().zip(counts) {
                // SAFETY: send buffers are only read, and `recv` is this member's own.
                copy(&mut recv[at..at + len], unsafe { g.bytes(0..len) });
                at += len;
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
        let (block, me) = (recv.len(), self.me);
        let site = self.site("reduce-scatter");
        self.shared.direct(&site, sig, (Region::of(send), None), 1, |_, regions, _| {
            if block > 0 {
                let r = me * block..(me + 1) * block;
                // SAFETY: send buffers are only read, and `recv` is this member's own.
                let parts: Vec<&[u8]> =
                    regions.iter().map(|g| unsafe { g.bytes(r.clone()) }).collect();
                reduce_into(recv, &parts, dtype, op);
            }
            Ok(())
        })
    }

    /// Each member's runs copied straight to their places in `recv`: no buffer of its own
    /// and no second copy.
    fn all_gather_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        outer: usize,
    ) -> Result<()> {
        args::interleaved(self, "all-gather-interleaved", send.len(), recv.len(), outer)?;
        let sig = Signature {
            len: Some(send.len()),
            counts: Some(vec![outer]),
            ..Signature::new("all-gather-interleaved")
        };
        let (n, run) = (self.size(), send.len() / outer.max(1));
        let site = self.site("all-gather-interleaved");
        self.shared.direct(&site, sig, (Region::of(send), None), 1, |_, regions, _| {
            for o in 0..outer {
                for (m, g) in regions.iter().enumerate() {
                    // SAFETY: send buffers are only read, and `recv` is this member's own.
                    let part = unsafe { g.bytes(o * run..(o + 1) * run) };
                    copy(&mut recv[(o * n + m) * run..][..run], part);
                }
            }
            Ok(())
        })
    }

    /// Each run's block reduced in place from every member's buffer, in member order: no
    /// packed copy.
    fn reduce_scatter_interleaved_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        (dtype, op): (DType, ReduceOp),
        outer: usize,
    ) -> Result<()> {
        let what = "reduce-scatter-interleaved";
        args::interleaved(self, what, recv.len(), send.len(), outer)?;
        args::elements(self, what, recv.len() / outer.max(1), dtype)?;
        let sig = Signature {
            dtype: Some(dtype),
            reduce: Some(op),
            len: Some(send.len()),
            counts: Some(vec![outer]),
            ..Signature::new(what)
        };
        let (n, me, block) = (self.size(), self.me, recv.len() / outer.max(1));
        let site = self.site(what);
        self.shared.direct(&site, sig, (Region::of(send), None), 1, |_, regions, _| {
            let mut parts: Vec<&[u8]> = Vec::with_capacity(n);
            for o in 0..outer {
                let r = (o * n + me) * block..(o * n + me + 1) * block;
                parts.clear();
                // SAFETY: send buffers are only read, and `recv` is this member's own.
                parts.extend(regions.iter().map(|g| unsafe { g.bytes(r.clone()) }));
                reduce_into(&mut recv[o * block..(o + 1) * block], &parts, dtype, op);
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
        let site = self.site("all-to-all-v");
        let (seq, me) = (site.seq, self.me);
        let own = (Region::of(send), Some(sc.to_vec()));
        self.shared.direct(&site, sig, own, 1, |_, regions, counts| {
            // Every member's counts first, so a mismatch moves nothing.
            let mut parts = Vec::with_capacity(regions.len());
            for (j, their) in counts.iter().enumerate() {
                let their = their.as_ref().expect("all-to-all-v posts counts");
                let (offset, len) = (their[..me].iter().sum::<usize>(), their[me]);
                if len != rc[j] {
                    return Err(CommError::Mismatch {
                        op: format!("all-to-all-v #{seq}"),
                        group: self.members.clone(),
                        detail: format!(
                            "rank {} sends {len} bytes to rank {}, which expects {}",
                            self.members[j], self.members[me], rc[j]
                        ),
                    });
                }
                parts.push(offset..offset + len);
            }
            let mut at = 0;
            for (g, r) in regions.iter().zip(parts) {
                let len = r.len();
                // SAFETY: send buffers are only read, and `recv` is this member's own.
                copy(&mut recv[at..at + len], unsafe { g.bytes(r) });
                at += len;
            }
            Ok(())
        })
    }

    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        check_peer(self, dst, "send")?;
        let key = (self.group_id, self.me, dst, tag);
        self.shared.post(key, self.members[dst], self.shared.pool.copy_of(data));
        Ok(())
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        check_peer(self, src, "recv")?;
        let letter = self.shared.take(self.group_id, &self.members, src, self.me, tag)?;
        let mismatch =
            |got: usize| length_mismatch(&self.members, self.me, src, tag, got, data.len());
        match letter {
            Letter::Copy(msg) => {
                let out = if msg.len() == data.len() {
                    copy(data, &msg);
                    Ok(())
                } else {
                    Err(mismatch(msg.len()))
                };
                self.shared.pool.give(msg);
                out
            }
            Letter::Lent(region, id) => {
                let out = if region.len() == data.len() {
                    // SAFETY: the sender waits in `reclaim` until this taker has returned
                    // the buffer, and only reads it meanwhile.
                    copy(data, unsafe { region.bytes(0..data.len()) });
                    Ok(())
                } else {
                    Err(mismatch(region.len()))
                };
                self.shared.returned(id, self.members[src]);
                out
            }
        }
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
        // The send is lent while this member receives (when every rank has a core): a
        // receiver that takes it meanwhile copies straight from `send` (one copy instead of
        // two); otherwise it becomes a buffered copy, as `send_bytes` makes, before this
        // call returns.
        if !self.shared.lends {
            self.send_bytes(send, dst, st)?;
            return self.recv_bytes(recv, src, rt);
        }
        check_peer(self, dst, "send")?;
        let key = (self.group_id, self.me, dst, st);
        let id = self.shared.lend(key, self.members[dst], Region::of(send));
        // Reclaimed on every way out, a panic included, before `send` can go.
        let got = catch_unwind(AssertUnwindSafe(|| self.recv_bytes(recv, src, rt)));
        let lender = (id, send.len(), self.members[self.me]);
        self.shared.reclaim(key, lender, || self.shared.pool.copy_of(send));
        got.unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    }

    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        check_batch(self, ops)?;
        // Sends are buffered here: post them all, then take each receive in turn.
        for op in ops.iter() {
            if let P2p::Send { data, peer, tag } = op {
                let key = (self.group_id, self.me, *peer, *tag);
                self.shared.post(key, self.members[*peer], self.shared.pool.copy_of(data));
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

#[cfg(test)]
mod tests {
    use super::{LocalOptions, launch};
    use crate::{CommExt, Communicator, ReduceOp};
    use std::time::Duration;

    /// Collectives whose copies pass [`super::copy::STREAM_MIN`] (streamed past the caches)
    /// give the bytes the small ones give: an all-gather, an all-reduce's copies of the
    /// other members' sums, a send-receive, each of an odd length.
    #[test]
    fn collectives_of_streamed_sizes_move_every_byte() {
        let n = super::copy::STREAM_MIN / 4 + 1001;
        let value = |rank: usize, i: usize| (rank * 7 + i % 1013) as f32;
        let out = launch(2, LocalOptions::default(), |c| {
            let me = c.rank();
            let mine: Vec<f32> = (0..n).map(|i| value(me, i)).collect();
            let mut all = vec![0f32; 2 * n];
            c.all_gather(&mine, &mut all).expect("all-gather");
            let gathered = (0..2 * n).all(|i| all[i] == value(i / n, i % n));
            c.all_reduce(&mut all, ReduceOp::Sum).expect("all-reduce");
            let summed = (0..2 * n).all(|i| all[i] == 2.0 * value(i / n, i % n));
            let mut got = vec![0f32; n];
            let other = 1 - me;
            c.send_recv(&mine, other, 3, &mut got, other, 3).expect("send-recv");
            let received = (0..n).all(|i| got[i] == value(other, i));
            (gathered, summed, received)
        })
        .expect("no panic");
        assert!(out.iter().all(|&r| r == (true, true, true)), "{out:?}");
    }

    /// A collective whose members disagree fails on every member, and every member leaves
    /// it, the ones that disagreed included: once the world ends no call's slot is held.
    #[test]
    fn a_mismatched_collective_leaves_no_slot_behind() {
        for world in [2, 3] {
            let opts = LocalOptions { timeout: Duration::from_secs(10) };
            let out = launch(world, opts, |c| {
                let mut x = vec![1.0f64; 4 + c.rank()];
                let failed = c.all_reduce(&mut x, ReduceOp::Sum).is_err();
                // The communicator goes on working after the failed call.
                let mut y = [c.rank() as f64];
                c.all_reduce(&mut y, ReduceOp::Sum).expect("a later call");
                (failed, y[0], c.shared.clone())
            })
            .expect("no panic");
            let sum = (0..world).sum::<usize>() as f64;
            assert!(out.iter().all(|&(failed, y, _)| failed && y == sum), "world {world}");
            assert_eq!(out[0].2.open_calls(), 0, "world {world}: calls still held");
        }
    }
}
