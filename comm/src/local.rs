//! `LocalComm`: the ranks of a world as threads of one process, exchanging host copies
//! through shared memory. The development and test backend of every parallel layout.
//!
//! - **Deterministic.** Reductions sum the ranks' contributions in rank order on every
//!   rank, so results never depend on which thread arrived first, and every rank of a
//!   group holds bitwise the same sum (replicas stay in sync).
//! - **Nothing hangs.** Every wait has a deadline ([`LocalWorld::new`]'s timeout): a
//!   collective that waits too long fails with an error naming the ranks that never
//!   arrived. A rank that errors or panics (see [`run_local`]) *poisons* the world: every
//!   rank blocked in, or later entering, a collective returns [`CommError::Poisoned`]
//!   naming the failed rank, within one polling tick (50 ms).
//! - **Desync is caught.** Ranks of a group that call different collectives at the same
//!   point (a bug in a schedule) get an error naming both calls.
//!
//! Groups: [`LocalComm::world`] is the whole world; [`Comm::subgroup`] makes a group of
//! some of its ranks. Groups with the same members (in the same order) share one state:
//! their members call them in one program order, like one NCCL communicator.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use braid_kernels::tensor::CpuStorage;
use braid_kernels::{DType, Device, Shape, Tensor};

use crate::{Comm, CommError, Result};

/// How often a waiting rank looks at the world's poison flag.
const POLL: Duration = Duration::from_millis(50);

/// The shared state of a world of threads.
pub struct LocalWorld {
    size: usize,
    timeout: Duration,
    poisoned: AtomicBool,
    /// The first failure: (world rank, what happened).
    cause: Mutex<Option<(usize, String)>>,
    /// Group states by member list (world ranks, group order).
    groups: Mutex<HashMap<Vec<usize>, Arc<GroupState>>>,
}

impl fmt::Debug for LocalWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalWorld")
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .field("poisoned", &self.poisoned.load(Ordering::SeqCst))
            .finish()
    }
}

impl LocalWorld {
    /// A world of `size` ranks whose collectives wait at most `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Arc<LocalWorld> {
        Arc::new(LocalWorld {
            size,
            timeout,
            poisoned: AtomicBool::new(false),
            cause: Mutex::new(None),
            groups: Mutex::new(HashMap::new()),
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Marks the world failed because of `rank`; only the first cause is kept. Every
    /// rank waiting in a collective wakes up with [`CommError::Poisoned`].
    pub fn poison(&self, rank: usize, why: impl Into<String>) {
        if let Ok(mut c) = self.cause.lock()
            && c.is_none()
        {
            *c = Some((rank, why.into()));
        }
        self.poisoned.store(true, Ordering::SeqCst);
        // Wake every waiter now rather than at its next poll.
        if let Ok(groups) = self.groups.lock() {
            for g in groups.values() {
                g.round_cv.notify_all();
                g.mail_cv.notify_all();
            }
        }
    }

    /// The first failure, if the world is poisoned: (world rank, what happened).
    pub fn failure(&self) -> Option<(usize, String)> {
        if !self.poisoned.load(Ordering::SeqCst) {
            return None;
        }
        self.cause.lock().ok().and_then(|c| c.clone())
    }

    fn group_state(&self, members: &[usize]) -> Result<Arc<GroupState>> {
        let mut groups = self.groups.lock().map_err(|_| CommError::Invalid {
            op: "subgroup",
            rank: 0,
            size: self.size,
            msg: "the group registry lock was poisoned by a panic".into(),
        })?;
        Ok(Arc::clone(groups.entry(members.to_vec()).or_insert_with(
            || Arc::new(GroupState::new(members.to_vec())),
        )))
    }
}

/// One tensor in flight: its host copy and shape.
#[derive(Clone, Debug)]
struct Payload {
    data: CpuStorage,
    shape: Shape,
}

impl Payload {
    fn of(t: &Tensor) -> Result<Payload> {
        Ok(Payload {
            data: t.to_host()?,
            shape: t.shape().clone(),
        })
    }

    fn empty() -> Payload {
        Payload {
            data: CpuStorage::F32(Vec::new()),
            shape: Shape::new([0]),
        }
    }

    fn to_tensor(&self, device: Device) -> Result<Tensor> {
        Ok(Tensor::from_host(
            self.data.clone(),
            self.shape.clone(),
            device,
        )?)
    }
}

/// What one rank brought to a collective.
#[derive(Debug)]
struct Post {
    op: &'static str,
    /// One payload (all-reduce, gather, broadcast), one per rank (all-to-all) or none.
    parts: Vec<Payload>,
}

/// One collective in progress: every member posts, then every member reads.
#[derive(Debug)]
struct Round {
    /// Counts completed rounds; a waiter knows its round by it.
    generation: u64,
    slots: Vec<Option<Arc<Post>>>,
    posted: usize,
    read: usize,
}

#[derive(Debug)]
struct GroupState {
    /// World ranks, in group order.
    members: Vec<usize>,
    round: Mutex<Round>,
    round_cv: Condvar,
    /// Point-to-point messages by (source, destination) group rank, in send order.
    mail: Mutex<HashMap<(usize, usize), VecDeque<Payload>>>,
    mail_cv: Condvar,
}

impl GroupState {
    fn new(members: Vec<usize>) -> GroupState {
        let n = members.len();
        GroupState {
            members,
            round: Mutex::new(Round {
                generation: 0,
                slots: vec![None; n],
                posted: 0,
                read: 0,
            }),
            round_cv: Condvar::new(),
            mail: Mutex::new(HashMap::new()),
            mail_cv: Condvar::new(),
        }
    }
}

/// One rank's handle on one group of a [`LocalWorld`].
#[derive(Clone)]
pub struct LocalComm {
    world: Arc<LocalWorld>,
    state: Arc<GroupState>,
    /// This rank's index in the group.
    rank: usize,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LocalComm(rank {} of group {:?})",
            self.rank, self.state.members
        )
    }
}

impl LocalComm {
    /// Rank `rank`'s handle on the whole world.
    pub fn world(world: &Arc<LocalWorld>, rank: usize) -> Result<LocalComm> {
        let members: Vec<usize> = (0..world.size).collect();
        if rank >= world.size {
            return Err(CommError::Invalid {
                op: "LocalComm::world",
                rank,
                size: world.size,
                msg: format!("rank {rank} is outside a world of {}", world.size),
            });
        }
        Ok(LocalComm {
            state: world.group_state(&members)?,
            world: Arc::clone(world),
            rank,
        })
    }

    /// This rank in the world (not in this group).
    pub fn world_rank(&self) -> usize {
        self.state.members[self.rank]
    }

    /// The group's members as world ranks, in group order.
    pub fn members(&self) -> &[usize] {
        &self.state.members
    }

    pub fn local_world(&self) -> &Arc<LocalWorld> {
        &self.world
    }

    fn err(&self, op: &'static str, msg: impl Into<String>) -> CommError {
        CommError::Invalid {
            op,
            rank: self.rank,
            size: self.size(),
            msg: format!("group {:?}: {}", self.state.members, msg.into()),
        }
    }

    fn poisoned_err(&self, op: &'static str) -> CommError {
        let (by, why) = self
            .world
            .failure()
            .unwrap_or((usize::MAX, "unknown".into()));
        CommError::Poisoned {
            op,
            rank: self.world_rank(),
            by,
            why,
        }
    }

    fn lock<'a, T>(&self, op: &'static str, m: &'a Mutex<T>) -> Result<MutexGuard<'a, T>> {
        m.lock()
            .map_err(|_| self.err(op, "a rank panicked while holding the group's lock"))
    }

    /// Waits on `cv` while `waiting(&guard)` holds, polling the poison flag, until the
    /// world's deadline; `on_timeout` says who is missing.
    fn wait<'a, T>(
        &self,
        op: &'static str,
        cv: &Condvar,
        mut guard: MutexGuard<'a, T>,
        mut waiting: impl FnMut(&T) -> bool,
        on_timeout: impl Fn(&T) -> String,
    ) -> Result<MutexGuard<'a, T>> {
        let start = Instant::now();
        while waiting(&guard) {
            if self.world.poisoned.load(Ordering::SeqCst) {
                return Err(self.poisoned_err(op));
            }
            let waited = start.elapsed();
            if waited >= self.world.timeout {
                let missing = on_timeout(&guard);
                drop(guard);
                let e = CommError::Timeout {
                    op,
                    rank: self.world_rank(),
                    group: self.state.members.clone(),
                    waited_s: waited.as_secs_f64(),
                    missing,
                };
                self.world.poison(self.world_rank(), e.to_string());
                return Err(e);
            }
            let tick = POLL.min(self.world.timeout - waited);
            guard = cv
                .wait_timeout(guard, tick)
                .map_err(|_| self.err(op, "a rank panicked while holding the group's lock"))?
                .0;
        }
        Ok(guard)
    }

    /// Posts this rank's contribution and returns every rank's, in group rank order.
    fn exchange(&self, op: &'static str, parts: Vec<Payload>) -> Result<Vec<Arc<Post>>> {
        let n = self.size();
        let st = &self.state;
        let members = &st.members;
        let absent = |r: &Round| {
            let missing: Vec<usize> = (0..n)
                .filter(|&i| r.slots[i].is_none())
                .map(|i| members[i])
                .collect();
            format!("world ranks {missing:?} never arrived")
        };
        let round = self.lock(op, &st.round)?;
        // A previous round may still be being read: wait for it to drain.
        let mut round = self.wait(
            op,
            &st.round_cv,
            round,
            |r| r.posted == n,
            |_| "the previous collective was never finished by every rank".into(),
        )?;
        let generation = round.generation;
        round.slots[self.rank] = Some(Arc::new(Post { op, parts }));
        round.posted += 1;
        if round.posted == n {
            st.round_cv.notify_all();
        }
        let mut round = self.wait(
            op,
            &st.round_cv,
            round,
            |r| r.generation == generation && r.posted < n,
            absent,
        )?;
        let posts: Vec<Arc<Post>> = round.slots.iter().flatten().cloned().collect();
        round.read += 1;
        if round.read == n {
            round.slots.iter_mut().for_each(|s| *s = None);
            round.posted = 0;
            round.read = 0;
            round.generation += 1;
            st.round_cv.notify_all();
        }
        drop(round);
        if posts.len() != n {
            return Err(self.err(op, "a rank's contribution vanished"));
        }
        if let Some((r, p)) = posts.iter().enumerate().find(|(_, p)| p.op != op) {
            return Err(self.err(
                op,
                format!(
                    "ranks out of step: this rank called {op} while world rank {} called {}",
                    members[r], p.op
                ),
            ));
        }
        Ok(posts)
    }

    /// The element-wise sum of every rank's f32 payload, in rank order.
    fn sum(&self, op: &'static str, posts: &[Arc<Post>], shape: &Shape) -> Result<Vec<f32>> {
        let mut sum = vec![0f32; shape.elem_count()];
        for (r, p) in posts.iter().enumerate() {
            let part = p
                .parts
                .first()
                .ok_or_else(|| self.err(op, "empty contribution"))?;
            if &part.shape != shape {
                return Err(self.err(
                    op,
                    format!(
                        "world rank {} has shape {} but this rank has {shape}",
                        self.state.members[r], part.shape
                    ),
                ));
            }
            match &part.data {
                CpuStorage::F32(v) => sum.iter_mut().zip(v).for_each(|(s, x)| *s += x),
                other => {
                    return Err(
                        self.err(op, format!("sums need f32 tensors, got {}", other.dtype()))
                    );
                }
            }
        }
        Ok(sum)
    }

    fn expect_f32(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.dtype() != DType::F32 {
            return Err(self.err(op, format!("sums need f32 tensors, got {}", t.dtype())));
        }
        Ok(())
    }
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.state.members.len()
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        self.expect_f32(OP, t)?;
        let posts = self.exchange(OP, vec![Payload::of(t)?])?;
        let sum = self.sum(OP, &posts, t.shape())?;
        *t = Tensor::from_vec(sum, t.shape().clone(), t.device())?;
        Ok(())
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= self.size(),
            None => return Err(self.err(OP, "cannot gather scalars along dim 0")),
        }
        let posts = self.exchange(OP, vec![Payload::of(t)?])?;
        let mut parts = Vec::with_capacity(posts.len());
        for (r, p) in posts.iter().enumerate() {
            let part = p
                .parts
                .first()
                .ok_or_else(|| self.err(OP, "empty contribution"))?;
            if part.shape != *t.shape() || part.data.dtype() != t.dtype() {
                return Err(self.err(
                    OP,
                    format!(
                        "world rank {} has {} {} but this rank has {} {}",
                        self.state.members[r],
                        part.data.dtype(),
                        part.shape,
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            parts.push(&part.data);
        }
        let data =
            concat_storage(&parts).ok_or_else(|| self.err(OP, "ranks sent different dtypes"))?;
        Ok(Tensor::from_host(data, dims, t.device())?)
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        self.expect_f32(OP, t)?;
        let n = self.size();
        let d0 = *t
            .dims()
            .first()
            .ok_or_else(|| self.err(OP, "cannot scatter scalars along dim 0"))?;
        if d0 % n != 0 {
            return Err(self.err(
                OP,
                format!(
                    "dim 0 of {} is not a multiple of the group size {n}",
                    t.shape()
                ),
            ));
        }
        let posts = self.exchange(OP, vec![Payload::of(t)?])?;
        let sum = self.sum(OP, &posts, t.shape())?;
        let chunk = t.elem_count() / n;
        let mine = sum[self.rank * chunk..(self.rank + 1) * chunk].to_vec();
        let mut dims = t.dims().to_vec();
        dims[0] = d0 / n;
        Ok(Tensor::from_vec(mine, dims, t.device())?)
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.size() {
            return Err(self.err(OP, format!("root {root} is not in the group")));
        }
        let mine = if self.rank == root {
            vec![Payload::of(t)?]
        } else {
            Vec::new()
        };
        let posts = self.exchange(OP, mine)?;
        let from = posts[root]
            .parts
            .first()
            .ok_or_else(|| self.err(OP, "the root sent nothing"))?;
        if from.shape != *t.shape() || from.data.dtype() != t.dtype() {
            return Err(self.err(
                OP,
                format!(
                    "root (world rank {}) sent {} {} but this rank expects {} {}",
                    self.state.members[root],
                    from.data.dtype(),
                    from.shape,
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        if self.rank != root {
            *t = from.to_tensor(t.device())?;
        }
        Ok(())
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        const OP: &str = "send";
        if dst >= self.size() || dst == self.rank {
            return Err(self.err(OP, format!("cannot send to rank {dst}")));
        }
        if self.world.poisoned.load(Ordering::SeqCst) {
            return Err(self.poisoned_err(OP));
        }
        let p = Payload::of(t)?;
        self.lock(OP, &self.state.mail)?
            .entry((self.rank, dst))
            .or_default()
            .push_back(p);
        self.state.mail_cv.notify_all();
        Ok(())
    }

    fn recv(&self, shape: &Shape, src: usize) -> Result<Tensor> {
        const OP: &str = "recv";
        if src >= self.size() || src == self.rank {
            return Err(self.err(OP, format!("cannot receive from rank {src}")));
        }
        let key = (src, self.rank);
        let from = self.state.members[src];
        let mail = self.lock(OP, &self.state.mail)?;
        let mut mail = self.wait(
            OP,
            &self.state.mail_cv,
            mail,
            |m| m.get(&key).is_none_or(|q| q.is_empty()),
            |_| format!("world rank {from} never sent"),
        )?;
        let p = mail
            .get_mut(&key)
            .and_then(|q| q.pop_front())
            .ok_or_else(|| self.err(OP, "message vanished"))?;
        drop(mail);
        if &p.shape != shape {
            return Err(self.err(
                OP,
                format!(
                    "world rank {from} sent shape {} but this rank expects {shape}",
                    p.shape
                ),
            ));
        }
        p.to_tensor(Device::Cpu)
    }

    fn all_to_all_v(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all_v";
        let n = self.size();
        if parts.len() != n {
            return Err(self.err(
                OP,
                format!("expected {n} parts (one per rank), got {}", parts.len()),
            ));
        }
        let device = parts.first().map(|t| t.device()).unwrap_or(Device::Cpu);
        let payloads = parts.iter().map(Payload::of).collect::<Result<Vec<_>>>()?;
        let posts = self.exchange(OP, payloads)?;
        posts
            .iter()
            .map(|p| {
                p.parts
                    .get(self.rank)
                    .unwrap_or(&Payload::empty())
                    .to_tensor(device)
            })
            .collect()
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Vec::new()).map(|_| ())
    }

    fn subgroup(&self, members: &[usize]) -> Result<Arc<dyn Comm>> {
        const OP: &str = "subgroup";
        let n = self.size();
        if let Some(&bad) = members.iter().find(|&&m| m >= n) {
            return Err(self.err(OP, format!("rank {bad} is not in the group")));
        }
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(self.err(OP, format!("members {members:?} repeat a rank")));
        }
        let rank = members
            .iter()
            .position(|&m| m == self.rank)
            .ok_or_else(|| {
                self.err(
                    OP,
                    format!(
                        "rank {} asked for a group {members:?} it is not in",
                        self.rank
                    ),
                )
            })?;
        let world_members: Vec<usize> = members.iter().map(|&m| self.state.members[m]).collect();
        Ok(Arc::new(LocalComm {
            state: self.world.group_state(&world_members)?,
            world: Arc::clone(&self.world),
            rank,
        }))
    }
}

/// Concatenation of host buffers of one dtype; `None` if they differ.
fn concat_storage(parts: &[&CpuStorage]) -> Option<CpuStorage> {
    match parts.first()? {
        CpuStorage::F32(_) => Some(CpuStorage::F32(
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::F32(v) => Some(v.as_slice()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?
                .concat(),
        )),
        CpuStorage::BF16(_) => Some(CpuStorage::BF16(
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::BF16(v) => Some(v.as_slice()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?
                .concat(),
        )),
        CpuStorage::U32(_) => Some(CpuStorage::U32(
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::U32(v) => Some(v.as_slice()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?
                .concat(),
        )),
    }
}

/// A failed world: the rank that failed first and why, plus every rank's own error.
#[derive(Debug)]
pub struct WorldFailure {
    /// The world rank whose error or panic poisoned the world.
    pub rank: usize,
    pub message: String,
    /// Every rank that did not succeed, with its own message (the others mostly say
    /// they were poisoned by `rank`).
    pub ranks: Vec<(usize, String)>,
}

impl fmt::Display for WorldFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} failed: {}", self.rank, self.message)
    }
}

impl std::error::Error for WorldFailure {}

/// Runs `f` on each of `size` ranks, each on its own thread (named `rank-N`) with its
/// world [`LocalComm`], and returns their results in rank order. The first rank to
/// return `Err` or panic poisons the world (so the others stop instead of waiting for
/// it), and the whole call returns a [`WorldFailure`] naming it.
pub fn run_local<T: Send, E: fmt::Display>(
    size: usize,
    timeout: Duration,
    f: impl Fn(LocalComm) -> std::result::Result<T, E> + Sync,
) -> std::result::Result<Vec<T>, WorldFailure> {
    let world = LocalWorld::new(size, timeout);
    let results: Vec<std::result::Result<T, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let world = Arc::clone(&world);
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .stack_size(16 << 20)
                    .spawn_scoped(s, move || {
                        let outcome =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                match LocalComm::world(&world, rank) {
                                    Ok(comm) => f(comm).map_err(|e| e.to_string()),
                                    Err(e) => Err(e.to_string()),
                                }
                            }));
                        let outcome = outcome.unwrap_or_else(|p| Err(panic_message(p.as_ref())));
                        if let Err(why) = &outcome {
                            world.poison(rank, why.clone());
                        }
                        outcome
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|p| Err(panic_message(p.as_ref()))),
                Err(e) => {
                    let why = format!("could not start thread: {e}");
                    world.poison(rank, why.clone());
                    Err(why)
                }
            })
            .collect()
    });
    let ranks: Vec<(usize, String)> = results
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.as_ref().err().map(|e| (r, e.clone())))
        .collect();
    if let Some((rank, message)) = world.failure() {
        return Err(WorldFailure {
            rank,
            message,
            ranks,
        });
    }
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.map_err(|message| WorldFailure {
                rank,
                message,
                ranks: ranks.clone(),
            })
        })
        .collect()
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let text = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic payload)".into());
    format!("panicked: {text}")
}
