//! Rotary position embedding on CUDA (`kernels/cuda/rope.cu`): rotate-half layout,
//! forward and inverse, x f32 or bf16 with cos/sin tables f32 or bf16 (each pair of
//! dtypes its own kernel, `braid_rope_<x>_<tables>`).

use cudarc::driver::{CudaSlice, DeviceRepr};

use super::compile::ROPE;
use super::{CudaBackend, CudaStorage, grid_for, storage_err};
use crate::backend::RopeKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// The shape of one rope launch: x (T, NH, HS), tables (T, R/2).
struct RopeDims {
    nh: u64,
    hs: u64,
    half: u64,
    sign: f32,
    n: usize,
}

impl CudaBackend {
    /// y = rope(x) with `kernel` = `braid_rope_<X>_<C>` for x's dtype X and the tables' C.
    fn rope_typed<X: DeviceRepr, C>(
        &self,
        kernel: &'static str,
        x: &CudaSlice<X>,
        cos: &CudaSlice<C>,
        sin: &CudaSlice<C>,
        d: &RopeDims,
        what: impl FnOnce() -> String,
    ) -> Result<CudaSlice<X>> {
        const OP: &str = "rope";
        let f = self.function(&ROPE, kernel)?;
        let mut y = self.alloc::<X>(OP, d.n, what)?; // (T, NH, HS)
        let n64 = d.n as u64;
        // braid_rope_X_C(X* y, const X* x, const C* cos, const C* sin, u64 nh, u64 hs,
        //                u64 half, float sign, u64 n): writes y[0..n), reads x[0..n) and
        // the tables at t * half + i with t < T, i < half.
        // SAFETY: signature above; `y` and `x` hold n = T*NH*HS elements and the tables
        // T*(R/2) (ops checked cos/sin are (T, R/2) with the x's T, and 2 * half <= HS,
        // so x[head + ch + half] stays inside the head).
        unsafe {
            launch!(self, OP, f, grid_for(d.n); &mut y, x, cos, sin, &d.nh, &d.hs, &d.half, &d.sign, &n64)?
        };
        Ok(y)
    }
}

impl RopeKernels for CudaBackend {
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
        const OP: &str = "rope";
        let [_, nh, hs] = x.shape().dims_n::<3>(OP, "x")?;
        let [_, half] = cos.shape().dims_n::<2>(OP, "cos")?;
        // The backward rotates by -theta: cos is even, sin odd.
        let sign = if inverse { -1.0f32 } else { 1.0 };
        let d = RopeDims {
            nh: nh as u64,
            hs: hs as u64,
            half: half as u64,
            sign,
            n: x.elem_count(),
        };
        let what = || format!("the rotation of {x:?}");
        use CudaStorage::{BF16, F32};
        let y = match (
            x.cuda_storage(OP, "x")?,
            cos.cuda_storage(OP, "cos")?,
            sin.cuda_storage(OP, "sin")?,
        ) {
            (F32(xv), F32(c), F32(s)) => {
                F32(self.rope_typed("braid_rope_f32_f32", xv, c, s, &d, what)?)
            }
            (F32(xv), BF16(c), BF16(s)) => {
                F32(self.rope_typed("braid_rope_f32_bf16", xv, c, s, &d, what)?)
            }
            (BF16(xv), F32(c), F32(s)) => {
                BF16(self.rope_typed("braid_rope_bf16_f32", xv, c, s, &d, what)?)
            }
            (BF16(xv), BF16(c), BF16(s)) => {
                BF16(self.rope_typed("braid_rope_bf16_bf16", xv, c, s, &d, what)?)
            }
            (F32(_) | BF16(_), _, _) => return Err(storage_err(OP, "cos", cos)),
            _ => return Err(storage_err(OP, "x", x)),
        };
        Tensor::from_cuda(y, x.shape().clone())
    }
}
