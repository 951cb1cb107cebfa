//! braid-llm: the decoder backbone (Llama/Qwen2 family), modality-embedding scatter, vocab-parallel cross-entropy, pipeline stages.
//!
//! - [`LlmConfig`]: Braid's validated config; [`LlmConfig::from_hf_config`] reads a
//!   Hugging Face `config.json`, [`LlmConfig::to_hf_json`] writes one.
//! - [`LlmStage`]: a contiguous range of layers (pipeline stage) with forward/backward
//!   on packed token rows ([`braid_nn::SeqInfo`]); [`Llm`] is the one stage that covers
//!   every layer.
//! - [`loss`]: next-token targets, the mean cross-entropy over valid targets, and the
//!   vocab-parallel cross-entropy.
//! - [`hf`]: import of Hugging Face checkpoints and export back to them.

pub mod config;
pub mod hf;
pub mod loss;
pub mod rope;
pub mod stage;

use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::Tensor;
use braid_nn::{Init, Module, Param, Result, SeqInfo};

pub use config::{Family, LlmConfig, RopeScaling, RopeSpec, SUPPORTED_ARCHITECTURES};
pub use hf::{HfLoadReport, hf_name};
pub use loss::{
    IGNORE_INDEX, LossOutput, cross_entropy_loss, next_token_targets, vocab_parallel_cross_entropy,
    vocab_parallel_loss,
};
pub use stage::{LlmStage, ModalityEmbeds, StageCache, StageInput};

/// The whole decoder: embed_tokens -> N pre-norm blocks (RMSNorm, RoPE, GQA, SwiGLU)
/// -> final norm -> lm_head (tied or not). It is the single [`LlmStage`] covering all
/// layers; every method delegates to it.
#[derive(Debug)]
pub struct Llm {
    pub stage: LlmStage,
}

impl Llm {
    /// A single-rank model initialized from `init`.
    pub fn new(config: &LlmConfig, init: &Init) -> Result<Self> {
        Self::with_group(config, init, Arc::new(SingleRank))
    }

    /// This rank's shard of the model over the tensor-parallel `group`: blocks split by
    /// heads and MLP columns, embedding and lm_head by vocabulary rows (see
    /// [`LlmStage`]); logits are then this rank's (T, V/tp) columns.
    pub fn with_group(config: &LlmConfig, init: &Init, group: Arc<dyn Comm>) -> Result<Self> {
        Ok(Llm {
            stage: LlmStage::new(config, 0..config.layers, init, group)?,
        })
    }

    pub fn config(&self) -> &LlmConfig {
        &self.stage.config
    }

    /// Token ids (T) u32 of packed rows `seq`, with optional modality embeddings
    /// scattered over their placeholder tokens -> logits (T, V) (this rank's
    /// `stage.vocab_range()` columns (T, V/tp) under tensor parallelism).
    pub fn forward(
        &self,
        ids: &Tensor,
        seq: &SeqInfo,
        modality: Option<&ModalityEmbeds>,
    ) -> Result<(Tensor, StageCache)> {
        self.stage.forward(
            StageInput::Tokens {
                ids,
                host_ids: None,
                modality,
            },
            seq,
        )
    }

    /// Input embeddings (T, C) -> logits (T, V); backward then returns their grad.
    pub fn forward_embeds(&self, embeds: Tensor, seq: &SeqInfo) -> Result<(Tensor, StageCache)> {
        self.stage.forward(StageInput::Hidden(embeds), seq)
    }

    /// Adds every parameter's grad for output grad `dlogits` (T, V); returns the grad
    /// of the modality embeddings (M, C) or of the input embeddings (T, C) when the
    /// forward had them.
    pub fn backward(&mut self, cache: StageCache, dlogits: &Tensor) -> Result<Option<Tensor>> {
        self.stage.backward(cache, dlogits)
    }

    /// Forward and next-token cross-entropy against host `targets` (T) (see
    /// [`next_token_targets`]): the mean over valid targets (or over `normalizer`
    /// targets), with dlogits ready for [`Self::backward`]. Under tensor parallelism
    /// the loss is the vocab-parallel one over the stage's group (the same on every
    /// rank) and dlogits this rank's shard.
    pub fn loss(
        &self,
        ids: &Tensor,
        seq: &SeqInfo,
        modality: Option<&ModalityEmbeds>,
        targets: &[u32],
        normalizer: Option<usize>,
    ) -> Result<(LossOutput, StageCache)> {
        let (logits, cache) = self.forward(ids, seq, modality)?;
        let group = self.stage.tp_group().as_ref();
        let start = self.stage.vocab_range().start;
        let out = vocab_parallel_loss(group, &logits, start, targets, normalizer)?;
        Ok((out, cache))
    }
}

impl Module for Llm {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.stage.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.stage.visit_params_mut(f);
    }
}
