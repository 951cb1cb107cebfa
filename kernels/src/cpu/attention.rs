//! CPU varlen attention (blocked, online softmax).

use super::{CpuBackend, not_yet};
use crate::backend::AttentionKernels;
use crate::error::Result;
use crate::ops::attention::AttentionSpec;
use crate::tensor::Tensor;

impl AttentionKernels for CpuBackend {
    fn attention_fwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _cu_seqlens: &[usize],
        _spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        Err(not_yet("attention_fwd"))
    }
    fn attention_bwd(
        &self,
        _dout: &Tensor,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _out: &Tensor,
        _lse: &Tensor,
        _cu_seqlens: &[usize],
        _spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Err(not_yet("attention_bwd"))
    }
}
