//! Elementwise arithmetic, reductions and casts.

use super::{accumulator_dtype, same_device, same_float_dtype, same_shape};
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// `a + b` (same shape, same dtype, same device).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "add";
    let dev = same_device(OP, &[("a", a), ("b", b)])?;
    same_float_dtype(OP, &[("a", a), ("b", b)])?;
    same_shape(OP, ("a", a), ("b", b))?;
    dev.backend()?.add(a, b)
}

/// `acc += x` — how gradients accumulate.
pub fn add_assign(acc: &mut Tensor, x: &Tensor) -> Result<()> {
    const OP: &str = "add_assign";
    let dev = same_device(OP, &[("acc", acc), ("x", x)])?;
    let dtype = same_float_dtype(OP, &[("x", x)])?;
    accumulator_dtype(OP, ("acc", acc), dtype)?;
    same_shape(OP, ("acc", acc), ("x", x))?;
    dev.backend()?.add_assign(acc, x)
}

/// `x *= s` in place.
pub fn scale_assign(x: &mut Tensor, s: f32) -> Result<()> {
    same_float_dtype("scale_assign", &[("x", x)])?;
    x.device().backend()?.scale_assign(x, s)
}

/// `sum(x^2)`, accumulated in f64 and returned to the host.
pub fn sum_squares(x: &Tensor) -> Result<f64> {
    same_float_dtype("sum_squares", &[("x", x)])?;
    x.device().backend()?.sum_squares(x)
}

/// The global L2 norm of a set of tensors (the gradients of a model), all on one
/// device: each tensor's sum of squares in f64, added in order (deterministic), and one
/// scalar copied to the host for the whole set.
pub fn global_norm<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<f64> {
    let tensors: Vec<&Tensor> = tensors.into_iter().collect();
    let Some(first) = tensors.first() else {
        return Ok(0.0);
    };
    for t in &tensors {
        same_float_dtype("global_norm", &[("tensor", t)])?;
    }
    let named: Vec<(&'static str, &Tensor)> = tensors.iter().map(|t| ("tensor", *t)).collect();
    same_device("global_norm", &named)?;
    Ok(first.device().backend()?.sum_squares_all(&tensors)?.sqrt())
}

/// Converts between f32 and bf16 (round to nearest even); the same dtype is a copy.
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    same_float_dtype("cast", &[("x", x)])?;
    if !dtype.is_float() {
        return Err(crate::Error::DType {
            op: "cast",
            arg: "dtype",
            got: dtype,
            expected: DType::F32,
        });
    }
    x.device().backend()?.cast(x, dtype)
}

/// `x` in `dtype`: moved through unchanged when it already is, cast otherwise (where
/// f32 data such as pixels or mel frames enters a model that computes in bf16).
pub fn into_dtype(x: Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x);
    }
    cast(&x, dtype)
}
