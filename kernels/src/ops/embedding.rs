//! Token-embedding lookup and its scatter-add backward.
//!
//! OWNER NOTE: validation to be completed (ids u32 rank 1, ids < V reported as Invalid).

use crate::error::Result;
use crate::tensor::Tensor;

/// ids (N) u32, table (V, C) -> (N, C).
pub fn embedding_fwd(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    table.device().backend()?.embedding_fwd(ids, table)
}

/// dtable[ids[n], :] += dy[n, :].
pub fn embedding_bwd(dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
    dy.device().backend()?.embedding_bwd(dy, ids, dtable)
}
