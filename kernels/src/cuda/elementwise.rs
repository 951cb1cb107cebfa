//! Elementwise arithmetic and the deterministic sum of squares on CUDA
//! (`kernels/cuda/elementwise.cu`). `add_assign` also takes a bf16 `x` into an f32
//! `acc` (mixed precision's grad accumulation).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::compile::ELEMENTWISE;
use super::{CudaBackend, CudaStorage, grid_for, storage_err};
use crate::backend::ElementwiseKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// Blocks of the first stage of a sum of squares. Fixed, so that the partition of the
/// elements into partial sums — and so the result's bits — never depend on the GPU.
const SUM_BLOCKS: u32 = 512;

impl ElementwiseKernels for CudaBackend {
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "add";
        let n = a.elem_count();
        let what = || format!("the sum of {a:?} and {b:?}");
        let out = match (a.cuda_storage(OP, "a")?, b.cuda_storage(OP, "b")?) {
            (CudaStorage::F32(x), CudaStorage::F32(y)) => {
                let mut out = self.alloc::<f32>(OP, n, what)?;
                self.binary("braid_add_f32", &mut out, x, y, n)?;
                CudaStorage::F32(out)
            }
            (CudaStorage::BF16(x), CudaStorage::BF16(y)) => {
                let mut out = self.alloc::<u16>(OP, n, what)?;
                self.binary("braid_add_bf16", &mut out, x, y, n)?;
                CudaStorage::BF16(out)
            }
            _ => return Err(storage_err(OP, "a", a)),
        };
        Tensor::from_cuda(out, a.shape().clone())
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        const OP: &str = "add_assign";
        let n = x.elem_count();
        if acc.elem_count() != n {
            return Err(crate::Error::shape(
                OP,
                format!("`acc` {acc:?} and `x` {x:?} differ in element count"),
            ));
        }
        let acc_dbg = format!("{acc:?}");
        let n64 = n as u64;
        let cfg = grid_for(n);
        // braid_add_assign_<A>_<X>(A* acc, const X* x, u64 n); equal dtypes are named by
        // one suffix (braid_add_assign_f32). f32 += bf16 is mixed precision's grad
        // accumulation; bf16 += f32 would round an f32 value into a bf16 accumulator and
        // is refused.
        match (acc.cuda_storage_mut(OP, "acc")?, x.cuda_storage(OP, "x")?) {
            (CudaStorage::F32(a), CudaStorage::F32(b)) => {
                let f = self.function(&ELEMENTWISE, "braid_add_assign_f32")?;
                // SAFETY: signature above; both hold n elements (checked above).
                unsafe { launch!(self, OP, f, cfg; a, b, &n64) }
            }
            (CudaStorage::BF16(a), CudaStorage::BF16(b)) => {
                let f = self.function(&ELEMENTWISE, "braid_add_assign_bf16")?;
                // SAFETY: as above.
                unsafe { launch!(self, OP, f, cfg; a, b, &n64) }
            }
            (CudaStorage::F32(a), CudaStorage::BF16(b)) => {
                let f = self.function(&ELEMENTWISE, "braid_add_assign_f32_bf16")?;
                // SAFETY: as above (acc f32, x bf16 bits).
                unsafe { launch!(self, OP, f, cfg; a, b, &n64) }
            }
            _ => Err(crate::Error::invalid(
                OP,
                format!(
                    "`acc` {acc_dbg} += `x` {x:?}: takes equal float dtypes or an f32 `acc` with a bf16 `x`"
                ),
            )),
        }
    }

    fn scale_assign(&self, x: &mut Tensor, s: f32) -> Result<()> {
        const OP: &str = "scale_assign";
        let n = x.elem_count();
        let dbg = format!("{x:?}");
        let n64 = n as u64;
        match x.cuda_storage_mut(OP, "x")? {
            // braid_scale_assign_T(T* x, float s, u64 n)
            CudaStorage::F32(v) => {
                let f = self.function(&ELEMENTWISE, "braid_scale_assign_f32")?;
                // SAFETY: signature above; `v` holds n elements.
                unsafe { launch!(self, OP, f, grid_for(n); v, &s, &n64) }
            }
            CudaStorage::BF16(v) => {
                let f = self.function(&ELEMENTWISE, "braid_scale_assign_bf16")?;
                // SAFETY: as above.
                unsafe { launch!(self, OP, f, grid_for(n); v, &s, &n64) }
            }
            CudaStorage::U32(_) => Err(crate::Error::invalid(
                OP,
                format!("`x` {dbg} is not a float tensor"),
            )),
        }
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        self.sum_squares_all(&[x])
    }

    fn sum_squares_all(&self, xs: &[&Tensor]) -> Result<f64> {
        const OP: &str = "sum_squares_all";
        let mut out = self.alloc_zeros::<f64>(OP, 1, || "the global sum of squares".into())?;
        for (i, x) in xs.iter().enumerate() {
            self.sum_squares_into(x, &mut out, 0, i > 0)?;
        }
        let host = self
            .stream
            .clone_dtoh(&out)
            .map_err(|e| self.driver_err(OP, e))?;
        Ok(host.first().copied().unwrap_or(0.0))
    }
}

impl CudaBackend {
    /// `out = a + b` (same dtype `T`): `braid_add_T(T* out, const T* a, const T* b, u64 n)`.
    fn binary<T>(
        &self,
        kernel: &'static str,
        out: &mut CudaSlice<T>,
        a: &CudaSlice<T>,
        b: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        let f = self.function(&ELEMENTWISE, kernel)?;
        let n64 = n as u64;
        // SAFETY: signature above; all three buffers hold n elements.
        unsafe { launch!(self, "add", f, grid_for(n); out, a, b, &n64) }
    }

    /// `out[slot] (+)= sum(x^2)` on the device, in f64, with a fixed reduction order: the
    /// global grad norm is one buffer filled by one launch pair per tensor and copied to
    /// the host once.
    pub(crate) fn sum_squares_into(
        &self,
        x: &Tensor,
        out: &mut CudaSlice<f64>,
        slot: u32,
        accumulate: bool,
    ) -> Result<()> {
        const OP: &str = "sum_squares";
        let n = x.elem_count();
        let mut partial = self.alloc::<f64>(OP, SUM_BLOCKS as usize, || "partial sums".into())?;
        let n64 = n as u64;
        let cfg = LaunchConfig {
            grid_dim: (SUM_BLOCKS, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // braid_sum_squares_partial_T(double* partial, const T* x, u64 n): writes
        // partial[0 .. SUM_BLOCKS] (every block writes its slot, even with no elements).
        match x.cuda_storage(OP, "x")? {
            CudaStorage::F32(v) => {
                let f = self.function(&ELEMENTWISE, "braid_sum_squares_partial_f32")?;
                // SAFETY: signature above; `partial` holds SUM_BLOCKS, `v` n elements.
                unsafe { launch!(self, OP, f, cfg; &mut partial, v, &n64)? }
            }
            CudaStorage::BF16(v) => {
                let f = self.function(&ELEMENTWISE, "braid_sum_squares_partial_bf16")?;
                // SAFETY: as above.
                unsafe { launch!(self, OP, f, cfg; &mut partial, v, &n64)? }
            }
            CudaStorage::U32(_) => return Err(storage_err(OP, "x", x)),
        }
        // braid_sum_partials_f64(double* out, const double* partial, u32 count, u32 slot, int accumulate)
        let f = self.function(&ELEMENTWISE, "braid_sum_partials_f64")?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let acc = i32::from(accumulate);
        // SAFETY: signature above; `out` holds at least slot + 1 elements (caller).
        unsafe { launch!(self, OP, f, cfg; out, &partial, &SUM_BLOCKS, &slot, &acc) }
    }
}
