//! Optimizer updates applied in place on the parameter's device.
//!
//! OWNER NOTE: validation to be completed.

use crate::error::Result;
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

/// One AdamW step, as `torch.optim.AdamW`:
/// `p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
///  p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`.
pub fn adamw_step(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    spec: &AdamWSpec,
) -> Result<()> {
    param
        .device()
        .backend()?
        .adamw_step(param, grad, m, v, spec)
}
