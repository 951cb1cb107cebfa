//! Rotary position embedding (rotate-half layout), forward and backward.
//!
//! The caller supplies `cos`/`sin` tables (T, R/2) built from each token's position
//! and the model's inverse frequencies, so RoPE scaling variants (linear, NTK, Llama 3,
//! YaRN) and packed sequences (positions restarting per sample) live in the layer,
//! not the kernel. Only the first R channels of each head rotate (R < HS is partial
//! rotary, as in Phi/StableLM); channel pairs are `(i, i + R/2)` for `i < R/2`, Hugging
//! Face's `rotate_half` layout, not the interleaved `(2i, 2i + 1)` of Meta's checkpoints.

use super::{same_device, same_float_dtype, same_shape};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Checks x (T, NH, HS) against cos/sin (T, R/2) with 1 <= R/2 and R <= HS.
fn validate(
    op: &'static str,
    xname: &'static str,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<()> {
    same_device(op, &[(xname, x), ("cos", cos), ("sin", sin)])?;
    same_float_dtype(op, &[(xname, x)])?;
    same_float_dtype(op, &[("cos", cos), ("sin", sin)])?;
    let [t, _, hs] = x.shape().dims_n::<3>(op, xname)?;
    let [tc, half] = cos.shape().dims_n::<2>(op, "cos")?;
    same_shape(op, ("cos", cos), ("sin", sin))?;
    if tc != t {
        return Err(Error::shape(
            op,
            format!(
                "`{xname}` {} has T = {t} tokens but cos/sin {} have {tc} rows",
                x.shape(),
                cos.shape()
            ),
        ));
    }
    if half == 0 || 2 * half > hs {
        return Err(Error::shape(
            op,
            format!(
                "cos/sin {} rotate R = {} channels; need 2 <= R <= HS = {hs} (`{xname}` {})",
                cos.shape(),
                2 * half,
                x.shape()
            ),
        ));
    }
    Ok(())
}

/// x (T, NH, HS), cos/sin (T, R/2), R even and <= HS -> rotated x (T, NH, HS):
/// for `i < R/2`, `y[i] = x[i] cos - x[i + R/2] sin`, `y[i + R/2] = x[i + R/2] cos + x[i] sin`;
/// channels `>= R` pass through. cos/sin may have a different float dtype than x (f32
/// tables for bf16 activations) but share theirs.
pub fn rope_fwd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    validate("rope_fwd", "x", x, cos, sin)?;
    x.device().backend()?.rope(x, cos, sin, false)
}

/// Backward of [`rope_fwd`]: the inverse rotation (angle -theta) of the output grad.
pub fn rope_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    validate("rope_bwd", "dy", dy, cos, sin)?;
    dy.device().backend()?.rope(dy, cos, sin, true)
}
