//! The norm kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::NormKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl NormKernels for CudaBackend {
    fn layer_norm_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Err(not_written("layer_norm_fwd"))
    }

    fn layer_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        Err(not_written("layer_norm_bwd"))
    }

    fn rms_norm_fwd(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        Err(not_written("rms_norm_fwd"))
    }

    fn rms_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        Err(not_written("rms_norm_bwd"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
