//! The collectives of [`NcclComm`]: each one NCCL group on the group's communicator and
//! the kernels' stream, waited for with the watchdog (see `mod.rs`).

use std::sync::Arc;

use braid_kernels::cuda::CudaStorage;
use braid_kernels::{DType, Device, Shape, Tensor};
use cudarc::nccl::sys;

use super::plan::{self, HEADER_WORDS};
use super::raw::{self, Buf};
use super::{NcclComm, p2p};
use crate::{Comm, CommError, Result};

impl NcclComm {
    fn buffer<'a>(&self, op: &'static str, t: &'a Tensor) -> Result<&'a CudaStorage> {
        t.cuda_buffer()
            .ok_or_else(|| self.err(op, "expected a GPU tensor"))
    }

    fn alloc(&self, op: &'static str, dtype: DType, n: usize) -> Result<CudaStorage> {
        p2p::alloc(&self.world.stream, dtype, n).map_err(|f| self.fail(op, f))
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.members.len() {
            return Err(self.err(
                op,
                format!("root {root} is not in this group of {}", self.members.len()),
            ));
        }
        Ok(())
    }

    /// The in-place sum of a GPU tensor.
    fn all_reduce_gpu(&self, op: &'static str, t: &mut Tensor) -> Result<()> {
        let stream = Arc::clone(&self.world.stream);
        let s = t
            .cuda_buffer_mut()
            .ok_or_else(|| self.err(op, "expected a GPU tensor"))?;
        let b = raw::buf_mut(s, &stream);
        self.run(op, |comm, cu| {
            // SAFETY: in place (send = receive buffer, allowed by NCCL); `b` is `t`'s
            // buffer of `b.count` elements, borrowed until `run` has waited for the sum.
            raw::check(unsafe {
                sys::ncclAllReduce(
                    b.send_ptr(),
                    b.recv_ptr(),
                    b.count,
                    b.ty,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    cu,
                )
            })
        })
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        if t.dtype() == DType::U32 {
            return Err(self.err(OP, "u32 tensors cannot be summed"));
        }
        match self.on_gpu(OP, t)? {
            None => self.all_reduce_gpu(OP, t),
            Some(mut g) => {
                self.all_reduce_gpu(OP, &mut g)?;
                *t = g.into_device(Device::Cpu)?;
                Ok(())
            }
        }
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let staged = self.on_gpu(OP, t)?;
        let src = staged.as_ref().unwrap_or(t);
        let dims =
            plan::gathered_dims(t.dims(), self.members.len()).map_err(|m| self.err(OP, m))?;
        let n: usize = dims.iter().product();
        let mut out = self.alloc(OP, t.dtype(), n)?;
        let stream = Arc::clone(&self.world.stream);
        let send = raw::buf(self.buffer(OP, src)?, &stream);
        let recv = raw::buf_mut(&mut out, &stream);
        self.run(OP, |comm, cu| {
            // SAFETY: `send` holds `send.count` elements, `recv` size times as many
            // (gathered dims); both stay alive until `run` has waited.
            raw::check(unsafe {
                sys::ncclAllGather(
                    send.send_ptr(),
                    recv.recv_ptr(),
                    send.count,
                    send.ty,
                    comm,
                    cu,
                )
            })
        })?;
        let g = Tensor::from_cuda_buffer(out, dims)?;
        Ok(if staged.is_some() {
            g.into_device(Device::Cpu)?
        } else {
            g
        })
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        if t.dtype() == DType::U32 {
            return Err(self.err(OP, "u32 tensors cannot be summed"));
        }
        let n = self.members.len();
        let count = plan::scatter_count(t.dims(), n).map_err(|m| self.err(OP, m))?;
        let staged = self.on_gpu(OP, t)?;
        let src = staged.as_ref().unwrap_or(t);
        let mut out = self.alloc(OP, t.dtype(), count)?;
        let stream = Arc::clone(&self.world.stream);
        let send = raw::buf(self.buffer(OP, src)?, &stream);
        let recv = raw::buf_mut(&mut out, &stream);
        self.run(OP, |comm, cu| {
            // SAFETY: `send` holds n * count elements, `recv` count; alive until `run`
            // has waited.
            raw::check(unsafe {
                sys::ncclReduceScatter(
                    send.send_ptr(),
                    recv.recv_ptr(),
                    count,
                    send.ty,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    cu,
                )
            })
        })?;
        let mut dims = t.dims().to_vec();
        dims[0] /= n;
        let r = Tensor::from_cuda_buffer(out, dims)?;
        Ok(if staged.is_some() {
            r.into_device(Device::Cpu)?
        } else {
            r
        })
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_root(OP, root)?;
        let stream = Arc::clone(&self.world.stream);
        let mut staged = self.on_gpu(OP, t)?;
        let target: &mut Tensor = match staged.as_mut() {
            Some(g) => g,
            None => t,
        };
        let s = target
            .cuda_buffer_mut()
            .ok_or_else(|| self.err(OP, "expected a GPU tensor"))?;
        let b = raw::buf_mut(s, &stream);
        let root_i = i32::try_from(root).unwrap_or(i32::MAX);
        self.run(OP, |comm, cu| {
            // SAFETY: in place; `b` is the tensor's buffer, alive until `run` has
            // waited. Every member's tensor has the same shape (the trait's contract;
            // NCCL cannot check it).
            raw::check(unsafe {
                sys::ncclBroadcast(b.send_ptr(), b.recv_ptr(), b.count, b.ty, root_i, comm, cu)
            })
        })?;
        if let Some(g) = staged {
            *t = g.into_device(Device::Cpu)?;
        }
        Ok(())
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        const OP: &str = "send";
        self.check_poison(OP)?;
        let w = *self.members.get(dst).ok_or_else(|| {
            self.err(
                OP,
                format!("rank {dst} is not in this group of {}", self.members.len()),
            )
        })?;
        if dst == self.rank {
            return Err(self.err(OP, "a rank cannot send to itself"));
        }
        plan::encode_header(t.dtype(), t.dims()).map_err(|m| self.err(OP, m))?;
        let staged = self.on_gpu(OP, t)?;
        let src = staged.as_ref().unwrap_or(t);
        self.channels
            .send(&self.world, src, w)
            .map_err(|f| self.fail(OP, f))
    }

    fn recv(&self, shape: &Shape, src: usize) -> Result<Tensor> {
        const OP: &str = "recv";
        self.check_poison(OP)?;
        let w = *self.members.get(src).ok_or_else(|| {
            self.err(
                OP,
                format!("rank {src} is not in this group of {}", self.members.len()),
            )
        })?;
        if src == self.rank {
            return Err(self.err(OP, "a rank cannot receive from itself"));
        }
        let (_, dims, data) = self.channels.recv(&self.world, w).map_err(|f| {
            let e = self.fail(OP, f);
            if !matches!(e, CommError::Poisoned { .. }) {
                self.world.poison(e.to_string());
            }
            e
        })?;
        if dims != shape.dims() {
            return Err(self.err(
                OP,
                format!("rank {src} sent shape {dims:?} but this rank expects {shape}"),
            ));
        }
        Ok(Tensor::from_cuda_buffer(data, dims)?)
    }

    fn all_to_all_v(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all_v";
        let n = self.members.len();
        if parts.len() != n {
            return Err(self.err(
                OP,
                format!("expected {n} parts (one per rank), got {}", parts.len()),
            ));
        }
        let back_to_cpu = parts.first().is_some_and(|p| p.device() == Device::Cpu);
        let mut gpu = Vec::with_capacity(n);
        for p in parts {
            gpu.push(match self.on_gpu(OP, &p)? {
                Some(g) => g,
                None => p,
            });
        }
        let peers = plan::exchange_peers(self.rank, n);
        let stream = Arc::clone(&self.world.stream);
        // Round 1: every part's header, all in one group.
        let mut words = Vec::with_capacity(n * HEADER_WORDS);
        for p in &gpu {
            let h = plan::encode_header(p.dtype(), p.dims()).map_err(|m| self.err(OP, m))?;
            words.extend_from_slice(&h);
        }
        let sent = stream
            .clone_htod(&words)
            .map_err(|e| self.err(OP, format!("copying the headers: {e}")))?;
        let sent = CudaStorage::U32(sent);
        let mut got = self.alloc(OP, DType::U32, n * HEADER_WORDS)?;
        let (sb, rb) = (raw::buf(&sent, &stream), raw::buf_mut(&mut got, &stream));
        self.run(OP, |comm, cu| {
            for &p in &peers {
                p2p::p2p_call(
                    true,
                    sb.part(p * HEADER_WORDS, HEADER_WORDS, 4),
                    p,
                    comm,
                    cu,
                )?;
                p2p::p2p_call(
                    false,
                    rb.part(p * HEADER_WORDS, HEADER_WORDS, 4),
                    p,
                    comm,
                    cu,
                )?;
            }
            Ok(())
        })?;
        let CudaStorage::U32(got) = &got else {
            return Err(self.err(OP, "header buffer of the wrong type"));
        };
        let got = stream
            .clone_dtoh(got)
            .map_err(|e| self.err(OP, format!("reading the headers: {e}")))?;
        // Round 2: the payloads, all in one group.
        let mut outs: Vec<Option<(Vec<usize>, CudaStorage)>> = (0..n).map(|_| None).collect();
        // The peers now post their payloads: a failure here poisons the process (its
        // communicators are aborted) so that they stop at once instead of timing out.
        let poison = |e: CommError| {
            self.world.poison(e.to_string());
            e
        };
        for &p in &peers {
            let (dtype, dims) = plan::decode_header(&got[p * HEADER_WORDS..(p + 1) * HEADER_WORDS])
                .map_err(|m| poison(self.err(OP, format!("from rank {p}: {m}"))))?;
            let len: usize = dims.iter().product();
            outs[p] = Some((dims, self.alloc(OP, dtype, len).map_err(poison)?));
        }
        let mut calls: Vec<(bool, Buf, usize)> = Vec::with_capacity(2 * peers.len());
        for &p in &peers {
            let s = self.buffer(OP, &gpu[p])?;
            if !s.is_empty() {
                calls.push((true, raw::buf(s, &stream), p));
            }
            if let Some((_, r)) = outs[p].as_mut()
                && !r.is_empty()
            {
                calls.push((false, raw::buf_mut(r, &stream), p));
            }
        }
        self.run(OP, |comm, cu| {
            for &(send, b, p) in &calls {
                p2p::p2p_call(send, b, p, comm, cu)?;
            }
            Ok(())
        })?;
        let mut result = Vec::with_capacity(n);
        let mut own = gpu.into_iter().nth(self.rank);
        for (p, slot) in outs.into_iter().enumerate() {
            let t = if p == self.rank {
                own.take().ok_or_else(|| self.err(OP, "own part missing"))?
            } else {
                let (dims, data) = slot.ok_or_else(|| self.err(OP, "a part is missing"))?;
                Tensor::from_cuda_buffer(data, dims)?
            };
            result.push(if back_to_cpu {
                t.into_device(Device::Cpu)?
            } else {
                t
            });
        }
        Ok(result)
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        let mut one = self.alloc(OP, DType::F32, 1)?;
        let stream = Arc::clone(&self.world.stream);
        let b = raw::buf_mut(&mut one, &stream);
        self.run(OP, |comm, cu| {
            // SAFETY: one element, in place (its value does not matter: uninitialized
            // bits summed into uninitialized bits); alive until `run` has waited.
            raw::check(unsafe {
                sys::ncclAllReduce(
                    b.send_ptr(),
                    b.recv_ptr(),
                    1,
                    b.ty,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    cu,
                )
            })
        })
    }

    fn subgroup(&self, members: &[usize]) -> Result<Arc<dyn Comm>> {
        const OP: &str = "subgroup";
        self.check_poison(OP)?;
        let (world, me) = crate::subgroup_members(&self.members, members, self.world.rank)
            .map_err(|msg| self.err(OP, msg))?;
        if world.len() == 1 {
            // A group of one has nothing to exchange: no communicator (each costs an init,
            // a proxy thread and device memory; a rank has several such groups).
            return Ok(Arc::new(crate::SingleRank));
        }
        let comm = NcclComm::make(Arc::clone(&self.world), world, me, OP)?;
        Ok(Arc::new(comm))
    }
}
