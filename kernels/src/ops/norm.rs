//! LayerNorm and RMSNorm over the last dimension, forward and backward.
//!
//! OWNER NOTE: validation to be completed (shapes of w/b/mean/rstd, dtypes, devices).

use crate::error::Result;
use crate::tensor::Tensor;

/// x (..., C), w (C), b (C) -> (y (..., C), mean (N), rstd (N)) with N = rows of x.
pub fn layer_norm_fwd(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    x.device().backend()?.layer_norm_fwd(x, w, b, eps)
}

/// Backward of [`layer_norm_fwd`]: returns dx; adds into `dw`/`db` when given.
pub fn layer_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    x.device()
        .backend()?
        .layer_norm_bwd(dy, x, w, mean, rstd, dw, db)
}

/// x (..., C), w (C) -> (y (..., C), rstd (N)).
pub fn rms_norm_fwd(x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    x.device().backend()?.rms_norm_fwd(x, w, eps)
}

/// Backward of [`rms_norm_fwd`]: returns dx; adds into `dw` when given.
pub fn rms_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dw: Option<&mut Tensor>,
) -> Result<Tensor> {
    x.device().backend()?.rms_norm_bwd(dy, x, w, rstd, dw)
}
