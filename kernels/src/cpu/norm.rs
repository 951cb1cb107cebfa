//! CPU LayerNorm and RMSNorm.

use super::{CpuBackend, not_yet};
use crate::backend::NormKernels;
use crate::error::Result;
use crate::tensor::Tensor;

impl NormKernels for CpuBackend {
    fn layer_norm_fwd(
        &self,
        _x: &Tensor,
        _w: &Tensor,
        _b: Option<&Tensor>,
        _eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Err(not_yet("layer_norm_fwd"))
    }
    fn layer_norm_bwd(
        &self,
        _dy: &Tensor,
        _x: &Tensor,
        _w: &Tensor,
        _mean: &Tensor,
        _rstd: &Tensor,
        _dw: Option<&mut Tensor>,
        _db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        Err(not_yet("layer_norm_bwd"))
    }
    fn rms_norm_fwd(&self, _x: &Tensor, _w: &Tensor, _eps: f32) -> Result<(Tensor, Tensor)> {
        Err(not_yet("rms_norm_fwd"))
    }
    fn rms_norm_bwd(
        &self,
        _dy: &Tensor,
        _x: &Tensor,
        _w: &Tensor,
        _rstd: &Tensor,
        _dw: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        Err(not_yet("rms_norm_bwd"))
    }
}
