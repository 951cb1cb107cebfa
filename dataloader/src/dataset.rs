//! `dataset.json`: what a packed dataset folder holds, how it was made, and its statistics.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::DataConfig;
use crate::pack::{Histograms, Imbalance};
use crate::shard::{Dataset, ShardError, ShardInfo};

/// The file name inside a dataset folder.
pub const DATASET_JSON: &str = "dataset.json";
/// One JSON object a line: id, source, stage, kind, reason.
pub const REJECTS_JSONL: &str = "rejects.jsonl";
/// Bumped when the shard schema or this file changes incompatibly.
pub const FORMAT_VERSION: u32 = 1;

/// The tokenizer the ids come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// `hf` (a `tokenizer.json`) or `byte`.
    pub kind: String,
    pub path: Option<String>,
    /// SHA-256 of the `tokenizer.json` bytes (`None` for the byte tokenizer).
    pub sha256: Option<String>,
    pub vocab_size: usize,
    /// The tokenizer's files copied into the dataset folder (`tokenizer.json` first; empty
    /// for the byte tokenizer and for datasets packed before they were copied).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
}

/// Per-pack encoder load before and after the modality-balancing pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BalanceInfo {
    pub vision: Imbalance,
    pub audio: Imbalance,
}

/// The contents of `dataset.json`. Counts add up: `samples = packed_samples + rejected`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetInfo {
    pub format_version: u32,
    /// `braid <version>` that wrote it.
    pub created_by: String,
    pub input: String,
    pub input_format: String,
    /// Input records seen (good and rejected).
    pub samples: u64,
    /// Samples in the shards (truncated ones included).
    pub packed_samples: u64,
    pub rejected: u64,
    /// Rejects per stage (`read`, `media`, `tokenize`, `pack`) and per `stage/kind`.
    pub rejected_by_stage: BTreeMap<String, u64>,
    pub rejected_by_kind: BTreeMap<String, u64>,
    /// Input files that could not be read to the end (truncated or corrupt archives):
    /// their unread records are in no count above. Each one's reason is in
    /// `rejects.jsonl` (kind `damaged_file`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub damaged_files: Vec<String>,
    pub truncated: u64,
    pub packs: u64,
    pub max_seq_len: u64,
    /// Non-padding tokens in the packs.
    pub tokens: u64,
    /// `tokens / (packs * max_seq_len)`.
    pub fill: f64,
    /// Images and clips in the shards.
    pub images: u64,
    pub audio_clips: u64,
    /// Length histograms of the packed samples (log2 buckets).
    pub histograms: Histograms,
    pub balance: BalanceInfo,
    pub shards: Vec<ShardInfo>,
    pub tokenizer: TokenizerInfo,
    /// The resolved data config the shards were made with (the loader preprocesses with it).
    pub settings: DataConfig,
    /// Wall time of `braid pack`.
    pub elapsed_s: f64,
}

/// Errors opening a dataset folder.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error(
        "{dir}: no dataset.json (not a `braid pack` output, or packing did not finish): {reason}"
    )]
    Missing { dir: String, reason: String },
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error(transparent)]
    Shard(#[from] ShardError),
}

/// The most bytes a `dataset.json` may hold (it lists shards and histograms: ~100 bytes a
/// shard, so a million shards fit many times over).
const MAX_DATASET_JSON: u64 = 1 << 30;

impl DatasetInfo {
    /// Reads `dir/dataset.json`.
    pub fn read(dir: &Path) -> Result<DatasetInfo, DatasetError> {
        let path = dir.join(DATASET_JSON);
        let invalid = |reason: String| DatasetError::Invalid {
            path: path.display().to_string(),
            reason,
        };
        // `braid pack` writes it as a regular file: a device or FIFO in its place (a
        // symlink to /dev/zero) would be read without end.
        match std::fs::metadata(&path) {
            Ok(m) if !m.is_file() => {
                return Err(invalid(
                    "not a regular file (a folder, FIFO or device)".into(),
                ));
            }
            Ok(m) if m.len() > MAX_DATASET_JSON => {
                return Err(invalid(format!(
                    "{} bytes, more than a dataset.json's {MAX_DATASET_JSON} at most",
                    m.len()
                )));
            }
            _ => {}
        }
        let text = std::fs::read_to_string(&path).map_err(|e| DatasetError::Missing {
            dir: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let info: DatasetInfo = serde_json::from_str(&text).map_err(|e| DatasetError::Invalid {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        if info.tokenizer.vocab_size == 0 {
            return Err(DatasetError::Invalid {
                path: path.display().to_string(),
                reason: "tokenizer.vocab_size is 0: no token id could be stored".into(),
            });
        }
        if info.format_version != FORMAT_VERSION {
            return Err(DatasetError::Invalid {
                path: path.display().to_string(),
                reason: format!(
                    "format_version {} (this braid reads {FORMAT_VERSION}); pack the data again",
                    info.format_version
                ),
            });
        }
        // A dataset reads (and checkpoints copy) only files of its own folder.
        let names = info
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("shards[{i}].file"), &s.file))
            .chain(
                (info.tokenizer.files.iter().enumerate())
                    .map(|(i, f)| (format!("tokenizer.files[{i}]"), f)),
            );
        for (key, name) in names {
            if !crate::shard::is_plain_file_name(name) {
                return Err(DatasetError::Invalid {
                    path: path.display().to_string(),
                    reason: format!(
                        "{key} {name:?} is not a file name inside the dataset folder \
                         (no folders, `..` or absolute paths: a dataset reads only its own folder)"
                    ),
                });
            }
        }
        Ok(info)
    }

    /// Writes `dir/dataset.json` under a temporary name, then renames it: a reader sees the
    /// old file or the complete new one.
    pub fn write(&self, dir: &Path) -> Result<(), DatasetError> {
        let path = dir.join(DATASET_JSON);
        let err = |e: String| DatasetError::Invalid {
            path: path.display().to_string(),
            reason: e,
        };
        let text = serde_json::to_string_pretty(self).map_err(|e| err(e.to_string()))?;
        let tmp = dir.join(format!(".{DATASET_JSON}.tmp"));
        std::fs::write(&tmp, text.as_bytes()).map_err(|e| err(e.to_string()))?;
        std::fs::rename(&tmp, &path).map_err(|e| err(e.to_string()))
    }

    /// Opens `dir`: its `dataset.json` and the pack index of its shards.
    pub fn open(dir: &Path) -> Result<(DatasetInfo, Dataset), DatasetError> {
        let info = DatasetInfo::read(dir)?;
        let mut ds = Dataset::open(dir, &info.shards)?;
        ds.check_ids_below(info.tokenizer.vocab_size);
        if ds.packs().len() as u64 != info.packs {
            return Err(DatasetError::Invalid {
                path: dir.join(DATASET_JSON).display().to_string(),
                reason: format!(
                    "says {} packs, the shards hold {}",
                    info.packs,
                    ds.packs().len()
                ),
            });
        }
        Ok((info, ds))
    }

    /// The dataset's identity: SHA-256 over its shards' names, pack counts and
    /// SHA-256s (hex). Two copies of one `braid pack` output agree, and so do two packs of
    /// the same input with the same settings (packing is deterministic); a stale or
    /// other dataset under the same path does not.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for s in &self.shards {
            h.update(format!("{}\t{}\t{}\n", s.file, s.packs, s.sha256).as_bytes());
        }
        crate::shard::hex(&h.finalize())
    }

    /// Recomputes every shard's SHA-256; the error names the first shard that differs.
    /// Returns the bytes hashed.
    pub fn verify_checksums(&self, dir: &Path) -> Result<u64, DatasetError> {
        use sha2::{Digest, Sha256};
        let mut bytes = 0;
        for s in &self.shards {
            let path = dir.join(&s.file);
            let bad = |reason: String| DatasetError::Invalid {
                path: path.display().to_string(),
                reason,
            };
            let mut f = crate::shard::open_shard(&path).map_err(|e| bad(e.to_string()))?;
            let mut h = Sha256::new();
            bytes += std::io::copy(&mut f, &mut h).map_err(|e| bad(e.to_string()))?;
            let got = crate::shard::hex(&h.finalize());
            if got != s.sha256 {
                return Err(bad(format!(
                    "checksum mismatch: sha256 {got}, dataset.json says {}",
                    s.sha256
                )));
            }
        }
        Ok(bytes)
    }
}
