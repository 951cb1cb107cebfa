//! CPU fused softmax cross-entropy.

use super::{CpuBackend, not_yet};
use crate::backend::LossKernels;
use crate::error::Result;
use crate::tensor::Tensor;

impl LossKernels for CpuBackend {
    fn cross_entropy(
        &self,
        _logits: &Tensor,
        _targets: &Tensor,
        _ignore_index: u32,
        _grad_scale: f32,
    ) -> Result<(Tensor, Tensor)> {
        Err(not_yet("cross_entropy"))
    }
}
