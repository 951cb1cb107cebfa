//! The matmul kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::MatmulKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::ops::matmul::GemmSpec;

impl MatmulKernels for CudaBackend {
    fn gemm(&self, a: &Tensor, b: &Tensor, c: &mut Tensor, spec: &GemmSpec) -> Result<()> {
        Err(not_written("gemm"))
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        Err(not_written("add_bias"))
    }

    fn bias_grad(&self, dy: &Tensor, dbias: &mut Tensor) -> Result<()> {
        Err(not_written("bias_grad"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
