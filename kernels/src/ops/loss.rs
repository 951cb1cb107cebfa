//! Softmax cross-entropy with an ignore index, forward and backward fused.
//!
//! OWNER NOTE: validation to be completed.

use crate::error::Result;
use crate::tensor::Tensor;

/// logits (N, V), targets (N) u32 -> (losses (N), dlogits (N, V)); see
/// [`crate::backend::LossKernels::cross_entropy`]. For a mean loss over the valid
/// targets pass `grad_scale = 1 / n_valid`.
pub fn cross_entropy_fwd_bwd(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    logits
        .device()
        .backend()?
        .cross_entropy(logits, targets, ignore_index, grad_scale)
}
