//! `[log]` and `<run.dir>/metrics.jsonl`: one JSON object per step, appended and flushed as
//! the step ends; on resume the file is cut back to the checkpoint's step so that it reads
//! exactly like an uninterrupted run's.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, invalid};
use crate::error::{TrainError, io_err};

/// This process's peak resident memory so far (`VmHWM` in `/proc/self/status`), bytes;
/// `None` where the kernel does not report it (not Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Hands the allocator's free memory back to the kernel: called when a phase's buffers
/// are gone for good (the layers laid out to count parameters; a rank's shards after
/// training, before rank 0 reads the whole model back), so that the next phase's peak is
/// not stacked on memory nobody uses. The `braid` binary allocates with mimalloc, which
/// keeps freed pages (also those of exited threads) until collected; glibc's malloc, for
/// other binaries, keeps freed heap chunks until trimmed. Both are asked.
pub fn return_freed_memory() {
    // SAFETY: `mi_collect` only walks mimalloc's own heaps and segments (this thread's
    // and the abandoned ones of exited threads) and frees pages nothing points into.
    unsafe { libmimalloc_sys::mi_collect(true) };
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own free lists under its lock; it takes no
    // pointers from us and frees nothing that is in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `[log]`: how often progress lines are printed when not on a terminal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Steps between log lines (the progress bar, on a terminal, shows every step).
    pub interval: u64,
    /// Write every rank's timeline to `<run.dir>/trace/` ([`crate::trace`]).
    pub trace: bool,
    /// How many steps (from the first of this run, or of its resumed part) the timeline
    /// covers: every span is kept in memory until the end.
    pub trace_steps: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            interval: 10,
            trace: false,
            trace_steps: 20,
        }
    }
}

impl LogConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.interval == 0 {
            return Err(invalid("log.interval", "must be >= 1"));
        }
        if self.trace_steps == 0 {
            return Err(invalid("log.trace_steps", "must be >= 1"));
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
    /// On a GPU: the most device memory held during the step, in GiB (the caching
    /// pool's high-water mark; absent on CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_mem_gib: Option<f64>,
    /// On several ranks: the rank furthest behind the ranks doing the same work, its
    /// compute seconds in the step and their median.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub straggler: Option<crate::straggler::Straggler>,
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
    /// Kept lines are kept byte for byte: parsing a number and writing it again can change
    /// its last bit (serde_json's default float parsing is not exact), and a resumed run's
    /// file must read exactly like an uninterrupted run's.
    pub fn open(path: &Path, keep_through: u64) -> Result<Self, TrainError> {
        let mut text = String::new();
        for (m, line) in read_metric_lines(path)? {
            if m.step <= keep_through {
                text.push_str(&line);
                text.push('\n');
            }
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
    Ok(read_metric_lines(path)?
        .into_iter()
        .map(|(m, _)| m)
        .collect())
}

/// [`read_metrics`] with each line's text as written.
fn read_metric_lines(path: &Path) -> Result<Vec<(StepMetrics, String)>, TrainError> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(path, "open")(e)),
    };
    let mut out = Vec::new();
    for line in BufReader::new(f).lines() {
        let line = line.map_err(io_err(path, "read"))?;
        if let Ok(m) = serde_json::from_str::<StepMetrics>(&line) {
            out.push((m, line));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn peak_rss_grows_with_a_touched_allocation() {
        let Some(before) = peak_rss_bytes() else {
            return; // not Linux: nothing to read
        };
        // 64 MiB, every page written: the peak must cover it.
        let mut big = vec![0u8; 64 << 20];
        for i in (0..big.len()).step_by(4096) {
            big[i] = 1;
        }
        let after = peak_rss_bytes().unwrap();
        assert!(
            after >= before.max(64 << 20),
            "{before} -> {after} bytes (sum {})",
            big.iter().map(|&b| u64::from(b)).sum::<u64>()
        );
    }

    fn line(step: u64, grad_norm: f64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 2.5,
            lr: 1e-3,
            grad_norm,
            tokens: 10,
            targets: 5,
            images: 0,
            clips: 0,
            step_time_s: 0.1,
            data_time_s: 0.0,
            skipped: false,
            epoch: 0,
            balance: None,
            peak_mem_gib: None,
            straggler: None,
        }
    }

    #[test]
    fn resuming_keeps_the_logged_lines_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        // A grad norm logged by a real run (demo, step 14) whose shortest decimal serde_json
        // parses back one ulp off: rewriting it changed the file on every resume.
        let exact: f64 = "3.1433333556404714".parse().unwrap();
        let mut w = MetricsWriter::open(&path, 0).unwrap();
        for step in 1..=3 {
            w.append(&line(step, exact * step as f64)).unwrap();
        }
        drop(w);
        let before = std::fs::read_to_string(&path).unwrap();
        assert!(before.contains("3.1433333556404714"), "{before}");
        MetricsWriter::open(&path, 3).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), before);
        // Cut back to step 2: the first two lines, unchanged.
        MetricsWriter::open(&path, 2).unwrap();
        let kept: Vec<&str> = before.lines().take(2).collect();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", kept.join("\n"))
        );
    }
}
