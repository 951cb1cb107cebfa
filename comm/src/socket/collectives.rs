//! The collectives of [`SocketComm`]: each built from the per-peer sends and receives of
//! `mod.rs`, reductions summed in member order.

use std::sync::Arc;

use braid_kernels::tensor::CpuStorage;
use braid_kernels::{DType, Device, Shape, Tensor};

use super::SocketComm;
use super::group_key;
use crate::{Comm, CommError, Result};

fn as_f32(op: &'static str, s: &CpuStorage) -> Result<Vec<f32>> {
    match s {
        CpuStorage::F32(v) => Ok(v.clone()),
        CpuStorage::BF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
        CpuStorage::U32(_) => Err(CommError::Invalid {
            op,
            rank: 0,
            size: 0,
            msg: "u32 tensors cannot be summed".into(),
        }),
    }
}

/// Sums in member order: `((0 + x_0) + x_1) + ...`, the order LocalComm uses.
fn sum_in_order(op: &'static str, parts: &[CpuStorage]) -> Result<Vec<f32>> {
    let mut sum: Vec<f32> = Vec::new();
    for p in parts {
        let v = as_f32(op, p)?;
        if sum.is_empty() {
            sum = vec![0.0; v.len()];
        }
        sum.iter_mut().zip(&v).for_each(|(s, x)| *s += x);
    }
    Ok(sum)
}

impl Comm for SocketComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        let all = self.gather_all(OP, t)?;
        let parts: Vec<CpuStorage> = all.into_iter().map(|(_, d)| d).collect();
        let sum = sum_in_order(OP, &parts)?;
        *t = crate::sum_tensor(sum, t.shape().clone(), t.dtype(), t.device())?;
        Ok(())
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let all = self.gather_all(OP, t)?;
        let mut dims = t.dims().to_vec();
        if dims.is_empty() {
            return Err(self.err(OP, "cannot gather a scalar along dim 0"));
        }
        dims[0] *= self.members.len();
        let data = concat(all.into_iter().map(|(_, d)| d).collect())?;
        Ok(Tensor::from_host(data, dims, t.device())?)
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let n = self.members.len();
        let dims = t.dims().to_vec();
        if dims.first().is_none_or(|&d| d % n != 0) {
            return Err(self.err(
                OP,
                format!(
                    "dim 0 of {} does not split into {n} equal slices",
                    t.shape()
                ),
            ));
        }
        // Gather everything, sum in order, keep this rank's slice: the same bits as
        // LocalComm's (which sums whole tensors), at n times the traffic; CI sizes only.
        let all = self.gather_all(OP, t)?;
        let parts: Vec<CpuStorage> = all.into_iter().map(|(_, d)| d).collect();
        let sum = sum_in_order(OP, &parts)?;
        let chunk = sum.len() / n;
        let mine = sum[self.rank * chunk..(self.rank + 1) * chunk].to_vec();
        let mut out = dims;
        out[0] /= n;
        crate::sum_tensor(mine, out, t.dtype(), t.device())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.members.len() {
            return Err(self.err(
                OP,
                format!("root {root} is not in this group of {}", self.members.len()),
            ));
        }
        if self.rank == root {
            let data = t.to_host()?;
            for m in 0..self.members.len() {
                if m != root {
                    self.send_to(OP, m, t.dims(), &data)?;
                }
            }
            return Ok(());
        }
        let f = self.recv_from(OP, root)?;
        if f.dims != t.dims() {
            return Err(self.err(
                OP,
                format!(
                    "root {root} sent shape {:?}, this rank has {}",
                    f.dims,
                    t.shape()
                ),
            ));
        }
        *t = Tensor::from_host(f.data, f.dims, t.device())?;
        Ok(())
    }

    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.send_to("send", dst, t.dims(), &t.to_host()?)
    }

    fn recv(&self, shape: &Shape, src: usize) -> Result<Tensor> {
        const OP: &str = "recv";
        let f = self.recv_from(OP, src)?;
        if f.dims != shape.dims() {
            return Err(self.err(
                OP,
                format!(
                    "rank {src} sent shape {:?} but this rank expects {shape}",
                    f.dims
                ),
            ));
        }
        Ok(Tensor::from_host(f.data, f.dims, Device::Cpu)?)
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
        let device = parts.first().map_or(Device::Cpu, Tensor::device);
        for (m, p) in parts.iter().enumerate() {
            if m != self.rank {
                self.send_to(OP, m, p.dims(), &p.to_host()?)?;
            }
        }
        let mut out = Vec::with_capacity(n);
        let mut own = parts.into_iter().nth(self.rank);
        for m in 0..n {
            if m == self.rank {
                out.push(own.take().ok_or_else(|| self.err(OP, "own part missing"))?);
            } else {
                let f = self.recv_from(OP, m)?;
                out.push(Tensor::from_host(f.data, f.dims, device)?);
            }
        }
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        let token = Tensor::from_vec(Vec::new(), [0], Device::Cpu)?;
        self.gather_all("barrier", &token).map(|_| ())
    }

    /// The same members under another key: its frames queue apart from this group's
    /// (groups are keyed by their member list, so a module group of every rank would
    /// otherwise share the world's queues).
    fn channel(&self, name: &str) -> Result<Arc<dyn Comm>> {
        Ok(Arc::new(SocketComm {
            key: super::channel_key(self.key, name),
            ..self.clone()
        }))
    }

    fn subgroup(&self, members: &[usize]) -> Result<Arc<dyn Comm>> {
        const OP: &str = "subgroup";
        let (world, rank) = crate::subgroup_members(&self.members, members, self.world.rank)
            .map_err(|msg| self.err(OP, msg))?;
        Ok(Arc::new(SocketComm {
            key: group_key(&world),
            world: Arc::clone(&self.world),
            members: world,
            rank,
        }))
    }
}

/// Concatenates host buffers of one dtype.
fn concat(parts: Vec<CpuStorage>) -> Result<CpuStorage> {
    let dtype = parts.first().map_or(DType::F32, CpuStorage::dtype);
    let bad = || CommError::Invalid {
        op: "all_gather",
        rank: 0,
        size: parts.len(),
        msg: "ranks sent different dtypes".into(),
    };
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::F32(v) => Ok(v.clone()),
                    _ => Err(bad()),
                })
                .collect::<Result<Vec<_>>>()?
                .concat(),
        ),
        DType::BF16 => CpuStorage::BF16(
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::BF16(v) => Ok(v.clone()),
                    _ => Err(bad()),
                })
                .collect::<Result<Vec<_>>>()?
                .concat(),
        ),
        DType::U32 => CpuStorage::U32(
            parts
                .iter()
                .map(|p| match p {
                    CpuStorage::U32(v) => Ok(v.clone()),
                    _ => Err(bad()),
                })
                .collect::<Result<Vec<_>>>()?
                .concat(),
        ),
    })
}
