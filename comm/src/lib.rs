//! braid-comm: collectives over a group of ranks, behind the [`Comm`] trait.
//!
//! A `Comm` is one process group: layers receive the group they communicate over as an
//! argument (there is no global group). [`SingleRank`] is the group of one, with which
//! every parallel layer is exactly its plain counterpart; [`local::LocalComm`] runs the
//! ranks of a world as threads (deterministic, with timeouts and poisoning);
//! [`socket::SocketComm`] runs them as CPU processes over TCP; [`nccl::NcclComm`] runs
//! them as processes with one GPU each over NCCL (loaded at run time, with a watchdog
//! that aborts a collective past the timeout; compile-checked, not yet run on a GPU). [`grid::Grid`] lays a module's ranks out as named
//! axes (TP fastest, then CP, DP, PP) with a rank offset. For a world of processes,
//! [`launch::LaunchEnv`] reads which rank this process is from the launcher (torchrun,
//! SLURM, `braid launch`) and [`store`] is the TCP key-value store they meet on.

pub mod grid;
pub mod launch;
pub mod local;
pub mod nccl;
pub mod socket;
pub mod store;
pub mod testing;

use std::fmt;
use std::sync::Arc;

use braid_kernels::{Shape, Tensor};

/// A sum computed in f32 (in rank order) as a tensor of the inputs' `dtype`: bf16 sums
/// are rounded once, after the last addition, so every rank holds the same bits.
pub(crate) fn sum_tensor(
    sum: Vec<f32>,
    shape: impl Into<Shape>,
    dtype: braid_kernels::DType,
    device: braid_kernels::Device,
) -> Result<Tensor> {
    let t = Tensor::from_vec(sum, shape, device)?;
    Ok(braid_kernels::ops::into_dtype(t, dtype)?)
}

/// A subgroup of a group whose rank `i` is world rank `group[i]`: `members` (ranks of
/// the group) as world ranks, and this rank's place among them. The message says which
/// member is wrong; transports wrap it in their own error.
pub(crate) fn subgroup_members(
    group: &[usize],
    members: &[usize],
    world_rank: usize,
) -> std::result::Result<(Vec<usize>, usize), String> {
    let world: Vec<usize> = members
        .iter()
        .map(|&m| {
            group
                .get(m)
                .copied()
                .ok_or_else(|| format!("rank {m} is not in this group"))
        })
        .collect::<std::result::Result<_, _>>()?;
    let me = world
        .iter()
        .position(|&w| w == world_rank)
        .ok_or_else(|| format!("this rank is not a member of {members:?}"))?;
    Ok((world, me))
}

/// A communication error, naming the collective, the rank and the group size.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("{op} on rank {rank} of {size}: {msg}")]
    Invalid {
        op: &'static str,
        rank: usize,
        size: usize,
        msg: String,
    },
    /// A collective that waited longer than the world's timeout.
    #[error(
        "{op} on world rank {rank} (group {}) timed out after {waited_s:.1} s: {missing}",
        rank_list(group)
    )]
    Timeout {
        op: &'static str,
        rank: usize,
        group: Vec<usize>,
        waited_s: f64,
        /// Who never arrived.
        missing: String,
    },
    /// Another rank failed; this one stops instead of waiting for it.
    #[error("{op} on world rank {rank} stopped: {} failed: {why}", rank_name(*by))]
    Poisoned {
        op: &'static str,
        rank: usize,
        by: usize,
        why: String,
    },
    #[error(transparent)]
    Kernel(#[from] braid_kernels::Error),
}

/// `rank N` for messages; `an unknown rank` for the `usize::MAX` an abort whose rank did
/// not parse carries (a stray store client's `!abort`).
pub fn rank_name(rank: usize) -> String {
    if rank == usize::MAX {
        "an unknown rank".into()
    } else {
        format!("rank {rank}")
    }
}

/// Ranks for messages, runs as ranges: `[0, 1, 2, 3, 7]` -> `0-3, 7`; past 16 runs the
/// rest is counted, so a million-rank world's error stays one short line.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, hi)) if hi.checked_add(1) == Some(r) => *hi = r,
            _ => runs.push((r, r)),
        }
    }
    let mut parts: Vec<String> = runs
        .iter()
        .take(16)
        .map(|&(lo, hi)| match hi - lo {
            0 => lo.to_string(),
            _ => format!("{lo}-{hi}"),
        })
        .collect();
    if runs.len() > 16 {
        let rest: usize = runs[16..].iter().map(|&(lo, hi)| hi - lo + 1).sum();
        parts.push(format!("and {rest} more"));
    }
    format!("[{}]", parts.join(", "))
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// The collectives of a process group. Tensors are exchanged whole, in rank order;
/// "along dim 0" means the leading dimension of each rank's tensor.
///
/// Every collective used in a forward pass has an adjoint used in the backward:
/// identity <-> all-reduce, all-gather <-> reduce-scatter, scatter (split) <-> gather.
pub trait Comm: Send + Sync + fmt::Debug {
    /// This rank's index in the group, `0..size`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// `t = sum over ranks of t`, in place.
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()>;
    /// Concatenation along dim 0 of every rank's `t` (all of one shape), in rank order.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    /// The sum over ranks of `t`, of which this rank keeps the `rank`-th of `size`
    /// equal slices along dim 0.
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank's `t` becomes the `root` rank's.
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()>;
    /// Sends `t` to rank `dst`.
    fn send(&self, t: &Tensor, dst: usize) -> Result<()>;
    /// Receives a tensor of `shape` from rank `src`.
    fn recv(&self, shape: &Shape, src: usize) -> Result<Tensor>;
    /// Ragged all-to-all: `parts[r]` goes to rank `r`; returns what each rank sent
    /// here, indexed by source rank.
    fn all_to_all_v(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// The group of `members` (ranks of this group; the new group's rank `i` is
    /// `members[i]`). Called by the members only, each with the same list. Groups
    /// that cannot make subgroups (test stand-ins) keep this default, an error.
    fn subgroup(&self, members: &[usize]) -> Result<Arc<dyn Comm>> {
        Err(CommError::Invalid {
            op: "subgroup",
            rank: self.rank(),
            size: self.size(),
            msg: format!("this group ({self:?}) cannot make the subgroup {members:?}"),
        })
    }

    /// A group of the same members whose messages never meet this group's on the wire
    /// (MPI's `MPI_Comm_dup`), the same on every member for one `name` (every member
    /// calls it, with the same name). The overlapped schedule sends its point-to-point
    /// messages on one, so that none is taken for a collective's of a module group with
    /// the same members. Default: a subgroup of every member, which is a communicator of
    /// its own where the transport makes one per subgroup (NCCL), and where it keeps
    /// point-to-point messages apart from collectives (threads).
    fn channel(&self, name: &str) -> Result<Arc<dyn Comm>> {
        let _ = name;
        let all: Vec<usize> = (0..self.size()).collect();
        self.subgroup(&all)
    }
}

/// The group of one rank: every collective is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl SingleRank {
    fn no_peer(op: &'static str, peer: usize) -> CommError {
        CommError::Invalid {
            op,
            rank: 0,
            size: 1,
            msg: format!("rank {peer} does not exist in a group of one"),
        }
    }
}

impl Comm for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _t: &mut Tensor) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.try_clone()?)
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.try_clone()?)
    }
    fn broadcast(&self, _t: &mut Tensor, root: usize) -> Result<()> {
        if root != 0 {
            return Err(Self::no_peer("broadcast", root));
        }
        Ok(())
    }
    fn send(&self, _t: &Tensor, dst: usize) -> Result<()> {
        Err(Self::no_peer("send", dst))
    }
    fn recv(&self, _shape: &Shape, src: usize) -> Result<Tensor> {
        Err(Self::no_peer("recv", src))
    }
    fn all_to_all_v(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if parts.len() != 1 {
            return Err(CommError::Invalid {
                op: "all_to_all_v",
                rank: 0,
                size: 1,
                msg: format!("expected 1 part (one per rank), got {}", parts.len()),
            });
        }
        Ok(parts)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn subgroup(&self, members: &[usize]) -> Result<Arc<dyn Comm>> {
        if members != [0] {
            return Err(CommError::Invalid {
                op: "subgroup",
                rank: 0,
                size: 1,
                msg: format!("a group of one has no subgroup {members:?}"),
            });
        }
        Ok(Arc::new(SingleRank))
    }
}

#[cfg(test)]
mod tests {
    use super::rank_list;

    #[test]
    fn rank_lists_are_short_whatever_the_world() {
        assert_eq!(rank_list(&[]), "[]");
        assert_eq!(rank_list(&[4]), "[4]");
        assert_eq!(rank_list(&[0, 1, 2, 3, 7, 9, 10]), "[0-3, 7, 9-10]");
        assert_eq!(rank_list(&(1..1_000_000).collect::<Vec<_>>()), "[1-999999]");
        let evens: Vec<usize> = (0..100).map(|r| 2 * r).collect();
        let s = rank_list(&evens);
        assert!(s.ends_with("30, and 84 more]"), "{s}");
    }
}
