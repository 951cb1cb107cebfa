//! The layout kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::LayoutKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl LayoutKernels for CudaBackend {
    fn transpose01(&self, x: &Tensor) -> Result<Tensor> {
        Err(not_written("transpose01"))
    }

    fn narrow_last(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        Err(not_written("narrow_last"))
    }

    fn gather_rows(&self, x: &Tensor, idx: &Tensor) -> Result<Tensor> {
        Err(not_written("gather_rows"))
    }

    fn scatter_rows(&self, dst: &mut Tensor, idx: &Tensor, src: &Tensor) -> Result<()> {
        Err(not_written("scatter_rows"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
