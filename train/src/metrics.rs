//! `[log]` and `<run.dir>/metrics.jsonl`: one JSON object per step, appended and flushed as
//! the step ends; on resume the file is cut back to the checkpoint's step so that it reads
//! exactly like an uninterrupted run's.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, invalid};
use crate::error::{TrainError, io_err};

/// `[log]`: how often progress lines are printed when not on a terminal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Steps between log lines (the progress bar, on a terminal, shows every step).
    pub interval: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { interval: 10 }
    }
}

impl LogConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.interval == 0 {
            return Err(invalid("log.interval", "must be >= 1"));
        }
        Ok(())
    }
}

/// One line of metrics.jsonl.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    /// Mean cross-entropy over the step's target tokens (may be non-finite on a skipped
    /// step: JSON writes it as null, read back as NaN).
    #[serde(deserialize_with = "null_as_nan")]
    pub loss: f64,
    pub lr: f32,
    /// Global grad norm before clipping (null/NaN like `loss`).
    #[serde(deserialize_with = "null_as_nan")]
    pub grad_norm: f64,
    /// Tokens in the step's rows (all of them, targets or not).
    pub tokens: u64,
    /// Target tokens (the loss's denominator).
    pub targets: u64,
    pub images: u64,
    pub clips: u64,
    pub step_time_s: f64,
    /// Time waiting for the loader inside this step.
    pub data_time_s: f64,
    /// The step was skipped (non-finite loss or grad norm): no update.
    pub skipped: bool,
    pub epoch: u64,
    /// On several ranks: how even this step's assignment was (absent on one rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<BalanceMetrics>,
}

/// Max over mean of the estimated load (forward FLOPs of the balancer's cost model) over
/// the LLM's replicas, over every (replica, microbatch), and over each encoder's
/// replicas: 1.0 is perfectly even.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct BalanceMetrics {
    pub llm: f64,
    pub microbatch: f64,
    pub vision: f64,
    pub audio: f64,
}

/// JSON has no NaN or infinity (serde_json writes them as null): null reads back as NaN.
fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Appends lines to metrics.jsonl.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
}

impl MetricsWriter {
    /// Opens `path` for appending after keeping only the complete lines with
    /// `step <= keep_through` (everything when starting fresh: pass 0 and an absent file).
    pub fn open(path: &Path, keep_through: u64) -> Result<Self, TrainError> {
        let kept = read_metrics(path)?
            .into_iter()
            .filter(|m| m.step <= keep_through)
            .collect::<Vec<_>>();
        let mut text = String::new();
        for m in &kept {
            text.push_str(&serde_json::to_string(m).map_err(|e| TrainError::Other(e.to_string()))?);
            text.push('\n');
        }
        std::fs::write(path, text).map_err(io_err(path, "write"))?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io_err(path, "open for appending"))?;
        Ok(MetricsWriter {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn append(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(m).map_err(|e| TrainError::Other(e.to_string()))?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(io_err(&self.path, "append"))
    }
}

/// Every complete, parseable line of a metrics.jsonl (a torn last line after a crash is
/// dropped); an absent file is empty.
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>, TrainError> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path, "open")(e)),
    };
    let mut out = Vec::new();
    for line in BufReader::new(f).lines() {
        let line = line.map_err(io_err(path, "read"))?;
        if let Ok(m) = serde_json::from_str::<StepMetrics>(&line) {
            out.push(m);
        }
    }
    Ok(out)
}
