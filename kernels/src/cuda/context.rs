//! One [`CudaBackend`] per GPU ordinal: context, stream, cuBLASLt handle, module cache,
//! and the checks that make `Device::Cuda(n)` an error (never a panic) where there is no
//! driver or no such GPU.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DriverError,
    ValidAsZeroBits, sys,
};

use super::compile::{self, KernelSource};
use super::matmul::Blas;
use crate::device::Device;
use crate::error::{Error, Result};

/// The CUDA backend of one GPU. Every kernel it launches runs on its one stream, so work
/// is ordered as it is issued and no kernel waits for the host.
pub struct CudaBackend {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// cuBLASLt handle + its workspace. A handle and its workspace must not be used by
    /// two threads at once (thread ranks may share a GPU), hence the lock.
    pub(crate) blas: Mutex<Blas>,
    /// `sm_90a` on an H100/H200, `sm_XY` elsewhere: what NVRTC compiles for.
    pub(crate) arch: String,
    pub(crate) name: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// Small u32 tables (attention's segment and tile lists) already on the device, most
    /// recently used first, by content: every layer of a microbatch asks for the same
    /// ones, so they cross to the device once per microbatch, not once per call.
    tables: Mutex<VecDeque<KeptTable>>,
}

/// A table's content and its device copy.
type KeptTable = (Vec<u32>, Arc<CudaSlice<u32>>);

/// Tables kept on the device by [`CudaBackend::table`]: a forward and a backward plan
/// (segments, query tiles, key tiles) of a few microbatches in flight.
const TABLES_KEPT: usize = 24;

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaBackend(cuda:{}, {}, {})",
            self.ordinal, self.name, self.arch
        )
    }
}

/// The most GPUs one process addresses (`cuda:0` .. `cuda:63`).
const MAX_GPUS: usize = 64;

/// Backends created so far, by ordinal. A backend lives for the whole process (the
/// context and its pool are process-wide resources), so it is leaked once and shared.
/// Every op looks its backend up: after the first, without a lock.
static BACKENDS: [OnceLock<&'static CudaBackend>; MAX_GPUS] = [const { OnceLock::new() }; MAX_GPUS];
/// Held while a backend is created, so that each is created once.
static CREATING: Mutex<()> = Mutex::new(());

/// The backend of GPU `ordinal`, created on first use.
pub fn backend(ordinal: usize) -> Result<&'static CudaBackend> {
    let slot = BACKENDS.get(ordinal).ok_or_else(|| Error::Cuda {
        op: "backend",
        device: Device::Cuda(ordinal),
        msg: format!("a process addresses at most {MAX_GPUS} GPUs"),
    })?;
    if let Some(b) = slot.get() {
        return Ok(b);
    }
    let _creating = lock(&CREATING);
    if let Some(b) = slot.get() {
        return Ok(b);
    }
    let b: &'static CudaBackend = Box::leak(Box::new(CudaBackend::create(ordinal)?));
    // Set under the lock after an empty check: this set is the only one.
    let _ = slot.set(b);
    Ok(b)
}

/// Locks a mutex, recovering the data if a thread panicked while holding it (the guarded
/// maps and handles stay valid: no update is left half-done across a panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The libraries the backend loads at run time, and whether each was found.
fn missing_libraries() -> Vec<&'static str> {
    let mut missing = Vec::new();
    // SAFETY: each call only tries to dlopen the library by its usual names and returns
    // whether it succeeded; nothing is called through it here.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            missing.push("the NVIDIA driver library libcuda.so (is an NVIDIA driver installed?)");
        }
        if !cudarc::cublaslt::sys::is_culib_present() {
            missing.push(
                "cuBLASLt (libcublasLt.so.13, from the CUDA toolkit or the nvidia-cublas wheel)",
            );
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            missing.push(
                "NVRTC (libnvrtc.so.13, from the CUDA toolkit or the nvidia-cuda-nvrtc wheel)",
            );
        }
    }
    missing
}

/// Why `Device::Cuda(ordinal)` cannot be used here, or `None` if it can be tried.
/// Cheap, never panics, creates no context: used by configs to fail early.
pub fn unavailable_reason(ordinal: usize) -> Option<String> {
    let missing = missing_libraries();
    if !missing.is_empty() {
        return Some(format!(
            "not found: {} (set LD_LIBRARY_PATH to the folder that holds it)",
            missing.join("; ")
        ));
    }
    match CudaContext::device_count() {
        Ok(n) if (n.max(0) as usize) > ordinal => None,
        Ok(n) => Some(format!(
            "this machine has {n} CUDA device(s), so cuda:{ordinal} does not exist"
        )),
        Err(e) => Some(format!("the CUDA driver failed to start: {e}")),
    }
}

impl CudaBackend {
    fn create(ordinal: usize) -> Result<Self> {
        let device = Device::Cuda(ordinal);
        if let Some(reason) = unavailable_reason(ordinal) {
            return Err(Error::DeviceUnavailable { device, reason });
        }
        let err = |what: &str, e: DriverError| Error::DeviceUnavailable {
            device,
            reason: format!("{what}: {e}"),
        };
        let ctx = CudaContext::new(ordinal).map_err(|e| err("creating the context", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| err("reading the compute capability", e))?;
        if major < 8 {
            return Err(Error::DeviceUnavailable {
                device,
                reason: format!(
                    "compute capability {major}.{minor}: Braid's kernels need bf16 tensor cores (8.0 or newer)"
                ),
            });
        }
        let arch = if (major, minor) == (9, 0) {
            // Hopper's architecture-specific features (wgmma, setmaxnreg) need `a`.
            "sm_90a".to_string()
        } else {
            format!("sm_{major}{minor}")
        };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        // SAFETY: every buffer this backend creates is used on its one stream (below),
        // so cudarc's per-buffer events, which order work across streams, are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| err("creating a stream", e))?;
        keep_freed_memory_cached(&ctx).map_err(|e| err("configuring the memory pool", e))?;
        let blas = Blas::new(&stream, major)
            .map_err(|reason| Error::DeviceUnavailable { device, reason })?;
        Ok(CudaBackend {
            ordinal,
            ctx,
            stream,
            blas: Mutex::new(blas),
            arch,
            name,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            tables: Mutex::new(VecDeque::new()),
        })
    }

    /// `v` on the device: the copy made for an earlier call with the same content if it
    /// is still kept (no transfer), else a new upload on the stream. Kernels only read
    /// tables, and a dropped table is freed stream-ordered (after the kernels before it).
    pub(crate) fn table(&self, op: &'static str, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let mut kept = lock(&self.tables);
        if let Some(i) = kept.iter().position(|(k, _)| k.as_slice() == v)
            && let Some(hit) = kept.remove(i)
        {
            let slice = Arc::clone(&hit.1);
            kept.push_front(hit);
            return Ok(slice);
        }
        let slice = Arc::new(
            self.stream
                .clone_htod(v)
                .map_err(|e| self.driver_err(op, e))?,
        );
        kept.push_front((v.to_vec(), Arc::clone(&slice)));
        kept.truncate(TABLES_KEPT);
        Ok(slice)
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The stream every kernel of this backend runs on. A library that enqueues work
    /// for this GPU (NCCL in braid-comm) uses it too, so its work is ordered with the
    /// kernels' as issued. Buffers have no per-buffer events (tracking is disabled).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context of this GPU (bind it to a thread before raw driver calls).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The GPU's name and architecture, for run summaries ("NVIDIA H200, sm_90a").
    pub fn describe(&self) -> String {
        format!("{}, {}", self.name, self.arch)
    }

    /// The kernel `name` of `src`, compiling and loading the module on first use.
    pub(crate) fn function(
        &self,
        src: &'static KernelSource,
        name: &'static str,
    ) -> Result<CudaFunction> {
        if let Some(f) = lock(&self.functions).get(&(src.name, name)) {
            return Ok(f.clone());
        }
        let module = self.module(src)?;
        let f = module
            .load_function(name)
            .map_err(|e| self.driver_err("load_function", e))?;
        lock(&self.functions).insert((src.name, name), f.clone());
        Ok(f)
    }

    /// Compiles (or reads from the disk cache) and loads every kernel module now rather
    /// than at first use: a world of NCCL ranks does this before its first collective.
    pub fn load_all_kernels(&self) -> Result<()> {
        for src in compile::SOURCES {
            self.module(src)?;
        }
        Ok(())
    }

    fn module(&self, src: &'static KernelSource) -> Result<Arc<CudaModule>> {
        if let Some(m) = lock(&self.modules).get(src.name) {
            return Ok(m.clone());
        }
        let cubin = compile::cached_cubin(src, &self.arch).map_err(|msg| Error::Cuda {
            op: "nvrtc",
            device: self.device(),
            msg,
        })?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| self.driver_err("load_module", e))?;
        lock(&self.modules).insert(src.name, module.clone());
        Ok(module)
    }

    /// A driver error as ours; out-of-memory becomes [`Error::OutOfMemory`].
    pub(crate) fn driver_err(&self, op: &'static str, e: DriverError) -> Error {
        if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return self.oom(op, "a device buffer".into(), 0);
        }
        Error::Cuda {
            op,
            device: self.device(),
            msg: e.to_string(),
        }
    }

    pub(crate) fn oom(&self, op: &'static str, what: String, bytes: usize) -> Error {
        let (free_bytes, total_bytes) = self.ctx.mem_get_info().unwrap_or((0, 0));
        Error::OutOfMemory {
            device: self.device(),
            op,
            what,
            bytes,
            free_bytes,
            total_bytes,
        }
    }

    /// `n` elements of uninitialized device memory, for outputs a kernel overwrites in
    /// full. `what` names the tensor in an out-of-memory error.
    pub(crate) fn alloc<T: DeviceRepr>(
        &self,
        op: &'static str,
        n: usize,
        what: impl FnOnce() -> String,
    ) -> Result<CudaSlice<T>> {
        if n == 0 {
            return self.empty(op);
        }
        // SAFETY: the caller's kernel writes every element before anything reads it
        // (each call site says which kernel); the buffer is stream-ordered on our stream.
        unsafe { self.stream.alloc::<T>(n) }
            .map_err(|e| self.alloc_err(op, e, n * size_of::<T>(), what))
    }

    /// A buffer of no elements. It is backed by a real one-element allocation: cudarc's
    /// `null()` asks `cuMemAllocAsync` for 0 bytes, which CUDA does not document as valid
    /// (`cuMemAlloc` rejects it), and a free that fails inside a drop would surface as
    /// the error of a later, unrelated op.
    pub(crate) fn empty<T: DeviceRepr>(&self, op: &'static str) -> Result<CudaSlice<T>> {
        // SAFETY: the element is never read or written: the slice made of it has length 0.
        let one = unsafe { self.stream.alloc::<T>(1) }.map_err(|e| self.driver_err(op, e))?;
        let ptr = one.leak();
        // SAFETY: `ptr` is a live allocation of this stream's context, owned by nobody
        // since `leak`; length 0 keeps every access in bounds, and dropping the slice
        // frees it on this stream.
        Ok(unsafe { self.stream.upgrade_device_ptr::<T>(ptr, 0) })
    }

    /// `n` zeroed elements.
    pub(crate) fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        n: usize,
        what: impl FnOnce() -> String,
    ) -> Result<CudaSlice<T>> {
        if n == 0 {
            return self.empty(op);
        }
        self.stream
            .alloc_zeros::<T>(n)
            .map_err(|e| self.alloc_err(op, e, n * size_of::<T>(), what))
    }

    fn alloc_err(
        &self,
        op: &'static str,
        e: DriverError,
        bytes: usize,
        what: impl FnOnce() -> String,
    ) -> Error {
        if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            self.oom(op, what(), bytes)
        } else {
            self.driver_err(op, e)
        }
    }

    /// Waits for every kernel issued so far (used by explicit host copies and tests).
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| self.driver_err("synchronize", e))
    }

    /// The most device memory the pool has held since the last reset, in bytes.
    pub fn peak_memory_bytes(&self) -> Result<u64> {
        let mut value: u64 = 0;
        self.pool_attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut value,
            false,
        )?;
        Ok(value)
    }

    /// Starts a new peak-memory window (the trainer calls this at the start of a step).
    pub fn reset_peak_memory(&self) -> Result<()> {
        let mut zero: u64 = 0;
        self.pool_attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut zero,
            true,
        )
    }

    fn pool_attribute(
        &self,
        attr: sys::CUmemPool_attribute,
        value: &mut u64,
        set: bool,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.driver_err("bind_to_thread", e))?;
        let pool =
            default_pool(&self.ctx).map_err(|e| self.driver_err("cuDeviceGetDefaultMemPool", e))?;
        let ptr = (value as *mut u64).cast::<c_void>();
        // SAFETY: `pool` is the device's default pool; USED_MEM_HIGH is a u64 attribute,
        // and `ptr` points at a live u64 for the duration of the call.
        let r = unsafe {
            if set {
                sys::cuMemPoolSetAttribute(pool, attr, ptr)
            } else {
                sys::cuMemPoolGetAttribute(pool, attr, ptr)
            }
        };
        r.result()
            .map_err(|e| self.driver_err("cuMemPool attribute", e))
    }
}

fn default_pool(ctx: &CudaContext) -> std::result::Result<sys::CUmemoryPool, DriverError> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer; the device handle comes from a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    Ok(pool)
}

/// Raises the stream-ordered pool's release threshold to "never", so memory freed in one
/// step is reused by the next instead of going back to the driver at every sync.
fn keep_freed_memory_cached(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread()?;
    let pool = default_pool(ctx)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: RELEASE_THRESHOLD is a u64 attribute and `threshold` outlives the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast::<c_void>(),
        )
    }
    .result()
}

/// What a verdict word holds until a kernel finds a bad index (`BRAID_NO_VERDICT` in
/// the `.cu` files). A real verdict is smaller: its position is below 2^32 - 1.
pub(crate) const NO_VERDICT: u64 = u64::MAX;

impl CudaBackend {
    /// `count` verdict words, each [`NO_VERDICT`], for a check kernel to lower.
    pub(crate) fn verdicts(&self, op: &'static str, count: usize) -> Result<CudaSlice<u64>> {
        self.stream
            .clone_htod(&vec![NO_VERDICT; count])
            .map_err(|e| self.driver_err(op, e))
    }

    /// Copies verdict words to the host (this waits for every kernel issued before) and
    /// decodes each into the first bad `(position, value)`, or `None` if there was none.
    pub(crate) fn read_verdicts(
        &self,
        op: &'static str,
        v: &CudaSlice<u64>,
    ) -> Result<Vec<Option<(u64, u32)>>> {
        let words = self
            .stream
            .clone_dtoh(v)
            .map_err(|e| self.driver_err(op, e))?;
        Ok(words
            .into_iter()
            .map(|w| (w != NO_VERDICT).then_some((w >> 32, w as u32)))
            .collect())
    }
}
