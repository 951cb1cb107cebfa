//! `VisionEncoder`: a CLIP- or SigLIP-style ViT over a packed batch of images.
//!
//! B images of one size go through the patch embedding together and then through the
//! transformer as B sequences packed back to back (`cu_seqlens`), so attention never
//! mixes images and every image gives exactly what it gives alone.
//!
//! CLIP: `[class; patches] + pos -> pre_layrnorm -> blocks` = last_hidden_state
//! (transformers' CLIPVisionModel does NOT post-norm it); pooler_output =
//! post_layernorm(class token). SigLIP: `patches + pos -> blocks -> post_layernorm` =
//! last_hidden_state; pooler_output = the attention-pooling head, when present.
//!
//! Tensor parallelism ([`VisionEncoder::with_group`]): the transformer blocks split
//! their heads and MLP columns over the TP group (nn's column/row-parallel layers).
//! Everything outside the blocks is replicated: the patch embedding (one small linear
//! over C*P*P inputs, not worth a collective), the class and position embeddings, the
//! pre/post LayerNorms, and the attention-pooling head's probe, q/k/v/o projections
//! and LayerNorm (one query per image, negligible work). Only the head's MLP is split,
//! as the blocks' are. Every rank holds the block outputs in full (the row-parallel
//! layers all-reduce them), so the replicated parameters get the same full grad on
//! every rank: nothing to reduce for them.
//!
//! Pipeline stages ([`VisionEncoder::stage`]) and context parallelism
//! ([`VisionEncoder::with_cp`]): see [`stage`] for the stage API, the CP token split and
//! which parameter grads each CP rank holds.

mod recompute;
pub mod stage;

use std::ops::Range;
use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::Tensor;
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, Error, Init, InitKind, LayerNorm, Linear,
    MlpConfig, MlpKind, Module, NormKind, Param, Result, Shard, TransformerBlock,
};

use crate::config::{VisionConfig, VisionFamily};
use crate::siglip_head::AttentionPoolingHead;
use crate::weights::{Shards, block_shards, mlp_shards};

pub use recompute::{VisionCache, VisionStageCache};
pub use stage::{VisionStageInput, VisionStageOutput};

/// The ViT, or one pipeline stage of it (layers `layers`). Braid parameter names (see
/// [`crate::vision_hf`] for the HF names): `embeddings.patch_embedding` (D, C*P*P),
/// `embeddings.class_embedding` (1, D), `embeddings.position_embedding.weight`
/// (NPOS, D), `pre_layrnorm`, `encoder.layers.{i}.*` (nn's block names),
/// `post_layernorm`, `head.*`. A stage holds the embeddings (and CLIP's pre-norm) when
/// it starts at layer 0, the post-norm and head when it ends at the last layer.
#[derive(Debug)]
pub struct VisionEncoder {
    pub config: VisionConfig,
    /// The encoder layers this stage runs (`0..num_layers` for the whole model).
    pub layers: Range<usize>,
    /// First stage. Conv2d(C, D, P, stride P) as patchify + linear: (D, C*P*P), bias
    /// for SigLIP.
    pub patch_embedding: Option<Linear>,
    /// First stage, CLIP only: (1, D).
    pub class_embedding: Option<Param>,
    /// First stage: (NPOS, D).
    pub position_embedding: Option<Param>,
    /// First stage, CLIP only.
    pub pre_layrnorm: Option<LayerNorm>,
    /// Layers `layers` (block `i` is named `encoder.layers.{layers.start + i}`).
    pub blocks: Vec<TransformerBlock>,
    /// Last stage.
    pub post_layernorm: Option<LayerNorm>,
    /// Last stage: SigLIP's optional attention-pooling head.
    pub head: Option<AttentionPoolingHead>,
    /// The context-parallel group, when it has more than one rank ([`Self::with_cp`]).
    pub cp: Option<Arc<dyn Comm>>,
    /// Activation recomputation of the whole stage from its input ([`VisionCache`]); off by default.
    pub recompute: bool,
}

/// What the encoder returns.
#[derive(Debug)]
pub struct VisionOutput {
    /// (B, S, D), S = N (+1 for CLIP's class token first)
    pub last_hidden_state: Tensor,
    /// (B, D): CLIP's post-normed class token, SigLIP's head output; None for a SigLIP
    /// without head.
    pub pooler_output: Option<Tensor>,
}

impl VisionEncoder {
    /// A randomly initialized encoder (linear and embedding weights Normal(0, init.std),
    /// norms 1/0, biases 0) on one rank.
    pub fn new(init: &Init, config: VisionConfig) -> Result<Self> {
        Self::with_group(init, config, Arc::new(SingleRank))
    }

    /// This rank's shard of the encoder over the tensor-parallel group `tp` (see the
    /// module doc for what is split): the shards of the `tp` ranks together hold
    /// exactly the weights [`Self::new`] draws from the same `init`.
    pub fn with_group(init: &Init, config: VisionConfig, tp: Arc<dyn Comm>) -> Result<Self> {
        let layers = 0..config.num_layers;
        Self::stage(init, config, layers, tp)
    }

    /// The pipeline stage of layers `layers` (non-empty, within `0..num_layers`), TP
    /// shard over `tp` as in [`Self::with_group`]: the embeddings (and CLIP's
    /// pre-norm) when `layers.start == 0`, the post-norm and pooling head when
    /// `layers.end == num_layers`. Parameters keep the full model's names, so the
    /// stages drawn from one `init` hold exactly the full model's weights.
    pub fn stage(
        init: &Init,
        config: VisionConfig,
        layers: Range<usize>,
        tp: Arc<dyn Comm>,
    ) -> Result<Self> {
        config.validate()?;
        if layers.start >= layers.end || layers.end > config.num_layers {
            return Err(Error::config(
                "vision encoder stage",
                format!(
                    "layers {layers:?} must be a non-empty range within 0..{} (num_layers)",
                    config.num_layers
                ),
            ));
        }
        check_tp(
            "vision encoder",
            config.num_heads,
            config.intermediate_size,
            tp.size(),
        )?;
        let group = tp;
        let VisionConfig {
            family,
            hidden_size: d,
            intermediate_size: ff,
            num_channels: c,
            patch_size: p,
            ..
        } = config;
        let clip = family == VisionFamily::Clip;
        let eps = config.layer_norm_eps;
        let (first, last) = (layers.start == 0, layers.end == config.num_layers);
        let patch_embedding = first
            .then(|| Linear::new(init, "embeddings.patch_embedding", c * p * p, d, !clip))
            .transpose()?;
        let class_embedding = (first && clip)
            .then(|| {
                init.param(
                    "embeddings.class_embedding",
                    &[1, d],
                    InitKind::Normal(init.std),
                    Shard::Full,
                )
            })
            .transpose()?;
        let position_embedding = first
            .then(|| {
                init.param(
                    "embeddings.position_embedding.weight",
                    &[config.num_positions(), d],
                    InitKind::Normal(init.std),
                    Shard::Full,
                )
            })
            .transpose()?;
        let pre_layrnorm = (first && clip)
            .then(|| LayerNorm::new(init, "pre_layrnorm", d, eps, true))
            .transpose()?;
        let block = BlockConfig {
            attn: AttentionConfig {
                dims: AttentionDims {
                    c: d,
                    nh: config.num_heads,
                    nkv: config.num_heads,
                    hs: config.head_size(),
                },
                causal: false,
                qkv_bias: true,
                o_bias: true,
                rope: None,
            },
            mlp: MlpConfig {
                c: d,
                ff,
                kind: MlpKind::Gelu(config.act.kernel()),
                bias: true,
            },
            norm: NormKind::LayerNorm,
            norm_eps: eps,
        };
        let blocks = layers
            .clone()
            .map(|i| {
                TransformerBlock::new(
                    init,
                    &format!("encoder.layers.{i}"),
                    block,
                    Arc::clone(&group),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let post_layernorm = last
            .then(|| LayerNorm::new(init, "post_layernorm", d, eps, true))
            .transpose()?;
        let head = if last && config.use_head {
            // The head's MLP is split like the blocks'; its attention is replicated.
            Some(AttentionPoolingHead::new(init, "head", &config, group)?)
        } else {
            None
        };
        Ok(VisionEncoder {
            config,
            layers,
            patch_embedding,
            class_embedding,
            position_embedding,
            pre_layrnorm,
            blocks,
            post_layernorm,
            head,
            cp: None,
            recompute: false,
        })
    }

    /// The same encoder (or stage) with context parallelism over `cp`: the tokens of
    /// every image are split over its ranks (see [`stage`]); a group of one rank is no
    /// CP. Every stage of one pipeline must get the same CP group size.
    pub fn with_cp(mut self, cp: Arc<dyn Comm>) -> Self {
        let group = (cp.size() > 1).then_some(cp);
        for b in &mut self.blocks {
            b.self_attn.cp = group.clone();
        }
        self.cp = group;
        self
    }

    /// Ranks in the context-parallel group (1 without CP).
    pub fn cp_size(&self) -> usize {
        self.cp.as_ref().map_or(1, |g| g.size())
    }

    /// Whether this stage starts at layer 0 (takes pixels, holds the embeddings).
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this stage ends at the last layer (returns the [`VisionOutput`]).
    pub fn is_last(&self) -> bool {
        self.layers.end == self.config.num_layers
    }

    /// The size of the tensor-parallel group the blocks are split over.
    pub fn tp_size(&self) -> usize {
        self.blocks.first().map_or(1, |b| b.self_attn.group.size())
    }

    /// The parameters this rank holds a slice of (blocks and the pooling head's MLP),
    /// for loading full checkpoint tensors into a shard; empty for a group of one.
    pub fn tp_shards(&self) -> Shards {
        let mut out = Shards::new();
        for b in &self.blocks {
            block_shards(b, &mut out);
        }
        if let Some(h) = &self.head {
            mlp_shards(&h.mlp, &mut out);
        }
        out
    }

    /// Tokens per image: N patches (+1 class token for CLIP).
    pub fn seq_len(&self) -> usize {
        self.config.num_positions()
    }

    /// Checks pixel_values (B, C, H, W) and returns (B, N).
    fn check_images(&self, x: &Tensor) -> Result<(usize, usize)> {
        let cfg = &self.config;
        let (c, p, side) = (cfg.num_channels, cfg.patch_size, cfg.image_size);
        let &[b, xc, h, w] = x.dims() else {
            return Err(Error::input(
                "vision",
                format!("pixel_values must be (B, C, H, W), got {}", x.shape()),
            ));
        };
        if xc != c {
            return Err(Error::input(
                "vision",
                format!(
                    "pixel_values {} has {xc} channels, the model expects num_channels = {c}",
                    x.shape()
                ),
            ));
        }
        if h % p != 0 || w % p != 0 {
            return Err(Error::input(
                "vision",
                format!(
                    "image size {h}x{w} (pixel_values {}) is not a multiple of the patch size {p}",
                    x.shape()
                ),
            ));
        }
        if h != side || w != side {
            // The position table has one row per patch of an image_size^2 image;
            // position interpolation for other sizes is not implemented.
            return Err(Error::input(
                "vision",
                format!(
                    "image size {h}x{w} differs from the config's image_size {side}x{side} (no position interpolation)"
                ),
            ));
        }
        if b == 0 {
            return Err(Error::input(
                "vision",
                "pixel_values holds no image (B = 0)",
            ));
        }
        Ok((b, (h / p) * (w / p)))
    }

    /// pixel_values (B, C, H, W) -> last_hidden_state (B, S, D) and pooler_output:
    /// [`Self::forward_stage`] of the whole model (an error on a partial stage).
    pub fn forward(&self, pixel_values: &Tensor) -> Result<(VisionOutput, VisionCache)> {
        let (b, _) = self.check_images(pixel_values)?;
        match self.forward_stage(VisionStageInput::Pixels(pixel_values), b)? {
            (VisionStageOutput::Final(out), cache) => Ok((out, cache)),
            (VisionStageOutput::Hidden(_), _) => Err(Error::input(
                "vision",
                format!(
                    "forward needs the whole encoder, this is the stage of layers {:?} of {} (use forward_stage)",
                    self.layers, self.config.num_layers
                ),
            )),
        }
    }

    /// Backward from d last_hidden_state (B, S, D) and, optionally, d pooler_output
    /// (B, D): returns d pixel_values (B, C, H, W) and adds into the parameter grads
    /// ([`Self::backward_stage`] of the whole model; under CP see [`stage`] for what
    /// each rank returns).
    pub fn backward(
        &mut self,
        cache: VisionCache,
        d_last: &Tensor,
        d_pooled: Option<&Tensor>,
    ) -> Result<Tensor> {
        if !self.is_first() || !self.is_last() {
            return Err(Error::input(
                "vision backward",
                format!(
                    "backward needs the whole encoder, this is the stage of layers {:?} of {} (use backward_stage)",
                    self.layers, self.config.num_layers
                ),
            ));
        }
        self.backward_stage(cache, d_last, d_pooled)
    }
}

/// Checks that `heads` and the MLP width `ff` split evenly over a TP group of `tp`,
/// naming the module and the sizes.
pub(crate) fn check_tp(module: &str, heads: usize, ff: usize, tp: usize) -> Result<()> {
    if tp == 0 || !heads.is_multiple_of(tp) {
        return Err(Error::config(
            "tensor parallelism",
            format!(
                "{module}: {heads} attention heads are not divisible by tp = {tp} (each rank holds heads / tp heads)"
            ),
        ));
    }
    if !ff.is_multiple_of(tp) {
        return Err(Error::config(
            "tensor parallelism",
            format!(
                "{module}: the MLP width (intermediate size) {ff} is not divisible by tp = {tp}"
            ),
        ));
    }
    Ok(())
}

impl Module for VisionEncoder {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(pe) = &self.patch_embedding {
            pe.visit_params(f);
        }
        if let Some(c) = &self.class_embedding {
            f(c);
        }
        if let Some(p) = &self.position_embedding {
            f(p);
        }
        if let Some(ln) = &self.pre_layrnorm {
            ln.visit_params(f);
        }
        for b in &self.blocks {
            b.visit_params(f);
        }
        if let Some(ln) = &self.post_layernorm {
            ln.visit_params(f);
        }
        if let Some(h) = &self.head {
            h.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(pe) = &mut self.patch_embedding {
            pe.visit_params_mut(f);
        }
        if let Some(c) = &mut self.class_embedding {
            f(c);
        }
        if let Some(p) = &mut self.position_embedding {
            f(p);
        }
        if let Some(ln) = &mut self.pre_layrnorm {
            ln.visit_params_mut(f);
        }
        for b in &mut self.blocks {
            b.visit_params_mut(f);
        }
        if let Some(ln) = &mut self.post_layernorm {
            ln.visit_params_mut(f);
        }
        if let Some(h) = &mut self.head {
            h.visit_params_mut(f);
        }
    }
}
