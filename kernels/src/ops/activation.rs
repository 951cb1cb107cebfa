//! Pointwise activations (GELU variants, SiLU), SwiGLU and softmax, forward and backward.
//!
//! Pointwise ops accept any shape (including empty); softmax runs over the last
//! dimension of a tensor of rank >= 1. Backwards take the forward's input (or, for
//! softmax, its output) rather than a cache type, so a layer decides what to keep.

use super::norm::rows_cols;
use super::{same_device, same_float_dtype, same_shape};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A pointwise nonlinearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` — `gelu_pytorch_tanh` (SigLIP, GPT-2).
    GeluTanh,
    /// `0.5 x (1 + erf(x / sqrt 2))` — exact GELU (Whisper, `nn.GELU()`).
    GeluErf,
    /// `x sigmoid(1.702 x)` — CLIP's `quick_gelu`.
    QuickGelu,
    /// `x sigmoid(x)`.
    Silu,
}

/// The complementary error function `erfc(x) = 1 - erf(x)` in f64: the fit the CPU
/// kernels of [`Activation::GeluErf`] evaluate in f32 on a vectorizable exp (public so
/// the fit's own accuracy is tested directly; the kernels are tested against f64).
///
/// Numerical Recipes' `erfcc` (Press et al., 2nd ed., section 6.2): a Chebyshev fit
/// of `erfc` with *fractional* error below 1.2e-7 for every x. Exact GELU is written
/// as `0.5 x erfc(-x / sqrt 2)`, so that relative accuracy carries over to GELU on
/// the whole line — including the negative tail, where `1 + erf` would cancel.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * (-z * z + poly).exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// `act(x)`, elementwise, any shape.
pub fn activation_fwd(x: &Tensor, act: Activation) -> Result<Tensor> {
    same_float_dtype("activation_fwd", &[("x", x)])?;
    x.device().backend()?.activation_fwd(x, act)
}

/// dx = dy * act'(x); `dy` and `x` have the same shape.
pub fn activation_bwd(dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
    const OP: &str = "activation_bwd";
    let dev = same_device(OP, &[("dy", dy), ("x", x)])?;
    same_float_dtype(OP, &[("dy", dy), ("x", x)])?;
    same_shape(OP, ("dy", dy), ("x", x))?;
    dev.backend()?.activation_bwd(dy, x, act)
}

/// silu(gate) * up — the gated MLP of Llama/Qwen2 — with `gate` and `up` the same shape.
pub fn swiglu_fwd(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu_fwd";
    let dev = same_device(OP, &[("gate", gate), ("up", up)])?;
    same_float_dtype(OP, &[("gate", gate), ("up", up)])?;
    same_shape(OP, ("gate", gate), ("up", up))?;
    dev.backend()?.swiglu_fwd(gate, up)
}

/// Backward of [`swiglu_fwd`] -> (dgate, dup).
pub fn swiglu_bwd(dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "swiglu_bwd";
    let args = [("dy", dy), ("gate", gate), ("up", up)];
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    same_shape(OP, ("gate", gate), ("up", up))?;
    same_shape(OP, ("dy", dy), ("gate", gate))?;
    dev.backend()?.swiglu_bwd(dy, gate, up)
}

/// Softmax over the last dimension (max-subtracted, so large logits do not overflow).
/// `x (..., C)` with C >= 1.
pub fn softmax_fwd(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_fwd";
    same_float_dtype(OP, &[("x", x)])?;
    softmax_rows(OP, x)?;
    x.device().backend()?.softmax_fwd(x)
}

/// Backward of [`softmax_fwd`] given its output `y`: dx = y * (dy - sum(dy * y)) per row.
pub fn softmax_bwd(dy: &Tensor, y: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_bwd";
    let dev = same_device(OP, &[("dy", dy), ("y", y)])?;
    same_float_dtype(OP, &[("dy", dy), ("y", y)])?;
    same_shape(OP, ("dy", dy), ("y", y))?;
    softmax_rows(OP, y)?;
    dev.backend()?.softmax_bwd(dy, y)
}

/// Softmax needs a last dimension, and a non-empty one unless there are no rows at
/// all (an empty row has no distribution to normalize).
fn softmax_rows(op: &'static str, x: &Tensor) -> Result<()> {
    if x.rank() == 0 {
        return Err(Error::shape(op, "softmax of a scalar: needs rank >= 1"));
    }
    if x.elem_count() == 0 && x.shape().rows() == 0 {
        return Ok(());
    }
    rows_cols(op, "x", x).map(|_| ())
}
