//! The `mpi` backend (feature `mpi`): rsmpi over the system's OpenMPI, one process per rank
//! under `mpirun`.
//!
//! MPI handles may not leave the thread that uses them, so they live on an engine thread
//! (`engine.rs`); the [`MpiComm`] handles callers hold are `Send + Sync` and lend their
//! buffers to the engine for the call (it blocks until the engine is done with them), so
//! MPI reads and writes them in place: no copy to the engine and back. A receive that fails
//! may have written part of its buffer (the pieces, or a batch's receives, taken before
//! the failure), as on the local backend. On the engine every operation is issued
//! non-blocking and polled against a deadline. While polling, and while idle between
//! operations, the engine answers status queries on a private control communicator ("what
//! are you doing?"). When a deadline passes, the rank asks the members it waits for, so the
//! timeout names the ranks that never arrived and what they are doing instead. A receive
//! that times out returns the error. A collective or send that times out cannot give its
//! buffers back to MPI, so the watchdog reports the error through the fatal handler and
//! aborts the whole job.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::environment::Universe;
use ::mpi::point_to_point::{Message, Status};
use ::mpi::request::{Request, Scope, scope};
use ::mpi::topology::Communicator as _;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use ::mpi::{Rank, Threading};

use crate::comm::{
    Communicator, P2p, SharedTimeout, args, check_batch, check_peer, check_subgroup,
    length_mismatch,
};
use crate::dtype::{DType, ReduceOp, reduce_into, reduce_onto};
use crate::engine::EngineHandle;
use crate::error::{CommError, Result, ranks};
use crate::pool::BufferPool;

/// What a rank outside any communication call answers a status query.
const COMPUTING: &str = "computing (not in a communication call)";

/// The most ranks a status answer names as those its call waits for, and a timeout asks in
/// turn: a larger group's missing members are found by its own members' timeouts, and
/// asking thousands of ranks would flood the job as it fails.
const CHASED: usize = 64;

/// Whom a rank's current call waits for (world ranks), as its status answer names them.
#[derive(Clone, Debug)]
enum Waits {
    /// Not in a call.
    Nobody,
    /// A collective: every member of communicator `id`.
    Group(usize),
    /// Point-to-point: its peers.
    Peers(Vec<usize>),
}

const QUERY_TAG: i32 = 1;
const REPLY_TAG: i32 = 2;
const SUBGROUP_TAG_BASE: i32 = 1000;

/// Options of an MPI world.
pub struct MpiOptions {
    /// How long a blocking call waits.
    pub timeout: Duration,
    /// Called with the error before a timeout aborts the job (the CLI prints it).
    pub on_fatal: Box<dyn Fn(&CommError) + Send>,
}

impl std::fmt::Debug for MpiOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiOptions").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

/// One communicator on the engine.
struct Entry {
    comm: SimpleCommunicator,
    /// A duplicate of `comm` for the messages a collective sends point to point (the parts
    /// of an all-to-all past its first round), apart from the callers' tags on `comm`.
    bulk: SimpleCommunicator,
    members: Vec<usize>,
    me: usize,
    seq: Cell<u64>,
    created: RefCell<HashMap<Vec<usize>, usize>>,
}

/// Everything MPI, on the engine thread. Field order is drop order: communicators are freed
/// before the universe finalizes MPI.
pub struct MpiEngine {
    entries: Vec<Entry>,
    pool: Arc<BufferPool>,
    control: SimpleCommunicator,
    /// What this rank is doing, as its answer to a status query says it, and whom the call
    /// it is in waits for.
    doing: RefCell<(String, Waits)>,
    timeout: Arc<SharedTimeout>,
    on_fatal: Box<dyn Fn(&CommError) + Send>,
    world_rank: usize,
    _universe: Universe,
}

impl std::fmt::Debug for MpiEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiEngine(rank {}, {} communicators)", self.world_rank, self.entries.len())
    }
}

/// A communicator of the MPI backend: a handle to a communicator on the engine thread.
pub struct MpiComm {
    engine: Arc<EngineHandle<MpiEngine>>,
    id: usize,
    members: Vec<usize>,
    me: usize,
    timeout: Arc<SharedTimeout>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {:?})", self.me, self.members)
    }
}

/// Initializes MPI on an engine thread and returns the world communicator. Fails when MPI
/// was initialized already.
pub fn init(opts: MpiOptions) -> Result<MpiComm> {
    let timeout = Arc::new(SharedTimeout::new(opts.timeout));
    let engine_timeout = timeout.clone();
    let pool = Arc::new(BufferPool::new());
    let engine = EngineHandle::spawn(
        "mpi",
        Duration::from_millis(2),
        move || {
            let (universe, _) = ::mpi::initialize_with_threading(Threading::Serialized)
                .ok_or_else(|| CommError::Backend {
                    backend: "mpi",
                    message: "MPI is initialized already in this process".into(),
                })?;
            let world = universe.world();
            let control = world.duplicate();
            let (rank, size) = (world.rank() as usize, world.size() as usize);
            let entry = Entry {
                comm: SimpleCommunicator::world(),
                bulk: world.duplicate(),
                members: (0..size).collect(),
                me: rank,
                seq: Cell::new(0),
                created: RefCell::new(HashMap::new()),
            };
            Ok(MpiEngine {
                entries: vec![entry],
                pool,
                control,
                doing: RefCell::new((COMPUTING.into(), Waits::Nobody)),
                timeout: engine_timeout,
                on_fatal: opts.on_fatal,
                world_rank: rank,
                _universe: universe,
            })
        },
        MpiEngine::serve,
    )?;
    let (members, me) = engine.call(|e| Ok((e.entries[0].members.clone(), e.entries[0].me)))?;
    Ok(MpiComm { engine, id: 0, members, me, timeout })
}

impl MpiComm {
    /// Frees every communicator and finalizes MPI; later calls on any handle fail. Call it
    /// at the end of an MPI program (dropping the last handle does the same).
    pub fn shutdown(&self) {
        self.engine.shutdown();
    }
}

/// Ends the whole job now with `code`: mpirun stops every process when one exits non-zero.
pub fn abort_job(code: i32) -> ! {
    std::process::exit(code)
}

/// Makes a panic on this rank print one line naming the rank and end the whole job, so
/// every process exits non-zero at once instead of waiting for the panicked one. Programs
/// call it right after [`init`]. `print` gets the whole line, its newline included, to
/// write in one call: ranks share mpirun's output, and a line written in pieces can take
/// another rank's line inside it.
pub fn abort_on_panic(rank: usize, print: fn(&str)) {
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with a non-string payload".into());
        let at =
            info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        print(&format!("rank {rank} panicked{at}: {msg}\n"));
        abort_job(101);
    }));
}

/// The most bytes one MPI call carries (MPI's counts and displacements are 32-bit):
/// messages, broadcasts, all-gathers and all-reduces longer than this go in pieces, and an
/// all-to-all sends each pair at most `PIECE / members` bytes through MPI's collective and
/// the rest point to point.
static PIECE: AtomicUsize = AtomicUsize::new(1 << 30);

fn piece_bytes() -> usize {
    PIECE.load(Ordering::Relaxed)
}

/// Sets the most bytes one MPI call carries (1 GiB unless set, and never more), so that
/// tests exercise the pieces with small messages; every rank sets the same, before any
/// communication.
#[cfg(feature = "testing")]
pub fn set_piece_bytes(bytes: usize) {
    PIECE.store(bytes.clamp(1, 1 << 30), Ordering::Relaxed);
}

/// The byte ranges a point-to-point message of `len` bytes travels in: whole `PIECE`s, then
/// one shorter piece (empty where `len` is a multiple of `PIECE`). A message under `PIECE`
/// goes as one, and a sender of more bytes than the receiver expects sends a longer last
/// piece than it waits for, so the length check still catches it.
fn pieces(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let p = piece_bytes();
    (0..=len / p).map(move |k| k * p..((k + 1) * p).min(len))
}

/// Posts the send of `data` to member `dst` of `comm` on `tag`, in the messages [`pieces`]
/// cuts it into (MPI keeps a pair's messages on one tag in order).
fn post<'a, Sc: Scope<'a> + Copy>(
    s: Sc,
    comm: &SimpleCommunicator,
    dst: usize,
    tag: u32,
    data: &'a [u8],
) -> Vec<Request<'a, [u8], Sc>> {
    let p = comm.process_at_rank(dst as Rank);
    let data = placed(data);
    pieces(data.len()).map(|r| p.immediate_send_with_tag(s, &data[r], tag as i32)).collect()
}

/// What an empty buffer MPI reads is handed to it as ([`placed`]).
static EMPTY: [u8; 1] = [0];

/// `data`, or where it is empty an empty slice of a real buffer. An empty slice's address
/// may be 1, which OpenMPI takes for `MPI_IN_PLACE` (an all-gather into it fails, and one
/// sent from it would read its part from the receive buffer): MPI gets a real address.
fn placed(data: &[u8]) -> &[u8] {
    if data.is_empty() { &EMPTY[..0] } else { data }
}

/// [`placed`] for a buffer MPI writes: an empty one becomes an empty slice of `spare`.
fn placed_mut<'a>(data: &'a mut [u8], spare: &'a mut [u8; 1]) -> &'a mut [u8] {
    if data.is_empty() { &mut spare[..0] } else { data }
}

/// Why a message was not received.
enum Missed {
    /// Not there by the deadline.
    Late,
    /// Of another length: the bytes that came (up to the deadline).
    Length(usize),
}

/// Where each part starts in the parts laid end to end.
fn starts(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            *at += c;
            Some(*at - c)
        })
        .collect()
}

/// `values` (counts or offsets within one call) as MPI's 32-bit counts: every call carries
/// at most `PIECE` bytes, so they fit.
fn mpi_counts(values: impl IntoIterator<Item = usize>) -> Vec<Rank> {
    values
        .into_iter()
        .map(|v| Rank::try_from(v).expect("one MPI call carries at most PIECE bytes"))
        .collect()
}

/// Between polls of a long wait: yield the core at first, sleep once the wait is clearly
/// long (ranks oversubscribed on few cores must not spin against each other).
fn pause(start: Instant) {
    if start.elapsed() > Duration::from_millis(500) {
        std::thread::sleep(Duration::from_micros(100));
    } else {
        std::thread::yield_now();
    }
}

/// Receives a matched message of any length into a buffer from `pool`.
fn receive_all(pool: &BufferPool, msg: Message, status: &Status) -> Vec<u8> {
    let mut buf = pool.take(status.count(u8::equivalent_datatype()) as usize);
    msg.matched_receive_into(&mut buf[..]);
    buf
}

impl MpiEngine {
    /// Answers pending status queries from other ranks.
    fn serve(&mut self) {
        self.answer();
    }

    fn answer(&self) {
        while let Some((msg, status)) =
            self.control.any_process().immediate_matched_probe_with_tag(QUERY_TAG)
        {
            self.pool.give(receive_all(&self.pool, msg, &status));
            // The text, then whom the call waits for (at most CHASED of them):
            // `in all-reduce #3 over ranks [0-1]\00,1`.
            let (text, waits) = &*self.doing.borrow();
            let ranks: &[usize] = match waits {
                Waits::Nobody => &[],
                Waits::Group(id) => &self.entries[*id].members,
                Waits::Peers(peers) => peers,
            };
            let named = if ranks.len() <= CHASED { ranks } else { &[] };
            let named: Vec<String> = named.iter().map(usize::to_string).collect();
            let reply = format!("{text}\0{}", named.join(",")).into_bytes();
            self.control.process_at_rank(status.source_rank()).send_with_tag(&reply[..], REPLY_TAG);
        }
    }

    /// Asks `peers` (world ranks) what they are doing; waits at most a second for answers:
    /// each one's words and the members of the call it is in.
    fn ask(&self, peers: &[usize]) -> HashMap<usize, (String, Vec<usize>)> {
        for &p in peers {
            self.control.process_at_rank(p as Rank).send_with_tag(&[0u8][..], QUERY_TAG);
        }
        let mut answers = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        while answers.len() < peers.len() && Instant::now() < deadline {
            self.answer();
            if let Some((msg, status)) =
                self.control.any_process().immediate_matched_probe_with_tag(REPLY_TAG)
            {
                let bytes = receive_all(&self.pool, msg, &status);
                // A late answer to an earlier question is not one to this.
                let from = status.source_rank() as usize;
                if !peers.contains(&from) {
                    continue;
                }
                let reply = String::from_utf8_lossy(&bytes).into_owned();
                let (text, members) = reply.split_once('\0').unwrap_or((&reply, ""));
                let members = members.split(',').filter_map(|m| m.parse().ok()).collect();
                answers.insert(from, (text.to_string(), members));
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        answers
    }

    fn doing_text(&self, id: usize, name: &str) -> String {
        format!("in {name} over ranks {}", ranks(&self.entries[id].members))
    }

    /// Starts collective `op` on communicator `id`: returns its name (`all-reduce #3`) and
    /// publishes what this rank is doing.
    fn begin(&self, id: usize, op: &str) -> String {
        let e = &self.entries[id];
        let seq = e.seq.get();
        e.seq.set(seq + 1);
        let name = format!("{op} #{seq}");
        self.doing.replace((self.doing_text(id, &name), Waits::Group(id)));
        name
    }

    /// Like [`Self::begin`] for point-to-point calls, named by peer and tag, waiting for
    /// `peers` (world ranks).
    fn begin_named(&self, id: usize, name: String, peers: Vec<usize>) -> String {
        self.doing.replace((self.doing_text(id, &name), Waits::Peers(peers)));
        name
    }

    fn end(&self) {
        self.doing.replace((COMPUTING.into(), Waits::Nobody));
    }

    fn others(&self, id: usize) -> Vec<usize> {
        let e = &self.entries[id];
        e.members.iter().copied().filter(|&r| r != e.members[e.me]).collect()
    }

    /// The timeout error of operation `name`, with what the members we wait for say, and,
    /// where one is in another call, which of that call's members did not answer: the rank
    /// it waits for may be the one hung, and this rank's timeout may end the job first.
    fn timeout_error(&self, id: usize, name: &str, waiting_on: &[usize]) -> CommError {
        let answers = self.ask(waiting_on);
        let me = self.world_rank;
        let mut further: Vec<usize> = answers
            .values()
            .flat_map(|(_, members)| members.iter().copied())
            .filter(|m| *m != me && !waiting_on.contains(m))
            .collect();
        further.sort_unstable();
        further.dedup();
        if further.len() > CHASED {
            further.clear();
        }
        let theirs = if further.is_empty() { HashMap::new() } else { self.ask(&further) };
        let mut notes = Vec::new();
        for &p in waiting_on {
            match answers.get(&p) {
                Some((a, _)) if *a == self.doing_text(id, name) => {}
                Some((a, members)) => {
                    let silent: Vec<usize> = members
                        .iter()
                        .copied()
                        .filter(|m| further.contains(m) && !theirs.contains_key(m))
                        .collect();
                    notes.push(match silent[..] {
                        [] => format!("rank {p} is {a}"),
                        [q] => {
                            format!("rank {p} is {a}, where rank {q} did not answer (hung or gone)")
                        }
                        _ => format!(
                            "rank {p} is {a}, where ranks {} did not answer (hung or gone)",
                            ranks(&silent)
                        ),
                    });
                }
                None => notes.push(format!("rank {p} did not answer (hung or gone)")),
            }
        }
        if notes.is_empty() {
            notes.push("every member arrived; the transfer itself stalled".into());
        }
        CommError::Timeout {
            op: name.to_string(),
            group: self.entries[id].members.clone(),
            rank: self.world_rank,
            after: self.timeout.get(),
            detail: notes.join("; "),
        }
    }

    /// Reports `err` through the fatal handler and aborts the job: MPI still owns buffers
    /// of operation on communicator `id` (a collective or send that never completed).
    fn fatal(&self, id: usize, err: &CommError) -> ! {
        (self.on_fatal)(err);
        self.entries[id].comm.abort(3)
    }

    /// Polls `req` until it completes; past the deadline, reports and aborts the job.
    fn wait<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        mut req: Request<'a, D, S>,
        id: usize,
        name: &str,
        waiting_on: &[usize],
    ) {
        let start = Instant::now();
        let deadline = start + self.timeout.get();
        let mut spins = 0u32;
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            self.answer();
            if Instant::now() >= deadline {
                self.fatal(id, &self.timeout_error(id, name, waiting_on));
            }
            // Non-blocking collectives progress only inside MPI calls: keep testing, yield
            // the core to other ranks, and only sleep once the wait is clearly long.
            spins += 1;
            if spins > 1000 {
                if start.elapsed() > Duration::from_millis(500) {
                    std::thread::sleep(Duration::from_micros(100));
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    fn all_reduce(&self, id: usize, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        // Member m reduces elements [m * len / n, (m + 1) * len / n) of every member's
        // buffer in member order, then every member gathers the reduced ranges: the same
        // arithmetic as the local backend for every type and group size (MPI's own
        // all-reduce picks its order by message size and group, so a sum over three or more
        // ranks could round differently from the local run's, and from one MPI to another).
        let name = self.begin(id, "all-reduce");
        if self.entries[id].members.len() > 1 {
            // In pieces of at most `PIECE` bytes, so MPI's 32-bit counts and displacements
            // hold (the sums are per element, so the pieces change nothing in the result); a
            // whole number of elements per member, so each member's range stays within the
            // all-to-all's one-call share. Every member holds the same length, so all cut
            // the same pieces.
            let step = self.entries[id].members.len() * dtype.size();
            let piece = (piece_bytes() / step).max(1) * step;
            if data.is_empty() {
                // Still one round of calls: members that disagree on the length fail in
                // MPI instead of matching this round with their next collective.
                self.reduce_piece(id, &name, data, dtype, op);
            }
            for part in data.chunks_mut(piece) {
                self.reduce_piece(id, &name, part, dtype, op);
            }
        }
        self.end();
        Ok(())
    }

    /// One piece of all-reduce `name`, in place: member m sums its range of every member's
    /// `data` in member order, then every member gathers the sums into `data`.
    fn reduce_piece(&self, id: usize, name: &str, data: &mut [u8], dtype: DType, op: ReduceOp) {
        let e = &self.entries[id];
        let (n, size) = (e.members.len(), dtype.size());
        let len = data.len() / size;
        let counts: Vec<usize> = (0..n).map(|m| ((m + 1) * len / n - m * len / n) * size).collect();
        let sums = self.sum_ranges(id, name, data, &counts, dtype, op);
        self.gather_v(id, name, &sums, &counts, data);
        self.pool.give(sums);
    }

    /// Member m's range (`counts[m]` bytes, in member order through `data`) of every
    /// member's `data`, reduced in member order: the same arithmetic as the local backend
    /// for every type, bf16 included.
    fn sum_ranges(
        &self,
        id: usize,
        name: &str,
        data: &[u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Vec<u8> {
        let e = &self.entries[id];
        let n = e.members.len();
        let mine = counts[e.me];
        let mut blocks = self.exchange(id, name, data, counts, &vec![mine; n]);
        // Member 0's block is the accumulator; the others fold onto it in member order.
        let (acc, rest) = blocks.split_at_mut(mine);
        if mine > 0 {
            let rest: Vec<&[u8]> = rest.chunks_exact(mine).collect();
            reduce_onto(acc, &rest, dtype, op);
        }
        blocks.truncate(mine);
        blocks
    }

    fn barrier(&self, id: usize) -> Result<()> {
        let name = self.begin(id, "barrier");
        let req = self.entries[id].comm.immediate_barrier();
        self.wait(req, id, &name, &self.others(id));
        self.end();
        Ok(())
    }

    fn broadcast(&self, id: usize, data: &mut [u8], root: usize) -> Result<()> {
        let name = self.begin(id, "broadcast");
        let e = &self.entries[id];
        // Every member holds the same length, so all cut it into the same pieces (none
        // where it is empty).
        for piece in data.chunks_mut(piece_bytes()) {
            scope(|s| {
                let req = e.comm.process_at_rank(root as Rank).immediate_broadcast_into(s, piece);
                self.wait(req, id, &name, &[e.members[root]]);
            });
        }
        self.end();
        Ok(())
    }

    fn all_gather_v(
        &self,
        id: usize,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
    ) -> Result<()> {
        let name = self.begin(id, "all-gather-v");
        self.gather_v(id, &name, send, counts, recv);
        self.end();
        Ok(())
    }

    /// The all-gather of operation `name` (begun by the caller). Every member knows every
    /// count, so all cut the gathered bytes into the same `PIECE`-long rounds: round `k`
    /// gathers bytes `[k * PIECE, (k + 1) * PIECE)` of the result from the members whose
    /// parts overlap them, straight into place. One round, the usual case, is one MPI call.
    fn gather_v(&self, id: usize, name: &str, send: &[u8], counts: &[usize], recv: &mut [u8]) {
        let e = &self.entries[id];
        let (total, at, p) = (counts.iter().sum::<usize>(), starts(counts), piece_bytes());
        debug_assert_eq!(recv.len(), total);
        for k in 0..total.div_ceil(p).max(1) {
            let (lo, hi) = (k * p, ((k + 1) * p).min(total));
            let overlap = |m: usize| (at[m].clamp(lo, hi), (at[m] + counts[m]).clamp(lo, hi));
            let c = mpi_counts((0..counts.len()).map(|m| overlap(m).1 - overlap(m).0));
            let d = mpi_counts((0..counts.len()).map(|m| overlap(m).0 - lo));
            let (a, b) = overlap(e.me);
            let mine = placed(if a < b { &send[a - at[e.me]..b - at[e.me]] } else { &[] });
            let mut spare = [0u8];
            let out = placed_mut(&mut recv[lo..hi], &mut spare);
            let mut part = PartitionMut::new(out, &c[..], &d[..]);
            scope(|s| {
                let req = e.comm.immediate_all_gather_varcount_into(s, mine, &mut part);
                self.wait(req, id, name, &self.others(id));
            });
        }
    }

    fn reduce_scatter(
        &self,
        id: usize,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let name = self.begin(id, "reduce-scatter");
        let (n, block) = (self.entries[id].members.len(), recv.len());
        let blocks = self.exchange(id, &name, send, &vec![block; n], &vec![block; n]);
        if block > 0 {
            // Every member's block of `send`, in member order: the same sums as all-reduce.
            let parts: Vec<&[u8]> = blocks.chunks_exact(block).collect();
            reduce_into(recv, &parts, dtype, op);
        }
        self.pool.give(blocks);
        self.end();
        Ok(())
    }

    fn all_to_all_v(
        &self,
        id: usize,
        (send, sc): (&[u8], &[usize]),
        (recv, rc): (&mut [u8], &[usize]),
    ) -> Result<()> {
        let name = self.begin(id, "all-to-all-v");
        self.exchange_into(id, &name, (send, sc), (recv, rc));
        self.end();
        Ok(())
    }

    /// [`Self::exchange_into`] a new buffer from the pool.
    fn exchange(&self, id: usize, name: &str, send: &[u8], sc: &[usize], rc: &[usize]) -> Vec<u8> {
        let mut recv = self.pool.take(rc.iter().sum());
        self.exchange_into(id, name, (send, sc), (&mut recv, rc));
        recv
    }

    /// The all-to-all of operation `name` (begun by the caller): `sc[m]` bytes of `send`
    /// to member `m`, `rc[m]` from it.
    ///
    /// A member knows only its own counts, so the members cannot agree on a number of
    /// rounds without another collective. Instead each pair's first `PIECE / members` bytes
    /// go through one MPI all-to-all (at most `PIECE` bytes a member, so its 32-bit counts
    /// and displacements hold), and a pair with more sends the rest point to point on the
    /// group's private communicator: both ends of a pair know its count, so they agree on
    /// that without asking. Without such a pair (the usual case) it is one MPI call.
    fn exchange_into(
        &self,
        id: usize,
        name: &str,
        (send, sc): (&[u8], &[usize]),
        (recv, rc): (&mut [u8], &[usize]),
    ) {
        let e = &self.entries[id];
        let share = (piece_bytes() / e.members.len()).max(1);
        if sc.iter().chain(rc).all(|&c| c <= share) {
            self.all_to_all_call(id, name, send, sc, recv, rc);
            return;
        }
        let (so, ro) = (starts(sc), starts(rc));
        let first = |c: &[usize]| c.iter().map(|&c| c.min(share)).collect::<Vec<_>>();
        let (sc1, rc1) = (first(sc), first(rc));
        let mut head = self.pool.take(sc1.iter().sum());
        for ((m, &c), to) in sc1.iter().enumerate().zip(starts(&sc1)) {
            head[to..to + c].copy_from_slice(&send[so[m]..so[m] + c]);
        }
        let mut got = self.pool.take(rc1.iter().sum());
        self.all_to_all_call(id, name, &head, &sc1, &mut got, &rc1);
        for ((m, &c), from) in rc1.iter().enumerate().zip(starts(&rc1)) {
            recv[ro[m]..ro[m] + c].copy_from_slice(&got[from..from + c]);
        }
        self.pool.give(head);
        self.pool.give(got);
        let start = Instant::now();
        let deadline = start + self.timeout.get();
        scope(|s| {
            let reqs: Vec<_> = (0..sc.len())
                .filter(|&m| sc[m] > share)
                .flat_map(|m| {
                    let rest = &send[so[m] + share..so[m] + sc[m]];
                    post(s, &e.bulk, m, 0, rest).into_iter().map(move |r| (m, r))
                })
                .collect();
            for m in (0..rc.len()).filter(|&m| rc[m] > share) {
                let rest = &mut recv[ro[m] + share..ro[m] + rc[m]];
                match self.take_message(&e.bulk, (m, 0), rest, deadline, || pause(start)) {
                    Ok(()) => {}
                    // The collective's members disagree on a count, or one is gone: the job
                    // cannot go on, as when an MPI collective times out.
                    Err(missed) => {
                        let err = match missed {
                            Missed::Late => self.timeout_error(id, name, &[e.members[m]]),
                            Missed::Length(got) => CommError::Backend {
                                backend: "mpi",
                                message: format!(
                                    "{name}: rank {} sent {} bytes to rank {} where it expects {}",
                                    e.members[m],
                                    share + got,
                                    e.members[e.me],
                                    rc[m]
                                ),
                            },
                        };
                        self.fatal(id, &err);
                    }
                }
            }
            for (m, req) in reqs {
                self.wait(req, id, name, &[e.members[m]]);
            }
        });
    }

    /// One MPI all-to-all of `sc[m]` bytes of `send` to member `m` and `rc[m]` from it into
    /// `recv`, each side at most `PIECE` bytes.
    fn all_to_all_call(
        &self,
        id: usize,
        name: &str,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) {
        let (sd, rd) = (mpi_counts(starts(sc)), mpi_counts(starts(rc)));
        let (sc, rc) = (mpi_counts(sc.iter().copied()), mpi_counts(rc.iter().copied()));
        let mut spare = [0u8];
        let part = Partition::new(placed(send), &sc[..], &sd[..]);
        let mut rpart = PartitionMut::new(placed_mut(recv, &mut spare), &rc[..], &rd[..]);
        scope(|s| {
            let req =
                self.entries[id].comm.immediate_all_to_all_varcount_into(s, &part, &mut rpart);
            self.wait(req, id, name, &self.others(id));
        });
    }

    fn send(&self, id: usize, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        let e = &self.entries[id];
        let name = format!("send to rank {} (tag {tag})", e.members[dst]);
        let name = self.begin_named(id, name, vec![e.members[dst]]);
        scope(|s| {
            for req in post(s, &e.comm, dst, tag, data) {
                self.wait(req, id, &name, &[e.members[dst]]);
            }
        });
        self.end();
        Ok(())
    }

    fn recv(&self, id: usize, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        let e = &self.entries[id];
        let name = format!("recv from rank {} (tag {tag})", e.members[src]);
        let name = self.begin_named(id, name, vec![e.members[src]]);
        let (start, len) = (Instant::now(), data.len());
        let got = self.take_message(&e.comm, (src, tag), data, start + self.timeout.get(), || {
            std::thread::yield_now();
        });
        let out = got.map_err(|missed| match missed {
            Missed::Late => self.timeout_error(id, &name, &[e.members[src]]),
            Missed::Length(got) => length_mismatch(&e.members, e.me, src, tag, got, len),
        });
        self.end();
        out
    }

    /// Receives message `(src, tag)` of `data.len()` bytes on `comm` into `data`, in the
    /// pieces [`pieces`] cuts it into, probing until `deadline` (`idle` between probes). A
    /// piece of the wrong length is taken anyway, so the tag's later messages still match.
    fn take_message(
        &self,
        comm: &SimpleCommunicator,
        (src, tag): (usize, u32),
        data: &mut [u8],
        deadline: Instant,
        idle: impl Fn(),
    ) -> std::result::Result<(), Missed> {
        for piece in pieces(data.len()) {
            let (msg, status) = loop {
                if let Some(found) =
                    comm.process_at_rank(src as Rank).immediate_matched_probe_with_tag(tag as i32)
                {
                    break found;
                }
                self.answer();
                if Instant::now() >= deadline {
                    return Err(Missed::Late);
                }
                idle();
            };
            let got = status.count(u8::equivalent_datatype()) as usize;
            if got != piece.len() {
                self.pool.give(receive_all(&self.pool, msg, &status));
                // A longer message goes on in whole pieces up to a shorter last one: all of
                // it is taken, so none is left to match a later receive on the tag.
                let (mut total, mut last) = (piece.start + got, got);
                while last == piece_bytes() {
                    let found = loop {
                        let p = comm.process_at_rank(src as Rank);
                        if let Some(found) = p.immediate_matched_probe_with_tag(tag as i32) {
                            break Some(found);
                        }
                        self.answer();
                        if Instant::now() >= deadline {
                            break None;
                        }
                        idle();
                    };
                    let Some((msg, status)) = found else { break };
                    last = status.count(u8::equivalent_datatype()) as usize;
                    total += last;
                    self.pool.give(receive_all(&self.pool, msg, &status));
                }
                return Err(Missed::Length(total));
            }
            let mut spare = [0u8];
            msg.matched_receive_into(placed_mut(&mut data[piece], &mut spare));
        }
        Ok(())
    }

    fn send_recv(
        &self,
        id: usize,
        (send, dst, st): (&[u8], usize, u32),
        (recv, src, rt): (&mut [u8], usize, u32),
    ) -> Result<()> {
        let e = &self.entries[id];
        let name = format!("send-recv with ranks {} and {}", e.members[dst], e.members[src]);
        let name = self.begin_named(id, name, vec![e.members[dst], e.members[src]]);
        scope(|s| {
            let reqs = post(s, &e.comm, dst, st, send);
            let got = self.recv(id, recv, src, rt);
            for req in reqs {
                self.wait(req, id, &name, &[e.members[dst]]);
            }
            self.end();
            got
        })
    }

    /// A batch of messages: every send posted non-blocking, each receive then probed and
    /// taken in list order (MPI keeps a pair's messages with one tag in order) while the
    /// sends progress, every send completed last. One deadline for the whole batch.
    fn batch(
        &self,
        id: usize,
        name: String,
        sends: &[(usize, u32, &[u8])],
        recvs: &mut [(usize, u32, &mut [u8])],
    ) -> Result<()> {
        let e = &self.entries[id];
        let mut peers: Vec<usize> =
            sends.iter().map(|s| s.0).chain(recvs.iter().map(|r| r.0)).collect();
        peers.sort_unstable();
        peers.dedup();
        let peers = peers.into_iter().map(|p| e.members[p]).collect();
        let name = self.begin_named(id, name, peers);
        let start = Instant::now();
        let deadline = start + self.timeout.get();
        let out = scope(|s| {
            let reqs: Vec<_> = sends
                .iter()
                .flat_map(|(dst, tag, data)| {
                    post(s, &e.comm, *dst, *tag, data).into_iter().map(|r| (*dst, r))
                })
                .collect();
            let mut failed = None;
            for (src, tag, data) in recvs.iter_mut() {
                let (src, tag, len) = (*src, *tag, data.len());
                match self.take_message(&e.comm, (src, tag), data, deadline, || pause(start)) {
                    Ok(()) => {}
                    Err(Missed::Late) => {
                        let what = format!("{name}: recv from rank {} (tag {tag})", e.members[src]);
                        failed = Some(self.timeout_error(id, &what, &[e.members[src]]));
                        break;
                    }
                    Err(Missed::Length(n)) => {
                        failed = Some(length_mismatch(&e.members, e.me, src, tag, n, len));
                        break;
                    }
                }
            }
            let Some(err) = failed else {
                for (dst, req) in reqs {
                    self.wait(req, id, &name, &[e.members[dst]]);
                }
                return Ok(());
            };
            // MPI owns the sends' buffers until they complete: give them until the batch's
            // deadline, then the job cannot go on.
            for (_, mut req) in reqs {
                loop {
                    match req.test() {
                        Ok(_) => break,
                        Err(r) => req = r,
                    }
                    self.answer();
                    if Instant::now() >= deadline {
                        self.fatal(id, &err);
                    }
                    std::thread::yield_now();
                }
            }
            Err(err)
        });
        self.end();
        out
    }

    fn subgroup(&mut self, id: usize, list: Vec<usize>) -> Result<(usize, Vec<usize>, usize)> {
        let parent = &self.entries[id];
        let occurrence = {
            let mut created = parent.created.borrow_mut();
            let n = created.entry(list.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let ranks_i32: Vec<Rank> = list.iter().map(|&r| r as Rank).collect();
        let group = parent.comm.group().include(&ranks_i32);
        let tag = SUBGROUP_TAG_BASE + (occurrence as i32 % 30_000);
        let comm = parent.comm.split_by_subgroup_with_tag(&group, tag).ok_or_else(|| {
            CommError::Backend {
                backend: "mpi",
                message: format!(
                    "MPI_Comm_create_group returned no communicator for {list:?} on rank {}",
                    self.world_rank
                ),
            }
        })?;
        let members: Vec<usize> = list.iter().map(|&i| parent.members[i]).collect();
        let me = list.iter().position(|&i| i == parent.me).expect("caller is a member");
        let bulk = comm.duplicate();
        self.entries.push(Entry {
            comm,
            bulk,
            members: members.clone(),
            me,
            seq: Cell::new(0),
            created: RefCell::new(HashMap::new()),
        });
        Ok((self.entries.len() - 1, members, me))
    }
}

impl Communicator for MpiComm {
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
        "mpi"
    }
    fn timeout(&self) -> Duration {
        self.timeout.get()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout.set(timeout);
    }

    fn barrier(&self) -> Result<()> {
        let id = self.id;
        self.engine.call(move |e| e.barrier(id))
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        args::elements(self, "all-reduce", data.len(), dtype)?;
        let id = self.id;
        self.engine.call(move |e| e.all_reduce(id, data, dtype, op))
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        check_peer(self, root, "broadcast root")?;
        let id = self.id;
        self.engine.call(move |e| e.broadcast(id, data, root))
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        args::all_gather_v(self, send, recv, counts)?;
        let id = self.id;
        self.engine.call(move |e| e.all_gather_v(id, send, recv, counts))
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        args::reduce_scatter(self, send, recv, dtype)?;
        let id = self.id;
        self.engine.call(move |e| e.reduce_scatter(id, send, recv, dtype, op))
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        args::all_to_all_v(self, send, sc, recv, rc)?;
        let id = self.id;
        self.engine.call(move |e| e.all_to_all_v(id, (send, sc), (recv, rc)))
    }

    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        check_peer(self, dst, "send")?;
        let id = self.id;
        self.engine.call(move |e| e.send(id, data, dst, tag))
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        check_peer(self, src, "recv")?;
        let id = self.id;
        self.engine.call(move |e| e.recv(id, data, src, tag))
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
        check_peer(self, dst, "send-recv")?;
        check_peer(self, src, "send-recv")?;
        let id = self.id;
        self.engine.call(move |e| e.send_recv(id, (send, dst, st), (recv, src, rt)))
    }

    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        let name = check_batch(self, ops)?;
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for op in ops.iter_mut() {
            match op {
                P2p::Send { data, peer, tag } => sends.push((*peer, *tag, &**data)),
                P2p::Recv { data, peer, tag } => recvs.push((*peer, *tag, &mut **data)),
            }
        }
        let id = self.id;
        self.engine.call(move |e| e.batch(id, name, &sends, &mut recvs))
    }

    fn subgroup(&self, list: &[usize]) -> Result<Box<dyn Communicator>> {
        check_subgroup(self, list)?;
        let (id, l) = (self.id, list.to_vec());
        let (new_id, members, me) = self.engine.call(move |e| e.subgroup(id, l))?;
        Ok(Box::new(MpiComm {
            engine: self.engine.clone(),
            id: new_id,
            members,
            me,
            timeout: self.timeout.clone(),
        }))
    }
}
