//! The run config (`braid train --config RUN.toml [--set a.b=v]...`): one TOML file, one
//! section per concern, each a serde struct with `deny_unknown_fields`, validated before
//! any work starts; every error names the key and says what is allowed.
//!
//! ```toml
//! [run]        name = "demo"  dir = "runs/demo"  seed = 1234
//! [data]       path = "data/demo/packed"  build = "configs/data-demo.toml"
//! [eval]       path = "data/demo/packed-heldout"  input = "data/demo/heldout.jsonl"
//! [model.llm]  family = "llama"  vocab = 261  hidden = 128 ...   # or init = "hf:PATH"
//! [model.vision] ...  [model.audio] ...  [model.projector.vision] ...  [model.projector.audio] ...
//! [train]      steps = 300  batch_rows = 8  microbatches = 2  freeze = []
//! [optim]      lr = 1e-3  warmup_steps = 20  schedule = "cosine"  weight_decay = 0.1  clip_grad = 1.0
//! [checkpoint] interval = 50  keep = 3
//! [log]        interval = 10
//! [parallel]   device = "cpu"  world_size = 1  placement = "disjoint"
//! ```
//!
//! Relative paths are taken from the current directory (where `braid train` runs).

mod model;
mod parallel;
mod set;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use model::{ModelSection, ModuleSpec, ProjectorSection};
pub use parallel::{AssignPolicy, Device, ModuleLayout, ParallelConfig, Placement};
pub use set::apply_set;

use crate::checkpoint::CheckpointConfig;
use crate::metrics::LogConfig;
use crate::mllm::Freeze;
use crate::optim::OptimConfig;

/// A config that cannot run; the message names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read run config {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("run config {path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("--set {assignment:?}: {reason}")]
    Set { assignment: String, reason: String },
    #[error("run config: {key}: {reason}")]
    Invalid { key: String, reason: String },
}

pub(crate) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// The message of a schema error (unknown key, wrong type, missing key) with the line and
/// column in the file, as the data config's errors give them. The merged document
/// (file + `--set`) has no positions; the file alone, parsed with positions, fails with
/// the same message when the mistake is in the file. Otherwise it came from a `--set`.
fn located(text: &str, sets: &[String], merged: toml::de::Error) -> String {
    if let Err(in_file) = toml::from_str::<RunConfig>(text)
        && in_file.message() == merged.message()
        && in_file.span().is_some()
    {
        return in_file.to_string();
    }
    let merged = merged.to_string(); // names the table (`in model.projector.vision`)
    if sets.is_empty() {
        merged
    } else {
        format!("{} (after the --set overrides)", merged.trim_end())
    }
}

/// `[run]`: what the run is called, where it writes, and the seed of everything random
/// (weight init and the data order; the step itself draws no random numbers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    pub name: String,
    /// Run folder: resolved config, metrics.jsonl, checkpoints, plots, eval.json, export.
    pub dir: PathBuf,
    #[serde(default)]
    pub seed: u64,
}

/// `[data]`: the packed training set (a `braid pack` output folder) and how to make it on
/// first use, plus the loader's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// The packed dataset folder (holds `dataset.json`).
    pub path: PathBuf,
    /// A data config (`braid pack --config`) to pack `path` from when it holds no dataset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<PathBuf>,
    /// When `build`'s input is missing: generate the demo data (`braid demo-data`) into this
    /// folder first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demo: Option<PathBuf>,
    /// Decoding threads.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// Decoded batches kept ready.
    #[serde(default = "default_prefetch")]
    pub prefetch: usize,
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// Check every shard's SHA-256 against `dataset.json` before training (rank 0), so a
    /// damaged or swapped shard is an error naming it rather than silently trained on;
    /// false trusts the files (hashing reads the whole dataset once: about a minute per
    /// 100 GB).
    #[serde(default = "yes")]
    pub verify: bool,
}

/// Upper bounds of a rank's loader settings (see [`RunConfig::validate`]).
const MAX_DATA_WORKERS: usize = 1024;
const MAX_DATA_PREFETCH: usize = 1024;

fn default_workers() -> usize {
    2
}
fn default_prefetch() -> usize {
    2
}
fn yes() -> bool {
    true
}

/// `[eval]`: a held-out packed dataset, measured at the end of the run (and every
/// `interval` steps when > 0) with and without the encoders' embeddings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSection {
    /// Packed held-out dataset; no `[eval]` path: no evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Raw input to pack `path` from (with `[data] build`'s data config) when it is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<PathBuf>,
    #[serde(default)]
    pub interval: u64,
    /// Packed rows per evaluation forward.
    #[serde(default = "default_eval_rows")]
    pub batch_rows: usize,
}

fn default_eval_rows() -> usize {
    4
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            path: None,
            input: None,
            interval: 0,
            batch_rows: default_eval_rows(),
        }
    }
}

/// `[train]`: the step loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Optimizer steps of the whole run.
    pub steps: u64,
    /// Global batch in packed rows (one row = up to `max_seq_len` tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_rows: Option<usize>,
    /// Global batch in tokens: `ceil(batch_tokens / max_seq_len)` rows. Exactly one of
    /// `batch_rows` and `batch_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_tokens: Option<usize>,
    /// Forward/backward passes per step (gradient accumulation); the step's rows are split
    /// among them. The loss is normalized by the step's total target count, so the update
    /// does not depend on this number.
    #[serde(default = "one")]
    pub microbatches: usize,
    /// Modules not trained: any of vision, audio, vision_projector, audio_projector, llm.
    #[serde(default)]
    pub freeze: Vec<String>,
    /// Steps in a row with a non-finite loss or grad norm (each skipped) before the run
    /// stops with an error.
    #[serde(default = "default_max_nonfinite")]
    pub max_nonfinite_in_a_row: u64,
    /// `"f32"` or `"bf16"` (mixed precision: f32 master weights, grads and AdamW state;
    /// bf16 compute copies of the weights and bf16 activations; loss and grad norm in
    /// f32). Unset: bf16 on CUDA, f32 on CPU. bf16 on the CPU is the reference
    /// emulation (f32 math on bf16 data): for checking numerics, slower than f32.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
}

/// The numeric precision of training (`train.precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    F32,
    Bf16,
}

impl Precision {
    /// The dtype the layers compute in (weights' compute copies and activations).
    pub fn compute_dtype(self) -> braid_kernels::DType {
        match self {
            Precision::F32 => braid_kernels::DType::F32,
            Precision::Bf16 => braid_kernels::DType::BF16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

fn one() -> usize {
    1
}
fn default_max_nonfinite() -> u64 {
    5
}

/// `[fault]`: fault injection for tests of the failure paths.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    /// Steps whose gradient is replaced by NaN (the step must be skipped).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nan_grad_at: Vec<u64>,
    /// Abort the process (as `kill -9` would stop it) in the middle of writing this step's
    /// checkpoint, after the weights and before the optimizer state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_during_checkpoint_at: Option<u64>,
    /// Make rank `panic_rank` panic at the start of step `panic_at` (every other rank
    /// must then stop with an error naming it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub panic_at: Option<u64>,
    #[serde(default)]
    pub panic_rank: usize,
}

/// The whole run config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub run: RunSection,
    pub data: DataSection,
    #[serde(default)]
    pub eval: EvalSection,
    pub model: ModelSection,
    pub train: TrainSection,
    #[serde(default)]
    pub optim: OptimConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub parallel: ParallelConfig,
    #[serde(default)]
    pub fault: FaultConfig,
    /// `[plan]`: defaults for `braid plan` (cluster, GPUs, the synthetic data mix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<crate::planning::PlanSection>,
}

impl RunConfig {
    /// Parses TOML text after applying `sets` (`KEY=VALUE` each), then validates.
    pub fn from_toml(text: &str, origin: &str, sets: &[String]) -> Result<Self, ConfigError> {
        let parse = |reason: String| ConfigError::Parse {
            path: origin.to_string(),
            reason,
        };
        let mut doc: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| parse(e.to_string()))?;
        for s in sets {
            apply_set(&mut doc, s)?;
        }
        let cfg = match RunConfig::deserialize(toml::Value::Table(doc)) {
            Ok(c) => c,
            Err(e) => return Err(parse(located(text, sets, e))),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads `path`, applies `sets` and validates.
    pub fn from_file(path: &Path, sets: &[String]) -> Result<Self, ConfigError> {
        let read_err = |reason: String| ConfigError::Read {
            path: path.to_path_buf(),
            reason,
        };
        let bytes =
            braid_nn::files::read_limited(path, 64 << 20).map_err(|e| read_err(e.to_string()))?;
        let text =
            String::from_utf8(bytes).map_err(|e| read_err(format!("not UTF-8 text: {e}")))?;
        Self::from_toml(&text, &path.display().to_string(), sets)
    }

    /// The resolved config as TOML (what is written to the run folder and checkpoints).
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string(self)
            .map_err(|e| invalid("(whole config)", format!("cannot serialize: {e}")))
    }

    /// Every check that needs no file: ranges, enums, cross-section consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.run.name.trim().is_empty() {
            return Err(invalid("run.name", "must not be empty"));
        }
        if self.run.dir.as_os_str().is_empty() {
            return Err(invalid("run.dir", "must not be empty"));
        }
        let d = &self.data;
        for (key, p) in [
            ("data.path", Some(&d.path)),
            ("data.build", d.build.as_ref()),
            ("data.demo", d.demo.as_ref()),
            ("eval.path", self.eval.path.as_ref()),
            ("eval.input", self.eval.input.as_ref()),
        ] {
            if p.is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(invalid(key, "must not be an empty path"));
            }
        }
        // Each rank runs its own loader: more threads than the largest node has cores,
        // or a thousand decoded batches, is a typo (100,000 threads failed after a minute
        // with an OS error that named no key).
        if !(1..=MAX_DATA_WORKERS).contains(&d.workers) {
            return Err(invalid(
                "data.workers",
                format!(
                    "{} decoding threads: must be 1..={MAX_DATA_WORKERS}",
                    d.workers
                ),
            ));
        }
        if !(1..=MAX_DATA_PREFETCH).contains(&d.prefetch) {
            return Err(invalid(
                "data.prefetch",
                format!(
                    "{} batches kept ready: must be 1..={MAX_DATA_PREFETCH}",
                    d.prefetch
                ),
            ));
        }
        if self.eval.batch_rows == 0 {
            return Err(invalid("eval.batch_rows", "must be >= 1"));
        }
        if self.eval.input.is_some() && self.eval.path.is_none() {
            return Err(invalid(
                "eval.input",
                "needs eval.path (where the packed held-out set goes)",
            ));
        }
        let t = &self.train;
        if t.steps == 0 {
            return Err(invalid("train.steps", "must be >= 1"));
        }
        match (t.batch_rows, t.batch_tokens) {
            (None, None) => {
                return Err(invalid(
                    "train.batch_rows",
                    "set the global batch: batch_rows (packed rows) or batch_tokens",
                ));
            }
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "train.batch_rows",
                    "set batch_rows or batch_tokens, not both",
                ));
            }
            (Some(0), _) => return Err(invalid("train.batch_rows", "must be >= 1")),
            (_, Some(0)) => return Err(invalid("train.batch_tokens", "must be >= 1")),
            _ => {}
        }
        if t.microbatches == 0 {
            return Err(invalid("train.microbatches", "must be >= 1"));
        }
        if let Some(r) = t.batch_rows
            && t.microbatches > r
        {
            return Err(invalid(
                "train.microbatches",
                format!(
                    "{} microbatches cannot split a batch of {r} rows (at most one microbatch per row)",
                    t.microbatches
                ),
            ));
        }
        if t.max_nonfinite_in_a_row == 0 {
            return Err(invalid("train.max_nonfinite_in_a_row", "must be >= 1"));
        }
        Freeze::from_names(&t.freeze).map_err(|e| invalid("train.freeze", e.to_string()))?;
        let m = &self.model;
        if !(m.init_std.is_finite() && m.init_std >= 0.0) {
            return Err(invalid(
                "model.init_std",
                format!("{} must be a finite number >= 0", m.init_std),
            ));
        }
        if m.vision.is_some() != m.projector.vision.is_some() {
            return Err(invalid(
                "model.projector.vision",
                "[model.vision] and [model.projector.vision] go together (the encoder needs a projector into the LLM)",
            ));
        }
        if m.audio.is_some() != m.projector.audio.is_some() {
            return Err(invalid(
                "model.projector.audio",
                "[model.audio] and [model.projector.audio] go together (the encoder needs a projector into the LLM)",
            ));
        }
        self.optim.validate(t.steps)?;
        self.checkpoint.validate()?;
        self.log.validate()?;
        self.parallel.validate()?;
        Ok(())
    }

    /// `train.precision`, or its default for the device: bf16 on CUDA, f32 on CPU.
    pub fn precision(&self) -> Precision {
        self.train.precision.unwrap_or(match self.parallel.device {
            Device::Cuda => Precision::Bf16,
            Device::Cpu => Precision::F32,
        })
    }

    /// Global batch rows for a dataset packed to `max_seq_len`.
    pub fn batch_rows(&self, max_seq_len: usize) -> usize {
        match (self.train.batch_rows, self.train.batch_tokens) {
            (Some(r), _) => r,
            (None, Some(t)) => t.div_ceil(max_seq_len.max(1)),
            (None, None) => 1,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
