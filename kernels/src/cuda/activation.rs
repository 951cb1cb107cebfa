//! The activation kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::ActivationKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::ops::activation::Activation;

impl ActivationKernels for CudaBackend {
    fn activation_fwd(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        Err(not_written("activation_fwd"))
    }

    fn activation_bwd(&self, dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
        Err(not_written("activation_bwd"))
    }

    fn swiglu_fwd(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        Err(not_written("swiglu_fwd"))
    }

    fn swiglu_bwd(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        Err(not_written("swiglu_bwd"))
    }

    fn softmax_fwd(&self, x: &Tensor) -> Result<Tensor> {
        Err(not_written("softmax_fwd"))
    }

    fn softmax_bwd(&self, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
        Err(not_written("softmax_bwd"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
