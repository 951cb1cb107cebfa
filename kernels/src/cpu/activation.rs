//! CPU activations, SwiGLU and softmax.

use super::{CpuBackend, not_yet};
use crate::backend::ActivationKernels;
use crate::error::Result;
use crate::ops::activation::Activation;
use crate::tensor::Tensor;

impl ActivationKernels for CpuBackend {
    fn activation_fwd(&self, _x: &Tensor, _act: Activation) -> Result<Tensor> {
        Err(not_yet("activation_fwd"))
    }
    fn activation_bwd(&self, _dy: &Tensor, _x: &Tensor, _act: Activation) -> Result<Tensor> {
        Err(not_yet("activation_bwd"))
    }
    fn swiglu_fwd(&self, _gate: &Tensor, _up: &Tensor) -> Result<Tensor> {
        Err(not_yet("swiglu_fwd"))
    }
    fn swiglu_bwd(&self, _dy: &Tensor, _gate: &Tensor, _up: &Tensor) -> Result<(Tensor, Tensor)> {
        Err(not_yet("swiglu_bwd"))
    }
    fn softmax_fwd(&self, _x: &Tensor) -> Result<Tensor> {
        Err(not_yet("softmax_fwd"))
    }
    fn softmax_bwd(&self, _dy: &Tensor, _y: &Tensor) -> Result<Tensor> {
        Err(not_yet("softmax_bwd"))
    }
}
