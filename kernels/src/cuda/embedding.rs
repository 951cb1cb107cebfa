//! The embedding kernels on CUDA: not written yet (each is an error naming itself).

#![allow(unused_variables)]

use super::CudaBackend;
use crate::backend::EmbeddingKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl EmbeddingKernels for CudaBackend {
    fn embedding_fwd(&self, ids: &Tensor, table: &Tensor) -> Result<Tensor> {
        Err(not_written("embedding_fwd"))
    }

    fn embedding_bwd(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
        Err(not_written("embedding_bwd"))
    }

}

fn not_written(op: &'static str) -> Error {
    Error::Cuda {
        op,
        device: crate::Device::Cuda(0),
        msg: "this kernel is not written for CUDA yet".into(),
    }
}
