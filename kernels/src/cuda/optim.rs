//! AdamW on CUDA (`kernels/cuda/optim.cu`): one grid-stride elementwise kernel, the
//! per-step scalars computed on the host exactly as the CPU backend does. Under mixed
//! precision a second kernel of the same update also writes the bf16 compute copy.

use super::compile::OPTIM;
use super::storage::{slice, slice_mut};
use super::{CudaBackend, grid_for};
use crate::backend::OptimKernels;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::optim::AdamWSpec;
use crate::tensor::Tensor;

impl OptimKernels for CudaBackend {
    fn adamw_step(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        compute: Option<&mut Tensor>,
        spec: &AdamWSpec,
    ) -> Result<()> {
        const OP: &str = "adamw_step";
        let n = param.elem_count();
        if grad.elem_count() != n || m.elem_count() != n || v.elem_count() != n {
            return Err(Error::shape(
                OP,
                format!(
                    "param, grad, m, v hold {}, {}, {}, {} elements",
                    n,
                    grad.elem_count(),
                    m.elem_count(),
                    v.elem_count()
                ),
            ));
        }
        // The compute copy is checked before anything is written, so a bad one leaves
        // param, m and v untouched.
        if let Some(c) = compute.as_deref() {
            if c.dtype() != DType::BF16 {
                return Err(Error::DType {
                    op: OP,
                    arg: "compute",
                    got: c.dtype(),
                    expected: DType::BF16,
                });
            }
            if c.elem_count() != n {
                return Err(Error::shape(
                    OP,
                    format!(
                        "param holds {n} elements, its compute copy {}",
                        c.elem_count()
                    ),
                ));
            }
        }
        if n == 0 {
            return Ok(());
        }
        let s = spec.scalars();
        let (b2, eps, n64) = (spec.beta2, spec.eps, n as u64);
        let gs = slice::<f32>(OP, "grad", grad)?; // (N)
        let ps = slice_mut::<f32>(OP, "param", param)?; // (N)
        let ms = slice_mut::<f32>(OP, "m", m)?; // (N)
        let vs = slice_mut::<f32>(OP, "v", v)?; // (N)
        match compute {
            None => {
                let f = self.function(&OPTIM, "braid_adamw_step_f32")?;
                // braid_adamw_step_f32(float* param, const float* grad, float* m, float* v,
                //     float decay, float one_minus_beta1, float beta2, float one_minus_beta2,
                //     float step_size, float bias_correction2_sqrt, float eps, u64 n)
                // SAFETY: signature above; all four buffers hold n elements (checked
                // above); grid-stride over i < n, each element read and written by one
                // thread.
                unsafe {
                    launch!(self, OP, f, grid_for(n);
                        ps, gs, ms, vs,
                        &s.decay, &s.one_minus_beta1, &b2, &s.one_minus_beta2,
                        &s.step_size, &s.bias_correction2_sqrt, &eps, &n64)
                }
            }
            Some(c) => {
                let cs = slice_mut::<u16>(OP, "compute", c)?; // (N) bf16 bits
                let f = self.function(&OPTIM, "braid_adamw_step_f32_copy")?;
                // braid_adamw_step_f32_copy(float* param, const float* grad, float* m,
                //     float* v, bf16* compute, float decay, float one_minus_beta1,
                //     float beta2, float one_minus_beta2, float step_size,
                //     float bias_correction2_sqrt, float eps, u64 n)
                // SAFETY: signature above; all five buffers hold n elements (checked
                // above: compute is bf16 with n elements); grid-stride over i < n, each
                // element read and written by one thread.
                unsafe {
                    launch!(self, OP, f, grid_for(n);
                        ps, gs, ms, vs, cs,
                        &s.decay, &s.one_minus_beta1, &b2, &s.one_minus_beta2,
                        &s.step_size, &s.bias_correction2_sqrt, &eps, &n64)
                }
            }
        }
    }
}
