//! CPU embedding lookup and scatter-add backward.

use super::{CpuBackend, not_yet};
use crate::backend::EmbeddingKernels;
use crate::error::Result;
use crate::tensor::Tensor;

impl EmbeddingKernels for CpuBackend {
    fn embedding_fwd(&self, _ids: &Tensor, _table: &Tensor) -> Result<Tensor> {
        Err(not_yet("embedding_fwd"))
    }
    fn embedding_bwd(&self, _dy: &Tensor, _ids: &Tensor, _dtable: &mut Tensor) -> Result<()> {
        Err(not_yet("embedding_bwd"))
    }
}
