//! The attention kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::AttentionKernels;
use crate::error::{Error, Result};
use crate::ops::attention::AttentionSpec;
use crate::ops::attention::QkSegment;
use crate::tensor::Tensor;

impl AttentionKernels for CudaBackend {
    fn attention_fwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        Err(not_written("attention_fwd"))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Err(not_written("attention_bwd"))
    }

    fn attention_fwd_ranges(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        Err(not_written("attention_fwd_ranges"))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_bwd_ranges(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Err(not_written("attention_bwd_ranges"))
    }
}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
