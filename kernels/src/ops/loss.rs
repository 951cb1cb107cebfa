//! Softmax cross-entropy with an ignore index, forward and backward fused.
//!
//! The loss is the last op of the forward and its grad the first of the backward, so
//! one pass over the logits (the largest activation of an LLM: N x V) gives both and
//! the softmax is never stored.

use super::{expect_dtype, expect_shape, same_device, same_float_dtype};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// logits (N, V), targets (N) u32 -> (losses (N), dlogits (N, V)); see
/// [`crate::backend::LossKernels::cross_entropy`]. Rows whose target is `ignore_index`
/// get loss 0 and grad 0; for a mean loss over the valid targets pass
/// `grad_scale = 1 / n_valid`.
///
/// A target `>= V` that is not `ignore_index` is an [`Error::Invalid`] naming the row.
/// Targets live on the device, so that check is made by the kernel, not here.
pub fn cross_entropy_fwd_bwd(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "cross_entropy";
    let dev = same_device(OP, &[("logits", logits), ("targets", targets)])?;
    same_float_dtype(OP, &[("logits", logits)])?;
    expect_dtype(OP, DType::U32, &[("targets", targets)])?;
    let [n, v] = logits.shape().dims_n::<2>(OP, "logits")?;
    if v == 0 {
        return Err(Error::shape(
            OP,
            format!("logits {} has an empty vocabulary", logits.shape()),
        ));
    }
    expect_shape(OP, "targets", targets, &Shape::new([n]))?;
    if !grad_scale.is_finite() {
        return Err(Error::invalid(
            OP,
            format!("grad_scale must be finite, got {grad_scale}"),
        ));
    }
    dev.backend()?
        .cross_entropy(logits, targets, ignore_index, grad_scale)
}
