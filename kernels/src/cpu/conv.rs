//! CPU conv1d (im2col + GEMM) and patchify.

use super::{CpuBackend, not_yet};
use crate::backend::ConvKernels;
use crate::error::Result;
use crate::ops::conv::Conv1dSpec;
use crate::shape::Shape;
use crate::tensor::Tensor;

impl ConvKernels for CpuBackend {
    fn conv1d_fwd(
        &self,
        _x: &Tensor,
        _w: &Tensor,
        _b: Option<&Tensor>,
        _spec: &Conv1dSpec,
    ) -> Result<Tensor> {
        Err(not_yet("conv1d_fwd"))
    }
    fn conv1d_bwd(
        &self,
        _dy: &Tensor,
        _x: &Tensor,
        _w: &Tensor,
        _spec: &Conv1dSpec,
        _dw: Option<&mut Tensor>,
        _db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        Err(not_yet("conv1d_bwd"))
    }
    fn patchify(&self, _images: &Tensor, _patch: usize) -> Result<Tensor> {
        Err(not_yet("patchify"))
    }
    fn unpatchify(
        &self,
        _dpatches: &Tensor,
        _image_shape: &Shape,
        _patch: usize,
    ) -> Result<Tensor> {
        Err(not_yet("unpatchify"))
    }
}
