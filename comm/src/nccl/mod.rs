//! `NcclComm`: the ranks of a world as processes, one GPU each, over NCCL (cudarc's
//! bindings, loaded at run time: building needs neither NCCL nor CUDA).
//!
//! - **One NCCL communicator per group.** The world's and every subgroup's: member 0
//!   creates the unique id and publishes it on the rendezvous store under a key derived
//!   from the member list ([`plan::group_key`]), the others wait for it; every member
//!   calls `subgroup` with the same list, in one program order.
//! - **Collectives on the kernels' stream** of the rank's GPU, so they are ordered with
//!   the kernels as issued. Every collective waits (on the host) until it has run: the
//!   result is ready when the call returns, and a failure is the failing call's error.
//! - **Point to point through directed channels** ([`p2p`]): a two-rank communicator per
//!   (group, sender, receiver), created on first use. A send is handed to the channel's
//!   own thread and returns at once (NCCL's sends are unbuffered; the trait's are not), so
//!   a pipeline's neighbours that send to each other before receiving never deadlock.
//! - **`all_to_all_v`** posts every send and receive in one NCCL group (headers first,
//!   then the payloads), so ragged exchanges never deadlock.
//! - **The watchdog** ([`raw`]): communicators are nonblocking; every wait polls NCCL and
//!   the GPU and gives up after the timeout, aborting the communicator (`CommError::Timeout`);
//!   an error NCCL reports (a peer that died) aborts it too. One failure poisons the
//!   process: every later call of every group fails at once, naming the first failure.
//!
//! Not run on a GPU yet (see docs/processes.md).

mod collectives;
mod p2p;
pub(crate) mod plan;
mod raw;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use braid_kernels::cuda::CudaBackend;
use braid_kernels::{Device, Tensor};
use cudarc::driver::{CudaContext, CudaStream};

use crate::store::StoreClient;
use crate::{CommError, Result};
use raw::{Failure, RawComm};

/// The oldest NCCL this transport accepts (nonblocking communicators, bf16 sums and the
/// configuration layout it sends are all older than this).
const MIN_NCCL: i32 = 21800;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What this process shares between its groups: the rank's GPU, the store (for the
/// unique ids of later groups and channels), the timeout, and the first failure.
pub(crate) struct NcclWorld {
    rank: usize,
    size: usize,
    device: Device,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    timeout: Duration,
    store: Mutex<StoreClient>,
    /// The first failure of any communicator of this process.
    failed: Mutex<Option<String>>,
    /// How many groups of each member list this process made (the `generation` of
    /// [`plan::group_key`]).
    generations: Mutex<HashMap<Vec<usize>, usize>>,
}

impl NcclWorld {
    fn poisoned(&self) -> Option<String> {
        lock(&self.failed).clone()
    }

    fn poison(&self, why: String) {
        let mut f = lock(&self.failed);
        if f.is_none() {
            *f = Some(why);
        }
    }

    /// Publishes `value` under `key`.
    fn publish(&self, key: &str, value: &[u8]) -> std::result::Result<(), String> {
        lock(&self.store).set(key, value).map_err(|e| e.to_string())
    }

    /// Waits for `key`, polling (the store lock is released between polls, so this
    /// process's channel threads can publish meanwhile), up to the timeout.
    fn fetch(&self, key: &str, hint: &str) -> std::result::Result<Vec<u8>, Failure> {
        let start = Instant::now();
        // Another rank's abort (its setup failed) is checked every 200 ms, not every poll.
        let mut abort_check = start;
        loop {
            if let Some(v) = lock(&self.store)
                .get(key)
                .map_err(|e| Failure::Error(e.to_string()))?
            {
                return Ok(v);
            }
            if let Some(why) = self.poisoned() {
                return Err(Failure::Poisoned(why));
            }
            if Instant::now() >= abort_check {
                match lock(&self.store).aborted() {
                    Ok(Some(crate::store::StoreError::Aborted { rank, why })) => {
                        return Err(Failure::Aborted { by: rank, why });
                    }
                    Ok(_) => {}
                    Err(e) => return Err(Failure::Error(e.to_string())),
                }
                abort_check = Instant::now() + Duration::from_millis(200);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(Failure::Timeout {
                    what: hint.to_string(),
                    waited,
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Creates or joins the communicator of `members` (world ranks; this rank is
    /// `members[me]`), its id under `key`.
    fn join(
        &self,
        key: &str,
        members: &[usize],
        me: usize,
    ) -> std::result::Result<RawComm, Failure> {
        let id = if me == 0 {
            let id = raw::new_unique_id()?;
            self.publish(key, &id).map_err(Failure::Error)?;
            id
        } else {
            self.fetch(
                key,
                &format!(
                    "rank {} publishes the NCCL id of group {members:?}",
                    members[0]
                ),
            )?
        };
        RawComm::init(&self.ctx, &id, me, members.len(), self.timeout, &|| {
            self.poisoned()
        })
    }
}

/// One group of an NCCL world: the whole world or a subgroup.
pub struct NcclComm {
    world: Arc<NcclWorld>,
    /// World ranks of the members, in group order.
    members: Vec<usize>,
    /// This rank's index in `members`.
    rank: usize,
    comm: Mutex<RawComm>,
    channels: p2p::Channels,
}

impl Drop for NcclComm {
    /// After a failure of this process, its communicators are aborted, not finalized: a
    /// finalize waits (up to the timeout, for each) for work that peers will never match,
    /// and the process must exit promptly for its launcher to name the failure.
    fn drop(&mut self) {
        if let Some(why) = self.world.poisoned() {
            lock(&self.comm).abort(&why);
            self.channels.abort_inbound(&why);
        }
    }
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of group {:?}, {})",
            self.rank, self.members, self.world.device
        )
    }
}

impl NcclComm {
    /// Whether NCCL (and the CUDA driver it needs) can be loaded here, with its version;
    /// otherwise what is missing. Never panics (cudarc panics on the first call into a
    /// library it cannot load: this checks first).
    pub fn is_available() -> std::result::Result<String, String> {
        // SAFETY: each call only tries to dlopen the library by its usual names and
        // returns whether it succeeded; nothing is called through it here.
        let (driver, nccl) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nccl::sys::is_culib_present(),
            )
        };
        let mut missing = Vec::new();
        if !driver {
            missing.push(
                "the NVIDIA driver library libcuda.so (is an NVIDIA driver installed?)".to_string(),
            );
        }
        if !nccl {
            missing.push(
                "NCCL (libnccl.so: the nvidia-nccl-cu13 wheel ships only libnccl.so.2, so make \
                 a folder with a symlink libnccl.so -> .../nvidia/nccl/lib/libnccl.so.2 and put \
                 it on LD_LIBRARY_PATH)"
                    .to_string(),
            );
        }
        if !missing.is_empty() {
            return Err(format!("not found: {}", missing.join("; ")));
        }
        let v = cudarc::nccl::result::get_nccl_version()
            .map_err(|e| format!("ncclGetVersion failed: {}", raw::nccl_text(e.0, None)))?;
        let (major, minor, patch) = (v / 10000, (v / 100) % 100, v % 100);
        if v < MIN_NCCL {
            return Err(format!(
                "NCCL {major}.{minor}.{patch} is too old (2.18 or newer is needed)"
            ));
        }
        Ok(format!("NCCL {major}.{minor}.{patch}"))
    }

    /// The world's group for world rank `rank` of `size`, on GPU `device` (this
    /// process's, `Device::Cuda(local rank)` as a rule), meeting through `store` (a
    /// connection of its own: the communicator keeps it for the ids of later groups).
    /// Every wait, here and in the collectives, is bounded by `timeout`.
    pub fn world(
        store: StoreClient,
        rank: usize,
        size: usize,
        device: Device,
        timeout: Duration,
    ) -> Result<Self> {
        const OP: &str = "nccl world";
        let invalid = |msg: String| CommError::Invalid {
            op: OP,
            rank,
            size,
            msg,
        };
        Self::is_available().map_err(invalid)?;
        let Device::Cuda(ordinal) = device else {
            return Err(invalid(format!(
                "NCCL moves GPU tensors: {device} is not a GPU"
            )));
        };
        let be: &CudaBackend = braid_kernels::cuda::backend(ordinal)?;
        // Every kernel now, before any NCCL kernel can be spinning: loading a module
        // mid-step may synchronize the context, which can deadlock against NCCL's kernels
        // waiting on a peer (NCCL's guide, "Using multiple NCCL communicators
        // concurrently"; the CLI also asks CUDA for eager loading of each module).
        be.load_all_kernels()?;
        let world = Arc::new(NcclWorld {
            rank,
            size,
            device,
            ordinal,
            ctx: Arc::clone(be.context()),
            stream: Arc::clone(be.stream()),
            timeout,
            store: Mutex::new(store),
            failed: Mutex::new(None),
            generations: Mutex::new(HashMap::new()),
        });
        let members: Vec<usize> = (0..size).collect();
        Self::make(world, members, rank, OP)
    }

    /// Joins (or creates, on member 0) the communicator of `members` (world ranks).
    fn make(
        world: Arc<NcclWorld>,
        members: Vec<usize>,
        me: usize,
        op: &'static str,
    ) -> Result<Self> {
        let generation = {
            let mut g = lock(&world.generations);
            let n = g.entry(members.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let key = plan::group_key(&members, generation);
        let comm = world
            .join(&key, &members, me)
            .map_err(|f| failure(&world, op, &members, f))?;
        Ok(NcclComm {
            channels: p2p::Channels::new(&members),
            world,
            members,
            rank: me,
            comm: Mutex::new(comm),
        })
    }

    fn err(&self, op: &'static str, msg: impl Into<String>) -> CommError {
        CommError::Invalid {
            op,
            rank: self.world.rank,
            size: self.members.len(),
            msg: msg.into(),
        }
    }

    fn fail(&self, op: &'static str, f: Failure) -> CommError {
        failure(&self.world, op, &self.members, f)
    }

    /// An error if this process already failed (every group stops at once).
    fn check_poison(&self, op: &'static str) -> Result<()> {
        match self.world.poisoned() {
            Some(why) => Err(self.fail(op, Failure::Poisoned(why))),
            None => Ok(()),
        }
    }

    /// Runs `issue` (NCCL calls on the communicator and the kernels' stream) inside one
    /// NCCL group, then waits for it to run. Calls of one group are serialized by the
    /// communicator's lock.
    fn run(
        &self,
        op: &'static str,
        issue: impl FnOnce(
            cudarc::nccl::sys::ncclComm_t,
            cudarc::nccl::sys::cudaStream_t,
        ) -> std::result::Result<(), cudarc::nccl::sys::ncclResult_t>,
    ) -> Result<()> {
        use cudarc::nccl::sys;
        self.check_poison(op)?;
        let mut comm = lock(&self.comm);
        let start = Instant::now();
        let issued = (|| {
            comm.bind()?;
            let h = comm.handle()?;
            let stream = self.world.stream.cu_stream() as sys::cudaStream_t;
            // SAFETY: group start/end only mark the calls between them as one launch
            // (thread-local NCCL state); the end is always reached below.
            raw::check(unsafe { sys::ncclGroupStart() }).map_err(|e| {
                Failure::Error(format!("ncclGroupStart: {}", raw::nccl_text(e, Some(h))))
            })?;
            let r = issue(h, stream);
            // SAFETY: see above.
            let end = raw::check(unsafe { sys::ncclGroupEnd() });
            r.and(end)
                .map_err(|e| Failure::Error(raw::nccl_text(e, Some(h))))
        })();
        let done = issued.and_then(|()| {
            let poisoned = || self.world.poisoned();
            let what = format!("{op} on group {:?}", self.members);
            comm.settle(start, &what, &poisoned)?;
            comm.complete(&self.world.stream, start, &what, &poisoned)
        });
        done.map_err(|f| {
            let e = self.fail(op, f);
            if !matches!(e, CommError::Poisoned { .. }) {
                comm.abort(&e.to_string());
                self.world.poison(e.to_string());
            }
            e
        })
    }

    /// `t` on this rank's GPU: itself, or a copy of a CPU tensor (small host values,
    /// such as loss sums, travel this way and go back to the CPU afterwards).
    fn on_gpu(&self, op: &'static str, t: &Tensor) -> Result<Option<Tensor>> {
        match t.device() {
            Device::Cuda(o) if o == self.world.ordinal => Ok(None),
            Device::Cpu => Ok(Some(t.try_clone()?.into_device(self.world.device)?)),
            other => Err(self.err(
                op,
                format!(
                    "a tensor on {other}, but this rank's GPU is {}",
                    self.world.device
                ),
            )),
        }
    }
}

/// A failure as a `CommError` of `op` on this rank and group.
fn failure(world: &NcclWorld, op: &'static str, members: &[usize], f: Failure) -> CommError {
    match f {
        Failure::Error(msg) => CommError::Invalid {
            op,
            rank: world.rank,
            size: members.len(),
            msg: format!("NCCL: {msg}"),
        },
        Failure::Timeout { what, waited } => CommError::Timeout {
            op,
            rank: world.rank,
            group: members.to_vec(),
            waited_s: waited.as_secs_f64(),
            missing: format!(
                "{what} did not complete (a rank stopped, hung or died?); the communicator was aborted"
            ),
        },
        Failure::Aborted { by, why } => CommError::Poisoned {
            op,
            rank: world.rank,
            by,
            why,
        },
        Failure::Poisoned(why) => CommError::Poisoned {
            op,
            rank: world.rank,
            by: world.rank,
            why: format!("an earlier NCCL call of this process failed: {why}"),
        },
    }
}

impl NcclComm {
    /// World size of the process's world (for messages).
    pub fn world_size(&self) -> usize {
        self.world.size
    }
}
