//! braid-train: run config, job assembly, optimizer, checkpoints, metrics and the loop.
//!
//! - [`mllm`]: the multimodal model (encoders, projectors, LLM) as one trainable unit,
//!   with its batch type, per-module freezing and the end-to-end forward/backward.
//! - [`config`]: the run config (`RUN.toml` + `--set`), validated before anything runs.
//! - [`trainer`]: set-up, the step, checkpoints, evaluation, export.
//! - [`optim`], [`checkpoint`], [`metrics`], [`eval`], [`data`]: the parts it uses.
//! - [`stop`]: a signal's request to stop after the current step, with a checkpoint.
//! - [`trace`]: a timeline of every rank as Chrome trace JSON (`log.trace`).

pub mod assemble;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod eval;
pub mod export;
pub mod generate;
pub mod metrics;
pub mod mllm;
pub mod optim;
pub mod parallel;
pub mod planning;
pub mod resume;
pub mod run_lock;
pub mod stop;
pub mod straggler;
pub mod summary;
pub mod tokenizer;
pub mod trace;
pub mod trainer;

pub use config::RunConfig;
pub use error::TrainError;
pub use mllm::{
    AudioProjectorConfig, Freeze, InputGrads, Mllm, MllmBatch, MllmCache, MllmConfig, MllmLoss,
    MllmParts, VisionProjectorConfig,
};
pub use stop::StopFlag;
pub use trainer::{Observer, Quiet, RunInfo, RunSummary, Trainer};
