//! `VocabParallelEmbedding`: a (V, C) token table split by rows across the TP group
//! (Megatron-LM's `VocabParallelEmbedding`).
//!
//! Rank `r` of `tp` holds rows `r * V/tp .. (r + 1) * V/tp`, cut from the full table
//! drawn for the same [`Init`] (`Shard::Split { dim: 0 }`), so the ranks' shards
//! concatenate to exactly the single-rank [`crate::Embedding`]'s table. Forward: each
//! rank looks up the ids it holds and writes zero rows for the others, then the rows
//! are summed over the group (reduce_from_tp: exactly one rank contributes a non-zero
//! row per id, so the sum is exact). Backward: reduce_from_tp's adjoint is the
//! identity, and each rank scatter-adds the output grad of its in-range ids into its
//! shard.
//!
//! With a group of one it is [`crate::Embedding`] bit for bit (same kernels, same
//! order of accumulation). For a larger group the in-range test runs on a host copy of
//! the ids (N u32, 4 bytes a token, which the data loader produced on the host
//! anyway): the kernels have no integer compare/subtract op yet. A device kernel pair
//! replaces it for the GPU.

use std::ops::Range;
use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::{DType, Tensor, ops};

use crate::error::{Context, Error, Result};
use crate::param::{Init, InitKind, Module, Param, Shard};
use crate::regions::{reduce_from_tp_bwd, reduce_from_tp_fwd};

/// Token embedding `(N) u32 -> (N, C)` over a vocabulary split across `group`; the
/// weight `{name}.weight` is this rank's (V/tp, C) rows of the full (V, C) table.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    pub name: String,
    /// (V/tp, C): rows `vocab_start .. vocab_start + V/tp` of the full table.
    pub weight: Param,
    /// Full vocabulary V.
    pub vocab: usize,
    /// First id this rank holds: `rank * V/tp`.
    pub vocab_start: usize,
    pub group: Arc<dyn Comm>,
}

/// Which ids the forward looked up on this rank, for the backward.
#[derive(Debug)]
enum Lookup {
    /// Group of one: every id, as given (N) u32.
    All { ids: Tensor },
    /// The ids this rank holds: rows `rows` (K) u32 of the output came from local rows
    /// `local_ids` (K) u32 of the shard.
    Some { rows: Tensor, local_ids: Tensor },
    /// No id of the batch is in this rank's range.
    None,
}

/// What [`VocabParallelEmbedding::backward`] needs.
#[derive(Debug)]
pub struct VocabParallelCache {
    lookup: Lookup,
    /// (N)
    n: usize,
}

impl VocabParallelEmbedding {
    /// This rank's shard of the `vocab x c` table `{name}.weight` (Normal(0, init.std)
    /// for the full table). `vocab` must be a multiple of the group size.
    pub fn new(
        init: &Init,
        name: &str,
        vocab: usize,
        c: usize,
        group: Arc<dyn Comm>,
    ) -> Result<Self> {
        let (rank, size) = (group.rank(), group.size());
        if vocab == 0 || c == 0 {
            return Err(Error::config(
                "VocabParallelEmbedding",
                format!("{name}: vocab = {vocab} and c = {c} must be > 0"),
            ));
        }
        if size == 0 || !vocab.is_multiple_of(size) {
            return Err(Error::config(
                "VocabParallelEmbedding",
                format!(
                    "{name}: vocab = {vocab} is not divisible by tp = {size} (the table's rows are split evenly across the tensor-parallel group)"
                ),
            ));
        }
        let shard = if size == 1 {
            Shard::Full
        } else {
            Shard::Split { dim: 0, rank, size }
        };
        let weight = init.param(
            &format!("{name}.weight"),
            &[vocab, c],
            InitKind::Normal(init.std),
            shard,
        )?;
        Ok(VocabParallelEmbedding {
            name: name.to_string(),
            weight,
            vocab,
            vocab_start: rank * (vocab / size),
            group,
        })
    }

    /// The ids whose rows this rank holds: `vocab_start .. vocab_start + V/tp`.
    pub fn vocab_range(&self) -> Range<usize> {
        self.vocab_start..self.vocab_start + self.vocab / self.group.size()
    }

    /// ids (N) u32 -> (N, C), the same on every rank of the group.
    pub fn forward(&self, ids: &Tensor) -> Result<(Tensor, VocabParallelCache)> {
        self.forward_with_host_ids(ids, None)
    }

    /// [`Self::forward`] given the same ids on the host as well (where the batch was
    /// built): under tensor parallelism each rank picks the ids of its vocabulary range
    /// from them instead of copying `ids` back from the device (a host sync per step).
    pub fn forward_with_host_ids(
        &self,
        ids: &Tensor,
        host_ids: Option<&[u32]>,
    ) -> Result<(Tensor, VocabParallelCache)> {
        let name = self.name.as_str();
        let n = match *ids.dims() {
            [n] if ids.dtype() == DType::U32 => n,
            _ => {
                return Err(Error::input(
                    name,
                    format!("ids must be (N) u32, got {} {}", ids.shape(), ids.dtype()),
                ));
            }
        };
        let table = self.weight.compute(); // (V/tp, C)
        if self.group.size() == 1 {
            let y = ops::embedding_fwd(ids, table).ctx(name, "forward")?; // (N, C)
            let ids = ids.try_clone().ctx(name, "caching ids")?;
            return Ok((
                y,
                VocabParallelCache {
                    lookup: Lookup::All { ids },
                    n,
                },
            ));
        }
        let range = self.vocab_range();
        let read;
        let host: &[u32] = match host_ids {
            Some(h) if h.len() == n => h,
            Some(h) => {
                return Err(Error::input(
                    name,
                    format!("{} host ids for {n} device ids", h.len()),
                ));
            }
            None => {
                read = ids.to_vec_u32().ctx(name, "ids to host")?;
                &read
            }
        }; // (N)
        let mut rows = Vec::new(); // (K)
        let mut local = Vec::new(); // (K)
        for (i, &id) in host.iter().enumerate() {
            let id = id as usize;
            if id >= self.vocab {
                return Err(Error::input(
                    name,
                    format!(
                        "ids[{i}] = {id} is out of range for a vocabulary of {}",
                        self.vocab
                    ),
                ));
            }
            if range.contains(&id) {
                rows.push(i as u32);
                local.push((id - range.start) as u32);
            }
        }
        let c = table.dims()[1];
        let dev = table.device();
        let mut y = Tensor::zeros([n, c], table.dtype(), dev).ctx(name, "zero rows")?; // (N, C)
        let lookup = if rows.is_empty() {
            Lookup::None
        } else {
            let k = rows.len();
            let rows = Tensor::from_vec_u32(rows, [k], dev).ctx(name, "rows to device")?;
            let local_ids =
                Tensor::from_vec_u32(local, [k], dev).ctx(name, "local ids to device")?;
            let found = ops::embedding_fwd(&local_ids, table).ctx(name, "forward")?; // (K, C)
            ops::scatter_rows(&mut y, &rows, &found).ctx(name, "place local rows")?;
            Lookup::Some { rows, local_ids }
        };
        let y = reduce_from_tp_fwd(self.group.as_ref(), y).ctx(name, "forward")?;
        Ok((y, VocabParallelCache { lookup, n }))
    }

    /// Adds the grad of this rank's rows for output grad `dy` (N, C) (nothing when
    /// frozen). Token ids have no gradient, so there is no input grad to return.
    pub fn backward(&mut self, cache: VocabParallelCache, dy: &Tensor) -> Result<()> {
        let name = self.name.as_str();
        let c = self.weight.value.dims()[1];
        if dy.dims() != [cache.n, c] {
            return Err(Error::input(
                name,
                format!("dy {} must be (N, C) = [{}, {c}]", dy.shape(), cache.n),
            ));
        }
        let dy = reduce_from_tp_bwd(self.group.as_ref(), dy);
        let Some(g) = self.weight.grad.as_mut() else {
            return Ok(());
        };
        match cache.lookup {
            Lookup::All { ids } => ops::embedding_bwd(dy, &ids, g).ctx(name, "backward"),
            Lookup::Some { rows, local_ids } => {
                let d = ops::gather_rows(dy, &rows).ctx(name, "backward: local rows")?; // (K, C)
                ops::embedding_bwd(&d, &local_ids, g).ctx(name, "backward")
            }
            Lookup::None => Ok(()),
        }
    }
}

impl Module for VocabParallelEmbedding {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(&self.weight);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
    }
}
