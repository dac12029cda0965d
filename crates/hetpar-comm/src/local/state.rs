//! Shared state of the local backend: one mutex and condition variable for the whole world,
//! collective slots keyed by (group, sequence number), point-to-point mailboxes, and the
//! failure and exit flags that make waiting ranks fail fast.
//!
//! Collectives post their members' own buffers ([`Region`]) and copy between them outside
//! the lock; messages are copies from the pool or lent buffers. The lock only guards
//! bookkeeping.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::SharedTimeout;
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Result, ranks};
use crate::pool::BufferPool;

/// What every member of a collective must agree on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Signature {
    pub op: &'static str,
    pub dtype: Option<DType>,
    pub reduce: Option<ReduceOp>,
    /// Byte length that must be equal on every member, if any.
    pub len: Option<usize>,
    pub root: Option<usize>,
    pub counts: Option<Vec<usize>>,
}

impl Signature {
    pub fn new(op: &'static str) -> Self {
        Signature { op, dtype: None, reduce: None, len: None, root: None, counts: None }
    }

    /// How `other` (from member `them`) differs from `self` (from member `us`).
    fn differs(&self, us: usize, other: &Signature, them: usize) -> Option<String> {
        if self.op != other.op {
            return Some(format!(
                "rank {them} called {} while rank {us} called {}",
                other.op, self.op
            ));
        }
        let field = |name: &str, a: String, b: String| {
            Some(format!("rank {them} passes {name} {b}, rank {us} passes {a}"))
        };
        if self.dtype != other.dtype {
            return field("type", format!("{:?}", self.dtype), format!("{:?}", other.dtype));
        }
        if self.reduce != other.reduce {
            return field("reduction", format!("{:?}", self.reduce), format!("{:?}", other.reduce));
        }
        if self.len != other.len {
            return field("bytes", format!("{:?}", self.len), format!("{:?}", other.len));
        }
        if self.root != other.root {
            return field("root", format!("{:?}", self.root), format!("{:?}", other.root));
        }
        if self.counts != other.counts {
            return field("counts", format!("{:?}", self.counts), format!("{:?}", other.counts));
        }
        None
    }
}

/// A member's own buffer in a direct collective, which the other members read in place
/// (one copy instead of a copy in and a copy out) and its owner writes.
///
/// The protocol that makes this sound (see [`Shared::direct`]): a region is posted only
/// while its owner is inside the call, so its buffer is alive; members access buffers only
/// in phases separated by waits for every member, and each phase's work touches ranges
/// that no other member touches in that phase (the caller's plan); a member leaves the call,
/// on success or error, only once no live member is inside a phase, and after an error the
/// slot is closed so no phase starts again. The owner touches its buffer only through the
/// region while the call lasts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    addr: usize,
    len: usize,
}

impl Region {
    /// The region of `data`, read by the other members.
    pub fn of(data: &[u8]) -> Region {
        Region { addr: data.as_ptr() as usize, len: data.len() }
    }

    /// The region of `data`, which its owner also writes through the region.
    pub fn of_mut(data: &mut [u8]) -> Region {
        Region { addr: data.as_mut_ptr() as usize, len: data.len() }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes `r` of the region.
    ///
    /// # Safety
    /// The region was posted in a direct collective still in progress, the caller is inside
    /// one of its phases, and no member writes `r` in this phase.
    pub unsafe fn bytes(&self, r: Range<usize>) -> &[u8] {
        assert!(r.start <= r.end && r.end <= self.len, "{r:?} outside {} bytes", self.len);
        // SAFETY: in bounds of a live buffer (the caller's contract) that nobody writes
        // in this range meanwhile.
        unsafe { std::slice::from_raw_parts((self.addr as *const u8).add(r.start), r.len()) }
    }

    /// Bytes `r` of the caller's own region, to write.
    ///
    /// # Safety
    /// As for [`Region::bytes`], and no other member reads or writes `r` in this phase.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, r: Range<usize>) -> &mut [u8] {
        assert!(r.start <= r.end && r.end <= self.len, "{r:?} outside {} bytes", self.len);
        // SAFETY: in bounds of the caller's own live buffer; no one else touches `r` in
        // this phase.
        unsafe { std::slice::from_raw_parts_mut((self.addr as *mut u8).add(r.start), r.len()) }
    }
}

/// One collective call in progress.
#[derive(Debug)]
pub(crate) struct Slot {
    signature: Option<(usize, Signature)>,
    pub counts: Vec<Option<Vec<usize>>>,
    finished: usize,
    poisoned: Option<String>,
    /// Direct collectives: each member's buffer, the phases it has finished, whether it
    /// is inside a phase, and why the call was abandoned (by which member).
    regions: Vec<Option<Region>>,
    phases: Vec<usize>,
    reading: Vec<bool>,
    closed: Option<(usize, CommError)>,
    /// Members that abandoned the call (they will not finish a phase).
    left: Vec<bool>,
}

impl Slot {
    fn new(n: usize) -> Slot {
        Slot {
            signature: None,
            counts: vec![None; n],
            finished: 0,
            poisoned: None,
            regions: vec![None; n],
            phases: vec![0; n],
            reading: vec![false; n],
            closed: None,
            left: vec![false; n],
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct State {
    failed: Option<(usize, String)>,
    exited: Vec<bool>,
    /// By world rank, the call it waits in ("in all-reduce #3 over ranks [0-1]"), or
    /// `None` while it computes: a timeout says what the ranks it waited for were doing.
    waiting: Vec<Option<String>>,
    next_group: u64,
    pub groups: HashMap<(u64, Vec<usize>, usize), u64>,
    slots: HashMap<(u64, u64), Slot>,
    mail: HashMap<(u64, usize, usize, u32), VecDeque<Letter>>,
    /// Lent buffers by id: whether the receiver has started and finished reading each.
    lent: HashMap<u64, Lend>,
    next_lend: u64,
}

/// Bytes per second a copy is assumed to move, to bound how long a lent buffer waits for
/// its receiver before it is copied.
const COPY_RATE: f64 = 8e9;

/// A queued message: a copy, or the sender's own buffer while the sender is inside a
/// combined send-receive (the receiver copies from it in place).
#[derive(Debug)]
pub(crate) enum Letter {
    Copy(Vec<u8>),
    Lent(Region, u64),
}

/// Where a lent buffer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lend {
    Posted,
    Reading,
    Read,
}

/// The world of one `launch`.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Each rank's timeout (its calls' waits), by world rank.
    pub timeouts: Vec<SharedTimeout>,
    state: Mutex<State>,
    /// By world rank, what the rank's threads wait on: a change wakes only the ranks it
    /// concerns (a collective's members, a message's receiver, a lent buffer's sender),
    /// every rank only on an exit. With one condition for all, each change woke every
    /// waiting rank, and on a machine with fewer cores than ranks those wake-ups took cores
    /// from the ranks computing.
    conds: Vec<Condvar>,
    /// Payload buffers to reuse.
    pub pool: BufferPool,
    /// Whether every rank can have a core of its own: only then does a send-receive lend
    /// its buffer (with more ranks than cores the receiver may wait for a core while the
    /// sender waits for it, and a buffered copy is faster).
    pub lends: bool,
}

/// Identifies a collective call for error messages.
pub(crate) struct CallSite<'a> {
    pub group_id: u64,
    pub seq: u64,
    pub members: &'a [usize],
    pub me: usize,
    pub op: &'static str,
}

impl CallSite<'_> {
    fn op_name(&self) -> String {
        format!("{} #{}", self.op, self.seq)
    }
}

impl Shared {
    pub fn new(world: usize, timeout: Duration) -> Self {
        let state = State {
            exited: vec![false; world],
            waiting: vec![None; world],
            next_group: 1,
            ..State::default()
        };
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Shared {
            timeouts: (0..world).map(|_| SharedTimeout::new(timeout)).collect(),
            state: Mutex::new(state),
            conds: (0..world).map(|_| Condvar::new()).collect(),
            pool: BufferPool::new(),
            lends: world <= cores,
        }
    }

    /// Wakes the threads of each world rank in `ranks`, after giving the lock back (a woken
    /// thread then finds it free).
    fn wake(&self, st: MutexGuard<'_, State>, ranks: &[usize]) {
        drop(st);
        for &r in ranks {
            self.conds[r].notify_all();
        }
    }

    /// Sleeps on world rank `rank`'s condition until woken or `timeout` passes (`None`:
    /// until woken).
    fn sleep<'s>(
        &'s self,
        st: MutexGuard<'s, State>,
        rank: usize,
        timeout: Option<Duration>,
    ) -> MutexGuard<'s, State> {
        let cond = &self.conds[rank];
        match timeout {
            Some(t) => cond.wait_timeout(st, t).unwrap_or_else(|e| e.into_inner()).0,
            None => cond.wait(st).unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Wakes every rank's threads.
    fn wake_all(&self) {
        self.conds.iter().for_each(Condvar::notify_all);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking rank never holds the lock while panicking in our code, but recover
        // from poisoning anyway: the failure flag carries the story.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that world rank `rank` returned (`failure: None`) or panicked.
    pub fn exit(&self, rank: usize, failure: Option<String>) {
        let mut st = self.lock();
        st.exited[rank] = true;
        if let Some(message) = failure
            && st.failed.is_none()
        {
            st.failed = Some((rank, message));
        }
        drop(st);
        self.wake_all();
    }

    /// The first rank that panicked, if any.
    pub fn first_failure(&self) -> Option<(usize, String)> {
        self.lock().failed.clone()
    }

    /// An id for the `occurrence`-th subgroup `members` (global ranks) of `parent`.
    pub fn group_id(&self, parent: u64, members: Vec<usize>, occurrence: usize) -> u64 {
        let mut st = self.lock();
        if let Some(&id) = st.groups.get(&(parent, members.clone(), occurrence)) {
            return id;
        }
        let id = st.next_group;
        st.next_group += 1;
        st.groups.insert((parent, members, occurrence), id);
        id
    }

    /// Waits until `ready` yields, failing fast on a failed or exited peer among `waiting_on`
    /// and timing out after the configured timeout. `gone` and `never` word the errors. Once
    /// it blocks, the rank's entry in `waiting` names the call (a wait that finds what it
    /// waits for at once, the usual case, formats nothing).
    #[allow(clippy::too_many_arguments)]
    fn wait<T>(
        &self,
        st: MutexGuard<'_, State>,
        members: &[usize],
        me: usize,
        op: &dyn Fn() -> String,
        ready: impl FnMut(&mut State) -> Result<Option<T>>,
        waiting_on: impl Fn(&State) -> Vec<usize>,
        words: (&str, &str),
    ) -> Result<T> {
        let (mut st, out) = self.wait_in(st, members, me, op, ready, waiting_on, words);
        st.waiting[members[me]] = None;
        out
    }

    /// [`Self::wait`]'s loop; gives the lock back with the outcome.
    #[allow(clippy::too_many_arguments)]
    fn wait_in<'s, T>(
        &'s self,
        mut st: MutexGuard<'s, State>,
        members: &[usize],
        me: usize,
        op: &dyn Fn() -> String,
        mut ready: impl FnMut(&mut State) -> Result<Option<T>>,
        waiting_on: impl Fn(&State) -> Vec<usize>,
        (gone, never): (&str, &str),
    ) -> (MutexGuard<'s, State>, Result<T>) {
        let timeout = self.timeouts[members[me]].get();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((failed, message)) = &st.failed {
                let e = CommError::PeerFailed { failed: *failed, message: message.clone() };
                return (st, Err(e));
            }
            match ready(&mut st) {
                Ok(Some(v)) => return (st, Ok(v)),
                Ok(None) => {}
                Err(e) => return (st, Err(e)),
            }
            let missing = waiting_on(&st);
            if let Some(&exited) = missing.iter().find(|&&g| st.exited[g]) {
                let message = format!("exited without {gone} ({} on rank {})", op(), members[me]);
                return (st, Err(CommError::PeerFailed { failed: exited, message }));
            }
            let now = Instant::now();
            if now >= deadline {
                // What each rank waited for is doing instead, as the MPI backend says it.
                let doing: Vec<String> = missing
                    .iter()
                    .map(|&g| match &st.waiting[g] {
                        Some(call) => format!("rank {g} is {call}"),
                        None => format!("rank {g} is computing (not in a communication call)"),
                    })
                    .collect();
                let e = CommError::Timeout {
                    op: op(),
                    group: members.to_vec(),
                    rank: members[me],
                    after: timeout,
                    detail: format!(
                        "ranks {} never {never}; {}",
                        ranks(&missing),
                        doing.join("; ")
                    ),
                };
                return (st, Err(e));
            }
            let waiting = &mut st.waiting[members[me]];
            if waiting.is_none() {
                *waiting = Some(format!("in {} over ranks {}", op(), ranks(members)));
            }
            st = self.sleep(st, members[me], Some(deadline - now));
        }
    }

    /// Runs a direct collective: posts this member's `region` (and `counts`), then for
    /// each of `phases` phases waits until every member has posted and finished the
    /// phases before, and runs `work(phase, regions, counts)` with every member's region
    /// and counts in member order; then waits until every member has finished every phase
    /// (so none still reads this member's buffer) and leaves.
    ///
    /// On any error (a mismatch, a failed, exited or missing peer, a timeout, an error of
    /// `work`) the member closes the slot, so no member starts another phase, and leaves
    /// only once no live member is inside a phase: after the call returns, however it
    /// returns, nobody touches the caller's buffer.
    #[allow(clippy::type_complexity)]
    pub fn direct(
        &self,
        site: &CallSite<'_>,
        sig: Signature,
        (region, counts): (Region, Option<Vec<usize>>),
        phases: usize,
        mut work: impl FnMut(usize, &[Region], &[Option<Vec<usize>>]) -> Result<()>,
    ) -> Result<()> {
        let n = site.members.len();
        let key = (site.group_id, site.seq);
        let mut st = self.lock();
        let slot = st.slots.entry(key).or_insert_with(|| Slot::new(n));
        if let Err(e) = agree(slot, site, sig) {
            // Not posted: nobody reads this buffer. The member is done with the call (the
            // others leave it through the poisoned slot), so the last to leave frees it.
            self.wake(st, site.members);
            self.finish(site);
            return Err(e);
        }
        slot.regions[site.me] = Some(region);
        slot.counts[site.me] = counts;
        self.wake(st, site.members);
        let op = || site.op_name();
        for phase in 0..=phases {
            let st = self.lock();
            let entered = self.wait(
                st,
                site.members,
                site.me,
                &op,
                |st| {
                    let slot = st.slots.get_mut(&key).expect("slot lives until all leave");
                    if let Some(d) = &slot.poisoned {
                        return Err(CommError::Mismatch {
                            op: site.op_name(),
                            group: site.members.to_vec(),
                            detail: d.clone(),
                        });
                    }
                    let ready = slot.regions.iter().all(Option::is_some)
                        && slot.phases.iter().all(|&p| p >= phase);
                    // A closed call starts no phase, and a member waiting on one that has
                    // left it would wait in vain; a member waiting on others goes on
                    // waiting, to report what it sees itself (a timeout, an exit).
                    if let Some((closer, err)) = &slot.closed {
                        let c = *closer;
                        let behind = |i: usize| slot.regions[i].is_none() || slot.phases[i] < phase;
                        if ready || (0..n).any(|i| slot.left[i] && behind(i)) {
                            // A peer's failure passes on as it is; any other error names
                            // the member that met it.
                            return Err(match err {
                                CommError::PeerFailed { .. } => err.clone(),
                                other => CommError::PeerFailed {
                                    failed: site.members[c],
                                    message: format!(
                                        "left {} after an error: {other}",
                                        site.op_name()
                                    ),
                                },
                            });
                        }
                    }
                    if !ready {
                        return Ok(None);
                    }
                    if phase == phases {
                        return Ok(Some(None));
                    }
                    slot.reading[site.me] = true;
                    let regions: Vec<Region> =
                        slot.regions.iter().map(|r| r.expect("present")).collect();
                    Ok(Some(Some((regions, slot.counts.clone()))))
                },
                |st| {
                    let slot = &st.slots[&key];
                    (0..n)
                        .filter(|&i| slot.regions[i].is_none() || slot.phases[i] < phase)
                        .map(|i| site.members[i])
                        .collect()
                },
                if phase == 0 { ("joining it", "joined") } else { ("finishing it", "finished") },
            );
            let (regions, counts) = match entered {
                Ok(Some(v)) => v,
                Ok(None) => break,
                Err(e) => return Err(self.abandon(site, e)),
            };
            // A panic in `work` must not unwind past the peers reading this buffer: it is
            // an error here first (the slot closed, the readers waited out), then goes on.
            let done = match catch_unwind(AssertUnwindSafe(|| work(phase, &regions, &counts))) {
                Ok(done) => done,
                Err(payload) => {
                    let message = "panicked inside the collective".to_string();
                    let err = CommError::PeerFailed { failed: site.members[site.me], message };
                    self.abandon(site, err);
                    resume_unwind(payload);
                }
            };
            let mut st = self.lock();
            let slot = st.slots.get_mut(&key).expect("slot lives until all leave");
            slot.reading[site.me] = false;
            match &done {
                Ok(()) => slot.phases[site.me] = phase + 1,
                // Closed before the phase counts as done, so no member leaves thinking
                // the call succeeded.
                Err(e) => {
                    if slot.closed.is_none() {
                        slot.closed = Some((site.me, e.clone()));
                    }
                }
            }
            self.wake(st, site.members);
            if let Err(e) = done {
                return Err(self.abandon(site, e));
            }
        }
        self.finish(site);
        Ok(())
    }

    /// Closes a direct collective after `err`, waits until no live member is inside a
    /// phase (each phase is bounded work, without waiting), leaves it and returns `err`.
    fn abandon(&self, site: &CallSite<'_>, err: CommError) -> CommError {
        let key = (site.group_id, site.seq);
        let mut st = self.lock();
        loop {
            let Some(slot) = st.slots.get_mut(&key) else { return err };
            slot.reading[site.me] = false;
            if slot.closed.is_none() {
                slot.closed = Some((site.me, err.clone()));
                // Every member waiting in the call learns it is closed; then look again.
                self.wake(st, site.members);
                st = self.lock();
                continue;
            }
            // A member's flag is set only while its thread (or any thread using its
            // communicator) runs a phase's work, and cleared after it, panics included;
            // an exited rank proves nothing, since its communicator may live on elsewhere.
            let busy = slot.reading.iter().any(|&r| r);
            if !busy {
                break;
            }
            st = self.sleep(st, site.members[site.me], None);
        }
        if let Some(slot) = st.slots.get_mut(&key) {
            slot.left[site.me] = true;
        }
        self.wake(st, site.members);
        self.finish(site);
        err
    }

    /// Collective calls whose slot is still held (by a member that has not left them).
    #[cfg(test)]
    pub fn open_calls(&self) -> usize {
        self.lock().slots.len()
    }

    /// Marks this member done with the slot; the last one frees it.
    pub fn finish(&self, site: &CallSite<'_>) {
        let key = (site.group_id, site.seq);
        let mut st = self.lock();
        let slot = st.slots.get_mut(&key).expect("slot");
        slot.finished += 1;
        if slot.finished == site.members.len() {
            st.slots.remove(&key);
        }
    }

    /// Queues a message (buffered send: never blocks) for world rank `to` (`dst` in the
    /// group).
    pub fn post(
        &self,
        (group_id, src, dst, tag): (u64, usize, usize, u32),
        to: usize,
        data: Vec<u8>,
    ) {
        let mut st = self.lock();
        st.mail.entry((group_id, src, dst, tag)).or_default().push_back(Letter::Copy(data));
        self.wake(st, &[to]);
    }

    /// Queues the sender's own buffer as a message for world rank `to` (`dst` in the
    /// group); the sender must [`Shared::reclaim`] it before its buffer may change or go.
    pub fn lend(
        &self,
        (group_id, src, dst, tag): (u64, usize, usize, u32),
        to: usize,
        region: Region,
    ) -> u64 {
        let mut st = self.lock();
        let id = st.next_lend;
        st.next_lend += 1;
        st.lent.insert(id, Lend::Posted);
        st.mail.entry((group_id, src, dst, tag)).or_default().push_back(Letter::Lent(region, id));
        self.wake(st, &[to]);
        id
    }

    /// Marks lent buffer `id` read (the receiver has finished with it); `lender` is the
    /// sender's world rank.
    pub fn returned(&self, id: u64, lender: usize) {
        let mut st = self.lock();
        st.lent.insert(id, Lend::Read);
        self.wake(st, &[lender]);
    }

    /// Takes lent buffer `id` back: done when it was read; waited for while it is being
    /// read; replaced by `copy()` in its queue when nobody has taken it yet, so the message
    /// is still delivered, as a buffered send's is.
    /// `me` is the sender's world rank.
    pub fn reclaim(
        &self,
        (group_id, src, dst, tag): (u64, usize, usize, u32),
        (id, len, me): (u64, usize, usize),
        copy: impl FnOnce() -> Vec<u8>,
    ) {
        let key = (group_id, src, dst, tag);
        let mut copy = Some(copy);
        let mut made: Option<Vec<u8>> = None;
        let mut waited = false;
        let mut st = self.lock();
        loop {
            match st.lent.get(&id).copied() {
                Some(Lend::Read) | None => {
                    st.lent.remove(&id);
                    drop(st);
                    if let Some(v) = made {
                        self.pool.give(v);
                    }
                    return;
                }
                Some(Lend::Reading) => st = self.sleep(st, me, None),
                Some(Lend::Posted) => match made.take() {
                    // First wait about as long as the copy would take (a receiver that is
                    // on its way then copies once), then copy outside the lock and swap
                    // the copy in if still nobody took the letter.
                    None if !waited => {
                        waited = true;
                        let secs = (len as f64 / COPY_RATE).clamp(20e-6, 0.05);
                        let wait = Duration::from_secs_f64(secs);
                        st = self.sleep(st, me, Some(wait));
                    }
                    None => {
                        drop(st);
                        made = Some((copy.take().expect("copied once"))());
                        st = self.lock();
                    }
                    Some(v) => {
                        let queue = st.mail.get_mut(&key).expect("a lent letter is queued");
                        let at = queue
                            .iter()
                            .position(|l| matches!(l, Letter::Lent(_, i) if *i == id))
                            .expect("a posted letter is in its queue");
                        queue[at] = Letter::Copy(v);
                        st.lent.remove(&id);
                        return;
                    }
                },
            }
        }
    }

    /// Takes the next message from `src` to `dst` with `tag`, waiting for it. A lent buffer
    /// is the taker's to read until it calls [`Shared::returned`].
    pub fn take(
        &self,
        group_id: u64,
        members: &[usize],
        src: usize,
        dst: usize,
        tag: u32,
    ) -> Result<Letter> {
        let key = (group_id, src, dst, tag);
        let st = self.lock();
        let op = || format!("recv from rank {} (tag {tag})", members[src]);
        self.wait(
            st,
            members,
            dst,
            &op,
            |st| {
                let letter = st.mail.get_mut(&key).and_then(VecDeque::pop_front);
                if let Some(Letter::Lent(_, id)) = &letter {
                    st.lent.insert(*id, Lend::Reading);
                }
                Ok(letter)
            },
            |_| vec![members[src]],
            ("sending the message", "sent it"),
        )
    }
}

/// Records the first member's signature in `slot`, or checks this member's against it
/// (poisoning the slot on a mismatch, so every member fails).
fn agree(slot: &mut Slot, site: &CallSite<'_>, sig: Signature) -> Result<()> {
    match &slot.signature {
        None => slot.signature = Some((site.me, sig)),
        Some((first, theirs)) => {
            if let Some(d) = theirs.differs(site.members[*first], &sig, site.members[site.me]) {
                slot.poisoned = Some(d.clone());
                return Err(CommError::Mismatch {
                    op: site.op_name(),
                    group: site.members.to_vec(),
                    detail: d,
                });
            }
        }
    }
    Ok(())
}
