//! `Embedding`: a (V, C) table looked up by token id.

use braid_kernels::{Tensor, ops};

use crate::error::{Context, Error, Result};
use crate::param::{Init, InitKind, Module, Param, Shard};

/// Token embedding `(N) u32 -> (N, C)`; the weight is `{name}.weight` (V, C),
/// initialized Normal(0, init.std).
#[derive(Debug)]
pub struct Embedding {
    pub name: String,
    pub weight: Param,
}

/// What [`Embedding::backward`] needs: the ids.
#[derive(Debug)]
pub struct EmbeddingCache {
    pub ids: Tensor,
}

impl Embedding {
    pub fn new(init: &Init, name: &str, vocab: usize, c: usize) -> Result<Self> {
        if vocab == 0 || c == 0 {
            return Err(Error::config(
                "Embedding",
                format!("{name}: vocab = {vocab} and c = {c} must be > 0"),
            ));
        }
        let weight = init.param(
            &format!("{name}.weight"),
            &[vocab, c],
            InitKind::Normal(init.std),
            Shard::Full,
        )?;
        Ok(Embedding {
            name: name.to_string(),
            weight,
        })
    }

    /// ids (N) u32 -> (N, C); the cache holds a copy of the ids.
    pub fn forward(&self, ids: &Tensor) -> Result<(Tensor, EmbeddingCache)> {
        let y = ops::embedding_fwd(ids, self.weight.compute()).ctx(&self.name, "forward")?;
        let ids = ids.try_clone().ctx(&self.name, "caching ids")?;
        Ok((y, EmbeddingCache { ids }))
    }

    /// Adds the scatter of `dy` (N, C) into the table's grad (nothing when frozen).
    /// Token ids have no gradient, so there is no input grad to return.
    pub fn backward(&mut self, cache: EmbeddingCache, dy: &Tensor) -> Result<()> {
        match self.weight.grad.as_mut() {
            Some(g) => ops::embedding_bwd(dy, &cache.ids, g).ctx(&self.name, "backward"),
            None => Ok(()),
        }
    }
}

impl Module for Embedding {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(&self.weight);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
    }
}
