//! `LlmStage`: a contiguous range of decoder layers, the unit of pipeline parallelism.
//! The first stage owns the token embedding (and the scatter of modality embeddings),
//! the last the final norm and the lm_head; the whole model is the one stage that is
//! both (see [`crate::Llm`]).
//!
//! Tensor parallelism: the stage's group splits the blocks (heads, MLP) and, when it
//! has more than one rank, the vocabulary: the embedding is a
//! [`VocabParallelEmbedding`] and lm_head (the tied embedding shard, or a
//! column-parallel linear without gather) produces this rank's logits columns
//! `vocab_range()` (T, V/tp); the caller computes the loss with
//! [`crate::vocab_parallel_loss`] (or [`crate::vocab_parallel_cross_entropy`]) over
//! [`LlmStage::tp_group`]. A group of one is the plain model, bit for bit.

use std::ops::Range;
use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::{DType, Tensor, ops};
use braid_nn::error::Context;
use braid_nn::norm::RmsNormCache;
use braid_nn::regions::{copy_to_tp_bwd, copy_to_tp_fwd};
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, BlockSaved, ColumnParallelLinear, Error, Init,
    MlpConfig, MlpKind, Module, NormKind, Param, Result, RmsNorm, RopeConfig, SeqInfo,
    TransformerBlock, VocabParallelCache, VocabParallelEmbedding,
};

use crate::config::LlmConfig;
use crate::rope::build_rope;

/// Embeddings of other modalities (image patches, audio frames) that replace the
/// embeddings of placeholder tokens: row `m` of `embeds` goes to token `positions[m]`.
#[derive(Debug)]
pub struct ModalityEmbeds {
    /// (M) u32, distinct, each < T
    pub positions: Tensor,
    /// (M, C)
    pub embeds: Tensor,
}

/// What a stage's forward starts from.
#[derive(Debug)]
pub enum StageInput<'a> {
    /// First stage: token ids (T) u32, optionally with modality embeddings scattered in.
    Tokens {
        ids: &'a Tensor,
        /// The same ids on the host, where the caller built them: saves the vocab-
        /// parallel embedding a device-to-host copy (`None`: it reads `ids`).
        host_ids: Option<&'a [u32]>,
        modality: Option<&'a ModalityEmbeds>,
    },
    /// Hidden states (T, C): the previous stage's output, or on the first stage the
    /// input embeddings themselves (`inputs_embeds`).
    Hidden(Tensor),
}

/// How the stage's input entered, for the backward.
// One per microbatch in flight: the bytes a box would save do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum InputCache {
    Tokens {
        /// the embedding's lookup of the (T) ids
        embed: VocabParallelCache,
        /// (M) u32 modality rows, if any
        positions: Option<Tensor>,
    },
    Hidden,
}

/// What the last stage's head needs for the backward.
#[derive(Debug)]
struct HeadCache {
    /// holds the last block's output (T, C)
    norm: RmsNormCache,
    /// normed hidden states, lm_head's input (T, C)
    xn: Tensor,
}

/// What [`LlmStage::backward`] needs; one per microbatch in flight.
#[derive(Debug)]
pub struct StageCache {
    input: InputCache,
    blocks: Vec<BlockSaved>,
    /// The forward's packing, kept when the blocks are recomputed.
    seq: Option<SeqInfo>,
    head: Option<HeadCache>,
}

/// Layers `layers` of a decoder, with the embedding when `layers.start == 0` and the
/// final norm + lm_head when `layers.end == config.layers`.
///
/// Parameter names (Braid's; [`crate::hf::hf_name`] maps them to Hugging Face's):
/// `embed_tokens.weight`, `layers.{i}.…` (nn's block names), `norm.weight`,
/// `lm_head.weight`. With tied embeddings, a last stage that is not also the first
/// holds its own copy named `embed_tokens.weight` (Megatron's "word embeddings for
/// head"): it starts equal to the first stage's, and the trainer must sum the two
/// copies' grads (all-reduce over the first and last stage) before the optimizer step.
///
/// Under a TP group of `tp` ranks, `embed_tokens.weight` and `lm_head.weight` hold this
/// rank's rows `vocab_range()` (V/tp, C) of the full tables (`Shard::Split { dim: 0 }`);
/// the blocks hold their heads and MLP columns; norms are replicated (every rank
/// computes the same full grad for them, nothing to reduce).
#[derive(Debug)]
pub struct LlmStage {
    pub config: LlmConfig,
    pub layers: Range<usize>,
    /// First stage (lookup), and the tied head's weight on the last stage.
    pub embed_tokens: Option<VocabParallelEmbedding>,
    pub blocks: Vec<TransformerBlock>,
    /// Last stage.
    pub norm: Option<RmsNorm>,
    /// Last stage, untied: rows `vocab_range()` of the (V, C) head, never gathered.
    pub lm_head: Option<ColumnParallelLinear>,
    /// The tensor-parallel group of the blocks, the embedding and the head.
    pub group: Arc<dyn Comm>,
    /// Activation recomputation: each block keeps only its input (T, C) between the
    /// forward and the backward, which runs its forward again (false by default).
    pub recompute: bool,
}

impl LlmStage {
    /// A stage with weights from `init` (normal(0, init.std), norms 1, biases 0); `group`
    /// is the tensor-parallel group of the blocks, the embedding and the head (split
    /// along the vocabulary when it has more than one rank).
    pub fn new(
        config: &LlmConfig,
        layers: Range<usize>,
        init: &Init,
        group: Arc<dyn Comm>,
    ) -> Result<Self> {
        config.validate()?;
        if layers.start >= layers.end || layers.end > config.layers {
            return Err(Error::config(
                "LlmStage",
                format!(
                    "layers {layers:?} must be a non-empty range within 0..{}",
                    config.layers
                ),
            ));
        }
        let tp = group.size();
        if tp == 0 || !config.vocab.is_multiple_of(tp) {
            return Err(Error::config(
                "LlmStage",
                format!(
                    "model.llm.vocab: vocab = {} is not divisible by tp = {tp} (the embedding and lm_head rows are split across the tensor-parallel group; pad the vocabulary to a multiple of {tp})",
                    config.vocab
                ),
            ));
        }
        for (key, n) in [("heads", config.heads), ("kv_heads", config.kv_heads)] {
            if !n.is_multiple_of(tp) {
                return Err(Error::config(
                    "LlmStage",
                    format!("model.llm.{key}: {key} = {n} is not divisible by tp = {tp}"),
                ));
            }
        }
        if !config.intermediate.is_multiple_of(tp) {
            return Err(Error::config(
                "LlmStage",
                format!(
                    "model.llm.intermediate: intermediate = {} is not divisible by tp = {tp}",
                    config.intermediate
                ),
            ));
        }
        let first = layers.start == 0;
        let last = layers.end == config.layers;
        let c = config.hidden;
        let embed_tokens = if first || (last && config.tie_embeddings) {
            Some(VocabParallelEmbedding::new(
                init,
                "embed_tokens",
                config.vocab,
                c,
                Arc::clone(&group),
            )?)
        } else {
            None
        };
        let block_config = block_config(config);
        let rope = build_rope(config)?;
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let mut b = TransformerBlock::new(
                init,
                &format!("layers.{i}"),
                block_config,
                Arc::clone(&group),
            )?;
            // The scaled variants' frequencies replace the plain theta^(-2i/HS) table.
            b.self_attn.rope = Some(rope.clone());
            blocks.push(b);
        }
        let norm = if last {
            Some(RmsNorm::new(init, "norm", c, config.rms_norm_eps as f32)?)
        } else {
            None
        };
        let lm_head = if last && !config.tie_embeddings {
            // Output features split, no gather: the logits stay a vocabulary shard.
            Some(ColumnParallelLinear::new(
                init,
                "lm_head",
                c,
                config.vocab,
                false,
                false,
                Arc::clone(&group),
            )?)
        } else {
            None
        };
        Ok(LlmStage {
            config: config.clone(),
            layers,
            embed_tokens,
            blocks,
            norm,
            lm_head,
            group,
            recompute: false,
        })
    }

    /// The tensor-parallel group (blocks, embedding and head).
    pub fn tp_group(&self) -> &Arc<dyn Comm> {
        &self.group
    }

    /// The vocabulary columns of the logits this rank's last stage returns (and the
    /// embedding rows it holds): `rank * V/tp .. (rank + 1) * V/tp`; `0..V` for a
    /// group of one.
    pub fn vocab_range(&self) -> Range<usize> {
        let part = self.config.vocab / self.group.size().max(1);
        let start = self.group.rank() * part;
        start..start + part
    }

    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    pub fn is_last(&self) -> bool {
        self.layers.end == self.config.layers
    }

    /// The output of this stage: logits (T, V) on the last stage (this rank's columns
    /// `vocab_range()`, (T, V/tp), under tensor parallelism), hidden states (T, C)
    /// otherwise.
    pub fn forward(&self, input: StageInput<'_>, seq: &SeqInfo) -> Result<(Tensor, StageCache)> {
        let c = self.config.hidden;
        let (mut h, input_cache) = match input {
            StageInput::Tokens {
                ids,
                host_ids,
                modality,
            } => self.embed((ids, host_ids), modality, seq)?,
            StageInput::Hidden(h) => {
                if h.dims() != [seq.num_tokens(), c] {
                    return Err(Error::input(
                        "llm",
                        format!(
                            "hidden states must be (T = {}, C = {c}), got {}",
                            seq.num_tokens(),
                            h.shape()
                        ),
                    ));
                }
                (h, InputCache::Hidden)
            }
        };
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let (y, saved) = block.forward_saving(h, seq, self.recompute)?; // (T, C)
            blocks.push(saved);
            h = y;
        }
        let (out, head) = match (&self.norm, self.head_weight()) {
            (Some(norm), Some(w)) => {
                let (xn, norm_cache) = norm.forward_owned(h)?; // (T, C)
                // Column-parallel head: xn is replicated, each rank multiplies by its
                // rows of the head (copy_to_tp; its adjoint all-reduces dxn).
                let x = copy_to_tp_fwd(self.group.as_ref(), &xn);
                let logits = ops::linear_fwd(x, w.compute(), None).ctx("lm_head", "forward")?; // (T, V/tp)
                let head = HeadCache {
                    norm: norm_cache,
                    xn,
                };
                (logits, Some(head))
            }
            _ => (h, None),
        };
        Ok((
            out,
            StageCache {
                input: input_cache,
                blocks,
                seq: self.recompute.then(|| seq.clone()),
                head,
            },
        ))
    }

    /// Token embedding (T, C), with modality rows scattered over their placeholders.
    fn embed(
        &self,
        (ids, host_ids): (&Tensor, Option<&[u32]>),
        modality: Option<&ModalityEmbeds>,
        seq: &SeqInfo,
    ) -> Result<(Tensor, InputCache)> {
        let embed = match (&self.embed_tokens, self.is_first()) {
            (Some(e), true) => e,
            _ => {
                return Err(Error::input(
                    "llm",
                    format!(
                        "token ids given to the stage of layers {:?}, which has no embedding (pass hidden states)",
                        self.layers
                    ),
                ));
            }
        };
        if ids.dims() != [seq.num_tokens()] || ids.dtype() != DType::U32 {
            return Err(Error::input(
                "llm",
                format!(
                    "token ids must be (T = {}) u32, got {} {}",
                    seq.num_tokens(),
                    ids.shape(),
                    ids.dtype()
                ),
            ));
        }
        // (T, C), summed over the TP group: the same full rows on every rank, so the
        // modality rows are scattered after the reduction.
        let (mut h, embed_cache) = embed.forward_with_host_ids(ids, host_ids)?;
        let positions = match modality {
            Some(m) => {
                ops::scatter_rows(&mut h, &m.positions, &m.embeds)
                    .ctx("llm", "scatter modality embeddings")?;
                Some(
                    m.positions
                        .try_clone()
                        .ctx("llm", "caching modality positions")?,
                )
            }
            None => None,
        };
        Ok((
            h,
            InputCache::Tokens {
                embed: embed_cache,
                positions,
            },
        ))
    }

    /// The weight lm_head multiplies by: its own, or the (tied) embedding table.
    fn head_weight(&self) -> Option<&Param> {
        if !self.is_last() {
            return None;
        }
        match (&self.lm_head, &self.embed_tokens) {
            (Some(l), _) => Some(&l.linear.weight),
            (None, Some(e)) => Some(&e.weight),
            (None, None) => None,
        }
    }

    /// Backward of [`Self::forward`] given the grad of its output (dlogits (T, V) on the
    /// last stage, this rank's (T, V/tp) columns under tensor parallelism; else d
    /// hidden (T, C)). Adds into every trainable parameter's grad and
    /// returns the grad of the stage's float input: d hidden (T, C) for
    /// `StageInput::Hidden`, d modality embeds (M, C) for tokens with modality
    /// embeddings, `None` for plain tokens.
    pub fn backward(&mut self, cache: StageCache, dout: &Tensor) -> Result<Option<Tensor>> {
        let StageCache {
            input,
            blocks,
            seq,
            head,
        } = cache;
        if blocks.len() != self.blocks.len() {
            return Err(Error::input(
                "llm backward",
                format!(
                    "the cache holds {} blocks, the stage of layers {:?} has {}",
                    blocks.len(),
                    self.layers,
                    self.blocks.len()
                ),
            ));
        }
        // d hidden (T, C); `None` while it is still `dout` itself (no copy of it).
        let mut dh: Option<Tensor> = match head {
            Some(HeadCache { norm, xn }) => {
                let dxn = self.head_backward(&xn, dout)?; // (T, C)
                let n = self.norm.as_mut().ok_or_else(|| missing("norm"))?;
                Some(n.backward(norm, &dxn)?)
            }
            None => None,
        };
        for (block, saved) in self.blocks.iter_mut().zip(blocks).rev() {
            let dy = dh.as_ref().unwrap_or(dout); // (T, C)
            dh = Some(block.backward_saved(saved, seq.as_ref(), dy)?);
        }
        let mut dh = match dh {
            Some(d) => d,
            None => dout.try_clone().ctx("llm", "output grad")?,
        };
        match input {
            InputCache::Hidden => Ok(Some(dh)),
            InputCache::Tokens { embed, positions } => {
                // Placeholder rows were overwritten in the forward: their grad belongs to
                // the modality embeddings, not to the placeholder token's embedding. dh
                // is the same on every TP rank, so is the modality grad.
                let dmod = match &positions {
                    Some(pos) => {
                        let d = ops::gather_rows(&dh, pos).ctx("llm", "modality grad")?; // (M, C)
                        let zeros = Tensor::zeros(d.shape().clone(), d.dtype(), d.device())
                            .ctx("llm", "zeros")?;
                        ops::scatter_rows(&mut dh, pos, &zeros)
                            .ctx("llm", "zero placeholder grads")?;
                        Some(d)
                    }
                    None => None,
                };
                let table = self
                    .embed_tokens
                    .as_mut()
                    .ok_or_else(|| missing("embed_tokens"))?;
                table.backward(embed, &dh)?;
                Ok(dmod)
            }
        }
    }

    /// lm_head backward: adds dlogitsᵀ xn into the head weight's grad (this rank's
    /// rows), returns dxn summed over the TP group.
    fn head_backward(&mut self, xn: &Tensor, dlogits: &Tensor) -> Result<Tensor> {
        let p = match (&mut self.lm_head, &mut self.embed_tokens) {
            (Some(l), _) => &mut l.linear.weight,
            (None, Some(e)) => &mut e.weight,
            (None, None) => return Err(missing("lm_head")),
        };
        let (w, grad) = p.compute_and_grad();
        let dxn = ops::linear_bwd(dlogits, xn, w, grad, None).ctx("lm_head", "backward")?;
        copy_to_tp_bwd(self.group.as_ref(), dxn).ctx("lm_head", "backward")
    }
}

fn missing(what: &str) -> Error {
    Error::input(
        "llm",
        format!("the cache needs `{what}`, which this stage lacks"),
    )
}

/// The nn block of a config: pre-norm RMSNorm, causal GQA with RoPE, SwiGLU.
pub fn block_config(config: &LlmConfig) -> BlockConfig {
    BlockConfig {
        attn: AttentionConfig {
            dims: AttentionDims {
                c: config.hidden,
                nh: config.heads,
                nkv: config.kv_heads,
                hs: config.head_dim,
            },
            causal: true,
            qkv_bias: config.qkv_bias,
            o_bias: config.o_bias,
            rope: Some(RopeConfig {
                theta: config.rope.theta as f32,
                rot_dim: config.head_dim,
            }),
        },
        mlp: MlpConfig {
            c: config.hidden,
            ff: config.intermediate,
            kind: MlpKind::SwiGlu,
            bias: config.mlp_bias,
        },
        norm: NormKind::RmsNorm,
        norm_eps: config.rms_norm_eps as f32,
    }
}

impl Module for LlmStage {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(e) = &self.embed_tokens {
            e.visit_params(f);
        }
        for b in &self.blocks {
            b.visit_params(f);
        }
        if let Some(n) = &self.norm {
            n.visit_params(f);
        }
        if let Some(l) = &self.lm_head {
            l.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(e) = &mut self.embed_tokens {
            e.visit_params_mut(f);
        }
        for b in &mut self.blocks {
            b.visit_params_mut(f);
        }
        if let Some(n) = &mut self.norm {
            n.visit_params_mut(f);
        }
        if let Some(l) = &mut self.lm_head {
            l.visit_params_mut(f);
        }
    }
}
