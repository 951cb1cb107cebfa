//! bf16 on the CPU: the reference for mixed precision. Every kernel computes in f32 on
//! bf16 inputs (widened exactly) and rounds each bf16 output once, to nearest even —
//! what the CUDA kernels do with bf16 data (f32 math, bf16 storage; cuBLASLt's bf16
//! GEMMs accumulate in f32 and round once). Accumulators follow their own dtype: an f32
//! grad gathers the f32 results unrounded, a bf16 one is widened, updated and rounded.
//!
//! Each family file dispatches here with one line when an input is bf16, and these
//! functions call the family's f32 kernel back on widened copies: one f32 kernel per
//! op, no second implementation to keep in step. Widening costs a copy per call; the
//! CPU is where bf16 is checked, not where it is fast.

use std::ops::Deref;

use half::bf16;
use rayon::prelude::*;

use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::{
    ActivationKernels, AttentionKernels, ConvKernels, ElementwiseKernels, EmbeddingKernels,
    LossKernels, MatmulKernels, NormKernels, RopeKernels, VocabLossKernels,
};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::activation::Activation;
use crate::ops::attention::{AttentionSpec, QkSegment};
use crate::ops::conv::Conv1dSpec;
use crate::ops::matmul::GemmSpec;
use crate::shape::Shape;
use crate::tensor::{CpuStorage, Storage, Tensor};

/// Whether any of `ts` is bf16 (then the call takes the widening path).
pub(super) fn any(ts: &[&Tensor]) -> bool {
    ts.iter().any(|t| t.dtype() == DType::BF16)
}

/// Whether any of the optional tensors is bf16.
pub(super) fn any_opt(ts: &[Option<&Tensor>]) -> bool {
    ts.iter().flatten().any(|t| t.dtype() == DType::BF16)
}

/// A tensor as f32: borrowed when it already is (or holds u32 ids), else a widened copy.
pub(super) enum Wide<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl Deref for Wide<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Wide::Borrowed(t) => t,
            Wide::Owned(t) => t,
        }
    }
}

/// `t` widened to f32 (exact: every bf16 is an f32).
pub(super) fn wide(t: &Tensor) -> Result<Wide<'_>> {
    let Storage::Cpu(CpuStorage::BF16(v)) = t.storage() else {
        return Ok(Wide::Borrowed(t));
    };
    let f: Vec<f32> = if v.len() <= PAR_MIN_ELEMS {
        v.iter().map(|x| x.to_f32()).collect()
    } else {
        v.par_iter()
            .with_min_len(PAR_MIN_ELEMS)
            .map(|x| x.to_f32())
            .collect()
    };
    Ok(Wide::Owned(Tensor::cpu_from_f32(f, t.shape().clone())?))
}

fn wide_opt(t: Option<&Tensor>) -> Result<Option<Wide<'_>>> {
    t.map(wide).transpose()
}

/// An f32 result rounded to `dtype` (to nearest even for bf16; unchanged for f32).
pub(super) fn round(t: Tensor, dtype: DType) -> Result<Tensor> {
    if dtype != DType::BF16 {
        return Ok(t);
    }
    let Storage::Cpu(CpuStorage::F32(v)) = t.storage() else {
        return Ok(t);
    };
    let b: Vec<bf16> = if v.len() <= PAR_MIN_ELEMS {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    } else {
        v.par_iter()
            .with_min_len(PAR_MIN_ELEMS)
            .map(|&x| bf16::from_f32(x))
            .collect()
    };
    Tensor::from_storage(Storage::Cpu(CpuStorage::BF16(b)), t.shape().clone())
}

/// An accumulator updated in f32: a bf16 one is widened now and rounded back by
/// [`Acc::finish`]; an f32 one is updated in place.
pub(super) struct Acc<'a> {
    dst: &'a mut Tensor,
    tmp: Option<Tensor>,
}

impl<'a> Acc<'a> {
    pub(super) fn new(dst: &'a mut Tensor) -> Result<Self> {
        let tmp = match wide(dst)? {
            Wide::Owned(t) => Some(t),
            Wide::Borrowed(_) => None,
        };
        Ok(Acc { dst, tmp })
    }

    pub(super) fn f32(&mut self) -> &mut Tensor {
        match &mut self.tmp {
            Some(t) => t,
            None => self.dst,
        }
    }

    pub(super) fn finish(self) -> Result<()> {
        if let Some(t) = self.tmp {
            *self.dst = round(t, DType::BF16)?;
        }
        Ok(())
    }
}

fn acc_opt(t: Option<&mut Tensor>) -> Result<Option<Acc<'_>>> {
    t.map(Acc::new).transpose()
}

fn finish_opt(a: Option<Acc<'_>>) -> Result<()> {
    a.map_or(Ok(()), Acc::finish)
}

// ---- elementwise ----

pub(super) fn add(be: &CpuBackend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    round(be.add(&*wide(a)?, &*wide(b)?)?, a.dtype())
}

pub(super) fn add_assign(be: &CpuBackend, acc: &mut Tensor, x: &Tensor) -> Result<()> {
    let mut acc = Acc::new(acc)?;
    be.add_assign(acc.f32(), &*wide(x)?)?;
    acc.finish()
}

pub(super) fn scale_assign(be: &CpuBackend, x: &mut Tensor, s: f32) -> Result<()> {
    let mut acc = Acc::new(x)?;
    be.scale_assign(acc.f32(), s)?;
    acc.finish()
}

pub(super) fn sum_squares(be: &CpuBackend, x: &Tensor) -> Result<f64> {
    be.sum_squares(&*wide(x)?)
}

// ---- matmul ----

pub(super) fn gemm(
    be: &CpuBackend,
    a: &Tensor,
    b: &Tensor,
    c: &mut Tensor,
    spec: &GemmSpec,
) -> Result<()> {
    let mut c = Acc::new(c)?;
    be.gemm(&*wide(a)?, &*wide(b)?, c.f32(), spec)?;
    c.finish()
}

pub(super) fn add_bias(be: &CpuBackend, y: &mut Tensor, bias: &Tensor) -> Result<()> {
    let mut y = Acc::new(y)?;
    be.add_bias(y.f32(), &*wide(bias)?)?;
    y.finish()
}

pub(super) fn bias_grad(be: &CpuBackend, dy: &Tensor, dbias: &mut Tensor) -> Result<()> {
    let mut db = Acc::new(dbias)?;
    be.bias_grad(&*wide(dy)?, db.f32())?;
    db.finish()
}

// ---- embedding ----

pub(super) fn embedding_fwd(be: &CpuBackend, ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    round(be.embedding_fwd(ids, &*wide(table)?)?, table.dtype())
}

pub(super) fn embedding_bwd(
    be: &CpuBackend,
    dy: &Tensor,
    ids: &Tensor,
    dtable: &mut Tensor,
) -> Result<()> {
    let mut dt = Acc::new(dtable)?;
    be.embedding_bwd(&*wide(dy)?, ids, dt.f32())?;
    dt.finish()
}

// ---- norms: y and dx in x's dtype, statistics f32 ----

pub(super) fn layer_norm_fwd(
    be: &CpuBackend,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let bw = wide_opt(b)?;
    let (y, mean, rstd) = be.layer_norm_fwd(&*wide(x)?, &*wide(w)?, bw.as_deref(), eps)?;
    Ok((round(y, x.dtype())?, mean, rstd))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn layer_norm_bwd(
    be: &CpuBackend,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    let (mut dw, mut db) = (acc_opt(dw)?, acc_opt(db)?);
    let dx = be.layer_norm_bwd(
        &*wide(dy)?,
        &*wide(x)?,
        &*wide(w)?,
        mean,
        rstd,
        dw.as_mut().map(Acc::f32),
        db.as_mut().map(Acc::f32),
    )?;
    finish_opt(dw)?;
    finish_opt(db)?;
    round(dx, x.dtype())
}

pub(super) fn rms_norm_fwd(
    be: &CpuBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let (y, rstd) = be.rms_norm_fwd(&*wide(x)?, &*wide(w)?, eps)?;
    Ok((round(y, x.dtype())?, rstd))
}

pub(super) fn rms_norm_bwd(
    be: &CpuBackend,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dw: Option<&mut Tensor>,
) -> Result<Tensor> {
    let mut dw = acc_opt(dw)?;
    let dx = be.rms_norm_bwd(
        &*wide(dy)?,
        &*wide(x)?,
        &*wide(w)?,
        rstd,
        dw.as_mut().map(Acc::f32),
    )?;
    finish_opt(dw)?;
    round(dx, x.dtype())
}

// ---- rope, activations ----

pub(super) fn rope(
    be: &CpuBackend,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    inverse: bool,
) -> Result<Tensor> {
    round(
        be.rope(&*wide(x)?, &*wide(cos)?, &*wide(sin)?, inverse)?,
        x.dtype(),
    )
}

pub(super) fn activation_fwd(be: &CpuBackend, x: &Tensor, act: Activation) -> Result<Tensor> {
    round(be.activation_fwd(&*wide(x)?, act)?, x.dtype())
}

pub(super) fn activation_bwd(
    be: &CpuBackend,
    dy: &Tensor,
    x: &Tensor,
    act: Activation,
) -> Result<Tensor> {
    round(be.activation_bwd(&*wide(dy)?, &*wide(x)?, act)?, x.dtype())
}

pub(super) fn swiglu_fwd(be: &CpuBackend, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    round(be.swiglu_fwd(&*wide(gate)?, &*wide(up)?)?, gate.dtype())
}

pub(super) fn swiglu_bwd(
    be: &CpuBackend,
    dy: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (dg, du) = be.swiglu_bwd(&*wide(dy)?, &*wide(gate)?, &*wide(up)?)?;
    Ok((round(dg, gate.dtype())?, round(du, up.dtype())?))
}

pub(super) fn softmax_fwd(be: &CpuBackend, x: &Tensor) -> Result<Tensor> {
    round(be.softmax_fwd(&*wide(x)?)?, x.dtype())
}

pub(super) fn softmax_bwd(be: &CpuBackend, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
    round(be.softmax_bwd(&*wide(dy)?, &*wide(y)?)?, y.dtype())
}

// ---- attention: out and grads in q's dtype, lse f32 ----

pub(super) fn attention_fwd(
    be: &CpuBackend,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    cu_seqlens: &[usize],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    let (out, lse) = be.attention_fwd(&*wide(q)?, &*wide(k)?, &*wide(v)?, cu_seqlens, spec)?;
    Ok((round(out, q.dtype())?, lse))
}

pub(super) fn attention_fwd_ranges(
    be: &CpuBackend,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    segs: &[QkSegment],
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor)> {
    let (out, lse) = be.attention_fwd_ranges(&*wide(q)?, &*wide(k)?, &*wide(v)?, segs, spec)?;
    Ok((round(out, q.dtype())?, lse))
}

/// Where the keys of an attention backward come from: whole sequences or ranges.
pub(super) enum Keys<'a> {
    Seqlens(&'a [usize]),
    Ranges(&'a [QkSegment]),
}

pub(super) fn attention_bwd(
    be: &CpuBackend,
    (dout, q, k, v, out, lse): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
    keys: Keys<'_>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (dw, qw, kw, vw, ow) = (wide(dout)?, wide(q)?, wide(k)?, wide(v)?, wide(out)?);
    let (dq, dk, dv) = match keys {
        Keys::Seqlens(cu) => be.attention_bwd(&dw, &qw, &kw, &vw, &ow, lse, cu, spec)?,
        Keys::Ranges(segs) => be.attention_bwd_ranges(&dw, &qw, &kw, &vw, &ow, lse, segs, spec)?,
    };
    Ok((
        round(dq, q.dtype())?,
        round(dk, k.dtype())?,
        round(dv, v.dtype())?,
    ))
}

// ---- losses: losses and partials f32, dlogits in the logits' dtype ----

pub(super) fn cross_entropy(
    be: &CpuBackend,
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (losses, d) = be.cross_entropy(&*wide(logits)?, targets, ignore_index, grad_scale)?;
    Ok((losses, round(d, logits.dtype())?))
}

pub(super) fn vocab_loss_partials(
    be: &CpuBackend,
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    ignore_index: u32,
) -> Result<Tensor> {
    be.vocab_loss_partials(&*wide(logits)?, targets, vocab_start, ignore_index)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn vocab_loss_finish(
    be: &CpuBackend,
    logits: &Tensor,
    targets: &Tensor,
    gathered: &Tensor,
    vocab_start: usize,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    let (losses, d) = be.vocab_loss_finish(
        &*wide(logits)?,
        targets,
        &*wide(gathered)?,
        vocab_start,
        ignore_index,
        grad_scale,
    )?;
    Ok((losses, round(d, logits.dtype())?))
}

// ---- conv stems ----

pub(super) fn conv1d_fwd(
    be: &CpuBackend,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    spec: &Conv1dSpec,
) -> Result<Tensor> {
    let bw = wide_opt(b)?;
    round(
        be.conv1d_fwd(&*wide(x)?, &*wide(w)?, bw.as_deref(), spec)?,
        x.dtype(),
    )
}

pub(super) fn conv1d_bwd(
    be: &CpuBackend,
    (dy, x, w): (&Tensor, &Tensor, &Tensor),
    spec: &Conv1dSpec,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    let (mut dw, mut db) = (acc_opt(dw)?, acc_opt(db)?);
    let dx = be.conv1d_bwd(
        &*wide(dy)?,
        &*wide(x)?,
        &*wide(w)?,
        spec,
        dw.as_mut().map(Acc::f32),
        db.as_mut().map(Acc::f32),
    )?;
    finish_opt(dw)?;
    finish_opt(db)?;
    round(dx, x.dtype())
}

pub(super) fn patchify(be: &CpuBackend, images: &Tensor, patch: usize) -> Result<Tensor> {
    round(be.patchify(&*wide(images)?, patch)?, images.dtype())
}

pub(super) fn unpatchify(
    be: &CpuBackend,
    dpatches: &Tensor,
    image_shape: &Shape,
    patch: usize,
) -> Result<Tensor> {
    round(
        be.unpatchify(&*wide(dpatches)?, image_shape, patch)?,
        dpatches.dtype(),
    )
}
