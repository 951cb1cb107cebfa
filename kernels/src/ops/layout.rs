//! Layout ops: move data without arithmetic. Their adjoints are each other's
//! counterparts (transpose01 is its own inverse; narrow_last's adjoint is a zero-pad,
//! needed only once a layer narrows a tensor it must also differentiate through).

use super::same_device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// x (A, B, C) -> (B, A, C). Any dtype.
pub fn transpose01(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "transpose01";
    same_device(OP, &[("x", x)])?;
    x.shape().dims_n::<3>(OP, "x")?;
    x.device().backend()?.transpose01(x)
}

/// Columns `start .. start + len` of the last dimension: x (..., C) -> (..., len).
/// Any dtype.
pub fn narrow_last(x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    const OP: &str = "narrow_last";
    let c = x.shape().last_dim(OP)?;
    if start.checked_add(len).is_none_or(|end| end > c) {
        return Err(Error::shape(
            OP,
            format!(
                "columns {start}..{} are out of range for x {}",
                start.saturating_add(len),
                x.shape()
            ),
        ));
    }
    let n = x.shape().rows();
    let out = x.device().backend()?.narrow_last(x, start, len)?;
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = len;
    }
    debug_assert_eq!(out.elem_count(), n * len);
    out.reshape(dims)
}
