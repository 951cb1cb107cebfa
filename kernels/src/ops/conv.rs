//! Encoder stems: 1-D convolution (audio) and patchify (images), forward and backward.
//!
//! conv1d is PyTorch's `nn.Conv1d` (cross-correlation, zero padding on both sides,
//! weight `(CO, CI, K)`), so Whisper's stem weights load as they are. patchify cuts
//! images into non-overlapping `P x P` patches whose rows are flattened in the order of
//! a PyTorch conv weight `(C, P, P)`: a `Conv2d(C, D, kernel = stride = P)` patch
//! embedding is then `patchify` followed by a linear layer with the conv weight
//! reshaped to `(D, C*P*P)`.

use super::{accumulator_dtype, expect_shape, same_device, same_float_dtype};
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// Stride and zero padding (both sides) of a 1-D convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv1dSpec {
    pub stride: usize,
    pub padding: usize,
}

impl Conv1dSpec {
    /// Output length for input length `l` and kernel size `k`, or `None` when the
    /// (padded) input is shorter than the kernel or the stride is zero.
    pub fn out_len(&self, l: usize, k: usize) -> Option<usize> {
        if self.stride == 0 || k == 0 {
            return None;
        }
        let padded = l.checked_add(self.padding.checked_mul(2)?)?;
        padded.checked_sub(k).map(|span| span / self.stride + 1)
    }
}

/// The dims `(B, CI, L, CO, K, LO)` of a conv1d, after checking x, w, b and spec.
fn conv1d_dims(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    spec: &Conv1dSpec,
) -> Result<[usize; 6]> {
    let [bsz, ci, l] = x.shape().dims_n::<3>(op, "x")?;
    let [co, wci, k] = w.shape().dims_n::<3>(op, "w")?;
    if spec.stride == 0 {
        return Err(Error::invalid(op, "stride must be >= 1, got 0"));
    }
    if wci != ci {
        return Err(Error::shape(
            op,
            format!(
                "x {} has {ci} input channels but w {} expects {wci}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if k == 0 {
        return Err(Error::shape(
            op,
            format!("w {} has kernel size 0", w.shape()),
        ));
    }
    let lo = spec.out_len(l, k).ok_or_else(|| {
        Error::shape(
            op,
            format!(
                "input x {} padded by {} on each side is shorter than the kernel of w {}",
                x.shape(),
                spec.padding,
                w.shape()
            ),
        )
    })?;
    if let Some(b) = b {
        expect_shape(op, "b", b, &Shape::new([co]))?;
    }
    Ok([bsz, ci, l, co, k, lo])
}

/// x (B, CI, L), w (CO, CI, K), b (CO) -> (B, CO, LO), LO = (L + 2 padding - K) / stride + 1.
pub fn conv1d_fwd(x: &Tensor, w: &Tensor, b: Option<&Tensor>, spec: &Conv1dSpec) -> Result<Tensor> {
    const OP: &str = "conv1d_fwd";
    let mut args = vec![("x", x), ("w", w)];
    if let Some(b) = b {
        args.push(("b", b));
    }
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    conv1d_dims(OP, x, w, b, spec)?;
    dev.backend()?.conv1d_fwd(x, w, b, spec)
}

/// Backward of [`conv1d_fwd`]: returns dx (B, CI, L); adds into `dw` (CO, CI, K) and
/// `db` (CO) when given (`None`: a frozen parameter).
pub fn conv1d_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    spec: &Conv1dSpec,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    const OP: &str = "conv1d_bwd";
    let mut args = vec![("dy", dy), ("x", x), ("w", w)];
    let dtype = same_float_dtype(OP, &args)?;
    if let Some(dw) = dw.as_deref() {
        args.push(("dw", dw));
        accumulator_dtype(OP, ("dw", dw), dtype)?;
    }
    if let Some(db) = db.as_deref() {
        args.push(("db", db));
        accumulator_dtype(OP, ("db", db), dtype)?;
    }
    let dev = same_device(OP, &args)?;
    let [bsz, _, _, co, _, lo] = conv1d_dims(OP, x, w, None, spec)?;
    expect_shape(OP, "dy", dy, &Shape::new([bsz, co, lo]))?;
    if let Some(dw) = dw.as_deref() {
        expect_shape(OP, "dw", dw, w.shape())?;
    }
    if let Some(db) = db.as_deref() {
        expect_shape(OP, "db", db, &Shape::new([co]))?;
    }
    dev.backend()?.conv1d_bwd(dy, x, w, spec, dw, db)
}

/// Checks `images (B, C, H, W)` against `patch` and returns `(B, C, H, W)`.
fn patch_dims(
    op: &'static str,
    name: &str,
    image_shape: &Shape,
    patch: usize,
) -> Result<[usize; 4]> {
    let dims = image_shape.dims_n::<4>(op, name)?;
    if patch == 0 {
        return Err(Error::invalid(op, "patch size must be >= 1, got 0"));
    }
    let [_, _, h, w] = dims;
    if h % patch != 0 || w % patch != 0 {
        return Err(Error::shape(
            op,
            format!(
                "`{name}` {image_shape}: H = {h} and W = {w} must be multiples of the patch size {patch}"
            ),
        ));
    }
    Ok(dims)
}

/// The shape `(B, (H/P)*(W/P), C*P*P)` of the patches of `(B, C, H, W)` images.
fn patches_shape([b, c, h, w]: [usize; 4], p: usize) -> Shape {
    Shape::new([b, (h / p) * (w / p), c * p * p])
}

/// images (B, C, H, W) -> patches (B, (H/P)(W/P), C P P); H and W multiples of P.
/// Patches are in raster order (row of patches by row), each flattened as (C, P, P).
pub fn patchify_fwd(images: &Tensor, patch: usize) -> Result<Tensor> {
    const OP: &str = "patchify_fwd";
    same_float_dtype(OP, &[("images", images)])?;
    patch_dims(OP, "images", images.shape(), patch)?;
    images.device().backend()?.patchify(images, patch)
}

/// Backward of [`patchify_fwd`]: dpatches -> dimages of `image_shape` (a permutation,
/// so this is also the exact inverse).
pub fn patchify_bwd(dpatches: &Tensor, image_shape: &Shape, patch: usize) -> Result<Tensor> {
    const OP: &str = "patchify_bwd";
    same_float_dtype(OP, &[("dpatches", dpatches)])?;
    let dims = patch_dims(OP, "image_shape", image_shape, patch)?;
    expect_shape(OP, "dpatches", dpatches, &patches_shape(dims, patch))?;
    dpatches
        .device()
        .backend()?
        .unpatchify(dpatches, image_shape, patch)
}

/// The dims of a conv1d, for the backends: the ops layer has validated them, this
/// re-derives them from the buffers' shapes so a kernel never indexes past a buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Conv1dDims {
    pub(crate) b: usize,
    pub(crate) ci: usize,
    pub(crate) l: usize,
    pub(crate) co: usize,
    pub(crate) k: usize,
    pub(crate) lo: usize,
    pub(crate) stride: usize,
    pub(crate) pad: usize,
}

impl Conv1dDims {
    pub(crate) fn new(op: &'static str, x: &Tensor, w: &Tensor, spec: &Conv1dSpec) -> Result<Self> {
        let [b, ci, l] = x.shape().dims_n::<3>(op, "x")?;
        let [co, _, k] = w.shape().dims_n::<3>(op, "w")?;
        let lo = spec.out_len(l, k).ok_or_else(|| {
            Error::shape(op, format!("x {} too short for w {}", x.shape(), w.shape()))
        })?;
        Ok(Conv1dDims {
            b,
            ci,
            l,
            co,
            k,
            lo,
            stride: spec.stride,
            pad: spec.padding,
        })
    }

    /// Rows of the column matrix: one per (input channel, kernel tap).
    pub(crate) fn cik(&self) -> usize {
        self.ci * self.k
    }

    /// The input position read by output position `o` at tap `kk`, if not padding.
    #[inline]
    pub(crate) fn src(&self, o: usize, kk: usize) -> Option<usize> {
        (o * self.stride + kk)
            .checked_sub(self.pad)
            .filter(|&i| i < self.l)
    }

    /// Threads for each batch item's GEMM: all of them for one item, fewer as the
    /// items themselves run in parallel.
    pub(crate) fn gemm_threads(&self) -> usize {
        (rayon::current_num_threads() / self.b.max(1)).max(1)
    }
}
