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

use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::{Shape, Tensor, ops};
use braid_nn::{
    AttentionConfig, AttentionDims, BlockCache, BlockConfig, Error, Init, InitKind, LayerNorm,
    Linear, LinearCache, MlpConfig, MlpKind, Module, NormKind, Param, Result, SeqInfo, Shard,
    TransformerBlock, norm::LayerNormCache,
};

use crate::config::{VisionConfig, VisionFamily};
use crate::siglip_head::{AttentionPoolingHead, HeadCache};
use crate::util::{ids, zeros};
use crate::weights::{Shards, block_shards, mlp_shards};
use braid_nn::error::Context;

/// The ViT. Braid parameter names (see [`crate::vision_hf`] for the HF names):
/// `embeddings.patch_embedding` (D, C*P*P), `embeddings.class_embedding` (1, D),
/// `embeddings.position_embedding.weight` (NPOS, D), `pre_layrnorm`,
/// `encoder.layers.{i}.*` (nn's block names), `post_layernorm`, `head.*`.
#[derive(Debug)]
pub struct VisionEncoder {
    pub config: VisionConfig,
    /// Conv2d(C, D, P, stride P) as patchify + linear: (D, C*P*P), bias for SigLIP.
    pub patch_embedding: Linear,
    /// CLIP only: (1, D).
    pub class_embedding: Option<Param>,
    /// (NPOS, D)
    pub position_embedding: Param,
    /// CLIP only.
    pub pre_layrnorm: Option<LayerNorm>,
    pub blocks: Vec<TransformerBlock>,
    pub post_layernorm: LayerNorm,
    /// SigLIP's optional attention-pooling head.
    pub head: Option<AttentionPoolingHead>,
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

/// What [`VisionEncoder::backward`] needs.
#[derive(Debug)]
pub struct VisionCache {
    image_shape: Shape,
    /// B, N, S
    b: usize,
    n: usize,
    s: usize,
    patch: LinearCache,
    /// (B*N) u32: the row of each patch token in the packed sequence
    patch_rows: Tensor,
    /// (B) u32: the row of each class token (CLIP), or of each image's first token
    first_rows: Tensor,
    /// (B) u32 zeros: broadcast of the class embedding
    zeros_b: Tensor,
    /// (B*S) u32: position of each token
    pos_ids: Tensor,
    pre: Option<LayerNormCache>,
    blocks: Vec<BlockCache>,
    post: Option<LayerNormCache>,
    head: Option<HeadCache>,
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
        config.validate()?;
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
        let patch_embedding = Linear::new(init, "embeddings.patch_embedding", c * p * p, d, !clip)?;
        let class_embedding = if clip {
            Some(init.param(
                "embeddings.class_embedding",
                &[1, d],
                InitKind::Normal(init.std),
                Shard::Full,
            )?)
        } else {
            None
        };
        let position_embedding = init.param(
            "embeddings.position_embedding.weight",
            &[config.num_positions(), d],
            InitKind::Normal(init.std),
            Shard::Full,
        )?;
        let pre_layrnorm = if clip {
            Some(LayerNorm::new(init, "pre_layrnorm", d, eps, true)?)
        } else {
            None
        };
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
        let blocks = (0..config.num_layers)
            .map(|i| {
                TransformerBlock::new(
                    init,
                    &format!("encoder.layers.{i}"),
                    block,
                    Arc::clone(&group),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let post_layernorm = LayerNorm::new(init, "post_layernorm", d, eps, true)?;
        let head = if config.use_head {
            // The head's MLP is split like the blocks'; its attention is replicated.
            Some(AttentionPoolingHead::new(init, "head", &config, group)?)
        } else {
            None
        };
        Ok(VisionEncoder {
            config,
            patch_embedding,
            class_embedding,
            position_embedding,
            pre_layrnorm,
            blocks,
            post_layernorm,
            head,
        })
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

    /// pixel_values (B, C, H, W) -> last_hidden_state (B, S, D) and pooler_output.
    pub fn forward(&self, pixel_values: &Tensor) -> Result<(VisionOutput, VisionCache)> {
        let (b, n) = self.check_images(pixel_values)?;
        let d = self.config.hidden_size;
        let dev = pixel_values.device();
        let clip = self.class_embedding.is_some();
        let s = n + usize::from(clip);
        let t = b * s;

        let patches = ops::patchify_fwd(pixel_values, self.config.patch_size)
            .and_then(|x| {
                let cpp = x.dims()[2];
                x.reshape([b * n, cpp])
            })
            .ctx("vision", "patchify")?; // (B*N, C*P*P)
        let (pe, patch) = self.patch_embedding.forward_owned(patches)?; // (B*N, D)

        // Token rows in the packed sequence: image i occupies [i*S, (i+1)*S), its class
        // token (CLIP) first.
        let off = usize::from(clip);
        let patch_rows: Vec<u32> = (0..b)
            .flat_map(|i| (0..n).map(move |j| (i * s + off + j) as u32))
            .collect();
        let first_rows: Vec<u32> = (0..b).map(|i| (i * s) as u32).collect();
        let pos: Vec<u32> = (0..b).flat_map(|_| 0..s as u32).collect();
        let patch_rows = ids(patch_rows, dev)?;
        let first_rows = ids(first_rows, dev)?;
        let zeros_b = ids(vec![0; b], dev)?;
        let pos_ids = ids(pos, dev)?;

        let mut x = match &self.class_embedding {
            Some(cls) => {
                let mut x = zeros(&[t, d], dev)?; // (T, D)
                ops::scatter_rows(&mut x, &patch_rows, &pe).ctx("vision", "place patches")?;
                let cls = ops::gather_rows(&cls.value, &zeros_b).ctx("vision", "class token")?; // (B, D)
                ops::scatter_rows(&mut x, &first_rows, &cls).ctx("vision", "place class")?;
                x
            }
            None => pe,
        };
        let pos_emb = ops::gather_rows(&self.position_embedding.value, &pos_ids)
            .ctx("vision", "positions")?; // (T, D)
        ops::add_assign(&mut x, &pos_emb).ctx("vision", "add positions")?;

        let (mut x, pre) = match &self.pre_layrnorm {
            Some(ln) => {
                let (y, c) = ln.forward_owned(x)?;
                (y, Some(c))
            }
            None => (x, None),
        };
        let seq = SeqInfo::packed(&vec![s; b]);
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for blk in &self.blocks {
            let (y, c) = blk.forward_owned(x, &seq)?;
            blocks.push(c);
            x = y;
        }

        let (last, pooled, post, head) = if clip {
            let cls = ops::gather_rows(&x, &first_rows).ctx("vision", "pool class token")?; // (B, D)
            let (pooled, post) = self.post_layernorm.forward_owned(cls)?;
            (x, Some(pooled), Some(post), None)
        } else {
            let (y, post) = self.post_layernorm.forward_owned(x)?;
            match &self.head {
                Some(h) => {
                    let (pooled, hc) = h.forward(&y, &seq, &first_rows)?;
                    (y, Some(pooled), Some(post), Some(hc))
                }
                None => (y, None, Some(post), None),
            }
        };
        let last = last.reshape([b, s, d]).ctx("vision", "output")?;
        let cache = VisionCache {
            image_shape: pixel_values.shape().clone(),
            b,
            n,
            s,
            patch,
            patch_rows,
            first_rows,
            zeros_b,
            pos_ids,
            pre,
            blocks,
            post,
            head,
        };
        Ok((
            VisionOutput {
                last_hidden_state: last,
                pooler_output: pooled,
            },
            cache,
        ))
    }

    /// Backward from d last_hidden_state (B, S, D) and, optionally, d pooler_output
    /// (B, D): returns d pixel_values (B, C, H, W) and adds into the parameter grads.
    pub fn backward(
        &mut self,
        cache: VisionCache,
        d_last: &Tensor,
        d_pooled: Option<&Tensor>,
    ) -> Result<Tensor> {
        let VisionCache {
            image_shape,
            b,
            n,
            s,
            patch,
            patch_rows,
            first_rows,
            zeros_b,
            pos_ids,
            pre,
            blocks,
            post,
            head,
        } = cache;
        let d = self.config.hidden_size;
        let t = b * s;
        if d_last.dims() != [b, s, d] {
            return Err(Error::input(
                "vision backward",
                format!(
                    "d_last {} must be (B, S, D) = [{b}, {s}, {d}]",
                    d_last.shape()
                ),
            ));
        }
        if let Some(dp) = d_pooled
            && dp.dims() != [b, d]
        {
            return Err(Error::input(
                "vision backward",
                format!("d_pooled {} must be (B, D) = [{b}, {d}]", dp.shape()),
            ));
        }
        let mut dx = d_last
            .try_clone()
            .and_then(|x| x.reshape([t, d]))
            .ctx("vision backward", "d_last")?; // (T, D)
        let clip = self.class_embedding.is_some();
        match (clip, post) {
            (true, Some(post)) => {
                if let Some(dp) = d_pooled {
                    let dcls = self.post_layernorm.backward(post, dp)?; // (B, D)
                    // Scatter-add into the class-token rows.
                    ops::embedding_bwd(&dcls, &first_rows, &mut dx)
                        .ctx("vision backward", "pool")?;
                }
            }
            (false, Some(post)) => {
                if let (Some(h), Some(hc), Some(dp)) = (self.head.as_mut(), head, d_pooled) {
                    let dh = h.backward(hc, dp)?; // (T, D)
                    ops::add_assign(&mut dx, &dh).ctx("vision backward", "head")?;
                }
                dx = self.post_layernorm.backward(post, &dx)?;
            }
            _ => {
                return Err(Error::input(
                    "vision backward",
                    "cache does not match this model",
                ));
            }
        }
        for (blk, c) in self.blocks.iter_mut().zip(blocks).rev() {
            dx = blk.backward(c, &dx)?;
        }
        if let (Some(ln), Some(c)) = (self.pre_layrnorm.as_mut(), pre) {
            dx = ln.backward(c, &dx)?;
        }
        if let Some(g) = self.position_embedding.grad.as_mut() {
            ops::embedding_bwd(&dx, &pos_ids, g).ctx("vision backward", "positions")?;
        }
        let dpe = if let Some(cls) = self.class_embedding.as_mut() {
            if let Some(g) = cls.grad.as_mut() {
                let dcls = ops::gather_rows(&dx, &first_rows).ctx("vision backward", "class")?; // (B, D)
                ops::embedding_bwd(&dcls, &zeros_b, g).ctx("vision backward", "class")?;
            }
            ops::gather_rows(&dx, &patch_rows).ctx("vision backward", "patches")? // (B*N, D)
        } else {
            dx
        };
        let dpatches = self.patch_embedding.backward(patch, &dpe)?; // (B*N, C*P*P)
        let cpp = dpatches.dims()[1];
        let dpatches = dpatches
            .reshape([b, n, cpp])
            .ctx("vision backward", "patchify")?;
        ops::patchify_bwd(&dpatches, &image_shape, self.config.patch_size)
            .ctx("vision backward", "patchify")
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
        self.patch_embedding.visit_params(f);
        if let Some(c) = &self.class_embedding {
            f(c);
        }
        f(&self.position_embedding);
        if let Some(ln) = &self.pre_layrnorm {
            ln.visit_params(f);
        }
        for b in &self.blocks {
            b.visit_params(f);
        }
        self.post_layernorm.visit_params(f);
        if let Some(h) = &self.head {
            h.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.patch_embedding.visit_params_mut(f);
        if let Some(c) = &mut self.class_embedding {
            f(c);
        }
        f(&mut self.position_embedding);
        if let Some(ln) = &mut self.pre_layrnorm {
            ln.visit_params_mut(f);
        }
        for b in &mut self.blocks {
            b.visit_params_mut(f);
        }
        self.post_layernorm.visit_params_mut(f);
        if let Some(h) = &mut self.head {
            h.visit_params_mut(f);
        }
    }
}
