//! LayerNorm and RMSNorm over the last dimension, forward and backward.
//!
//! `x (..., C)` is read as `(N, C)`, N the product of the leading dimensions. The
//! forwards return the per-row statistics (`mean (N)`, `rstd (N)`, always f32 whatever
//! the activation dtype, as in llm.c) and the backwards take them back, so the
//! backward never recomputes a reduction over the row.

use super::{
    accumulator_dtype, expect_dtype, expect_shape, same_device, same_float_dtype, same_shape,
};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// Reads `x (..., C)` as `(N, C)`. A scalar, or an empty last dimension (whose mean
/// and variance do not exist), is a shape error.
pub(crate) fn rows_cols(op: &'static str, name: &str, x: &Tensor) -> Result<(usize, usize)> {
    let Some(&c) = x.dims().last() else {
        return Err(Error::shape(
            op,
            format!("`{name}` must have rank >= 1, got a scalar"),
        ));
    };
    if c == 0 {
        return Err(Error::shape(
            op,
            format!(
                "`{name}` {} has an empty last dimension: nothing to normalize",
                x.shape()
            ),
        ));
    }
    Ok((x.shape().rows(), c))
}

/// `eps` must be a finite, non-negative number (a negative one can make the variance
/// term negative and the result NaN).
fn check_eps(op: &'static str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::invalid(
            op,
            format!("eps must be finite and >= 0, got {eps}"),
        ));
    }
    Ok(())
}

/// A parameter-grad buffer: on `dev`, the dtype of `dy`, shape `want`.
fn check_param_grad(
    op: &'static str,
    name: &'static str,
    g: &Tensor,
    dy: &Tensor,
    dev: Device,
    want: &Shape,
) -> Result<()> {
    if g.device() != dev {
        return Err(Error::Device {
            op,
            arg: name,
            got: g.device(),
            expected: dev,
        });
    }
    let dtype = same_float_dtype(op, &[("dy", dy)])?;
    accumulator_dtype(op, (name, g), dtype)?;
    expect_shape(op, name, g, want)
}

/// The per-row statistics handed from forward to backward: f32, shape (N).
fn check_stats(
    op: &'static str,
    dev: Device,
    n: usize,
    stats: &[(&'static str, &Tensor)],
) -> Result<()> {
    for (name, t) in stats {
        if t.device() != dev {
            return Err(Error::Device {
                op,
                arg: name,
                got: t.device(),
                expected: dev,
            });
        }
    }
    expect_dtype(op, DType::F32, stats)?;
    for (name, t) in stats {
        expect_shape(op, name, t, &Shape::new([n]))?;
    }
    Ok(())
}

/// `y = (x - mean) * rstd * w + b` per row, `rstd = 1 / sqrt(var + eps)` with the
/// biased variance (PyTorch's `nn.LayerNorm`).
///
/// x (..., C), w (C), b (C) -> (y (..., C), mean (N), rstd (N)) with N = rows of x.
pub fn layer_norm_fwd(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layer_norm_fwd";
    let mut args = vec![("x", x), ("w", w)];
    if let Some(b) = b {
        args.push(("b", b));
    }
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    let (_, c) = rows_cols(OP, "x", x)?;
    expect_shape(OP, "w", w, &Shape::new([c]))?;
    if let Some(b) = b {
        expect_shape(OP, "b", b, &Shape::new([c]))?;
    }
    check_eps(OP, eps)?;
    dev.backend()?.layer_norm_fwd(x, w, b, eps)
}

/// Backward of [`layer_norm_fwd`]: returns dx (shaped like x); adds `sum_n dy * xhat`
/// into `dw` and `sum_n dy` into `db` when given (`None`: a frozen parameter).
pub fn layer_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    const OP: &str = "layer_norm_bwd";
    let args = [("dy", dy), ("x", x), ("w", w)];
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    same_shape(OP, ("dy", dy), ("x", x))?;
    let (n, c) = rows_cols(OP, "x", x)?;
    let c_shape = Shape::new([c]);
    expect_shape(OP, "w", w, &c_shape)?;
    check_stats(OP, dev, n, &[("mean", mean), ("rstd", rstd)])?;
    if let Some(dw) = dw.as_deref() {
        check_param_grad(OP, "dw", dw, dy, dev, &c_shape)?;
    }
    if let Some(db) = db.as_deref() {
        check_param_grad(OP, "db", db, dy, dev, &c_shape)?;
    }
    dev.backend()?.layer_norm_bwd(dy, x, w, mean, rstd, dw, db)
}

/// `y = x * rstd * w`, `rstd = 1 / sqrt(mean(x^2) + eps)` per row: the RMSNorm of
/// Llama and Qwen2 (the weight multiplies as is, not `1 + w` as in Gemma).
///
/// x (..., C), w (C) -> (y (..., C), rstd (N)).
pub fn rms_norm_fwd(x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rms_norm_fwd";
    let dev = same_device(OP, &[("x", x), ("w", w)])?;
    same_float_dtype(OP, &[("x", x), ("w", w)])?;
    let (_, c) = rows_cols(OP, "x", x)?;
    expect_shape(OP, "w", w, &Shape::new([c]))?;
    check_eps(OP, eps)?;
    dev.backend()?.rms_norm_fwd(x, w, eps)
}

/// Backward of [`rms_norm_fwd`]: returns dx (shaped like x); adds `sum_n dy * x * rstd`
/// into `dw` when given.
pub fn rms_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dw: Option<&mut Tensor>,
) -> Result<Tensor> {
    const OP: &str = "rms_norm_bwd";
    let args = [("dy", dy), ("x", x), ("w", w)];
    let dev = same_device(OP, &args)?;
    same_float_dtype(OP, &args)?;
    same_shape(OP, ("dy", dy), ("x", x))?;
    let (n, c) = rows_cols(OP, "x", x)?;
    let c_shape = Shape::new([c]);
    expect_shape(OP, "w", w, &c_shape)?;
    check_stats(OP, dev, n, &[("rstd", rstd)])?;
    if let Some(dw) = dw.as_deref() {
        check_param_grad(OP, "dw", dw, dy, dev, &c_shape)?;
    }
    dev.backend()?.rms_norm_bwd(dy, x, w, rstd, dw)
}
