//! Vocab-parallel cross-entropy on CUDA (`kernels/cuda/vocab_loss.cu`): one block per
//! row for the partials, one for the loss and grad.

use cudarc::driver::LaunchConfig;

use super::compile::VOCAB_LOSS;
use super::{CudaBackend, CudaStorage, storage_err, to_u32};
use crate::backend::VocabLossKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// One block per row; 256 threads stride over the row's Vl columns.
fn per_row(t: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (t.max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl VocabLossKernels for CudaBackend {
    fn vocab_loss_partials(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        vocab_start: usize,
        ignore_index: u32,
    ) -> Result<Tensor> {
        const OP: &str = "vocab_loss_partials";
        let [t, vl] = logits.shape().dims_n::<2>(OP, "logits")?;
        let (t32, vl32, start) = (
            to_u32(OP, "T", t)?,
            to_u32(OP, "Vl", vl)?,
            vocab_start as u64,
        );
        let mut out = self.alloc::<f32>(OP, 3 * t, || format!("vocab-loss partials (3, {t})"))?;
        let CudaStorage::U32(tg) = targets.cuda_storage(OP, "targets")? else {
            return Err(storage_err(OP, "targets", targets));
        };
        if t > 0 {
            // braid_vocab_loss_partials_T(float* p, const T* x, const u32* tg, u32 t,
            // u32 vl, u64 start, u32 ignore): block `row` writes p[row], p[t + row],
            // p[2t + row] for every row < t (grid = t blocks).
            match logits.cuda_storage(OP, "logits")? {
                CudaStorage::F32(x) => {
                    let f = self.function(&VOCAB_LOSS, "braid_vocab_loss_partials_f32")?;
                    // SAFETY: signature above; x holds t x vl, tg t, out 3t elements.
                    unsafe {
                        launch!(self, OP, f, per_row(t); &mut out, x, tg, &t32, &vl32, &start, &ignore_index)?
                    }
                }
                CudaStorage::BF16(x) => {
                    let f = self.function(&VOCAB_LOSS, "braid_vocab_loss_partials_bf16")?;
                    // SAFETY: as above.
                    unsafe {
                        launch!(self, OP, f, per_row(t); &mut out, x, tg, &t32, &vl32, &start, &ignore_index)?
                    }
                }
                CudaStorage::U32(_) => return Err(storage_err(OP, "logits", logits)),
            }
        }
        Tensor::from_cuda(CudaStorage::F32(out), [3, t])
    }

    fn vocab_loss_finish(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        gathered: &Tensor,
        vocab_start: usize,
        ignore_index: u32,
        grad_scale: f32,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "vocab_loss_finish";
        let [t, vl] = logits.shape().dims_n::<2>(OP, "logits")?;
        let ranks = to_u32(OP, "R", gathered.dims()[0])?;
        let (t32, vl32, start) = (
            to_u32(OP, "T", t)?,
            to_u32(OP, "Vl", vl)?,
            vocab_start as u64,
        );
        let mut losses = self.alloc::<f32>(OP, t, || format!("losses ({t})"))?;
        let CudaStorage::U32(tg) = targets.cuda_storage(OP, "targets")? else {
            return Err(storage_err(OP, "targets", targets));
        };
        let CudaStorage::F32(g) = gathered.cuda_storage(OP, "gathered")? else {
            return Err(storage_err(OP, "gathered", gathered));
        };
        let what = || format!("dlogits ({t}, {vl})");
        // braid_vocab_loss_finish_T(float* losses, T* d, const T* x, const u32* tg,
        // const float* g, u32 ranks, u32 t, u32 vl, u64 start, u32 ignore, float scale):
        // block `row` writes losses[row] and all vl entries of d's row (grid = t blocks).
        let dlogits = match logits.cuda_storage(OP, "logits")? {
            CudaStorage::F32(x) => {
                let mut d = self.alloc::<f32>(OP, t * vl, what)?;
                if t > 0 {
                    let f = self.function(&VOCAB_LOSS, "braid_vocab_loss_finish_f32")?;
                    // SAFETY: signature above; x and d hold t x vl, tg and losses t, g
                    // ranks x 3 x t elements (validated by ops).
                    unsafe {
                        launch!(self, OP, f, per_row(t); &mut losses, &mut d, x, tg, g, &ranks, &t32, &vl32, &start, &ignore_index, &grad_scale)?
                    }
                }
                CudaStorage::F32(d)
            }
            CudaStorage::BF16(x) => {
                let mut d = self.alloc::<u16>(OP, t * vl, what)?;
                if t > 0 {
                    let f = self.function(&VOCAB_LOSS, "braid_vocab_loss_finish_bf16")?;
                    // SAFETY: as above.
                    unsafe {
                        launch!(self, OP, f, per_row(t); &mut losses, &mut d, x, tg, g, &ranks, &t32, &vl32, &start, &ignore_index, &grad_scale)?
                    }
                }
                CudaStorage::BF16(d)
            }
            CudaStorage::U32(_) => return Err(storage_err(OP, "logits", logits)),
        };
        Ok((
            Tensor::from_cuda(CudaStorage::F32(losses), [t])?,
            Tensor::from_cuda(dlogits, [t, vl])?,
        ))
    }
}
