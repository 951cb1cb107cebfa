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

/// logits shard (T, Vl) of a vocabulary split over `R` ranks, targets (T) u32 ->
/// partials (3, T); see [`crate::backend::VocabLossKernels::vocab_loss_partials`]. The
/// targets' range is checked by the caller on the host, where the targets are made (a
/// target outside every shard only makes its row's loss wrong, never a bad access).
pub fn vocab_loss_partials(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    ignore_index: u32,
) -> Result<Tensor> {
    const OP: &str = "vocab_loss_partials";
    check_shard(OP, logits, targets)?;
    logits
        .device()
        .backend()?
        .vocab_loss_partials(logits, targets, vocab_start, ignore_index)
}

/// The losses (T) and this shard's dlogits (T, Vl) from every rank's partials, gathered
/// (R, 3, T); see [`crate::backend::VocabLossKernels::vocab_loss_finish`].
pub fn vocab_loss_finish(
    logits: &Tensor,
    targets: &Tensor,
    gathered: &Tensor,
    vocab_start: usize,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "vocab_loss_finish";
    let [t, _] = check_shard(OP, logits, targets)?;
    same_device(OP, &[("logits", logits), ("gathered", gathered)])?;
    expect_dtype(OP, DType::F32, &[("gathered", gathered)])?;
    let [r, three, tg] = gathered.shape().dims_n::<3>(OP, "gathered")?;
    if r == 0 || three != 3 || tg != t {
        return Err(Error::shape(
            OP,
            format!(
                "gathered must be (R >= 1, 3, T = {t}), got {}",
                gathered.shape()
            ),
        ));
    }
    if !grad_scale.is_finite() {
        return Err(Error::invalid(
            OP,
            format!("grad_scale must be finite, got {grad_scale}"),
        ));
    }
    logits.device().backend()?.vocab_loss_finish(
        logits,
        targets,
        gathered,
        vocab_start,
        ignore_index,
        grad_scale,
    )
}

/// A (T, Vl > 0) float shard and (T) u32 targets on one device; returns [T, Vl].
fn check_shard(op: &'static str, logits: &Tensor, targets: &Tensor) -> Result<[usize; 2]> {
    same_device(op, &[("logits", logits), ("targets", targets)])?;
    same_float_dtype(op, &[("logits", logits)])?;
    expect_dtype(op, DType::U32, &[("targets", targets)])?;
    let [t, vl] = logits.shape().dims_n::<2>(op, "logits")?;
    if vl == 0 {
        return Err(Error::shape(
            op,
            format!("logits shard {} has no columns", logits.shape()),
        ));
    }
    expect_shape(op, "targets", targets, &Shape::new([t]))?;
    Ok([t, vl])
}
