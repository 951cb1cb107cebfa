//! CUDA allocation, host <-> device copies and f32 <-> bf16 casts (`kernels/cuda/memory.cu`).

use half::bf16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::compile::MEMORY;
use super::{CudaBackend, CudaStorage, backend, grid_for};
use crate::backend::MemoryKernels;
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::Shape;
use crate::tensor::{CpuStorage, Tensor};

impl CudaBackend {
    /// `n` zeroed elements of `dtype` (none: an empty buffer, see `empty`); `what` names
    /// the tensor in an out-of-memory error.
    fn zeroed_storage(
        &self,
        op: &'static str,
        dtype: DType,
        n: usize,
        what: impl FnOnce() -> String,
    ) -> Result<CudaStorage> {
        Ok(match dtype {
            DType::F32 => CudaStorage::F32(self.alloc_zeros(op, n, what)?),
            DType::BF16 => CudaStorage::BF16(self.alloc_zeros(op, n, what)?),
            DType::U32 => CudaStorage::U32(self.alloc_zeros(op, n, what)?),
        })
    }
}

impl MemoryKernels for CudaBackend {
    fn zeros(&self, shape: &Shape, dtype: DType) -> Result<Tensor> {
        const OP: &str = "zeros";
        let n = shape.elem_count();
        let what = || format!("a {dtype} tensor of shape {shape}");
        let storage = self.zeroed_storage(OP, dtype, n, what)?;
        Tensor::from_cuda(storage, shape.clone())
    }

    fn copy_from_host(&self, data: CpuStorage, shape: Shape) -> Result<Tensor> {
        const OP: &str = "copy_from_host";
        let err = |e| self.driver_err(OP, e);
        let storage = match &data {
            // An empty buffer without a zero-byte allocation (see `empty`).
            d if d.is_empty() => self.zeroed_storage(OP, d.dtype(), 0, String::new)?,
            CpuStorage::F32(v) => {
                CudaStorage::F32(self.stream.clone_htod(v.as_slice()).map_err(err)?)
            }
            CpuStorage::BF16(v) => {
                let bits: &[u16] = v.as_slice().reinterpret_cast();
                CudaStorage::BF16(self.stream.clone_htod(bits).map_err(err)?)
            }
            CpuStorage::U32(v) => {
                CudaStorage::U32(self.stream.clone_htod(v.as_slice()).map_err(err)?)
            }
        };
        Tensor::from_cuda(storage, shape)
    }

    fn copy_to_host(&self, t: &Tensor) -> Result<CpuStorage> {
        const OP: &str = "copy_to_host";
        let err = |e| self.driver_err(OP, e);
        // clone_dtoh waits for the stream: the copy sees every kernel issued before it.
        let storage = t.cuda_storage(OP, "t")?;
        if storage.is_empty() {
            return Ok(match storage {
                CudaStorage::F32(_) => CpuStorage::F32(Vec::new()),
                CudaStorage::U32(_) => CpuStorage::U32(Vec::new()),
                CudaStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
            });
        }
        Ok(match storage {
            CudaStorage::F32(s) => CpuStorage::F32(self.stream.clone_dtoh(s).map_err(err)?),
            CudaStorage::U32(s) => CpuStorage::U32(self.stream.clone_dtoh(s).map_err(err)?),
            CudaStorage::BF16(s) => {
                let bits = self.stream.clone_dtoh(s).map_err(err)?;
                CpuStorage::BF16(bits.as_slice().reinterpret_cast::<bf16>().to_vec())
            }
        })
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        const OP: &str = "cast";
        let n = x.elem_count();
        let n64 = n as u64;
        let what = || format!("the {dtype} cast of {x:?}");
        let out = match (x.cuda_storage(OP, "x")?, dtype) {
            (CudaStorage::F32(src), DType::BF16) => {
                // braid_cast_f32_bf16(bf16* out, const float* x, u64 n) writes all n.
                let mut out = self.alloc::<u16>(OP, n, what)?;
                let f = self.function(&MEMORY, "braid_cast_f32_bf16")?;
                // SAFETY: signature above; `out` and `src` hold n elements.
                unsafe { launch!(self, OP, f, grid_for(n); &mut out, src, &n64)? };
                CudaStorage::BF16(out)
            }
            (CudaStorage::BF16(src), DType::F32) => {
                // braid_cast_bf16_f32(float* out, const bf16* x, u64 n) writes all n.
                let mut out = self.alloc::<f32>(OP, n, what)?;
                let f = self.function(&MEMORY, "braid_cast_bf16_f32")?;
                // SAFETY: signature above; `out` and `src` hold n elements.
                unsafe { launch!(self, OP, f, grid_for(n); &mut out, src, &n64)? };
                CudaStorage::F32(out)
            }
            (same, _) => clone_storage(same)?,
        };
        Tensor::from_cuda(out, x.shape().clone())
    }
}

/// A device-to-device copy of a buffer (`Tensor::try_clone`).
pub(crate) fn clone_storage(s: &CudaStorage) -> Result<CudaStorage> {
    let b = backend(s.ordinal())?;
    let op = "try_clone";
    let err = |e| b.driver_err(op, e);
    Ok(match s {
        _ if s.is_empty() => b.zeroed_storage(op, s.dtype(), 0, String::new)?,
        CudaStorage::F32(x) => CudaStorage::F32(b.stream.clone_dtod(x).map_err(err)?),
        CudaStorage::BF16(x) => CudaStorage::BF16(b.stream.clone_dtod(x).map_err(err)?),
        CudaStorage::U32(x) => CudaStorage::U32(b.stream.clone_dtod(x).map_err(err)?),
    })
}

/// Zeroes a buffer in place (a memset on the stream).
pub(crate) fn zero_storage(s: &mut CudaStorage) -> Result<()> {
    let b = backend(s.ordinal())?;
    let op = "zero_";
    let err = |e| b.driver_err(op, e);
    if s.is_empty() {
        return Ok(());
    }
    match s {
        CudaStorage::F32(x) => b.stream.memset_zeros(x).map_err(err),
        CudaStorage::BF16(x) => b.stream.memset_zeros(x).map_err(err),
        CudaStorage::U32(x) => b.stream.memset_zeros(x).map_err(err),
    }
}
