//! Shared state of the local backend: one mutex and condition variable for the whole world,
//! collective slots keyed by (group, sequence number), point-to-point mailboxes, and the
//! failure and exit flags that make waiting ranks fail fast.
//!
//! Payloads are copied outside the lock and shared as `Arc<Vec<u8>>`; the lock only guards
//! bookkeeping.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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

/// One collective call in progress.
#[derive(Debug)]
pub(crate) struct Slot {
    signature: Option<(usize, Signature)>,
    pub deposits: Vec<Option<Arc<Vec<u8>>>>,
    pub counts: Vec<Option<Vec<usize>>>,
    pub second: Vec<Option<Arc<Vec<u8>>>>,
    finished: usize,
    poisoned: Option<String>,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    failed: Option<(usize, String)>,
    exited: Vec<bool>,
    next_group: u64,
    pub groups: HashMap<(u64, Vec<usize>, usize), u64>,
    slots: HashMap<(u64, u64), Slot>,
    mail: HashMap<(u64, usize, usize, u32), VecDeque<Vec<u8>>>,
}

/// The world of one `launch`.
#[derive(Debug)]
pub(crate) struct Shared {
    pub timeout: Duration,
    state: Mutex<State>,
    cond: Condvar,
    /// Payload buffers to reuse.
    pub pool: BufferPool,
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
        let state = State { exited: vec![false; world], next_group: 1, ..State::default() };
        Shared { timeout, state: Mutex::new(state), cond: Condvar::new(), pool: BufferPool::new() }
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
        self.cond.notify_all();
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
    /// and timing out after the configured timeout. `gone` and `never` word the errors.
    #[allow(clippy::too_many_arguments)]
    fn wait<T>(
        &self,
        mut st: MutexGuard<'_, State>,
        members: &[usize],
        me: usize,
        op: &dyn Fn() -> String,
        mut ready: impl FnMut(&mut State) -> Result<Option<T>>,
        waiting_on: impl Fn(&State) -> Vec<usize>,
        (gone, never): (&str, &str),
    ) -> Result<T> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some((failed, message)) = &st.failed {
                return Err(CommError::PeerFailed { failed: *failed, message: message.clone() });
            }
            if let Some(v) = ready(&mut st)? {
                return Ok(v);
            }
            let missing = waiting_on(&st);
            if let Some(&exited) = missing.iter().find(|&&g| st.exited[g]) {
                return Err(CommError::PeerFailed {
                    failed: exited,
                    message: format!("exited without {gone} ({} on rank {})", op(), members[me]),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: op(),
                    group: members.to_vec(),
                    rank: members[me],
                    after: self.timeout,
                    detail: format!("ranks {} never {never}", ranks(&missing)),
                });
            }
            st = self.cond.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Deposits this member's contribution to a collective and waits for all members'.
    /// Returns every deposit and count list, in member order.
    #[allow(clippy::type_complexity)]
    pub fn gather_deposits(
        &self,
        site: &CallSite<'_>,
        sig: Signature,
        data: Arc<Vec<u8>>,
        counts: Option<Vec<usize>>,
    ) -> Result<(Vec<Arc<Vec<u8>>>, Vec<Option<Vec<usize>>>)> {
        let n = site.members.len();
        let key = (site.group_id, site.seq);
        let mut st = self.lock();
        let slot = st.slots.entry(key).or_insert_with(|| Slot {
            signature: None,
            deposits: vec![None; n],
            counts: vec![None; n],
            second: vec![None; n],
            finished: 0,
            poisoned: None,
        });
        match &slot.signature {
            None => slot.signature = Some((site.me, sig)),
            Some((first, theirs)) => {
                if let Some(d) = theirs.differs(site.members[*first], &sig, site.members[site.me]) {
                    slot.poisoned = Some(d.clone());
                    drop(st);
                    self.cond.notify_all();
                    return Err(CommError::Mismatch {
                        op: site.op_name(),
                        group: site.members.to_vec(),
                        detail: d,
                    });
                }
            }
        }
        slot.deposits[site.me] = Some(data);
        slot.counts[site.me] = counts;
        self.cond.notify_all();
        let op = || site.op_name();
        self.wait(
            st,
            site.members,
            site.me,
            &op,
            |st| {
                let slot = st.slots.get(&key).expect("slot lives until all finish");
                if let Some(d) = &slot.poisoned {
                    return Err(CommError::Mismatch {
                        op: site.op_name(),
                        group: site.members.to_vec(),
                        detail: d.clone(),
                    });
                }
                if slot.deposits.iter().all(Option::is_some) {
                    let data = slot.deposits.iter().map(|d| d.clone().expect("present")).collect();
                    return Ok(Some((data, slot.counts.clone())));
                }
                Ok(None)
            },
            |st| {
                let slot = &st.slots[&key];
                (0..n).filter(|&i| slot.deposits[i].is_none()).map(|i| site.members[i]).collect()
            },
            ("joining it", "joined"),
        )
    }

    /// Second round of a collective (all-reduce's reduced chunks).
    pub fn gather_second(
        &self,
        site: &CallSite<'_>,
        data: Arc<Vec<u8>>,
    ) -> Result<Vec<Arc<Vec<u8>>>> {
        let n = site.members.len();
        let key = (site.group_id, site.seq);
        let mut st = self.lock();
        st.slots.get_mut(&key).expect("slot").second[site.me] = Some(data);
        self.cond.notify_all();
        let op = || site.op_name();
        self.wait(
            st,
            site.members,
            site.me,
            &op,
            |st| {
                let slot = &st.slots[&key];
                Ok(slot
                    .second
                    .iter()
                    .all(Option::is_some)
                    .then(|| slot.second.iter().map(|d| d.clone().expect("present")).collect()))
            },
            |st| {
                let slot = &st.slots[&key];
                (0..n).filter(|&i| slot.second[i].is_none()).map(|i| site.members[i]).collect()
            },
            ("finishing it", "finished"),
        )
    }

    /// Marks this member done with the slot (it must have dropped its copies of the
    /// deposits); the last one frees the slot and recycles its buffers.
    pub fn finish(&self, site: &CallSite<'_>) {
        let key = (site.group_id, site.seq);
        let mut st = self.lock();
        let slot = st.slots.get_mut(&key).expect("slot");
        slot.finished += 1;
        if slot.finished == site.members.len() {
            let slot = st.slots.remove(&key).expect("slot");
            drop(st);
            for a in slot.deposits.into_iter().chain(slot.second).flatten() {
                if let Ok(v) = Arc::try_unwrap(a) {
                    self.pool.give(v);
                }
            }
        }
    }

    /// Queues a message (buffered send: never blocks).
    pub fn post(&self, group_id: u64, src: usize, dst: usize, tag: u32, data: Vec<u8>) {
        self.lock().mail.entry((group_id, src, dst, tag)).or_default().push_back(data);
        self.cond.notify_all();
    }

    /// Takes the next message from `src` to `dst` with `tag`, waiting for it.
    pub fn take(
        &self,
        group_id: u64,
        members: &[usize],
        src: usize,
        dst: usize,
        tag: u32,
    ) -> Result<Vec<u8>> {
        let key = (group_id, src, dst, tag);
        let st = self.lock();
        let op = || format!("recv from rank {} (tag {tag})", members[src]);
        self.wait(
            st,
            members,
            dst,
            &op,
            |st| Ok(st.mail.get_mut(&key).and_then(VecDeque::pop_front)),
            |_| vec![members[src]],
            ("sending the message", "sent it"),
        )
    }
}
