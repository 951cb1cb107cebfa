//! Fused softmax cross-entropy on CUDA (`kernels/cuda/loss.cu`): one block per row of
//! the logits, losses f32, dlogits in the logits' dtype (f32 or bf16).
//!
//! A target >= V that is not the ignore index is the CPU backend's [`Error::Invalid`]
//! naming the first such row: the kernel records it in one verdict word (an integer
//! atomicMin) and the host copies that word back after the launch.

use cudarc::driver::LaunchConfig;

use super::compile::LOSS;
use super::{CudaBackend, CudaStorage, storage_err, to_u32};
use crate::backend::LossKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Threads per row block: `CE_THREADS` in `loss.cu` (its `__launch_bounds__`).
const CE_THREADS: u32 = 512;

impl LossKernels for CudaBackend {
    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: u32,
        grad_scale: f32,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "cross_entropy";
        let [n, v] = logits.shape().dims_n::<2>(OP, "logits")?;
        if targets.elem_count() != n {
            return Err(Error::shape(
                OP,
                format!(
                    "targets {} do not match logits {}",
                    targets.shape(),
                    logits.shape()
                ),
            ));
        }
        let tv = match targets.cuda_storage(OP, "targets")? {
            CudaStorage::U32(t) => t, // (N)
            _ => return Err(storage_err(OP, "targets", targets)),
        };
        let (n32, v32) = (to_u32(OP, "N", n)?, to_u32(OP, "V", v)?);
        if n32 > i32::MAX as u32 {
            return Err(Error::invalid(
                OP,
                format!("N = {n} rows exceed a grid's 2^31 - 1 blocks"),
            ));
        }
        let mut losses = self.alloc::<f32>(OP, n, || format!("the losses of {n} rows"))?; // (N)
        let mut verdict = self.verdicts(OP, 1)?;
        let total = n * v;
        let what = || format!("the logits' grad, like {logits:?}");
        let cfg = LaunchConfig {
            grid_dim: (n32, 1, 1),
            block_dim: (CE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // braid_cross_entropy_T(float* losses, T* dlogits, u64* verdict, const T* logits,
        //                       const u32* targets, u32 v, u32 ignore, float grad_scale):
        // block r reads targets[r], logits row r and writes losses[r] and dlogits row r in
        // full (r < N = grid); the target row t is read only when t < V.
        let dlogits = if n == 0 {
            // A grid of 0 blocks is not a valid launch; there is nothing to compute.
            match logits.cuda_storage(OP, "logits")? {
                CudaStorage::F32(_) => CudaStorage::F32(self.alloc::<f32>(OP, 0, what)?),
                CudaStorage::BF16(_) => CudaStorage::BF16(self.alloc::<u16>(OP, 0, what)?),
                CudaStorage::U32(_) => return Err(storage_err(OP, "logits", logits)),
            }
        } else {
            match logits.cuda_storage(OP, "logits")? {
                CudaStorage::F32(x) => {
                    let mut d = self.alloc::<f32>(OP, total, what)?; // (N, V)
                    let f = self.function(&LOSS, "braid_cross_entropy_f32")?;
                    // SAFETY: signature above; `x`, `d` hold N*V, `losses`, `tv` N, `verdict` 1.
                    unsafe {
                        launch!(self, OP, f, cfg; &mut losses, &mut d, &mut verdict, x, tv, &v32, &ignore_index, &grad_scale)?
                    };
                    CudaStorage::F32(d)
                }
                CudaStorage::BF16(x) => {
                    let mut d = self.alloc::<u16>(OP, total, what)?; // (N, V)
                    let f = self.function(&LOSS, "braid_cross_entropy_bf16")?;
                    // SAFETY: as above.
                    unsafe {
                        launch!(self, OP, f, cfg; &mut losses, &mut d, &mut verdict, x, tv, &v32, &ignore_index, &grad_scale)?
                    };
                    CudaStorage::BF16(d)
                }
                CudaStorage::U32(_) => return Err(storage_err(OP, "logits", logits)),
            }
        };
        if let Some(Some((row, bad))) = self.read_verdicts(OP, &verdict)?.first() {
            return Err(Error::invalid(
                OP,
                format!(
                    "targets[{row}] = {bad} is out of range for a vocabulary of {v} (ignore_index = {ignore_index})"
                ),
            ));
        }
        Ok((
            Tensor::from_cuda(CudaStorage::F32(losses), [n])?,
            Tensor::from_cuda(dlogits, [n, v])?,
        ))
    }
}
