//! One NCCL communicator (`ncclComm_t`) and its watchdog: nonblocking initialization and
//! calls, every wait bounded by the world's timeout, and `ncclCommAbort` when a wait
//! runs out, NCCL reports an error (a peer that died: `ncclRemoteError`) or another
//! communicator of this process failed first.
//!
//! cudarc's safe `nccl::Comm` is not used: it is not `Send`, it aborts in `Drop` with
//! `expect` (a panic if the abort fails, a double abort after ours), and it creates
//! blocking communicators, whose calls cannot be bounded.

use std::ffi::{CStr, c_char, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_kernels::DType;
use braid_kernels::cuda::CudaStorage;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;

/// Why a wait on NCCL ended without success (mapped to a `CommError` by the caller,
/// who knows the op, the ranks and the group).
#[derive(Debug)]
pub(crate) enum Failure {
    /// NCCL or CUDA returned an error; its string (and NCCL's last message).
    Error(String),
    /// Nothing completed within the timeout: what was waited for, and for how long.
    Timeout { what: String, waited: Duration },
    /// Another communicator of this process failed first; its message.
    Poisoned(String),
    /// Another rank's setup failed, and it said so in the store: its rank and message.
    Aborted { by: usize, why: String },
}

/// NCCL's text for a result code, with the communicator's last error message if any.
pub(crate) fn nccl_text(r: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string
    // for every code (NCCL is loaded: callers check availability before any call).
    let base = unsafe { CStr::from_ptr(sys::ncclGetErrorString(r)) }
        .to_string_lossy()
        .into_owned();
    let last = comm.map(|c| {
        // SAFETY: `c` is a live communicator (not yet aborted or destroyed); the
        // returned string is owned by NCCL and valid until the next NCCL call on this
        // thread, and it is copied at once.
        let p = unsafe { sys::ncclGetLastError(c) };
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated, see above.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    });
    match last {
        Some(l) if !l.is_empty() => format!("{base} ({r:?}): {l}"),
        _ => format!("{base} ({r:?})"),
    }
}

/// `Ok` for success and "in progress" (nonblocking calls), the code otherwise.
pub(crate) fn check(r: sys::ncclResult_t) -> Result<(), sys::ncclResult_t> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(e),
    }
}

/// NCCL's datatype for a dtype (bf16 is summed natively by NCCL).
pub(crate) fn nccl_type(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::U32 => sys::ncclDataType_t::ncclUint32,
    }
}

/// A device buffer as NCCL takes it: address, element count, datatype.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Buf {
    pub ptr: u64,
    pub count: usize,
    pub ty: sys::ncclDataType_t,
}

impl Buf {
    /// The buffer `offset..offset + count` (in elements) of `self`.
    pub fn part(self, offset: usize, count: usize, elem_bytes: usize) -> Buf {
        Buf {
            ptr: self.ptr + (offset * elem_bytes) as u64,
            count,
            ty: self.ty,
        }
    }
    pub fn send_ptr(self) -> *const c_void {
        self.ptr as usize as *const c_void
    }
    pub fn recv_ptr(self) -> *mut c_void {
        self.ptr as usize as *mut c_void
    }
}

/// The address of a tensor's device buffer, to read. The guard cudarc returns is a no-op
/// here: the kernels backend disables per-buffer event tracking (one stream per GPU).
pub(crate) fn buf(s: &CudaStorage, stream: &CudaStream) -> Buf {
    let (ptr, count) = match s {
        CudaStorage::F32(x) => (x.device_ptr(stream).0, x.len()),
        CudaStorage::BF16(x) => (x.device_ptr(stream).0, x.len()),
        CudaStorage::U32(x) => (x.device_ptr(stream).0, x.len()),
    };
    Buf {
        ptr,
        count,
        ty: nccl_type(s.dtype()),
    }
}

/// The address of a tensor's device buffer, to write.
pub(crate) fn buf_mut(s: &mut CudaStorage, stream: &CudaStream) -> Buf {
    let ty = nccl_type(s.dtype());
    let (ptr, count) = match s {
        CudaStorage::F32(x) => {
            let n = x.len();
            (x.device_ptr_mut(stream).0, n)
        }
        CudaStorage::BF16(x) => {
            let n = x.len();
            (x.device_ptr_mut(stream).0, n)
        }
        CudaStorage::U32(x) => {
            let n = x.len();
            (x.device_ptr_mut(stream).0, n)
        }
    };
    Buf { ptr, count, ty }
}

/// How often a wait looks at NCCL and the GPU.
const POLL: Duration = Duration::from_micros(50);

/// A communicator created nonblocking (`config.blocking = 0`), so that every call
/// returns at once and [`RawComm::settle`] / [`RawComm::complete`] bound the waits.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    /// Set once the communicator was aborted: it must not be used again.
    dead: Option<String>,
    ctx: Arc<CudaContext>,
    timeout: Duration,
}

// SAFETY: an NCCL communicator is a heap object that NCCL lets any host thread use, as
// long as no two threads call into the same communicator at once (NCCL's docs: calls on
// one communicator must be serialized by the application). `RawComm` is only reached
// through `&mut` (every owner keeps it in a `Mutex` or on one thread), so calls are
// serialized; the CUDA context is bound to the calling thread before every call.
unsafe impl Send for RawComm {}

impl std::fmt::Debug for RawComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawComm(dead: {:?})", self.dead)
    }
}

/// The default configuration (`NCCL_CONFIG_INITIALIZER` of nccl.h), nonblocking.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 30, 0): the header cudarc binds; NCCL reads a config of an
        // older or newer layout by this version and `size`.
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// A fresh NCCL unique id (to publish through the store), as bytes.
pub(crate) fn new_unique_id() -> Result<Vec<u8>, Failure> {
    let id = cudarc::nccl::result::get_uniqueid()
        .map_err(|e| Failure::Error(format!("ncclGetUniqueId: {}", nccl_text(e.0, None))))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn unique_id(bytes: &[u8]) -> Result<sys::ncclUniqueId, Failure> {
    if bytes.len() != 128 {
        return Err(Failure::Error(format!(
            "an NCCL unique id of {} bytes from the store (expected 128)",
            bytes.len()
        )));
    }
    let mut internal = [0 as c_char; 128];
    for (d, &b) in internal.iter_mut().zip(bytes) {
        *d = b as c_char;
    }
    Ok(sys::ncclUniqueId { internal })
}

impl RawComm {
    /// Joins the communicator of `size` ranks named by `id` as `rank`, on the GPU of
    /// `ctx`. Waits (bounded by `timeout`) for every rank to join; `poisoned` is asked
    /// between polls whether the process already failed elsewhere.
    pub fn init(
        ctx: &Arc<CudaContext>,
        id: &[u8],
        rank: usize,
        size: usize,
        timeout: Duration,
        poisoned: &dyn Fn() -> Option<String>,
    ) -> Result<RawComm, Failure> {
        let id = unique_id(id)?;
        ctx.bind_to_thread()
            .map_err(|e| Failure::Error(format!("binding the CUDA context: {e}")))?;
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let (n, r) = (
            i32::try_from(size).unwrap_or(i32::MAX),
            i32::try_from(rank).unwrap_or(i32::MAX),
        );
        // SAFETY: `comm` and `config` are valid for the call; the id is 128 bytes; the
        // context of the GPU is current on this thread (NCCL picks the current device).
        let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, id, r, &mut config) };
        if let Err(e) = check(r) {
            let text = nccl_text(e, None);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL returned, not used elsewhere.
                unsafe { sys::ncclCommAbort(comm) };
            }
            return Err(Failure::Error(format!("ncclCommInitRankConfig: {text}")));
        }
        let mut raw = RawComm {
            comm,
            dead: None,
            ctx: Arc::clone(ctx),
            timeout,
        };
        let start = Instant::now();
        raw.settle(start, "every rank joins the communicator", poisoned)?;
        Ok(raw)
    }

    /// The handle, to pass to NCCL calls; an error if the communicator was aborted.
    pub fn handle(&self) -> Result<sys::ncclComm_t, Failure> {
        match &self.dead {
            Some(why) => Err(Failure::Error(format!(
                "this communicator was aborted earlier: {why}"
            ))),
            None => Ok(self.comm),
        }
    }

    pub fn bind(&self) -> Result<(), Failure> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Failure::Error(format!("binding the CUDA context: {e}")))
    }

    /// Aborts the communicator (no-op if it already was): its pending work is dropped
    /// and every rank still waiting on it sees an error instead of hanging.
    pub fn abort(&mut self, why: &str) {
        if self.dead.is_none() {
            // SAFETY: the communicator is live and this is the only call on it (`&mut`).
            let _ = unsafe { sys::ncclCommAbort(self.comm) };
            self.dead = Some(why.to_string());
        }
    }

    /// Aborts and passes the failure on.
    fn fail(&mut self, f: Failure) -> Failure {
        let why = match &f {
            Failure::Error(m) | Failure::Poisoned(m) => m.clone(),
            Failure::Aborted { by, why } => format!("{} failed: {why}", crate::rank_name(*by)),
            Failure::Timeout { what, waited } => {
                format!("timed out after {:.1} s: {what}", waited.as_secs_f64())
            }
        };
        self.abort(&why);
        f
    }

    /// Waits until the last nonblocking call (an init, a group end) has been issued:
    /// `ncclCommGetAsyncError` leaves `ncclInProgress`. Aborts on error or timeout.
    pub fn settle(
        &mut self,
        start: Instant,
        what: &str,
        poisoned: &dyn Fn() -> Option<String>,
    ) -> Result<(), Failure> {
        let comm = self.handle()?;
        loop {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator, `state` a valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            if let Err(e) = check(r) {
                let f = Failure::Error(format!(
                    "ncclCommGetAsyncError: {}",
                    nccl_text(e, Some(comm))
                ));
                return Err(self.fail(f));
            }
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {}
                e => {
                    let f = Failure::Error(nccl_text(e, Some(comm)));
                    return Err(self.fail(f));
                }
            }
            self.tick(start, what, poisoned)?;
        }
    }

    /// Checks the deadline and the process-wide failure between polls, then sleeps.
    fn tick(
        &mut self,
        start: Instant,
        what: &str,
        poisoned: &dyn Fn() -> Option<String>,
    ) -> Result<(), Failure> {
        if let Some(why) = poisoned() {
            return Err(self.fail(Failure::Poisoned(why)));
        }
        let waited = start.elapsed();
        if waited >= self.timeout {
            let f = Failure::Timeout {
                what: what.to_string(),
                waited,
            };
            return Err(self.fail(f));
        }
        std::thread::sleep(POLL);
        Ok(())
    }

    /// Waits until everything issued on `stream` so far has run on the GPU (an event
    /// recorded now completes), watching NCCL's asynchronous error meanwhile (a peer that
    /// died or aborted shows up there). Aborts on error or timeout.
    pub fn complete(
        &mut self,
        stream: &CudaStream,
        start: Instant,
        what: &str,
        poisoned: &dyn Fn() -> Option<String>,
    ) -> Result<(), Failure> {
        let event = match stream.record_event(None) {
            Ok(e) => e,
            Err(e) => return Err(self.fail(Failure::Error(format!("recording an event: {e}")))),
        };
        let comm = self.handle()?;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(self.fail(Failure::Error(format!("the GPU failed: {e}"))));
                }
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator, `state` a valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            let err = match (check(r), state) {
                (Err(e), _) => Some(e),
                (Ok(()), sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {
                    None
                }
                (Ok(()), e) => Some(e),
            };
            if let Some(e) = err {
                return Err(self.fail(Failure::Error(nccl_text(e, Some(comm)))));
            }
            self.tick(start, what, poisoned)?;
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.dead.is_some() {
            return;
        }
        let _ = self.bind();
        // Finalize (flushes the communicator's work; nonblocking), then destroy; a
        // finalize that does not settle within the timeout is aborted instead.
        // SAFETY: the communicator is live and owned here.
        let r = unsafe { sys::ncclCommFinalize(self.comm) };
        let settled = check(r).is_ok() && self.settle(Instant::now(), "finalize", &|| None).is_ok();
        if settled {
            // SAFETY: finalized, never used again.
            let _ = unsafe { sys::ncclCommDestroy(self.comm) };
        } else {
            self.abort("dropped");
        }
    }
}
