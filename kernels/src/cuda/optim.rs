//! The optim kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::OptimKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::ops::optim::AdamWSpec;

impl OptimKernels for CudaBackend {
    fn adamw_step(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        spec: &AdamWSpec,
    ) -> Result<()> {
        Err(not_written("adamw_step"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
