//! Scaled-dot-product attention over packed variable-length sequences (GQA/MQA,
//! causal or bidirectional), forward and backward.
//!
//! Sequences are packed along `T` and delimited by `cu_seqlens` (the cumulative
//! lengths, FlashAttention's varlen convention): tokens of different sequences never
//! attend to each other, so a packed batch gives exactly what running each sample
//! alone would. Query head `h` reads key/value head `h / (NH / NKV)`.

use super::{expect_dtype, expect_shape, same_device, same_float_dtype, same_shape};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// How attention scores are formed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Each query sees only keys at or before its own position (within its sequence).
    pub causal: bool,
    /// Multiplies `q · k`; usually `1 / sqrt(HS)`.
    pub scale: f32,
}

/// The sizes every attention kernel works with, read from validated shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttentionDims {
    /// Tokens of all sequences together.
    pub t: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads (divides `nh`).
    pub nkv: usize,
    /// Head size.
    pub hs: usize,
}

/// Checks q (T, NH, HS), k (T, NKV, HS), v like k, NH % NKV == 0, `cu_seqlens` and
/// the scale; returns the sizes. Backends call it too, to read the sizes.
pub(crate) fn check_qkv(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &[usize],
    spec: &AttentionSpec,
) -> Result<AttentionDims> {
    let [t, nh, hs] = q.shape().dims_n::<3>(op, "q (T, NH, HS)")?;
    let [tk, nkv, hsk] = k.shape().dims_n::<3>(op, "k (T, NKV, HS)")?;
    same_shape(op, ("k", k), ("v", v))?;
    if tk != t || hsk != hs {
        return Err(Error::shape(
            op,
            format!(
                "q {} and k {} must agree on T and HS (q (T, NH, HS), k/v (T, NKV, HS))",
                q.shape(),
                k.shape()
            ),
        ));
    }
    if nh == 0 || nkv == 0 || nh % nkv != 0 {
        return Err(Error::shape(
            op,
            format!(
                "query heads NH = {nh} (q {}) must be a positive multiple of key/value heads NKV = {nkv} (k {})",
                q.shape(),
                k.shape()
            ),
        ));
    }
    check_cu_seqlens(op, cu_seqlens, t)?;
    if !spec.scale.is_finite() {
        return Err(Error::invalid(
            op,
            format!("scale must be finite, got {}", spec.scale),
        ));
    }
    Ok(AttentionDims { t, nh, nkv, hs })
}

/// `cu_seqlens` must be `[0, ..., T]`, nondecreasing, with at least two entries
/// (empty sequences are allowed: they contribute nothing).
fn check_cu_seqlens(op: &'static str, cu_seqlens: &[usize], t: usize) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::invalid(
            op,
            format!("cu_seqlens {cu_seqlens:?} {why} (T = {t})"),
        ))
    };
    match (cu_seqlens.first(), cu_seqlens.last()) {
        _ if cu_seqlens.len() < 2 => bad("must have at least 2 entries [0, ..., T]"),
        (Some(&first), _) if first != 0 => bad("must start at 0"),
        (_, Some(&last)) if last != t => bad("must end at T"),
        _ if cu_seqlens.windows(2).any(|w| w[1] < w[0]) => bad("must be nondecreasing"),
        _ => Ok(()),
    }
}

/// q (T, NH, HS), k/v (T, NKV, HS), cu_seqlens [0, ..., T] -> (out (T, NH, HS), lse (NH, T)).
/// Tokens of different sequences never attend to each other.
///
/// `lse[h, t]` is the natural-log log-sum-exp of query row `(t, h)`'s scaled scores
/// over the keys it sees; it is always f32 (whatever the dtype of q/k/v), and the
/// backward takes it back to rebuild the softmax without storing it.
pub fn attention_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &[usize],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_fwd";
    let args = [("q", q), ("k", k), ("v", v)];
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    check_qkv(OP, q, k, v, cu_seqlens, spec)?;
    dev.backend()?.attention_fwd(q, k, v, cu_seqlens, spec)
}

/// Backward of [`attention_fwd`] -> (dq, dk, dv), shaped like q, k, v.
///
/// `out` and `lse` are the forward's outputs for the same inputs; dout is shaped like
/// q. Grads of key/value heads shared by several query heads (GQA) are summed over
/// those heads in a fixed order, so the result is deterministic.
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
    const OP: &str = "attention_bwd";
    let args = [("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)];
    let dev = same_device(
        OP,
        &[args[0], args[1], args[2], args[3], args[4], ("lse", lse)],
    )?;
    same_float_dtype(OP, &args)?;
    expect_dtype(OP, DType::F32, &[("lse", lse)])?;
    let AttentionDims { t, nh, .. } = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
    same_shape(OP, ("dout", dout), ("q", q))?;
    same_shape(OP, ("out", out), ("q", q))?;
    expect_shape(OP, "lse (NH, T)", lse, &Shape::new([nh, t]))?;
    dev.backend()?
        .attention_bwd(dout, q, k, v, out, lse, cu_seqlens, spec)
}
