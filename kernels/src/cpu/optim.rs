//! CPU AdamW.

use super::{CpuBackend, not_yet};
use crate::backend::OptimKernels;
use crate::error::Result;
use crate::ops::optim::AdamWSpec;
use crate::tensor::Tensor;

impl OptimKernels for CpuBackend {
    fn adamw_step(
        &self,
        _param: &mut Tensor,
        _grad: &Tensor,
        _m: &mut Tensor,
        _v: &mut Tensor,
        _spec: &AdamWSpec,
    ) -> Result<()> {
        Err(not_yet("adamw_step"))
    }
}
