//! Scaled-dot-product attention over packed variable-length sequences (GQA/MQA,
//! causal or bidirectional), forward and backward.
//!
//! OWNER NOTE: validation to be completed (cu_seqlens starts at 0, is nondecreasing,
//! ends at T; NH % NKV == 0; shapes).

use crate::error::Result;
use crate::tensor::Tensor;

/// How attention scores are formed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Each query sees only keys at or before its own position (within its sequence).
    pub causal: bool,
    /// Multiplies `q · k`; usually `1 / sqrt(HS)`.
    pub scale: f32,
}

/// q (T, NH, HS), k/v (T, NKV, HS), cu_seqlens [0, ..., T] -> (out (T, NH, HS), lse (NH, T)).
/// Tokens of different sequences never attend to each other.
pub fn attention_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &[usize],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    q.device()
        .backend()?
        .attention_fwd(q, k, v, cu_seqlens, spec)
}

/// Backward of [`attention_fwd`] -> (dq, dk, dv).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cu_seqlens: &[usize],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    q.device()
        .backend()?
        .attention_bwd(dout, q, k, v, out, lse, cu_seqlens, spec)
}
