//! braid-train: run config, job assembly, pipeline schedules, optimizer, checkpoints and metrics.
//!
//! - [`mllm`]: the multimodal model (encoders, projectors, LLM) as one trainable unit,
//!   with its batch type, per-module freezing and the end-to-end forward/backward.

pub mod mllm;

pub use mllm::{
    AudioProjectorConfig, Freeze, InputGrads, Mllm, MllmBatch, MllmCache, MllmConfig, MllmLoss,
    MllmParts, VisionProjectorConfig,
};
