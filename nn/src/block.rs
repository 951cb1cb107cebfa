//! Pre-norm transformer block: `h = x + attn(norm1(x))`, `y = h + mlp(norm2(h))`.

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::{Tensor, ops};

use crate::attention::{Attention, AttentionCache, AttentionConfig};
use crate::error::{Context, Error, Result};
use crate::mlp::{Mlp, MlpCache, MlpConfig};
use crate::norm::{Norm, NormCache, NormKind};
use crate::param::{Init, Module, Param};
use crate::rope::SeqInfo;

/// Everything that defines a block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockConfig {
    pub attn: AttentionConfig,
    pub mlp: MlpConfig,
    pub norm: NormKind,
    pub norm_eps: f32,
}

impl BlockConfig {
    /// Checks the whole block for a TP group of `tp` ranks.
    pub fn validate(&self, tp: usize) -> Result<()> {
        self.attn.validate(tp)?;
        self.mlp.validate(tp)?;
        if self.mlp.c != self.attn.dims.c {
            return Err(Error::config(
                "BlockConfig",
                format!(
                    "mlp.c = {} differs from attn.dims.c = {}",
                    self.mlp.c, self.attn.dims.c
                ),
            ));
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(Error::config(
                "BlockConfig",
                format!("norm_eps = {} must be a positive number", self.norm_eps),
            ));
        }
        Ok(())
    }
}

/// A pre-norm block with Hugging Face parameter names: `{name}.input_layernorm`,
/// `{name}.self_attn.{q,k,v,o}_proj`, `{name}.post_attention_layernorm`,
/// `{name}.mlp.{gate,up,down}_proj` (or `mlp.fc1`/`mlp.fc2`).
#[derive(Debug)]
pub struct TransformerBlock {
    pub name: String,
    pub config: BlockConfig,
    pub input_layernorm: Norm,
    pub self_attn: Attention,
    pub post_attention_layernorm: Norm,
    pub mlp: Mlp,
}

/// What [`TransformerBlock::backward`] needs.
#[derive(Debug)]
pub struct BlockCache {
    /// holds x (T, C)
    norm1: NormCache,
    attn: AttentionCache,
    /// holds h = x + attn (T, C)
    norm2: NormCache,
    mlp: MlpCache,
}

/// What a block keeps between its forward and its backward: every intermediate, or
/// under activation recomputation only its input, the forward re-run by the backward
/// (Megatron's "full" recomputation, one block at a time).
#[derive(Debug)]
pub enum BlockSaved {
    Cache(Box<BlockCache>),
    /// x (T, C)
    Input(Tensor),
}

impl TransformerBlock {
    pub fn new(init: &Init, name: &str, config: BlockConfig, group: Arc<dyn Comm>) -> Result<Self> {
        config.validate(group.size())?;
        let c = config.attn.dims.c;
        let norm = |n: &str| {
            Norm::new(
                init,
                &format!("{name}.{n}"),
                config.norm,
                c,
                config.norm_eps,
            )
        };
        Ok(TransformerBlock {
            name: name.to_string(),
            config,
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::new(
                init,
                &format!("{name}.self_attn"),
                config.attn,
                Arc::clone(&group),
            )?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            mlp: Mlp::new(init, &format!("{name}.mlp"), config.mlp, group)?,
        })
    }

    /// x (T, C) packed tokens described by `seq` -> (T, C).
    pub fn forward(&self, x: &Tensor, seq: &SeqInfo) -> Result<(Tensor, BlockCache)> {
        self.forward_owned(x.try_clone().ctx(&self.name, "caching input")?, seq)
    }

    /// Forward that moves `x` into the cache.
    pub fn forward_owned(&self, x: Tensor, seq: &SeqInfo) -> Result<(Tensor, BlockCache)> {
        let (xn, norm1) = self.input_layernorm.forward_owned(x)?;
        let (a, attn) = self.self_attn.forward_owned(xn, seq)?;
        let h = ops::add(norm1.input(), &a).ctx(&self.name, "attention residual")?; // (T, C)
        let (hn, norm2) = self.post_attention_layernorm.forward_owned(h)?;
        let (m, mlp) = self.mlp.forward_owned(hn)?;
        let y = ops::add(norm2.input(), &m).ctx(&self.name, "mlp residual")?; // (T, C)
        Ok((
            y,
            BlockCache {
                norm1,
                attn,
                norm2,
                mlp,
            },
        ))
    }

    /// [`Self::forward_owned`] keeping everything (`recompute` false) or only `x`: the
    /// intermediates are freed as soon as `y` is computed, and
    /// [`Self::backward_saved`] computes them again. The re-run issues the forward's
    /// collectives (TP, CP) again, in the same order on every rank of the group.
    pub fn forward_saving(
        &self,
        x: Tensor,
        seq: &SeqInfo,
        recompute: bool,
    ) -> Result<(Tensor, BlockSaved)> {
        if !recompute {
            let (y, cache) = self.forward_owned(x, seq)?;
            return Ok((y, BlockSaved::Cache(Box::new(cache))));
        }
        // Keep x itself (the cache holds it for the first norm), drop the rest.
        let (y, cache) = self.forward_owned(x, seq)?; // (T, C)
        Ok((y, BlockSaved::Input(cache.norm1.into_input())))
    }

    /// Backward of [`Self::forward_saving`]; `seq` is the one the forward was given
    /// (read only to recompute, so callers that keep everything may pass `None`).
    pub fn backward_saved(
        &mut self,
        saved: BlockSaved,
        seq: Option<&SeqInfo>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let cache = match (saved, seq) {
            (BlockSaved::Cache(c), _) => *c,
            (BlockSaved::Input(x), Some(seq)) => self.forward_owned(x, seq)?.1,
            (BlockSaved::Input(_), None) => {
                return Err(Error::input(
                    &self.name,
                    "recomputing the forward needs the packing (SeqInfo) it was given",
                ));
            }
        };
        self.backward(cache, dy)
    }

    pub fn backward(&mut self, cache: BlockCache, dy: &Tensor) -> Result<Tensor> {
        let BlockCache {
            norm1,
            attn,
            norm2,
            mlp,
        } = cache;
        // y = h + mlp(norm2(h)): dh = dy + norm2ᵀ(mlpᵀ(dy))
        let dhn = self.mlp.backward(mlp, dy)?;
        let mut dh = self.post_attention_layernorm.backward(norm2, &dhn)?;
        ops::add_assign(&mut dh, dy).ctx(&self.name, "mlp residual backward")?;
        // h = x + attn(norm1(x)): dx = dh + norm1ᵀ(attnᵀ(dh))
        let dxn = self.self_attn.backward(attn, &dh)?;
        let mut dx = self.input_layernorm.backward(norm1, &dxn)?;
        ops::add_assign(&mut dx, &dh).ctx(&self.name, "attention residual backward")?;
        Ok(dx)
    }
}

impl Module for TransformerBlock {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.input_layernorm.visit_params(f);
        self.self_attn.visit_params(f);
        self.post_attention_layernorm.visit_params(f);
        self.mlp.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.input_layernorm.visit_params_mut(f);
        self.self_attn.visit_params_mut(f);
        self.post_attention_layernorm.visit_params_mut(f);
        self.mlp.visit_params_mut(f);
    }
}
