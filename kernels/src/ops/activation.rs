//! Pointwise activations (GELU variants, SiLU), SwiGLU and softmax, forward and backward.
//!
//! OWNER NOTE: validation to be completed.

use crate::error::Result;
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

pub fn activation_fwd(x: &Tensor, act: Activation) -> Result<Tensor> {
    x.device().backend()?.activation_fwd(x, act)
}

/// dx = dy * act'(x).
pub fn activation_bwd(dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
    x.device().backend()?.activation_bwd(dy, x, act)
}

/// silu(gate) * up.
pub fn swiglu_fwd(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.device().backend()?.swiglu_fwd(gate, up)
}

/// -> (dgate, dup).
pub fn swiglu_bwd(dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    gate.device().backend()?.swiglu_bwd(dy, gate, up)
}

/// Softmax over the last dimension.
pub fn softmax_fwd(x: &Tensor) -> Result<Tensor> {
    x.device().backend()?.softmax_fwd(x)
}

/// Backward of [`softmax_fwd`] given its output `y`.
pub fn softmax_bwd(dy: &Tensor, y: &Tensor) -> Result<Tensor> {
    y.device().backend()?.softmax_bwd(dy, y)
}
