//! `braid pack` as a library call: read -> decode + tokenize (parallel, order kept) -> pack ->
//! shards, `rejects.jsonl` and `dataset.json` (written last, atomically).
//!
//! Bad samples never stop the job: each becomes one line of `rejects.jsonl`. The job fails only
//! when the input cannot be opened, the output cannot be written, nothing valid remains, or
//! more than `pack.max_reject_ratio` of the samples were rejected or of the input files could
//! not be read to the end (a truncated archive loses records no sample count sees).
//! Memory: one chunk of raw samples (a few per thread) plus the packer's window of token ids;
//! media bytes of samples waiting in the window sit in a staging file (`shard::Staging`).
//! The output is a pure function of the input and the config: the thread count changes nothing.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use crate::config::{ConfigError, DataConfig};
use crate::dataset::{
    BalanceInfo, DATASET_JSON, DatasetError, DatasetInfo, FORMAT_VERSION, REJECTS_JSONL,
    TokenizerInfo,
};
use crate::pack::{Admission, Pack, Packer};
use crate::prepare::{Prepared, Preparer, SampleReject, Stage};
use crate::read::{self, Format, ReadError};
use crate::shard::{ShardError, ShardWriter, Staging};
use crate::tokenize::{ByteTokenizer, HfTokenizer, TokenizeError, Tokenizer, check_media_tokens};

/// Why `braid pack` stopped.
#[derive(Debug, thiserror::Error)]
pub enum PackJobError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot read the input: {0}")]
    Input(#[from] ReadError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizeError),
    #[error("output {path}: {reason}")]
    Output { path: String, reason: String },
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("{}", nothing_valid(*.samples, .damaged, .rejects))]
    NothingValid {
        samples: u64,
        /// Input files that could not be read to the end (each counted as a reject).
        damaged: Vec<String>,
        rejects: String,
    },
    #[error("{}", too_many_rejects(.rejected, .samples, .max_ratio, .by_kind, .rejects))]
    TooManyRejects {
        rejected: u64,
        samples: u64,
        max_ratio: f64,
        /// `stage/kind` -> count, as `dataset.json`'s `rejected_by_kind`.
        by_kind: BTreeMap<String, u64>,
        rejects: String,
    },
    #[error("{}", too_many_damaged(.damaged, *.files, *.max_ratio, .rejects))]
    TooManyDamagedFiles {
        /// The files, in the order they failed.
        damaged: Vec<String>,
        /// Input files in all.
        files: usize,
        max_ratio: f64,
        rejects: String,
    },
}

/// The first three of `files`, then how many more.
fn some_files(files: &[String]) -> String {
    const SHOWN: usize = 3;
    let mut names = files[..files.len().min(SHOWN)].join(", ");
    if files.len() > SHOWN {
        names.push_str(&format!(" and {} more", files.len() - SHOWN));
    }
    names
}

fn too_many_damaged(damaged: &[String], files: usize, max_ratio: f64, rejects: &str) -> String {
    let names = some_files(damaged);
    format!(
        "{} of {files} input files could not be read to the end ({names}): the records after the damage are lost and counted nowhere, so they count against pack.max_reject_ratio = {max_ratio} as files; no dataset was written (shards removed; each file's reason is in {rejects}, kind damaged_file). Repair or re-download them, remove them from the input, or raise pack.max_reject_ratio to keep what they held before the damage",
        damaged.len()
    )
}

fn nothing_valid(samples: u64, damaged: &[String], rejects: &str) -> String {
    if samples == 0 {
        return "nothing to pack: the input holds no records (an empty file, folder or archive)"
            .into();
    }
    if damaged.is_empty() {
        return format!(
            "nothing valid to pack: all {samples} input samples were rejected (see {rejects})"
        );
    }
    // A file that cannot be read is one reject: say so, naming it, instead of counting it
    // as a sample.
    let names = some_files(damaged);
    let others = samples.saturating_sub(damaged.len() as u64);
    let rest = if others == 0 {
        String::new()
    } else {
        format!(", and the other {others} samples were rejected")
    };
    format!(
        "nothing valid to pack: {} input file{} could not be read ({names}: damaged or not the \
         input format){rest} (each reason is in {rejects})",
        damaged.len(),
        if damaged.len() == 1 { "" } else { "s" },
    )
}

fn too_many_rejects(
    rejected: &u64,
    samples: &u64,
    max_ratio: &f64,
    by_kind: &BTreeMap<String, u64>,
    rejects: &str,
) -> String {
    let kinds: Vec<String> = by_kind.iter().map(|(k, n)| format!("{k} {n}")).collect();
    format!(
        "{rejected} of {samples} samples rejected ({:.1}%), above pack.max_reject_ratio = {max_ratio}: {}; no dataset was written (shards removed; every reject is in {rejects})",
        100.0 * *rejected as f64 / (*samples).max(1) as f64,
        kinds.join(", ")
    )
}

fn out_err(path: &Path, e: impl std::fmt::Display) -> PackJobError {
    PackJobError::Output {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Counters reported while packing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackProgress {
    pub read: u64,
    pub packed: u64,
    pub rejected: u64,
    pub packs: u64,
    pub shards: u64,
}

/// What to pack and where.
#[derive(Clone, Debug)]
pub struct PackJob {
    pub input: PathBuf,
    pub format: Format,
    pub output: PathBuf,
    pub config: DataConfig,
    /// Replace an existing dataset in `output`.
    pub overwrite: bool,
}

/// The tokenizer named by the config, and what `dataset.json` says about it.
pub fn load_tokenizer(
    cfg: &DataConfig,
) -> Result<(Box<dyn Tokenizer>, TokenizerInfo), PackJobError> {
    match &cfg.tokenizer.path {
        None => {
            let t = ByteTokenizer::new();
            let info = TokenizerInfo {
                kind: "byte".into(),
                path: None,
                sha256: None,
                vocab_size: t.vocab_size(),
                files: Vec::new(),
            };
            Ok((Box::new(t), info))
        }
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| TokenizeError::Load {
                path: p.display().to_string(),
                reason: e.to_string(),
            })?;
            let t = HfTokenizer::from_bytes(&bytes, &p.display().to_string())?;
            let info = TokenizerInfo {
                kind: "hf".into(),
                path: Some(p.display().to_string()),
                sha256: Some(crate::tokenize::files::tokenizer_sha256(&bytes)),
                vocab_size: t.vocab_size(),
                files: Vec::new(),
            };
            Ok((Box::new(t), info))
        }
    }
}

/// Whether `name` is a file `braid pack` itself writes into an output folder. The tokenizer's
/// copies count only beside a `dataset.json` (`has_dataset`): a `tokenizer.json` in a folder
/// without one may be the user's own.
fn written_by_pack(name: &str, has_dataset: bool) -> bool {
    (has_dataset && crate::tokenize::files::is_tokenizer_file(name))
        || name == DATASET_JSON
        || name == REJECTS_JSONL
        || name.starts_with(".staging")
        || name == PACK_LOCK
        || name.starts_with(".dataset.json")
        || (name.starts_with("shard-") && (name.ends_with(".parquet") || name.ends_with(".tmp")))
}

/// The entries of an existing output folder `out`, or an error naming the files in it
/// that `braid pack` does not write (the folder is the user's: nothing may be deleted or
/// added there). Reads only.
pub fn check_output(out: &Path) -> Result<Vec<std::path::PathBuf>, PackJobError> {
    let mut entries = Vec::new();
    for e in std::fs::read_dir(out).map_err(|e| out_err(out, e))? {
        entries.push(e.map_err(|e| out_err(out, e))?.path());
    }
    let has_dataset = out.join(DATASET_JSON).is_file();
    let foreign: Vec<String> = entries
        .iter()
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            // A pack's file, or one gone since the listing (a pack on first use that holds
            // the lock cleared it).
            !(written_by_pack(name, has_dataset)
                && (p.is_file()
                    || (name == crate::job_output::STAGING_DIR && p.is_dir())
                    || std::fs::symlink_metadata(p).is_err()))
        })
        .map(|p| p.display().to_string())
        .collect();
    if !foreign.is_empty() {
        let shown = foreign
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        let more = foreign.len().saturating_sub(3);
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        return Err(out_err(
            out,
            format!(
                "exists and holds files braid pack did not write ({shown}{more}), so it is not a braid dataset; choose an empty or new folder (nothing was deleted)"
            ),
        ));
    }
    Ok(entries)
}

/// Prepares `output`: created if missing; an existing dataset (a `dataset.json`) is replaced
/// only with `overwrite`. A folder without `dataset.json` holds no dataset: the leftovers of a
/// killed or failed pack (shards, staging, rejects) are removed and the job goes on. A folder
/// holding any file the pack does not write is refused: nothing of the user's is deleted.
pub fn prepare_output(out: &Path, overwrite: bool) -> Result<(), PackJobError> {
    if !out.exists() {
        return std::fs::create_dir_all(out).map_err(|e| out_err(out, e));
    }
    let entries = check_output(out)?;
    if out.join(DATASET_JSON).exists() && !overwrite {
        return Err(out_err(
            out,
            "already holds a packed dataset; pass --overwrite to replace it",
        ));
    }
    for p in entries {
        // The lock of a pack on first use (`PACK_LOCK`) stays: another starter holds it.
        if p.file_name().and_then(|n| n.to_str()) == Some(PACK_LOCK) {
            continue;
        }
        if p.is_dir() {
            // An `--overwrite` pack's staging folder, left by a killed run.
            std::fs::remove_dir_all(&p).map_err(|e| out_err(&p, e))?;
        } else {
            std::fs::remove_file(&p).map_err(|e| out_err(&p, e))?;
        }
    }
    Ok(())
}

/// The lock file a pack on first use holds in its output folder while it packs, so that
/// runs (or ranks) starting at once on the same unpacked dataset pack it once.
pub const PACK_LOCK: &str = ".pack.lock";

/// Runs the job; `progress` is called after every chunk.
pub fn run_pack(
    job: &PackJob,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<DatasetInfo, PackJobError> {
    let started = Instant::now();
    let cfg = &job.config;
    cfg.validate()?;
    let (tokenizer, mut tok_info) = load_tokenizer(cfg)?;
    let preparer = Preparer::new(cfg, tokenizer.as_ref())?;
    let tokenizer_name = tok_info
        .path
        .as_deref()
        .unwrap_or("the byte-level tokenizer");
    check_media_tokens(&cfg.template, tokenizer.as_ref(), tokenizer_name)?;
    let records = read::open(&job.input, &cfg.read_config(job.format))?;
    let input_files = read::input_count(&job.input, job.format)?;
    prepare_output(&job.output, job.overwrite)?;
    let threads = match cfg.shards.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| out_err(&job.output, format!("thread pool: {e}")))?;

    let rejects_path = job.output.join(REJECTS_JSONL);
    let mut rejects = Rejects::create(&rejects_path)?;
    let mut staging = Staging::create(&job.output.join(".staging.bin"))?;
    let mut writer = ShardWriter::new(&job.output, &cfg.shards, &cfg.pack.cost)?;
    let mut packer = Packer::new(cfg.pack.clone()).map_err(ConfigError::from)?;
    let mut p = PackProgress::default();
    let mut next_pack = 0u64;
    let mut counts = MediaCounts::default();

    let chunk_len = 16 * threads;
    let mut records = records.peekable();
    while records.peek().is_some() {
        let chunk: Vec<_> = records.by_ref().take(chunk_len).collect();
        p.read += chunk.len() as u64;
        let prepared: Vec<Result<Prepared, SampleReject>> = pool.install(|| {
            chunk
                .into_par_iter()
                .map_init(
                    || preparer.audio_decoder(),
                    |dec, r| match (r, dec) {
                        (Err(rej), _) => Err(SampleReject::read(rej)),
                        (Ok(raw), Ok(dec)) => preparer.prepare(raw, dec),
                        (Ok(raw), Err(e)) => Err(SampleReject {
                            id: Some(raw.id),
                            source: raw.source,
                            stage: Stage::Media,
                            kind: "config".into(),
                            reason: e.to_string(),
                            damaged_file: None,
                        }),
                    },
                )
                .collect()
        });
        for r in prepared {
            match r {
                Err(rej) => rejects.push(&rej)?,
                Ok(mut s) => {
                    let index = packer.samples_seen();
                    match packer.push(&s.meta) {
                        Admission::Rejected(reason) => rejects.push(&SampleReject {
                            id: Some(s.id),
                            source: s.source,
                            stage: Stage::Pack,
                            kind: reason.kind().into(),
                            reason: reason.to_string(),
                            damaged_file: None,
                        })?,
                        admission => {
                            if let Admission::Truncated(t) = admission {
                                s.truncate_to(&t);
                            }
                            counts.add(&s);
                            staging.put(index, s)?;
                        }
                    }
                }
            }
        }
        write_packs(
            &packer.drain_packs(),
            &mut staging,
            &mut writer,
            &mut next_pack,
        )?;
        p.rejected = rejects.total;
        p.packed = counts.samples;
        p.packs = next_pack;
        p.shards = writer.shards().len() as u64;
        progress(&p);
    }
    let out = packer.finish();
    write_packs(&out.packs, &mut staging, &mut writer, &mut next_pack)?;
    let shards = writer.finish()?;
    staging.remove()?;
    rejects.finish()?;
    p.packs = next_pack;
    p.shards = shards.len() as u64;
    progress(&p);
    if next_pack == 0 {
        return Err(PackJobError::NothingValid {
            samples: p.read,
            damaged: rejects.damaged.clone(),
            rejects: rejects_path.display().to_string(),
        });
    }
    let max_ratio = cfg.pack.max_reject_ratio;
    let failure = if p.rejected as f64 > max_ratio * p.read as f64 {
        Some(PackJobError::TooManyRejects {
            rejected: rejects.total,
            samples: p.read,
            max_ratio,
            by_kind: rejects.by_kind.clone(),
            rejects: rejects_path.display().to_string(),
        })
    } else if rejects.damaged.len() as f64 > max_ratio * input_files as f64 {
        // A truncated shard is one reject however many records it lost: the sample
        // ratio cannot see it, so damaged files are held to the ratio of the files.
        Some(PackJobError::TooManyDamagedFiles {
            damaged: rejects.damaged.clone(),
            files: input_files,
            max_ratio,
            rejects: rejects_path.display().to_string(),
        })
    } else {
        None
    };
    if let Some(e) = failure {
        // Shards of a failed pack are not a dataset: remove them now (the next pack into this
        // folder would too) and keep `rejects.jsonl`, which says what went wrong.
        for s in &shards {
            let path = job.output.join(&s.file);
            std::fs::remove_file(&path).map_err(|e| out_err(&path, e))?;
        }
        return Err(e);
    }
    let st = &out.stats;
    let mut by_stage: BTreeMap<String, u64> = BTreeMap::new();
    for (k, v) in &rejects.by_kind {
        let stage = k.split('/').next().unwrap_or(k).to_string();
        *by_stage.entry(stage).or_default() += v;
    }
    // The tokenizer travels with the dataset (a checkpoint or export needs no other path).
    if let Some(tok) = &cfg.tokenizer.path {
        tok_info.files = crate::tokenize::files::copy_tokenizer_files(tok, &job.output)
            .map_err(|e| out_err(&job.output, e))?;
    }
    let info = DatasetInfo {
        format_version: FORMAT_VERSION,
        created_by: format!("braid {}", env!("CARGO_PKG_VERSION")),
        input: job.input.display().to_string(),
        input_format: format!("{:?}", job.format).to_lowercase(),
        samples: p.read,
        packed_samples: st.packed_samples as u64,
        rejected: rejects.total,
        rejected_by_stage: by_stage,
        rejected_by_kind: rejects.by_kind.clone(),
        damaged_files: rejects.damaged.clone(),
        truncated: st.truncated as u64,
        packs: st.packs as u64,
        max_seq_len: st.max_seq_len as u64,
        tokens: st.tokens,
        fill: st.fill,
        images: counts.images,
        audio_clips: counts.audio,
        histograms: st.histograms.clone(),
        balance: BalanceInfo {
            vision: st.vision,
            audio: st.audio,
        },
        shards,
        tokenizer: tok_info,
        settings: cfg.clone(),
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    if info.packed_samples + info.rejected != info.samples {
        return Err(out_err(
            &job.output,
            format!(
                "internal count mismatch: {} packed + {} rejected != {} read",
                info.packed_samples, info.rejected, info.samples
            ),
        ));
    }
    info.write(&job.output)?;
    Ok(info)
}

/// Moves the samples of `packs` from the staging file into the shards, numbering the packs.
fn write_packs(
    packs: &[Pack],
    staging: &mut Staging,
    writer: &mut ShardWriter,
    next_pack: &mut u64,
) -> Result<(), PackJobError> {
    for pack in packs {
        let samples = pack
            .samples
            .iter()
            .map(|&i| staging.take(i))
            .collect::<Result<Vec<_>, _>>()?;
        writer.write_pack(*next_pack, samples)?;
        *next_pack += 1;
    }
    Ok(())
}

#[derive(Default)]
struct MediaCounts {
    samples: u64,
    images: u64,
    audio: u64,
}

impl MediaCounts {
    fn add(&mut self, s: &Prepared) {
        self.samples += 1;
        self.images += s.images.len() as u64;
        self.audio += s.audio.len() as u64;
    }
}

/// `rejects.jsonl`, written as rejects come, and the counts per `stage/kind`.
struct Rejects {
    path: PathBuf,
    out: BufWriter<File>,
    total: u64,
    by_kind: BTreeMap<String, u64>,
    /// Input files whose rest could not be read, in the order they failed.
    damaged: Vec<String>,
}

impl Rejects {
    fn create(path: &Path) -> Result<Rejects, PackJobError> {
        let f = File::create(path).map_err(|e| out_err(path, e))?;
        Ok(Rejects {
            path: path.to_path_buf(),
            out: BufWriter::new(f),
            total: 0,
            by_kind: BTreeMap::new(),
            damaged: Vec::new(),
        })
    }

    fn push(&mut self, r: &SampleReject) -> Result<(), PackJobError> {
        let stage = serde_json::to_value(r.stage)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        *self
            .by_kind
            .entry(format!("{stage}/{}", r.kind))
            .or_default() += 1;
        self.total += 1;
        if let Some(f) = r.damaged_file.as_deref()
            && !self.damaged.iter().any(|d| d == f)
        {
            self.damaged.push(f.to_string());
        }
        let line = serde_json::to_string(r).map_err(|e| out_err(&self.path, e))?;
        writeln!(self.out, "{line}").map_err(|e| out_err(&self.path, e))
    }

    fn finish(&mut self) -> Result<(), PackJobError> {
        self.out.flush().map_err(|e| out_err(&self.path, e))
    }
}
