//! Encoder stems: 1-D convolution (audio) and patchify (images), forward and backward.
//!
//! OWNER NOTE: validation to be completed.

use crate::error::Result;
use crate::shape::Shape;
use crate::tensor::Tensor;

/// Stride and zero padding (both sides) of a 1-D convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv1dSpec {
    pub stride: usize,
    pub padding: usize,
}

/// x (B, CI, L), w (CO, CI, K), b (CO) -> (B, CO, (L + 2 padding - K) / stride + 1).
pub fn conv1d_fwd(x: &Tensor, w: &Tensor, b: Option<&Tensor>, spec: &Conv1dSpec) -> Result<Tensor> {
    x.device().backend()?.conv1d_fwd(x, w, b, spec)
}

/// Backward of [`conv1d_fwd`]: returns dx; adds into `dw`/`db` when given.
pub fn conv1d_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    spec: &Conv1dSpec,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    x.device().backend()?.conv1d_bwd(dy, x, w, spec, dw, db)
}

/// images (B, C, H, W) -> patches (B, (H/P)(W/P), C P P); H and W multiples of P.
pub fn patchify_fwd(images: &Tensor, patch: usize) -> Result<Tensor> {
    images.device().backend()?.patchify(images, patch)
}

/// Backward of [`patchify_fwd`]: dpatches -> dimages of `image_shape`.
pub fn patchify_bwd(dpatches: &Tensor, image_shape: &Shape, patch: usize) -> Result<Tensor> {
    dpatches
        .device()
        .backend()?
        .unpatchify(dpatches, image_shape, patch)
}
