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

mod collectives;
mod run;
pub use run::{WorldFailure, panic_message, run_local};

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

    /// The element-wise sum of every rank's payload (bf16 widened), in f32, in rank order.
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
                CpuStorage::BF16(v) => sum.iter_mut().zip(v).for_each(|(s, x)| *s += x.to_f32()),
                other => {
                    return Err(self.err(
                        op,
                        format!("sums need float tensors, got {}", other.dtype()),
                    ));
                }
            }
        }
        Ok(sum)
    }

    fn expect_float(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.dtype() == DType::U32 {
            return Err(self.err(op, format!("sums need float tensors, got {}", t.dtype())));
        }
        Ok(())
    }
}
