//! The collectives of [`LocalComm`]: each rank posts its host copy, reads everyone's,
//! and computes its result from them in rank order.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use braid_kernels::tensor::CpuStorage;
use braid_kernels::{Device, Shape, Tensor};

use super::{LocalComm, Payload};
use crate::{Comm, Result};

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.state.members.len()
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        self.expect_float(OP, t)?;
        let posts = self.exchange(OP, vec![Payload::of(t)?])?;
        let sum = self.sum(OP, &posts, t.shape())?;
        *t = crate::sum_tensor(sum, t.shape().clone(), t.dtype(), t.device())?;
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
        self.expect_float(OP, t)?;
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
        crate::sum_tensor(mine, dims, t.dtype(), t.device())
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
