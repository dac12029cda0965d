//! The `nccl` backend (feature `nccl`): NCCL through cudarc, loaded dynamically, one GPU per
//! rank, communicators bootstrapped from unique ids broadcast over MPI.
//!
//! This implementation of [`Communicator`] works on host buffers: it stages them on the
//! device, runs the NCCL operation on the rank's stream and copies the result back, which is
//! what the conformance suite and the boundary executor need. Variable-size exchanges
//! (all-gather-v, all-to-all-v) are grouped sends and receives. NCCL has no tags: messages
//! between a pair arrive in issue order, so tags must be used in a consistent order. A
//! timeout polls a CUDA event; NCCL knows nothing of arrivals, so the error says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp};

use crate::comm::{CommExt, Communicator, args, check_peer, check_subgroup};
use crate::dtype::{DType, ReduceOp, typed};
use crate::error::{CommError, Result};

/// A communicator of the NCCL backend.
pub struct NcclComm {
    nccl: Comm,
    stream: Arc<CudaStream>,
    /// The MPI communicator of the same members, for bootstrapping subgroups.
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
    let ctx = CudaContext::new(device).map_err(backend)?;
    let stream = ctx.new_stream().map_err(backend)?;
    NcclComm::join(bootstrap, stream)
}

impl NcclComm {
    fn join(bootstrap: Box<dyn Communicator>, stream: Arc<CudaStream>) -> Result<NcclComm> {
        let mut raw = [0u8; 128];
        if bootstrap.rank() == 0 {
            let id = Id::new().map_err(backend)?;
            for (r, c) in raw.iter_mut().zip(id.internal()) {
                *r = *c as u8;
            }
        }
        bootstrap.broadcast_bytes(&mut raw, 0)?;
        let internal = raw.map(|b| b as core::ffi::c_char);
        let nccl = Comm::from_rank(
            stream.clone(),
            bootstrap.rank(),
            bootstrap.size(),
            Id::uninit(internal),
        )
        .map_err(backend)?;
        Ok(NcclComm { nccl, stream, bootstrap })
    }

    fn upload<T: DeviceRepr + bytemuck::Pod>(&self, bytes: &[u8]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(&typed::<T>(bytes)).map_err(backend)
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n).map_err(backend)
    }

    fn download<T: DeviceRepr + bytemuck::Pod + Default>(
        &self,
        src: &CudaSlice<T>,
        out: &mut [u8],
    ) -> Result<()> {
        let v: Vec<T> = self.stream.clone_dtoh(src).map_err(backend)?;
        out.copy_from_slice(bytemuck::cast_slice(&v));
        Ok(())
    }

    /// Waits for the stream with the timeout.
    fn wait(&self, op: &str) -> Result<()> {
        let event = self.stream.record_event(None).map_err(backend)?;
        let deadline = Instant::now() + self.timeout();
        while !event.try_is_complete().map_err(backend)? {
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    op: op.to_string(),
                    group: self.global_ranks().to_vec(),
                    rank: self.global_rank(),
                    after: self.timeout(),
                    detail: "the operation did not complete on the GPU (NCCL does not report which ranks arrived)".into(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    fn all_reduce_typed<T>(&self, data: &mut [u8], op: ReduceOp) -> Result<()>
    where
        T: DeviceRepr + NcclType + bytemuck::Pod + Default,
    {
        let mut buf = self.upload::<T>(data)?;
        self.nccl.all_reduce_in_place(&mut buf, &nccl_op(op)).map_err(backend)?;
        self.wait("all-reduce")?;
        self.download(&buf, data)
    }

    fn reduce_scatter_typed<T>(&self, send: &[u8], recv: &mut [u8], op: ReduceOp) -> Result<()>
    where
        T: DeviceRepr + ValidAsZeroBits + NcclType + bytemuck::Pod + Default,
    {
        let s = self.upload::<T>(send)?;
        let mut r = self.zeros::<T>(recv.len() / size_of::<T>())?;
        self.nccl.reduce_scatter(&s, &mut r, &nccl_op(op)).map_err(backend)?;
        self.wait("reduce-scatter")?;
        self.download(&r, recv)
    }

    /// Grouped point-to-point exchange of byte parts: `send[j]` to member `j`, `recv[j]`
    /// (of the given lengths) from member `j`; the own entries are copied locally.
    fn exchange(&self, op: &str, send: &[&[u8]], recv_lens: &[usize]) -> Result<Vec<Vec<u8>>> {
        let me = self.rank();
        let sends: Vec<CudaSlice<u8>> = send
            .iter()
            .map(|s| self.stream.clone_htod(*s).map_err(backend))
            .collect::<Result<_>>()?;
        let mut recvs: Vec<CudaSlice<u8>> =
            recv_lens.iter().map(|&n| self.zeros::<u8>(n.max(1))).collect::<Result<_>>()?;
        {
            let send_views: Vec<_> = sends.iter().map(|s| s.as_view()).collect();
            let recv_views: Vec<_> = recvs.iter_mut().map(|r| r.as_view_mut()).collect();
            let mut group = self.nccl.group();
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
        self.wait(op)?;
        let mut out = Vec::with_capacity(recvs.len());
        for (j, r) in recvs.iter().enumerate() {
            if j == me {
                out.push(send[j].to_vec());
            } else {
                let mut v: Vec<u8> = self.stream.clone_dtoh(r).map_err(backend)?;
                v.truncate(recv_lens[j]);
                out.push(v);
            }
        }
        Ok(out)
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
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

    fn barrier(&self) -> Result<()> {
        let mut x = [0u8; 4];
        self.all_reduce_bytes(&mut x, DType::F32, ReduceOp::Sum)
    }

    fn all_reduce_bytes(&self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        args::elements(self, "all-reduce", data.len(), dtype)?;
        if data.is_empty() {
            return self.barrier_if_empty();
        }
        match dtype {
            DType::F32 => self.all_reduce_typed::<f32>(data, op),
            DType::F64 => self.all_reduce_typed::<f64>(data, op),
            DType::I64 => self.all_reduce_typed::<i64>(data, op),
            DType::Bf16 => self.all_reduce_typed::<half::bf16>(data, op),
        }
    }

    fn broadcast_bytes(&self, data: &mut [u8], root: usize) -> Result<()> {
        check_peer(self, root, "broadcast root")?;
        if data.is_empty() {
            return Ok(());
        }
        let mut buf = self.upload::<u8>(data)?;
        self.nccl.broadcast_in_place(&mut buf, root as i32).map_err(backend)?;
        self.wait("broadcast")?;
        self.download(&buf, data)
    }

    fn all_gather_v_bytes(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<()> {
        args::all_gather_v(self, send, recv, counts)?;
        let parts: Vec<&[u8]> = (0..self.size()).map(|_| send).collect();
        let got = self.exchange("all-gather-v", &parts, counts)?;
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
        match dtype {
            DType::F32 => self.reduce_scatter_typed::<f32>(send, recv, op),
            DType::F64 => self.reduce_scatter_typed::<f64>(send, recv, op),
            DType::I64 => self.reduce_scatter_typed::<i64>(send, recv, op),
            DType::Bf16 => self.reduce_scatter_typed::<half::bf16>(send, recv, op),
        }
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
            parts.push(&send[at..at + c]);
            at += c;
        }
        let got = self.exchange("all-to-all-v", &parts, rc)?;
        let mut at = 0;
        for (part, &c) in got.iter().zip(rc) {
            if part.len() != c {
                return Err(CommError::Usage(format!(
                    "all-to-all-v: expected {c} bytes, the self part has {}",
                    part.len()
                )));
            }
            recv[at..at + c].copy_from_slice(part);
            at += c;
        }
        Ok(())
    }

    fn send_bytes(&self, data: &[u8], dst: usize, _tag: u32) -> Result<()> {
        check_peer(self, dst, "send")?;
        if data.is_empty() {
            return Ok(());
        }
        let buf = self.upload::<u8>(data)?;
        self.nccl.send(&buf, dst as i32).map_err(backend)?;
        self.wait(&format!("send to rank {}", self.global_ranks()[dst]))
    }

    fn recv_bytes(&self, data: &mut [u8], src: usize, _tag: u32) -> Result<()> {
        check_peer(self, src, "recv")?;
        if data.is_empty() {
            return Ok(());
        }
        let mut buf = self.zeros::<u8>(data.len())?;
        self.nccl.recv(&mut buf, src as i32).map_err(backend)?;
        self.wait(&format!("recv from rank {}", self.global_ranks()[src]))?;
        self.download(&buf, data)
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
        let n = self.size();
        let mut parts: Vec<&[u8]> = vec![&[]; n];
        let mut lens = vec![0usize; n];
        parts[dst] = send;
        lens[src] = recv.len();
        if dst == self.rank() || src == self.rank() {
            // A self exchange: only valid when both ends are this rank.
            recv.copy_from_slice(send);
            return Ok(());
        }
        let got = self.exchange("send-recv", &parts, &lens)?;
        recv.copy_from_slice(&got[src]);
        Ok(())
    }

    fn subgroup(&self, list: &[usize]) -> Result<Box<dyn Communicator>> {
        check_subgroup(self, list)?;
        let bootstrap = self.bootstrap.subgroup(list)?;
        Ok(Box::new(NcclComm::join(bootstrap, self.stream.clone())?))
    }
}

impl NcclComm {
    /// NCCL rejects zero-length reductions; keep the collective's synchronization anyway.
    fn barrier_if_empty(&self) -> Result<()> {
        self.bootstrap.barrier()
    }
}
