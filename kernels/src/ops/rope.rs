//! Rotary position embedding (rotate-half layout), forward and backward.
//!
//! The caller supplies `cos`/`sin` tables (T, R/2) built from each token's position
//! and the model's inverse frequencies, so RoPE scaling variants (linear, NTK, Llama 3,
//! YaRN) and packed sequences (positions restarting per sample) live in the layer,
//! not the kernel.
//!
//! OWNER NOTE: validation to be completed.

use crate::error::Result;
use crate::tensor::Tensor;

/// x (T, NH, HS), cos/sin (T, R/2), R even and <= HS -> rotated x.
pub fn rope_fwd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.device().backend()?.rope(x, cos, sin, false)
}

/// Backward of [`rope_fwd`]: the inverse rotation of the output grad.
pub fn rope_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    dy.device().backend()?.rope(dy, cos, sin, true)
}
