//! Scaled-dot-product attention over packed variable-length sequences (GQA/MQA,
//! causal or bidirectional), forward and backward.
//!
//! Sequences are packed along `T` and delimited by `cu_seqlens` (the cumulative
//! lengths, FlashAttention's varlen convention): tokens of different sequences never
//! attend to each other, so a packed batch gives exactly what running each sample
//! alone would. Query head `h` reads key/value head `h / (NH / NKV)`.
//!
//! [`attention_fwd_ranges`] / [`attention_bwd_ranges`] generalize this to queries and
//! keys from different buffers: each [`QkSegment`] says which key rows a run of query
//! rows attends to. Context parallelism uses it (a rank's query chunks against the
//! keys gathered from every rank); `cu_seqlens` is the case of equal ranges.

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
    /// Query tokens of all sequences together.
    pub t: usize,
    /// Key/value tokens (= `t` for self-attention over `cu_seqlens`).
    pub tk: usize,
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
    check_scale(op, spec)?;
    Ok(AttentionDims {
        t,
        tk: t,
        nh,
        nkv,
        hs,
    })
}

fn check_scale(op: &'static str, spec: &AttentionSpec) -> Result<()> {
    if !spec.scale.is_finite() {
        return Err(Error::invalid(
            op,
            format!("scale must be finite, got {}", spec.scale),
        ));
    }
    Ok(())
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

/// Queries `q_start .. q_start + q_len` (rows of q) attend to keys
/// `k_start .. k_start + k_len` (rows of k and v).
///
/// Causal masks are bottom-right aligned (FlashAttention's varlen convention): query
/// `i` of the segment (0-based) sees keys `j < k_len - q_len + i + 1`, i.e. the
/// segment's queries are the last `q_len` tokens of a sequence whose keys are the
/// `k_len` given. With `q_len == k_len` that is the usual causal mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QkSegment {
    pub q_start: usize,
    pub q_len: usize,
    pub k_start: usize,
    pub k_len: usize,
}

impl QkSegment {
    /// The segments of self-attention over `cu_seqlens`: every sequence's queries
    /// attend to its own keys.
    pub fn from_cu_seqlens(cu_seqlens: &[usize]) -> Vec<QkSegment> {
        cu_seqlens
            .windows(2)
            .map(|w| {
                let len = w[1].saturating_sub(w[0]);
                QkSegment {
                    q_start: w[0],
                    q_len: len,
                    k_start: w[0],
                    k_len: len,
                }
            })
            .collect()
    }
}

/// Checks q (Tq, NH, HS), k (Tk, NKV, HS), v like k, NH % NKV == 0, the segments and
/// the scale; returns the sizes.
///
/// Segments: their query ranges are consecutive from 0 and end at Tq (empty ones
/// allowed); key ranges lie inside 0..Tk and may overlap; a segment with queries has
/// keys, and when causal at least as many keys as queries (so every query sees one).
pub(crate) fn check_qk_ranges(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segs: &[QkSegment],
    spec: &AttentionSpec,
) -> Result<AttentionDims> {
    let [t, nh, hs] = q.shape().dims_n::<3>(op, "q (Tq, NH, HS)")?;
    let [tk, nkv, hsk] = k.shape().dims_n::<3>(op, "k (Tk, NKV, HS)")?;
    same_shape(op, ("k", k), ("v", v))?;
    if hsk != hs {
        return Err(Error::shape(
            op,
            format!(
                "q {} and k {} must agree on HS (q (Tq, NH, HS), k/v (Tk, NKV, HS))",
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
    check_segments(op, segs, t, tk, spec.causal)?;
    check_scale(op, spec)?;
    Ok(AttentionDims { t, tk, nh, nkv, hs })
}

/// See [`check_qk_ranges`].
fn check_segments(
    op: &'static str,
    segs: &[QkSegment],
    tq: usize,
    tk: usize,
    causal: bool,
) -> Result<()> {
    let bad = |i: usize, s: &QkSegment, why: String| {
        Err(Error::invalid(
            op,
            format!("segment {i} {s:?} {why} (Tq = {tq}, Tk = {tk})"),
        ))
    };
    let mut next_q = 0usize;
    for (i, s) in segs.iter().enumerate() {
        if s.q_start != next_q {
            return bad(
                i,
                s,
                format!(
                    "must start its queries at {next_q}: query ranges are consecutive, in order, from 0"
                ),
            );
        }
        let Some(q_end) = s.q_start.checked_add(s.q_len).filter(|&e| e <= tq) else {
            return bad(i, s, "has queries past Tq".into());
        };
        if s.k_start.checked_add(s.k_len).is_none_or(|e| e > tk) {
            return bad(i, s, "has keys past Tk".into());
        }
        if causal && s.q_len > s.k_len {
            return bad(
                i,
                s,
                "has more queries than keys, which a causal (bottom-right aligned) mask does not allow".into(),
            );
        }
        if s.q_len > 0 && s.k_len == 0 {
            return bad(i, s, "has queries but no keys".into());
        }
        next_q = q_end;
    }
    if next_q != tq {
        return Err(Error::invalid(
            op,
            format!(
                "the {} segments cover queries 0..{next_q}, but q has Tq = {tq} rows",
                segs.len()
            ),
        ));
    }
    Ok(())
}

/// q (Tq, NH, HS), k/v (Tk, NKV, HS) -> (out (Tq, NH, HS), lse (NH, Tq) f32): every
/// segment's queries attend to its keys only (see [`QkSegment`]).
pub fn attention_fwd_ranges(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segs: &[QkSegment],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_fwd_ranges";
    let args = [("q", q), ("k", k), ("v", v)];
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    check_qk_ranges(OP, q, k, v, segs, spec)?;
    dev.backend()?.attention_fwd_ranges(q, k, v, segs, spec)
}

/// Backward of [`attention_fwd_ranges`] -> (dq (Tq, NH, HS), dk, dv (Tk, NKV, HS)).
///
/// A key row in the ranges of several segments gets the sum of their grads, added in
/// segment order (deterministic); a key row in none gets 0.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd_ranges(
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    segs: &[QkSegment],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "attention_bwd_ranges";
    let args = [("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)];
    let dev = same_device(
        OP,
        &[args[0], args[1], args[2], args[3], args[4], ("lse", lse)],
    )?;
    same_float_dtype(OP, &args)?;
    expect_dtype(OP, DType::F32, &[("lse", lse)])?;
    let AttentionDims { t, nh, .. } = check_qk_ranges(OP, q, k, v, segs, spec)?;
    same_shape(OP, ("dout", dout), ("q", q))?;
    same_shape(OP, ("out", out), ("q", q))?;
    expect_shape(OP, "lse (NH, Tq)", lse, &Shape::new([nh, t]))?;
    dev.backend()?
        .attention_bwd_ranges(dout, q, k, v, out, lse, segs, spec)
}
