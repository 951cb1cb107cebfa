//! `[checkpoint]` and the checkpoint folder: `<run.dir>/checkpoints/step-00000050/` holds
//! `model.safetensors` (every weight, module-prefixed names), `optim.safetensors` (AdamW
//! moments, `<param>.exp_avg` / `<param>.exp_avg_sq`), `state.json` (step counters, the
//! loader's position, the seed), `config.toml` (the resolved run config) and `data.json`
//! (the data config of the dataset: tokenizer, chat template, preprocessing).
//!
//! Atomicity: everything is written into `.tmp-step-...`, each file synced, then the folder
//! is renamed into place and the parent synced. A folder named `step-*` is therefore always
//! complete; a crash mid-write leaves only a `.tmp-*` folder, removed on the next start.

use std::path::{Path, PathBuf};

use braid_dataloader::loader::LoaderState;
use braid_kernels::Device;
use braid_nn::hf::save_safetensors;
use braid_nn::{Module, Shard};
use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, invalid};
use crate::error::{Result, TrainError, io_err};
use crate::optim::AdamW;
use crate::parallel::ckpt::SliceReader;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Steps between checkpoints; 0: only at the end.
    pub interval: u64,
    /// Checkpoints kept (the oldest are deleted once a newer one is in place).
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            interval: 100,
            keep: 3,
        }
    }
}

impl CheckpointConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.keep == 0 {
            return Err(invalid("checkpoint.keep", "must be >= 1"));
        }
        Ok(())
    }
}

/// `state.json`: everything besides tensors that resuming needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    /// Steps completed (skipped ones included).
    pub step: u64,
    /// AdamW updates applied (bias correction).
    pub optimizer_step: u64,
    /// The loader's next batch.
    pub loader: LoaderState,
    /// The run's seed (weight init and data order; the step draws no random numbers).
    pub seed: u64,
    pub skipped_steps: u64,
    pub nonfinite_in_a_row: u64,
    pub tokens_seen: u64,
    /// Training time so far, summed over every resumed segment.
    pub elapsed_s: f64,
}

impl TrainState {
    /// Step 0 of a run: nothing done, the loader at `loader`.
    pub fn fresh(loader: LoaderState, seed: u64) -> Self {
        TrainState {
            step: 0,
            optimizer_step: 0,
            loader,
            seed,
            skipped_steps: 0,
            nonfinite_in_a_row: 0,
            tokens_seen: 0,
            elapsed_s: 0.0,
        }
    }
}

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIM_FILE: &str = "optim.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const CONFIG_FILE: &str = "config.toml";
/// The data config the dataset was packed with (tokenizer, template, preprocessing), so a
/// checkpoint alone can read new prompts (`braid generate`).
pub const DATA_FILE: &str = "data.json";

fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn ckpt_err(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir, "sync"))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io_err(path, "create"))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io_err(path, "write"))
}

/// Every entry under `root` named `step-*`, as (what follows `step-`, path); none when
/// `root` does not exist.
fn step_entries(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    let rd = match std::fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(root, "list")(e)),
    };
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(io_err(root, "list"))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(n) = name.strip_prefix("step-") {
            out.push((n.to_string(), entry.path()));
        }
    }
    Ok(out)
}

/// The step of a complete checkpoint's `step-*` entry, or why it is not one.
fn step_of(suffix: &str, path: &Path) -> std::result::Result<u64, &'static str> {
    let step = suffix
        .parse::<u64>()
        .map_err(|_| "its name is not step-<number>")?;
    if !path.is_dir() {
        return Err("not a folder");
    }
    if !path.join(STATE_FILE).is_file() {
        return Err("no state.json in it");
    }
    Ok(step)
}

/// Complete checkpoints under `root`, oldest first, as (step, folder).
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out: Vec<(u64, PathBuf)> = step_entries(root)?
        .into_iter()
        .filter_map(|(n, path)| Some((step_of(&n, &path).ok()?, path)))
        .collect();
    out.sort();
    Ok(out)
}

/// Entries under `root` named like checkpoints (`step-*`) that [`list`] does not take, as
/// (folder, step where the name is one, why): damaged or hand-made, never left by a crash
/// (a save, and a deletion, that dies leaves a `.tmp-*` folder).
pub fn unusable(root: &Path) -> Result<Vec<(PathBuf, Option<u64>, String)>> {
    let mut out: Vec<(PathBuf, Option<u64>, String)> = step_entries(root)?
        .into_iter()
        .filter_map(|(n, path)| {
            let why = step_of(&n, &path).err()?;
            Some((path, n.parse::<u64>().ok(), why.to_string()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// What every checkpoint holds besides tensors and state: the resolved run config, the
/// data config, the tokenizer's files.
pub(crate) fn files<'a>(
    config_toml: &'a str,
    data_json: &'a str,
    tokenizer: &'a crate::tokenizer::TokenizerFiles,
) -> Vec<(&'a str, &'a [u8])> {
    let mut files = vec![
        (CONFIG_FILE, config_toml.as_bytes()),
        (DATA_FILE, data_json.as_bytes()),
    ];
    files.extend(tokenizer.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    files
}

/// The newest complete checkpoint under `root`.
pub fn latest(root: &Path) -> Result<Option<(u64, PathBuf)>> {
    Ok(list(root)?.pop())
}

/// Removes half-written `.tmp-*` folders left by a crash; returns the folders removed.
pub fn remove_partial(root: &Path) -> Result<Vec<PathBuf>> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for entry in rd.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".tmp-") {
            std::fs::remove_dir_all(entry.path()).map_err(io_err(&entry.path(), "remove"))?;
            removed.push(entry.path());
        }
    }
    removed.sort();
    Ok(removed)
}

/// Writes one checkpoint atomically and deletes the oldest beyond `keep`. Returns its folder.
/// `abort_midway` (fault injection only) aborts the process half-way through.
pub fn save<M: Module + ?Sized>(
    root: &Path,
    model: &M,
    optim: &AdamW,
    state: &TrainState,
    files: &[(&str, &[u8])],
    keep: usize,
    abort_midway: bool,
) -> Result<PathBuf> {
    let tmp = begin(root, state.step)?;
    let mut weights = Vec::new();
    model.visit_params(&mut |p| weights.push((p.name.clone(), &p.value)));
    save_safetensors(&tmp.join(MODEL_FILE), &weights)?;
    if abort_midway {
        // Fault injection (`fault.abort_during_checkpoint_at`): die like `kill -9` would.
        std::process::abort();
    }
    let mut moments = Vec::with_capacity(2 * optim.moments.len());
    for m in &optim.moments {
        moments.push((format!("{}.exp_avg", m.name), &m.exp_avg));
        moments.push((format!("{}.exp_avg_sq", m.name), &m.exp_avg_sq));
    }
    save_safetensors(&tmp.join(OPTIM_FILE), &moments)?;
    finish(root, &tmp, state, files, keep)
}

/// Starts the checkpoint of `step`: an empty `.tmp-step-N` folder under `root` (a stale
/// one from a crash is removed). Returns it.
pub fn begin(root: &Path, step: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(root).map_err(io_err(root, "create"))?;
    let tmp = root.join(format!(".tmp-{}", step_dir_name(step)));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp, "remove"))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp, "create"))?;
    Ok(tmp)
}

/// Completes a checkpoint whose tensors are in `tmp`: writes `state.json` and `files`,
/// syncs, renames the folder into place, prunes beyond `keep`. Returns the folder.
pub fn finish(
    root: &Path,
    tmp: &Path,
    state: &TrainState,
    files: &[(&str, &[u8])],
    keep: usize,
) -> Result<PathBuf> {
    let dst = root.join(step_dir_name(state.step));
    let json = serde_json::to_string_pretty(state).map_err(|e| ckpt_err(tmp, e.to_string()))?;
    write_synced(&tmp.join(STATE_FILE), json.as_bytes())?;
    for (name, bytes) in files {
        write_synced(&crate::tokenizer::plain_child(tmp, name)?, bytes)?;
    }
    sync_dir(tmp)?;

    if dst.exists() {
        // The same step saved again (a resumed run re-reaching it): replace it whole.
        discard(root, &dst)?;
    }
    std::fs::rename(tmp, &dst).map_err(io_err(&dst, "rename into place"))?;
    sync_dir(root)?;

    let all = list(root)?;
    if all.len() > keep {
        for (_, old) in &all[..all.len() - keep] {
            discard(root, old)?;
        }
    }
    Ok(dst)
}

/// Deletes checkpoint folder `dir` of `root`: renamed to `.tmp-discard-*` first, so that a
/// crash part-way through the deletion leaves a `.tmp-*` folder (removed at the next
/// start, [`remove_partial`]), never a `step-*` folder without some of its files.
fn discard(root: &Path, dir: &Path) -> Result<()> {
    let name = dir
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().to_string());
    let doomed = root.join(format!(".tmp-discard-{name}"));
    if doomed.exists() {
        std::fs::remove_dir_all(&doomed).map_err(io_err(&doomed, "remove"))?;
    }
    std::fs::rename(dir, &doomed).map_err(io_err(dir, "move aside to remove"))?;
    std::fs::remove_dir_all(&doomed).map_err(io_err(&doomed, "remove old checkpoint"))
}

/// Reads `state.json` of a checkpoint folder.
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let p = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&p).map_err(io_err(&p, "read"))?;
    let state: TrainState = serde_json::from_str(&text)
        .map_err(|e| ckpt_err(&p, format!("invalid state.json: {e}")))?;
    // The folder is named after the step it holds: a state that disagrees was edited or
    // damaged, and resuming from it would retrain (and overwrite) logged steps or skip
    // the rest of the run.
    let named = dir
        .file_name()
        .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<u64>().ok());
    if let Some(n) = named
        && n != state.step
    {
        return Err(ckpt_err(
            &p,
            format!(
                "says step {} but the folder holds step {n}: the checkpoint is damaged",
                state.step
            ),
        ));
    }
    // Every step takes one batch: the loader cannot be further on than the step count.
    if state.loader.epoch > state.step || state.loader.batch > state.step {
        return Err(ckpt_err(
            &p,
            format!(
                "loader epoch {} batch {} lie beyond step {}: the checkpoint is damaged",
                state.loader.epoch, state.loader.batch, state.step
            ),
        ));
    }
    if state.optimizer_step > state.step
        || state.skipped_steps > state.step
        || state.nonfinite_in_a_row > state.skipped_steps
    {
        return Err(ckpt_err(
            &p,
            format!(
                "optimizer_step {} and skipped_steps {} cannot exceed step {}, nor nonfinite_in_a_row {} skipped_steps: the checkpoint is damaged",
                state.optimizer_step, state.skipped_steps, state.step, state.nonfinite_in_a_row
            ),
        ));
    }
    Ok(state)
}

/// Overwrites every weight of `model` from checkpoint `dir` (one rank's
/// `model.safetensors` or every rank's slices); every parameter must be there with its
/// shape, and nothing else may be.
pub fn load_weights<M: Module + ?Sized>(dir: &Path, model: &mut M, device: Device) -> Result<()> {
    let stored = SliceReader::open(dir, "model")?;
    load_each(model, stored.len(), dir, |name, dims| {
        stored.tensor(name, Shard::Full, dims, device)
    })
}

/// Every parameter of `model` from `get(name, shape)`; `stored` tensors must be exactly
/// the model's.
fn load_each<M: Module + ?Sized>(
    model: &mut M,
    stored: usize,
    origin: &Path,
    get: impl Fn(&str, &[usize]) -> Result<braid_kernels::Tensor>,
) -> Result<()> {
    let mut res: Result<()> = Ok(());
    let mut n = 0usize;
    model.visit_params_mut(&mut |p| {
        if res.is_err() {
            return;
        }
        n += 1;
        // A loaded master re-derives its compute copy (mixed precision).
        res = get(&p.name, p.value.dims()).and_then(|t| {
            p.value = t;
            Ok(p.refresh_compute()?)
        });
    });
    res?;
    if stored != n {
        return Err(ckpt_err(
            origin,
            format!(
                "{stored} tensors stored but the model has {n} parameters: the checkpoint is of another model"
            ),
        ));
    }
    Ok(())
}

/// Restores the AdamW moments (one pair per trainable parameter) and the update count.
pub fn load_optim(
    dir: &Path,
    optim: &mut AdamW,
    optimizer_step: u64,
    device: Device,
) -> Result<()> {
    let stored = SliceReader::open(dir, "optim")?;
    for m in &mut optim.moments {
        for (suffix, t) in [
            ("exp_avg", &mut m.exp_avg),
            ("exp_avg_sq", &mut m.exp_avg_sq),
        ] {
            let name = format!("{}.{suffix}", m.name);
            *t = stored.tensor(&name, Shard::Full, t.dims(), device)?;
        }
    }
    if stored.len() != 2 * optim.moments.len() {
        return Err(ckpt_err(
            dir,
            format!(
                "{} tensors stored for {} trainable parameters (2 each): were other modules frozen?",
                stored.len(),
                optim.moments.len()
            ),
        ));
    }
    optim.step = optimizer_step;
    Ok(())
}
