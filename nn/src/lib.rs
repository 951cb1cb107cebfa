//! braid-nn: layers shared by the encoders and the LLM, each a forward/backward pair with an explicit cache, tensor-parallel aware.
//!
//! Every layer has `forward(&self, ..) -> Result<(Tensor, Cache)>` and
//! `backward(&mut self, cache, dy) -> Result<Tensor>`: backward returns the input grad
//! and *adds* into the parameter grads (none for frozen parameters, whose `grad` is
//! `None`). The cache is owned by the caller; dropping it and running the forward
//! again is activation recomputation.
//!
//! Model code is separate from parallelization: layers take the TP group as an
//! `Arc<dyn Comm>`; with [`braid_comm::SingleRank`] each is exactly the plain layer.
//! The collectives live in [`regions`], as adjoint pairs.
//!
//! Parameters are named as in Hugging Face checkpoints (`blocks.3.self_attn.q_proj.weight`)
//! and initialized deterministically from `(seed, name)` (see [`Init`]).

pub mod attention;
pub mod block;
pub mod cp;
pub mod embedding;
pub mod error;
pub mod files;
pub mod hf;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod parallel;
pub mod param;
pub mod regions;
pub mod rope;
pub mod vocab;
pub mod wgrad;

pub use attention::{Attention, AttentionCache, AttentionConfig, AttentionDims};
pub use block::{BlockCache, BlockConfig, BlockSaved, TransformerBlock};
pub use cp::{CpLocal, CpPlan};
pub use embedding::{Embedding, EmbeddingCache};
pub use error::{Error, Result};
pub use linear::{Linear, LinearCache};
pub use mlp::{Mlp, MlpCache, MlpConfig, MlpKind};
pub use norm::{LayerNorm, Norm, NormCache, NormKind, RmsNorm};
pub use parallel::{
    ColumnParallelCache, ColumnParallelLinear, RowParallelCache, RowParallelLinear,
};
pub use param::{Init, InitKind, Module, Param, Shard};
pub use rope::{DynamicNtk, Rope, RopeConfig, SeqInfo};
pub use vocab::{VocabParallelCache, VocabParallelEmbedding};
