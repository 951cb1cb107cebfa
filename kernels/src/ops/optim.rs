//! Optimizer updates applied in place on the parameter's device.
//!
//! Optimizer state and master weights are f32 on every device (bf16 copies of the
//! weights are cast from the master after the step), so every tensor here is f32.

use super::{expect_dtype, same_device, same_shape};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyperparameters of one AdamW step. `step` counts from 1 (bias correction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWSpec {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub step: u64,
}

/// The per-step scalars of AdamW, computed on the host in f64 as PyTorch does (its
/// hyperparameters and step count are Python floats) and rounded once to f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr * weight_decay`: the decoupled decay factor.
    pub decay: f32,
    /// `1 - beta1`: the weight of the new gradient in `m`.
    pub one_minus_beta1: f32,
    /// `1 - beta2`: the weight of the new squared gradient in `v`.
    pub one_minus_beta2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
}

impl AdamWSpec {
    /// Checks the ranges `torch.optim.AdamW` accepts, plus `step >= 1`.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let bad = |msg: String| Err(Error::invalid(op, msg));
        if self.step == 0 {
            return bad(
                "step counts from 1 (bias correction divides by 1 - beta^step), got 0".into(),
            );
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("lr must be finite and >= 0, got {}", self.lr));
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} must be in [0, 1), got {b}"));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return bad(format!("eps must be finite and >= 0, got {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            ));
        }
        Ok(())
    }

    /// The scalars of this step (see [`AdamWScalars`]).
    pub fn scalars(&self) -> AdamWScalars {
        let [lr, b1, b2, wd] =
            [self.lr, self.beta1, self.beta2, self.weight_decay].map(decimal_f64);
        // Steps beyond i32::MAX: beta^t has long underflowed to 0 for beta < 1.
        let t = i32::try_from(self.step).unwrap_or(i32::MAX);
        AdamWScalars {
            decay: (1.0 - lr * wd) as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            one_minus_beta2: (1.0 - b2) as f32,
            step_size: (lr / (1.0 - b1.powi(t))) as f32,
            bias_correction2_sqrt: (1.0 - b2.powi(t)).sqrt() as f32,
        }
    }
}

/// The f64 nearest to the shortest decimal that rounds to `x`: the value written in
/// the config (`0.999`), as PyTorch holds it in a Python float. `f64::from(x)` would
/// carry the f32 rounding error instead, and `1 - beta2` would be off by 1.3e-5
/// relative (0.999f32 = 0.99900001287...), a visible drift from torch's `v`.
fn decimal_f64(x: f32) -> f64 {
    // Display of f32 prints the shortest string that parses back to the same f32.
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// One AdamW step in place, as `torch.optim.AdamW` (single-tensor, non-amsgrad):
/// `p *= 1 - lr wd; m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2;
///  p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
/// param, grad, m, v: same shape, all f32, one device.
pub fn adamw_step(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    spec: &AdamWSpec,
) -> Result<()> {
    const OP: &str = "adamw_step";
    let args = [("param", &*param), ("grad", grad), ("m", &*m), ("v", &*v)];
    let dev = same_device(OP, &args)?;
    expect_dtype(OP, DType::F32, &args)?;
    for (name, t) in &args[1..] {
        same_shape(OP, ("param", param), (name, t))?;
    }
    spec.validate(OP)?;
    dev.backend()?.adamw_step(param, grad, m, v, None, spec)
}

/// [`adamw_step`] that also refreshes the weight's bf16 compute copy (mixed precision:
/// the layers read `compute`, the optimizer updates the f32 master `param`): `compute`
/// becomes the updated param rounded to nearest even, in the same pass.
pub fn adamw_step_with_copy(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    compute: &mut Tensor,
    spec: &AdamWSpec,
) -> Result<()> {
    const OP: &str = "adamw_step_with_copy";
    let args = [("param", &*param), ("grad", grad), ("m", &*m), ("v", &*v)];
    let dev = same_device(OP, &args)?;
    same_device(OP, &[("param", &*param), ("compute", &*compute)])?;
    expect_dtype(OP, DType::F32, &args)?;
    expect_dtype(OP, DType::BF16, &[("compute", &*compute)])?;
    for (name, t) in &args[1..] {
        same_shape(OP, ("param", param), (name, t))?;
    }
    same_shape(OP, ("param", param), ("compute", compute))?;
    spec.validate(OP)?;
    dev.backend()?
        .adamw_step(param, grad, m, v, Some(compute), spec)
}
