//! The `mpi` backend (feature `mpi`): rsmpi over the system's OpenMPI, one process per rank
//! under `mpirun`.
//!
//! Every operation is issued non-blocking and polled against a deadline. While polling, a
//! rank answers status queries on a private control communicator ("which operation are you
//! in?"). When a deadline passes, the rank asks the members it waits for, and the timeout
//! names those that never arrived and what they are doing instead. A receive that times out
//! returns the error. A collective or send that times out cannot give its buffers back to
//! MPI, so the watchdog reports the error through the world's fatal handler and aborts the
//! whole job (every rank exits non-zero).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use ::mpi::collective::SystemOperation;
use ::mpi::datatype::{Partition, PartitionMut};
use ::mpi::environment::Universe;
use ::mpi::request::{Request, Scope, scope};
use ::mpi::topology::Communicator as _;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use ::mpi::{Rank, Threading};

use crate::comm::{CommExt, Communicator, args, check_peer, check_subgroup};
use crate::dtype::{DType, ReduceOp, reduce_into, typed};
use crate::error::{CommError, Result, ranks};

const QUERY_TAG: i32 = 1;
const REPLY_TAG: i32 = 2;
const SUBGROUP_TAG_BASE: i32 = 1000;

/// Options of an MPI world.
pub struct MpiOptions {
    /// How long a blocking call waits.
    pub timeout: Duration,
    /// Called with the error before a timeout aborts the job (the CLI prints it).
    pub on_fatal: Box<dyn Fn(&CommError)>,
}

impl std::fmt::Debug for MpiOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiOptions").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

/// What every communicator of this process shares. Field order is drop order: the control
/// communicator is freed before the universe finalizes MPI.
struct Shared {
    control: SimpleCommunicator,
    /// What this rank is doing, for status queries.
    doing: RefCell<String>,
    timeout: Duration,
    on_fatal: Box<dyn Fn(&CommError)>,
    world_rank: usize,
    _universe: Universe,
}

/// A communicator of the MPI backend.
pub struct MpiComm {
    comm: SimpleCommunicator,
    members: Vec<usize>,
    me: usize,
    seq: Cell<u64>,
    created: RefCell<HashMap<Vec<usize>, usize>>,
    shared: Rc<Shared>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {:?})", self.me, self.members)
    }
}

/// Initializes MPI and returns the world communicator. Fails when MPI was initialized
/// already.
pub fn init(opts: MpiOptions) -> Result<MpiComm> {
    let (universe, _) =
        ::mpi::initialize_with_threading(Threading::Single).ok_or_else(|| CommError::Backend {
            backend: "mpi",
            message: "MPI is initialized already in this process".into(),
        })?;
    let world = universe.world();
    let control = world.duplicate();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let shared = Rc::new(Shared {
        control,
        doing: RefCell::new("starting".into()),
        timeout: opts.timeout,
        on_fatal: opts.on_fatal,
        world_rank: rank,
        _universe: universe,
    });
    Ok(MpiComm {
        comm: SimpleCommunicator::world(),
        members: (0..size).collect(),
        me: rank,
        seq: Cell::new(0),
        created: RefCell::new(HashMap::new()),
        shared,
    })
}

/// Aborts every process of the job.
pub fn abort_job(code: i32) -> ! {
    SimpleCommunicator::world().abort(code)
}

/// Makes a panic on this rank print one line naming the rank and abort the whole job, so
/// every process exits non-zero at once instead of waiting for the panicked one. Programs
/// call it right after [`init`].
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
        print(&format!("rank {rank} panicked{at}: {msg}"));
        abort_job(101);
    }));
}

/// Receives a matched message of any length.
fn receive_all(
    msg: ::mpi::point_to_point::Message,
    status: &::mpi::point_to_point::Status,
) -> Vec<u8> {
    let mut buf = vec![0u8; status.count(u8::equivalent_datatype()) as usize];
    msg.matched_receive_into(&mut buf[..]);
    buf
}

fn mpi_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

fn counts_i32(counts: &[usize]) -> Vec<Rank> {
    counts.iter().map(|&c| Rank::try_from(c).expect("message under 2 GiB")).collect()
}

fn displacements(counts: &[Rank]) -> Vec<Rank> {
    counts
        .iter()
        .scan(0, |acc, &c| {
            let d = *acc;
            *acc += c;
            Some(d)
        })
        .collect()
}

impl Shared {
    /// Answers pending status queries from other ranks.
    fn serve(&self) {
        while let Some((msg, status)) =
            self.control.any_process().immediate_matched_probe_with_tag(QUERY_TAG)
        {
            receive_all(msg, &status);
            let reply = self.doing.borrow().clone().into_bytes();
            self.control.process_at_rank(status.source_rank()).send_with_tag(&reply[..], REPLY_TAG);
        }
    }

    /// Asks `peers` (world ranks) what they are doing; waits at most a second for answers.
    fn ask(&self, peers: &[usize]) -> HashMap<usize, String> {
        for &p in peers {
            self.control.process_at_rank(p as Rank).send_with_tag(&[0u8][..], QUERY_TAG);
        }
        let mut answers = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        while answers.len() < peers.len() && Instant::now() < deadline {
            self.serve();
            if let Some((msg, status)) =
                self.control.any_process().immediate_matched_probe_with_tag(REPLY_TAG)
            {
                let bytes = receive_all(msg, &status);
                answers.insert(
                    status.source_rank() as usize,
                    String::from_utf8_lossy(&bytes).into_owned(),
                );
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        answers
    }
}

impl MpiComm {
    /// Starts an operation: returns its name (`all-reduce #3`) and publishes what this rank
    /// is doing for status queries.
    fn begin(&self, op: &str) -> String {
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        self.begin_named(format!("{op} #{seq}"))
    }

    /// Like [`Self::begin`] for point-to-point calls, which are named by peer and tag.
    fn begin_named(&self, name: String) -> String {
        self.shared.doing.replace(self.doing(&name));
        name
    }

    fn doing(&self, name: &str) -> String {
        format!("in {name} over ranks {}", ranks(&self.members))
    }

    fn end(&self) {
        self.shared.doing.replace("computing (not in a communication call)".into());
    }

    /// The timeout error of operation `name`, with what the members we wait for say they
    /// are doing.
    fn timeout_error(&self, name: &str, waiting_on: &[usize]) -> CommError {
        let answers = self.shared.ask(waiting_on);
        let mut notes = Vec::new();
        for &p in waiting_on {
            match answers.get(&p) {
                Some(a) if *a == self.doing(name) => {}
                Some(a) => notes.push(format!("rank {p} is {a}")),
                None => notes
                    .push(format!("rank {p} did not answer (busy outside communication, or gone)")),
            }
        }
        if notes.is_empty() {
            notes.push("every member arrived; the transfer itself stalled".into());
        }
        CommError::Timeout {
            op: name.to_string(),
            group: self.members.clone(),
            rank: self.shared.world_rank,
            after: self.shared.timeout,
            detail: notes.join("; "),
        }
    }

    /// Polls `req` until it completes; past the deadline, reports and aborts the job.
    fn wait<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        mut req: Request<'a, D, S>,
        name: &str,
        waiting_on: &[usize],
    ) {
        let start = Instant::now();
        let deadline = start + self.shared.timeout;
        let mut spins = 0u32;
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            self.shared.serve();
            if Instant::now() >= deadline {
                let e = self.timeout_error(name, waiting_on);
                (self.shared.on_fatal)(&e);
                self.comm.abort(3);
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

    fn others(&self) -> Vec<usize> {
        self.members.iter().copied().filter(|&r| r != self.members[self.me]).collect()
    }

    /// A collective on typed data.
    fn all_reduce_typed<T: Equivalence + bytemuck::Pod>(
        &self,
        data: &mut [u8],
        op: ReduceOp,
        what: &str,
    ) {
        let send: Vec<T> = typed(data);
        let mut recv: Vec<T> = send.clone();
        scope(|s| {
            let req = self.comm.immediate_all_reduce_into(s, &send[..], &mut recv[..], mpi_op(op));
            self.wait(req, what, &self.others());
        });
        data.copy_from_slice(bytemuck::cast_slice(&recv));
    }

    fn reduce_scatter_typed<T: Equivalence + bytemuck::Pod>(
        &self,
        send: &[u8],
        recv: &mut [u8],
        op: ReduceOp,
        what: &str,
    ) {
        let s_t: Vec<T> = typed(send);
        let mut r_t: Vec<T> = typed(recv);
        scope(|s| {
            let req = self.comm.immediate_reduce_scatter_block_into(
                s,
                &s_t[..],
                &mut r_t[..],
                mpi_op(op),
            );
            self.wait(req, what, &self.others());
        });
        recv.copy_from_slice(bytemuck::cast_slice(&r_t));
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
        self.shared.timeout
    }

    fn barrier(&self) -> Result<()> {
        let what = self.begin("barrier");
        let req = self.comm.immediate_barrier();
        self.wait(req, &what, &self.others());
        self.end();
        Ok(())
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        args::elements(self, "all-reduce", data.len(), dtype)?;
        let what = self.begin("all-reduce");
        match dtype {
            DType::F32 => self.all_reduce_typed::<f32>(data, op, &what),
            DType::F64 => self.all_reduce_typed::<f64>(data, op, &what),
            DType::I64 => self.all_reduce_typed::<i64>(data, op, &what),
            DType::Bf16 => {
                // MPI has no bf16: reduce in f32, round once.
                let wide: Vec<f32> = typed::<half::bf16>(data).iter().map(|v| v.to_f32()).collect();
                let mut wide_bytes: Vec<u8> = bytemuck::cast_slice(&wide).to_vec();
                self.all_reduce_typed::<f32>(&mut wide_bytes, op, &what);
                let out: Vec<half::bf16> =
                    typed::<f32>(&wide_bytes).iter().map(|&v| half::bf16::from_f32(v)).collect();
                data.copy_from_slice(bytemuck::cast_slice(&out));
            }
        }
        self.end();
        Ok(())
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        check_peer(self, root, "broadcast root")?;
        let what = self.begin("broadcast");
        scope(|s| {
            let req = self.comm.process_at_rank(root as Rank).immediate_broadcast_into(s, data);
            self.wait(req, &what, &[self.members[root]]);
        });
        self.end();
        Ok(())
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        args::all_gather_v(self, send, recv, counts)?;
        let what = self.begin("all-gather-v");
        let c = counts_i32(counts);
        let d = displacements(&c);
        let mut part = PartitionMut::new(recv, &c[..], &d[..]);
        scope(|s| {
            let req = self.comm.immediate_all_gather_varcount_into(s, send, &mut part);
            self.wait(req, &what, &self.others());
        });
        self.end();
        Ok(())
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        args::reduce_scatter(self, send, recv, dtype)?;
        let what = self.begin("reduce-scatter");
        match dtype {
            DType::F32 => self.reduce_scatter_typed::<f32>(send, recv, op, &what),
            DType::F64 => self.reduce_scatter_typed::<f64>(send, recv, op, &what),
            DType::I64 => self.reduce_scatter_typed::<i64>(send, recv, op, &what),
            DType::Bf16 => {
                // Gather every block of every member and reduce in member order locally.
                let n = self.size();
                let mut all = vec![0u8; send.len() * n];
                self.end();
                self.all_gather_v_bytes(send, &mut all, &vec![send.len(); n])?;
                let block = recv.len();
                let parts: Vec<&[u8]> = (0..n)
                    .map(|m| {
                        &all[m * send.len() + self.me * block
                            ..m * send.len() + (self.me + 1) * block]
                    })
                    .collect();
                if block > 0 {
                    reduce_into(recv, &parts, DType::Bf16, op);
                }
            }
        }
        self.end();
        Ok(())
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        sc: &[usize],
        recv: &mut [u8],
        rc: &[usize],
    ) -> Result<()> {
        args::all_to_all_v(self, send, sc, recv, rc)?;
        let what = self.begin("all-to-all-v");
        let (sc, rc) = (counts_i32(sc), counts_i32(rc));
        let (sd, rd) = (displacements(&sc), displacements(&rc));
        let part = Partition::new(send, &sc[..], &sd[..]);
        let mut rpart = PartitionMut::new(recv, &rc[..], &rd[..]);
        scope(|s| {
            let req = self.comm.immediate_all_to_all_varcount_into(s, &part, &mut rpart);
            self.wait(req, &what, &self.others());
        });
        self.end();
        Ok(())
    }

    fn send_bytes(&self, data: &[u8], dst: usize, tag: u32) -> Result<()> {
        check_peer(self, dst, "send")?;
        let what = self.begin_named(format!("send to rank {} (tag {tag})", self.members[dst]));
        scope(|s| {
            let req =
                self.comm.process_at_rank(dst as Rank).immediate_send_with_tag(s, data, tag as i32);
            self.wait(req, &what, &[self.members[dst]]);
        });
        self.end();
        Ok(())
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, tag: u32) -> Result<()> {
        check_peer(self, src, "recv")?;
        let op = format!("recv from rank {} (tag {tag})", self.members[src]);
        let what = self.begin_named(op.clone());
        let deadline = Instant::now() + self.shared.timeout;
        let (msg, status) = loop {
            if let Some(found) =
                self.comm.process_at_rank(src as Rank).immediate_matched_probe_with_tag(tag as i32)
            {
                break found;
            }
            self.shared.serve();
            if Instant::now() >= deadline {
                let e = self.timeout_error(&what, &[self.members[src]]);
                self.end();
                return Err(e);
            }
            std::thread::yield_now();
        };
        let len = status.count(u8::equivalent_datatype()) as usize;
        if len != data.len() {
            receive_all(msg, &status);
            self.end();
            return Err(CommError::Mismatch {
                op,
                group: self.members.clone(),
                detail: format!(
                    "rank {} sent {len} bytes, rank {} expects {}",
                    self.members[src],
                    self.members[self.me],
                    data.len()
                ),
            });
        }
        msg.matched_receive_into(data);
        self.end();
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
        check_peer(self, dst, "send-recv")?;
        check_peer(self, src, "send-recv")?;
        let what = self.begin(&format!(
            "send-recv with ranks {} and {}",
            self.members[dst], self.members[src]
        ));
        let result = scope(|s| {
            let req =
                self.comm.process_at_rank(dst as Rank).immediate_send_with_tag(s, send, st as i32);
            let got = self.recv_bytes(recv, src, rt);
            self.wait(req, &what, &[self.members[dst]]);
            got
        });
        self.end();
        result
    }

    fn subgroup(&self, list: &[usize]) -> Result<Box<dyn Communicator>> {
        check_subgroup(self, list)?;
        let occurrence = {
            let mut created = self.created.borrow_mut();
            let n = created.entry(list.to_vec()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let ranks_i32: Vec<Rank> = list.iter().map(|&r| r as Rank).collect();
        let group = self.comm.group().include(&ranks_i32);
        let tag = SUBGROUP_TAG_BASE + (occurrence as i32 % 30_000);
        let comm = self.comm.split_by_subgroup_with_tag(&group, tag).ok_or_else(|| {
            CommError::Backend {
                backend: "mpi",
                message: format!(
                    "MPI_Comm_create_group returned no communicator for {list:?} on rank {}",
                    self.global_rank()
                ),
            }
        })?;
        Ok(Box::new(MpiComm {
            comm,
            members: list.iter().map(|&i| self.members[i]).collect(),
            me: list.iter().position(|&i| i == self.me).expect("caller is a member"),
            seq: Cell::new(0),
            created: RefCell::new(HashMap::new()),
            shared: self.shared.clone(),
        }))
    }
}
