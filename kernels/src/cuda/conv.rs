//! The conv kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::ConvKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::ops::conv::Conv1dSpec;
use crate::shape::Shape;

impl ConvKernels for CudaBackend {
    fn conv1d_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        spec: &Conv1dSpec,
    ) -> Result<Tensor> {
        Err(not_written("conv1d_fwd"))
    }

    fn conv1d_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        spec: &Conv1dSpec,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        Err(not_written("conv1d_bwd"))
    }

    fn patchify(&self, images: &Tensor, patch: usize) -> Result<Tensor> {
        Err(not_written("patchify"))
    }

    fn unpatchify(&self, dpatches: &Tensor, image_shape: &Shape, patch: usize) -> Result<Tensor> {
        Err(not_written("unpatchify"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
