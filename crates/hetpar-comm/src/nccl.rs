//! The `nccl` backend (feature `nccl`): NCCL through cudarc, loaded dynamically, one GPU per
//! rank, communicators bootstrapped from unique ids broadcast over MPI.
//!
//! This implementation of [`Communicator`] works on host buffers: it stages them on the
//! device, runs the NCCL operation on the rank's stream and copies the result back, which is
//! what the conformance suite and the boundary executor need. Variable-size exchanges
//! (all-gather-v, all-to-all-v) are grouped sends and receives. NCCL has no tags: messages
//! between a pair arrive in issue order, so tags must be used in a consistent order (a batched
//! exchange orders each pair's messages by tag on both sides, so its callers need not). A
//! timeout polls a CUDA event; NCCL knows nothing of arrivals, so the error says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp};

use crate::comm::{
    CommExt, Communicator, P2p, args, check_batch, check_peer, check_subgroup, length_mismatch,
};
use crate::dtype::{DType, ReduceOp, typed};
use crate::engine::EngineHandle;
use crate::error::{CommError, Result};

/// NCCL and CUDA state, on the engine thread (NCCL handles may not leave it).
pub struct NcclState {
    comms: Vec<Comm>,
    stream: Arc<CudaStream>,
    timeout: Duration,
}

impl std::fmt::Debug for NcclState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclState({} communicators)", self.comms.len())
    }
}

/// A communicator of the NCCL backend: a handle to an NCCL communicator on the engine
/// thread, plus the MPI communicator of the same members (for bootstrapping subgroups).
pub struct NcclComm {
    engine: Arc<EngineHandle<NcclState>>,
    id: usize,
    bootstrap: Box<dyn Communicator>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {:?})", self.bootstrap.rank(), self.bootstrap.global_ranks())
    }
}

fn backend(e: impl std::fmt::Debug) -> CommError {
    CommError::Backend { backend: "nccl", message: format!("{e:?}") }
}

/// An NCCL communicator over the members of `bootstrap` (an MPI communicator), on GPU
/// `device`: member 0 creates the unique id, MPI broadcasts it, every member joins.
pub fn init(bootstrap: Box<dyn Communicator>, device: usize) -> Result<NcclComm> {
    let timeout = bootstrap.timeout();
    let engine = EngineHandle::spawn(
        "nccl",
        Duration::from_millis(50),
        move || {
            let ctx = CudaContext::new(device).map_err(backend)?;
            let stream = ctx.new_stream().map_err(backend)?;
            Ok(NcclState { comms: Vec::new(), stream, timeout })
        },
        |_| {},
    )?;
    NcclComm::join(engine, bootstrap)
}

impl NcclComm {
    fn join(
        engine: Arc<EngineHandle<NcclState>>,
        bootstrap: Box<dyn Communicator>,
    ) -> Result<NcclComm> {
        let mut raw = [0u8; 128];
        if bootstrap.rank() == 0 {
            raw = engine.call(|_| {
                let id = Id::new().map_err(backend)?;
                let mut raw = [0u8; 128];
                for (r, c) in raw.iter_mut().zip(id.internal()) {
                    *r = *c as u8;
                }
                Ok(raw)
            })?;
        }
        bootstrap.broadcast_bytes(&mut raw, 0)?;
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        let id = engine.call(move |s| {
            let internal = raw.map(|b| b as core::ffi::c_char);
            let comm = Comm::from_rank(s.stream.clone(), rank, size, Id::uninit(internal))
                .map_err(backend)?;
            s.comms.push(comm);
            Ok(s.comms.len() - 1)
        })?;
        Ok(NcclComm { engine, id, bootstrap })
    }

    fn timeout_error(&self, op: &str) -> CommError {
        CommError::Timeout {
            op: op.to_string(),
            group: self.global_ranks().to_vec(),
            rank: self.global_rank(),
            after: self.timeout(),
            detail: "the operation did not complete on the GPU (NCCL does not report which ranks arrived)".into(),
        }
    }
}

impl NcclState {
    fn upload<T: DeviceRepr + bytemuck::Pod>(&self, bytes: &[u8]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(&typed::<T>(bytes)).map_err(backend)
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n).map_err(backend)
    }

    fn download<T: DeviceRepr + bytemuck::Pod>(&self, src: &CudaSlice<T>) -> Result<Vec<u8>> {
        let v: Vec<T> = self.stream.clone_dtoh(src).map_err(backend)?;
        Ok(bytemuck::cast_slice(&v).to_vec())
    }

    /// Waits for the stream; `false` when the timeout passed first.
    fn wait(&self) -> Result<bool> {
        let event = self.stream.record_event(None).map_err(backend)?;
        let deadline = Instant::now() + self.timeout;
        while !event.try_is_complete().map_err(backend)? {
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(true)
    }

    fn all_reduce<T>(&self, id: usize, data: &[u8], op: ReduceOp) -> Result<Option<Vec<u8>>>
    where
        T: DeviceRepr + NcclType + bytemuck::Pod,
    {
        let mut buf = self.upload::<T>(data)?;
        self.comms[id].all_reduce_in_place(&mut buf, &nccl_op(op)).map_err(backend)?;
        if !self.wait()? {
            return Ok(None);
        }
        self.download(&buf).map(Some)
    }

    fn reduce_scatter<T>(
        &self,
        id: usize,
        send: &[u8],
        block: usize,
        op: ReduceOp,
    ) -> Result<Option<Vec<u8>>>
    where
        T: DeviceRepr + ValidAsZeroBits + NcclType + bytemuck::Pod,
    {
        let s = self.upload::<T>(send)?;
        let mut r = self.zeros::<T>(block / size_of::<T>())?;
        self.comms[id].reduce_scatter(&s, &mut r, &nccl_op(op)).map_err(backend)?;
        if !self.wait()? {
            return Ok(None);
        }
        self.download(&r).map(Some)
    }

    fn broadcast(&self, id: usize, data: &[u8], root: usize) -> Result<Option<Vec<u8>>> {
        let mut buf = self.upload::<u8>(data)?;
        self.comms[id].broadcast_in_place(&mut buf, root as i32).map_err(backend)?;
        if !self.wait()? {
            return Ok(None);
        }
        self.download(&buf).map(Some)
    }

    /// Grouped point-to-point exchange: `send[j]` to member `j`, `recv_lens[j]` bytes from
    /// member `j`; the own entry is copied locally.
    fn exchange(
        &self,
        id: usize,
        me: usize,
        send: &[Vec<u8>],
        recv_lens: &[usize],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let sends: Vec<CudaSlice<u8>> = send
            .iter()
            .map(|s| self.stream.clone_htod(&s[..]).map_err(backend))
            .collect::<Result<_>>()?;
        let mut recvs: Vec<CudaSlice<u8>> =
            recv_lens.iter().map(|&n| self.zeros::<u8>(n.max(1))).collect::<Result<_>>()?;
        {
            let send_views: Vec<_> = sends.iter().map(|s| s.as_view()).collect();
            let recv_views: Vec<_> = recvs.iter_mut().map(|r| r.as_view_mut()).collect();
            let mut group = self.comms[id].group();
            for (j, (sv, rv)) in send_views.into_iter().zip(recv_views).enumerate() {
                if j == me {
                    continue;
                }
                if !send[j].is_empty() {
                    group.send(sv, j as i32).map_err(backend)?;
                }
                if recv_lens[j] > 0 {
                    group.recv(rv, j as i32).map_err(backend)?;
                }
            }
        }
        if !self.wait()? {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(recvs.len());
        for (j, r) in recvs.iter().enumerate() {
            if j == me {
                out.push(send[j].clone());
            } else {
                let mut v = self.download(r)?;
                v.truncate(recv_lens[j]);
                out.push(v);
            }
        }
        Ok(Some(out))
    }
}

impl NcclState {
    /// One group of point-to-point calls: `sends` as (peer, bytes), `recvs` as (peer,
    /// length), none to or from this rank, each pair's messages in the order both sides
    /// agree on. Empty messages are not posted.
    fn batch(
        &self,
        id: usize,
        sends: &[(usize, Vec<u8>)],
        recvs: &[(usize, usize)],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let send_bufs: Vec<CudaSlice<u8>> = sends
            .iter()
            .map(|(_, b)| self.stream.clone_htod(&b[..]).map_err(backend))
            .collect::<Result<_>>()?;
        let mut recv_bufs: Vec<CudaSlice<u8>> =
            recvs.iter().map(|&(_, n)| self.zeros::<u8>(n.max(1))).collect::<Result<_>>()?;
        {
            let mut group = self.comms[id].group();
            for ((peer, b), buf) in sends.iter().zip(&send_bufs) {
                if !b.is_empty() {
                    group.send(buf.as_view(), *peer as i32).map_err(backend)?;
                }
            }
            for (&(peer, n), buf) in recvs.iter().zip(recv_bufs.iter_mut()) {
                if n > 0 {
                    group.recv(buf.as_view_mut(), peer as i32).map_err(backend)?;
                }
            }
        }
        if !self.wait()? {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(recvs.len());
        for (&(_, n), buf) in recvs.iter().zip(&recv_bufs) {
            let mut v = self.download(buf)?;
            v.truncate(n);
            out.push(v);
        }
        Ok(Some(out))
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

impl NcclComm {
    /// Runs `f` on the engine; `None` (the GPU did not finish in time) becomes a timeout.
    fn run<R: Send + 'static>(
        &self,
        op: &str,
        f: impl FnOnce(&NcclState, usize) -> Result<Option<R>> + Send + 'static,
    ) -> Result<R> {
        let id = self.id;
        self.engine.call(move |s| f(s, id))?.ok_or_else(|| self.timeout_error(op))
    }

    fn exchange(
        &self,
        op: &str,
        send: Vec<Vec<u8>>,
        recv_lens: Vec<usize>,
    ) -> Result<Vec<Vec<u8>>> {
        let me = self.rank();
        self.run(op, move |s, id| s.exchange(id, me, &send, &recv_lens))
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.bootstrap.rank()
    }
    fn size(&self) -> usize {
        self.bootstrap.size()
    }
    fn global_ranks(&self) -> &[usize] {
        self.bootstrap.global_ranks()
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn timeout(&self) -> Duration {
        self.bootstrap.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        // The bootstrap's setting is the job's; the engine waits on the GPU by its own.
        self.bootstrap.set_timeout(timeout);
        let _ = self.engine.call(move |s| {
            s.timeout = timeout;
            Ok(())
        });
    }

    fn barrier(&self) -> Result<()> {
        let mut x = [0u8; 4];
        self.all_reduce_bytes(&mut x, DType::F32, ReduceOp::Sum)
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        args::elements(self, "all-reduce", data.len(), dtype)?;
        if data.is_empty() {
            // NCCL rejects empty reductions; keep the synchronization.
            return self.bootstrap.barrier();
        }
        let input = data.to_vec();
        let out = self.run("all-reduce", move |s, id| match dtype {
            DType::F32 => s.all_reduce::<f32>(id, &input, op),
            DType::F64 => s.all_reduce::<f64>(id, &input, op),
            DType::I64 => s.all_reduce::<i64>(id, &input, op),
            DType::Bf16 => s.all_reduce::<half::bf16>(id, &input, op),
        })?;
        data.copy_from_slice(&out);
        Ok(())
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        check_peer(self, root, "broadcast root")?;
        if data.is_empty() {
            return Ok(());
        }
        let input = data.to_vec();
        let out = self.run("broadcast", move |s, id| s.broadcast(id, &input, root))?;
        data.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        args::all_gather_v(self, send, recv, counts)?;
        let parts: Vec<Vec<u8>> = (0..self.size()).map(|_| send.to_vec()).collect();
        let got = self.exchange("all-gather-v", parts, counts.to_vec())?;
        let mut at = 0;
        for part in got {
            recv[at..at + part.len()].copy_from_slice(&part);
            at += part.len();
        }
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
        if recv.is_empty() {
            return Ok(());
        }
        let (input, block) = (send.to_vec(), recv.len());
        let out = self.run("reduce-scatter", move |s, id| match dtype {
            DType::F32 => s.reduce_scatter::<f32>(id, &input, block, op),
            DType::F64 => s.reduce_scatter::<f64>(id, &input, block, op),
            DType::I64 => s.reduce_scatter::<i64>(id, &input, block, op),
            DType::Bf16 => s.reduce_scatter::<half::bf16>(id, &input, block, op),
        })?;
        recv.copy_from_slice(&out);
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
        let mut parts = Vec::with_capacity(sc.len());
        let mut at = 0;
        for &c in sc {
            parts.push(send[at..at + c].to_vec());
            at += c;
        }
        let got = self.exchange("all-to-all-v", parts, rc.to_vec())?;
        let mut at = 0;
        for (part, &c) in got.iter().zip(rc) {
            recv[at..at + c].copy_from_slice(&part[..c]);
            at += c;
        }
        Ok(())
    }

    fn send_bytes(&self, data: &[u8], dst: usize, _tag: u32) -> Result<()> {
        check_peer(self, dst, "send")?;
        let n = self.size();
        let mut parts = vec![Vec::new(); n];
        parts[dst] = data.to_vec();
        self.exchange("send", parts, vec![0; n]).map(|_| ())
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, _tag: u32) -> Result<()> {
        check_peer(self, src, "recv")?;
        let n = self.size();
        let mut lens = vec![0; n];
        lens[src] = data.len();
        let got = self.exchange("recv", vec![Vec::new(); n], lens)?;
        data.copy_from_slice(&got[src]);
        Ok(())
    }

    fn send_recv_bytes(
        &self,
        send: &[u8],
        dst: usize,
        _st: u32,
        recv: &mut [u8],
        src: usize,
        _rt: u32,
    ) -> Result<()> {
        check_peer(self, dst, "send-recv")?;
        check_peer(self, src, "send-recv")?;
        if dst == self.rank() && src == self.rank() {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let n = self.size();
        let mut parts = vec![Vec::new(); n];
        let mut lens = vec![0; n];
        parts[dst] = send.to_vec();
        lens[src] = recv.len();
        let got = self.exchange("send-recv", parts, lens)?;
        recv.copy_from_slice(&got[src]);
        Ok(())
    }

    fn batch_p2p(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        check_batch(self, ops)?;
        let me = self.rank();
        // NCCL has no tags: both sides list a pair's messages by tag (stable, so one tag's
        // messages keep their order), which makes any listing order of the caller match.
        let mut order: Vec<usize> = (0..ops.len()).collect();
        order.sort_by_key(|&i| (ops[i].peer(), ops[i].tag()));
        let (mut sends, mut recvs, mut recv_at) = (Vec::new(), Vec::new(), Vec::new());
        let mut local: Vec<(u32, Vec<u8>)> = Vec::new();
        for &i in &order {
            if let P2p::Send { data, peer, tag } = &ops[i] {
                if *peer == me {
                    local.push((*tag, data.to_vec()));
                } else {
                    sends.push((*peer, data.to_vec()));
                }
            }
        }
        for &i in &order {
            if let P2p::Recv { data, peer, tag } = &mut ops[i] {
                if *peer != me {
                    recvs.push((*peer, data.len()));
                    recv_at.push(i);
                    continue;
                }
                let Some(k) = local.iter().position(|(t, _)| t == tag) else {
                    return Err(CommError::Usage(format!(
                        "batched point-to-point on rank {}: a receive from itself with tag {tag} and no matching send",
                        self.global_rank()
                    )));
                };
                let (_, bytes) = local.remove(k);
                if bytes.len() != data.len() {
                    let ranks = self.global_ranks();
                    return Err(length_mismatch(ranks, me, me, *tag, bytes.len(), data.len()));
                }
                data.copy_from_slice(&bytes);
            }
        }
        let got = self.run("batched point-to-point", move |s, id| s.batch(id, &sends, &recvs))?;
        for (i, bytes) in recv_at.into_iter().zip(got) {
            if let P2p::Recv { data, .. } = &mut ops[i] {
                data.copy_from_slice(&bytes);
            }
        }
        Ok(())
    }

    fn subgroup(&self, list: &[usize]) -> Result<Box<dyn Communicator>> {
        check_subgroup(self, list)?;
        let bootstrap = self.bootstrap.subgroup(list)?;
        Ok(Box::new(NcclComm::join(self.engine.clone(), bootstrap)?))
    }
}
