//! CPU rotary position embedding.

use super::{CpuBackend, not_yet};
use crate::backend::RopeKernels;
use crate::error::Result;
use crate::tensor::Tensor;

impl RopeKernels for CpuBackend {
    fn rope(&self, _x: &Tensor, _cos: &Tensor, _sin: &Tensor, _inverse: bool) -> Result<Tensor> {
        Err(not_yet("rope"))
    }
}
