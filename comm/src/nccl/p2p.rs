//! Point to point for `NcclComm`: directed channels, each a two-rank NCCL communicator
//! that carries only one sender's tensors to one receiver, in order.
//!
//! NCCL's sends are unbuffered: a send completes only once the receiver posts the
//! matching receive, and the operations of one communicator run in the order they were
//! issued. Two pipeline neighbours that each send before they receive would therefore
//! wait for each other forever on one shared communicator. Here a send is copied (on the
//! kernels' stream) and handed to its channel's thread, which issues it on a stream of
//! its own and waits for it with the watchdog; `send` returns at once, like the trait's
//! other transports. A channel carries one direction only, so no send waits behind a
//! receive. The receiver posts the header (dtype and dims), reads it, then posts the
//! payload, on the kernels' stream.
//!
//! A channel's communicator is made on first use: the sender's thread publishes the id
//! under [`super::plan::channel_key`], the receiver's first `recv` joins it.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use braid_kernels::cuda::CudaStorage;
use braid_kernels::{DType, Tensor};
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys;

use super::plan::{self, HEADER_WORDS};
use super::raw::{self, Buf, Failure, RawComm};
use super::{NcclWorld, lock};

/// A send handed to a channel's thread: a private copy of the tensor, and the event
/// after which the copy is complete on the kernels' stream.
struct Job {
    data: Tensor,
    ready: CudaEvent,
}

/// The channels of one group, by peer (world rank).
pub(crate) struct Channels {
    group: Vec<usize>,
    out: Mutex<HashMap<usize, Sender<Job>>>,
    inbound: Mutex<HashMap<usize, Arc<Mutex<RawComm>>>>,
}

/// `n` elements of `dtype` on the world's stream, uninitialized: every caller hands the
/// buffer to an NCCL receive (or gather) that writes all of it before it is read.
pub(crate) fn alloc(
    stream: &Arc<CudaStream>,
    dtype: DType,
    n: usize,
) -> Result<CudaStorage, Failure> {
    let err = |e: cudarc::driver::DriverError| {
        Failure::Error(format!("allocating {n} {dtype} elements on the GPU: {e}"))
    };
    if n == 0 {
        return Ok(match dtype {
            DType::F32 => CudaStorage::F32(stream.null().map_err(err)?),
            DType::BF16 => CudaStorage::BF16(stream.null().map_err(err)?),
            DType::U32 => CudaStorage::U32(stream.null().map_err(err)?),
        });
    }
    // SAFETY: for all three allocations, the memory is written in full by the NCCL
    // operation the caller posts next, before anything reads it (stream order).
    let s = unsafe {
        match dtype {
            DType::F32 => CudaStorage::F32(stream.alloc::<f32>(n).map_err(err)?),
            DType::BF16 => CudaStorage::BF16(stream.alloc::<u16>(n).map_err(err)?),
            DType::U32 => CudaStorage::U32(stream.alloc::<u32>(n).map_err(err)?),
        }
    };
    Ok(s)
}

/// One point-to-point call (`ncclSend` if `send`, else `ncclRecv`) of `b` with `peer`.
pub(crate) fn p2p_call(
    send: bool,
    b: Buf,
    peer: usize,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> Result<(), sys::ncclResult_t> {
    let peer = i32::try_from(peer).unwrap_or(i32::MAX);
    // SAFETY: `b` is a live device buffer of `b.count` elements of `b.ty` on the
    // communicator's GPU, kept alive by the caller until the operation has completed
    // (every caller waits for completion before dropping it); `comm` is live and used
    // by this thread only (its owner's lock or thread).
    let r = unsafe {
        if send {
            sys::ncclSend(b.send_ptr(), b.count, b.ty, peer, comm, stream)
        } else {
            sys::ncclRecv(b.recv_ptr(), b.count, b.ty, peer, comm, stream)
        }
    };
    raw::check(r)
}

impl Channels {
    pub fn new(group: &[usize]) -> Self {
        Channels {
            group: group.to_vec(),
            out: Mutex::new(HashMap::new()),
            inbound: Mutex::new(HashMap::new()),
        }
    }

    /// Aborts the receiving channels' communicators (a failed process's teardown).
    pub fn abort_inbound(&self, why: &str) {
        for c in lock(&self.inbound).values() {
            lock(c).abort(why);
        }
    }

    /// Queues `t` (on the world's GPU) for world rank `dst`; returns once it is queued.
    pub fn send(&self, world: &Arc<NcclWorld>, t: &Tensor, dst: usize) -> Result<(), Failure> {
        let data = t
            .try_clone()
            .map_err(|e| Failure::Error(format!("copying the tensor to send: {e}")))?;
        let ready = world
            .stream
            .record_event(None)
            .map_err(|e| Failure::Error(format!("recording an event: {e}")))?;
        let mut out = lock(&self.out);
        let tx = match out.entry(dst) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => {
                let (tx, rx) = channel();
                let w = Arc::clone(world);
                let key = plan::channel_key(&self.group, world.rank, dst);
                std::thread::Builder::new()
                    .name(format!("braid-nccl-send-{dst}"))
                    .spawn(move || channel_thread(w, key, dst, rx))
                    .map_err(|e| Failure::Error(format!("starting a send thread: {e}")))?;
                v.insert(tx)
            }
        };
        tx.send(Job { data, ready }).map_err(|_| {
            Failure::Poisoned(
                world
                    .poisoned()
                    .unwrap_or_else(|| format!("the send channel to rank {dst} has stopped")),
            )
        })
    }

    /// Receives the next tensor world rank `src` sent here: its dtype, dims and buffer.
    pub fn recv(
        &self,
        world: &Arc<NcclWorld>,
        src: usize,
    ) -> Result<(DType, Vec<usize>, CudaStorage), Failure> {
        let comm = {
            let mut inbound = lock(&self.inbound);
            match inbound.get(&src) {
                Some(c) => Arc::clone(c),
                None => {
                    let key = plan::channel_key(&self.group, src, world.rank);
                    let c = Arc::new(Mutex::new(world.join(&key, &[src, world.rank], 1)?));
                    inbound.insert(src, Arc::clone(&c));
                    c
                }
            }
        };
        let mut comm = lock(&comm);
        let stream = &world.stream;
        let poisoned = || world.poisoned();
        let what = format!("receiving from rank {src}");
        let start = Instant::now();
        comm.bind()?;
        let mut header = alloc(stream, DType::U32, HEADER_WORDS)?;
        let h = comm.handle()?;
        let cu = stream.cu_stream() as sys::cudaStream_t;
        p2p_call(false, raw::buf_mut(&mut header, stream), 0, h, cu)
            .map_err(|e| Failure::Error(format!("ncclRecv: {}", raw::nccl_text(e, Some(h)))))?;
        comm.settle(start, &what, &poisoned)?;
        comm.complete(stream, start, &what, &poisoned)?;
        let CudaStorage::U32(words) = &header else {
            return Err(Failure::Error("header buffer of the wrong type".into()));
        };
        let words = stream
            .clone_dtoh(words)
            .map_err(|e| Failure::Error(format!("reading the header: {e}")))?;
        let (dtype, dims) = plan::decode_header(&words).map_err(Failure::Error)?;
        let n: usize = dims.iter().product();
        let mut data = alloc(stream, dtype, n)?;
        if n > 0 {
            p2p_call(false, raw::buf_mut(&mut data, stream), 0, h, cu)
                .map_err(|e| Failure::Error(format!("ncclRecv: {}", raw::nccl_text(e, Some(h)))))?;
            comm.settle(start, &what, &poisoned)?;
            comm.complete(stream, start, &what, &poisoned)?;
        }
        Ok((dtype, dims, data))
    }
}

/// The thread of the channel `world.rank -> dst`: joins its communicator, then sends
/// each queued tensor (header, then payload) and waits for it. A failure poisons the
/// process; later jobs are dropped.
fn channel_thread(world: Arc<NcclWorld>, key: String, dst: usize, jobs: Receiver<Job>) {
    let me = world.rank;
    let setup = (|| {
        let stream = world
            .ctx
            .new_stream()
            .map_err(|e| Failure::Error(format!("creating a stream: {e}")))?;
        let comm = world.join(&key, &[me, dst], 0)?;
        Ok::<_, Failure>((stream, comm))
    })();
    let (stream, mut comm) = match setup {
        Ok(s) => s,
        Err(f) => {
            world.poison(format!("rank {me}: the send channel to rank {dst}: {f:?}"));
            return;
        }
    };
    for job in jobs {
        if world.poisoned().is_some() {
            continue;
        }
        if let Err(f) = send_one(&world, &stream, &mut comm, &job, dst) {
            comm.abort(&format!("{f:?}"));
            world.poison(format!("rank {me}: sending to rank {dst}: {f:?}"));
        }
    }
    // A failed process aborts rather than finalizes (see NcclComm's drop).
    if let Some(why) = world.poisoned() {
        comm.abort(&why);
    }
}

fn send_one(
    world: &NcclWorld,
    stream: &Arc<CudaStream>,
    comm: &mut RawComm,
    job: &Job,
    dst: usize,
) -> Result<(), Failure> {
    let start = Instant::now();
    let poisoned = || world.poisoned();
    let what = format!("rank {dst} receives what rank {} sent", world.rank);
    comm.bind()?;
    let h = comm.handle()?;
    let cu = stream.cu_stream() as sys::cudaStream_t;
    stream
        .wait(&job.ready)
        .map_err(|e| Failure::Error(format!("waiting for the copy: {e}")))?;
    let words = plan::encode_header(job.data.dtype(), job.data.dims()).map_err(Failure::Error)?;
    let header = stream
        .clone_htod(&words[..])
        .map_err(|e| Failure::Error(format!("copying the header: {e}")))?;
    let header = CudaStorage::U32(header);
    let nccl = |e| Failure::Error(format!("ncclSend: {}", raw::nccl_text(e, Some(h))));
    p2p_call(true, raw::buf(&header, stream), 1, h, cu).map_err(nccl)?;
    comm.settle(start, &what, &poisoned)?;
    if let Some(data) = job.data.cuda_buffer()
        && !data.is_empty()
    {
        p2p_call(true, raw::buf(data, stream), 1, h, cu).map_err(nccl)?;
        comm.settle(start, &what, &poisoned)?;
    }
    comm.complete(stream, start, &what, &poisoned)
}
