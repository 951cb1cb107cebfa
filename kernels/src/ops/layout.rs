//! Layout ops: move data without arithmetic. Their adjoints are each other's
//! counterparts (transpose01 is its own inverse; narrow_last's adjoint is a zero-pad,
//! needed only once a layer narrows a tensor it must also differentiate through).

use super::{expect_dtype, same_device};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `dst[dst_start .. dst_start + n] = src[src_start .. src_start + n]` over the flat
/// element order of two tensors of one dtype on one device: how gradient buckets are
/// packed and unpacked without leaving the device. Any dtype.
pub fn copy_range(
    src: &Tensor,
    src_start: usize,
    dst: &mut Tensor,
    dst_start: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "copy_range";
    let dev = same_device(OP, &[("src", src), ("dst", dst)])?;
    if src.dtype() != dst.dtype() {
        return Err(Error::DType {
            op: OP,
            arg: "dst",
            got: dst.dtype(),
            expected: src.dtype(),
        });
    }
    for (name, t, start) in [("src", src, src_start), ("dst", &*dst, dst_start)] {
        if start.checked_add(n).is_none_or(|end| end > t.elem_count()) {
            return Err(Error::shape(
                OP,
                format!(
                    "{name} {} holds {} elements: cannot take {n} from offset {start}",
                    t.shape(),
                    t.elem_count()
                ),
            ));
        }
    }
    if n == 0 {
        return Ok(());
    }
    dev.backend()?.copy_range(src, src_start, dst, dst_start, n)
}

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

/// Checks `idx` is a rank-1 u32 tensor and `x` has rank 2; returns (N, C, M).
fn rows_and_index(op: &'static str, x: &Tensor, idx: &Tensor) -> Result<(usize, usize, usize)> {
    same_device(op, &[("x", x), ("idx", idx)])?;
    expect_dtype(op, DType::U32, &[("idx", idx)])?;
    let [n, c] = x.shape().dims_n::<2>(op, "x")?;
    let [m] = idx.shape().dims_n::<1>(op, "idx")?;
    Ok((n, c, m))
}

/// Rows of x (N, C) picked by idx (M) u32 -> (M, C). Its adjoint is a scatter-add
/// (`ops::embedding_bwd`, which is exactly that); together with [`scatter_rows`] it
/// places modality embeddings into a token sequence and routes their grads back.
pub fn gather_rows(x: &Tensor, idx: &Tensor) -> Result<Tensor> {
    rows_and_index("gather_rows", x, idx)?;
    x.device().backend()?.gather_rows(x, idx)
}

/// Overwrites rows of dst (N, C): `dst[idx[m]] = src[m]` for distinct idx (M) u32,
/// src (M, C) of dst's dtype. Backward: `d_src = gather_rows(d_dst, idx)`, and the
/// overwritten rows of `d_dst` are zeroed (scatter zeros) before flowing further back.
pub fn scatter_rows(dst: &mut Tensor, idx: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "scatter_rows";
    let (_, c, m) = rows_and_index(OP, dst, idx)?;
    same_device(OP, &[("dst", dst), ("src", src)])?;
    if src.dtype() != dst.dtype() {
        return Err(Error::DType {
            op: OP,
            arg: "src",
            got: src.dtype(),
            expected: dst.dtype(),
        });
    }
    if src.dims() != [m, c] {
        return Err(Error::shape(
            OP,
            format!(
                "src {} must be (M, C) = [{m}, {c}] for idx of {m} rows into dst {}",
                src.shape(),
                dst.shape()
            ),
        ));
    }
    dst.device().backend()?.scatter_rows(dst, idx, src)
}
