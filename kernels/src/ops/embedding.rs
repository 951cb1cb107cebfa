//! Token-embedding lookup and its scatter-add backward.
//!
//! Ids may have any rank >= 1 (`(N)` or `(B, T)`): the kernels read them as a flat
//! `(N)` and the output takes the ids' shape plus the channel dimension. That every id
//! is `< V` is a property of values in device memory, so it is checked by the kernel
//! (the CPU one returns [`Error::Invalid`] naming the first bad id, its position and
//! V); this layer checks everything else.

use super::{expect_dtype, expect_shape, same_device, same_float_dtype};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// `ids` must be u32 of rank >= 1; returns the shape of the rows it selects, `ids.dims + [C]`.
fn out_shape(op: &'static str, ids: &Tensor, c: usize) -> Result<Shape> {
    expect_dtype(op, DType::U32, &[("ids", ids)])?;
    if ids.rank() == 0 {
        return Err(Error::shape(
            op,
            "`ids` must have rank >= 1, got a scalar".to_string(),
        ));
    }
    let mut dims = ids.dims().to_vec();
    dims.push(c);
    Ok(Shape::new(dims))
}

/// ids (..., ) u32, table (V, C) -> (..., C): row `ids[n]` of the table for every n.
pub fn embedding_fwd(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding_fwd";
    let dev = same_device(OP, &[("table", table), ("ids", ids)])?;
    same_float_dtype(OP, &[("table", table)])?;
    let [_, c] = table.shape().dims_n::<2>(OP, "table")?;
    let shape = out_shape(OP, ids, c)?;
    let y = dev.backend()?.embedding_fwd(ids, table)?;
    y.reshape(shape)
}

/// dtable[ids[n], :] += dy[n, :]; `dy` is `ids.dims + [C]`, `dtable` (V, C). Repeated
/// ids sum their rows.
pub fn embedding_bwd(dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
    const OP: &str = "embedding_bwd";
    let dev = same_device(OP, &[("dtable", dtable), ("dy", dy), ("ids", ids)])?;
    // Embedding grads sum many rows: the accumulator is f32 whatever dy is.
    same_float_dtype(OP, &[("dy", dy)])?;
    expect_dtype(OP, DType::F32, &[("dtable", dtable)])?;
    let [_, c] = dtable.shape().dims_n::<2>(OP, "dtable")?;
    let shape = out_shape(OP, ids, c)?;
    expect_shape(OP, "dy", dy, &shape)?;
    dev.backend()?.embedding_bwd(dy, ids, dtable)
}
