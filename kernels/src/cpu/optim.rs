//! CPU AdamW.

use half::bf16;
use rayon::prelude::*;

use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::OptimKernels;
use crate::error::{Error, Result};
use crate::ops::optim::AdamWSpec;
use crate::tensor::Tensor;

impl OptimKernels for CpuBackend {
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
        let s = spec.scalars();
        let (b2, eps) = (spec.beta2, spec.eps);
        let g = grad.cpu_f32(OP, "grad")?; // (N)
        let p = param.cpu_f32_mut(OP, "param")?; // (N)
        let m = m.cpu_f32_mut(OP, "m")?; // (N)
        let v = v.cpu_f32_mut(OP, "v")?; // (N)
        if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
            return Err(Error::shape(
                OP,
                format!(
                    "param, grad, m, v hold {}, {}, {}, {} elements",
                    p.len(),
                    g.len(),
                    m.len(),
                    v.len()
                ),
            ));
        }
        // Elementwise, in the order of operations of torch's single-tensor AdamW so
        // the f32 roundings match it.
        p.par_iter_mut()
            .zip(g.par_iter())
            .zip(m.par_iter_mut().zip(v.par_iter_mut()))
            .with_min_len(PAR_MIN_ELEMS)
            .for_each(|((p, &g), (m, v))| {
                *p *= s.decay;
                *m = lerp(*m, g, s.one_minus_beta1);
                *v = *v * b2 + s.one_minus_beta2 * g * g;
                let denom = v.sqrt() / s.bias_correction2_sqrt + eps;
                // addcdiv(p, m, denom, value = -step_size) = p + (-step_size * m) / denom
                *p += (-s.step_size * *m) / denom;
            });
        if let Some(compute) = compute {
            let n = p.len();
            let c = compute.cpu_bf16_mut(OP, "compute")?; // (N)
            if c.len() != n {
                return Err(Error::shape(
                    OP,
                    format!("param holds {n} elements, its compute copy {}", c.len()),
                ));
            }
            c.par_iter_mut()
                .zip(p.par_iter())
                .with_min_len(PAR_MIN_ELEMS)
                .for_each(|(c, &p)| *c = bf16::from_f32(p));
        }
        Ok(())
    }
}

/// `a + w (b - a)`, computed as PyTorch's `lerp` does (from the nearer end).
#[inline]
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}
