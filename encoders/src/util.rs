//! Small helpers shared by the encoders: index tensors and zero buffers.

use braid_kernels::{DType, Device, Tensor};
use braid_nn::Result;
use braid_nn::error::Context;

/// A u32 index tensor (N) on `dev` (row indices for gather/scatter).
pub(crate) fn ids(v: Vec<u32>, dev: Device) -> Result<Tensor> {
    let n = v.len();
    Tensor::from_vec_u32(v, [n], dev).ctx("encoders", "index tensor")
}

/// An f32 zero tensor of `dims` on `dev`.
pub(crate) fn zeros(dims: &[usize], dtype: DType, dev: Device) -> Result<Tensor> {
    Tensor::zeros(dims.to_vec(), dtype, dev).ctx("encoders", "zero buffer")
}
