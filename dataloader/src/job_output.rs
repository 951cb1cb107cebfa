//! A pack's output folder held by one writer at a time, and replaced only once the new dataset is whole.
//!
//! `braid pack` and `braid train`'s packing on first use both take an exclusive `flock`
//! on `<output>/.pack.lock` (the OS drops it with the process, so it never goes stale):
//! the CLI refuses a folder another pack holds, a training run waits for it. With
//! `--overwrite`, the new dataset is packed into `<output>/.staging-new/` and moved over
//! the old one only when it is complete, so a failed or rejected pack leaves the old
//! dataset as it was.

use std::fs::File;
use std::path::Path;

use crate::dataset::{DATASET_JSON, DatasetInfo};
use crate::job::{PACK_LOCK, PackJob, PackJobError, PackProgress, check_output, run_pack};

/// Where an `--overwrite` pack builds the new dataset before it replaces the old one.
pub const STAGING_DIR: &str = ".staging-new";

fn out_err(path: &Path, e: impl std::fmt::Display) -> PackJobError {
    PackJobError::Output {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// Takes `out`'s pack lock (creating the folder if missing): waits for another holder
/// where `wait`, else fails naming the folder. A folder of the user's own files is
/// refused before anything is added to it.
pub fn lock_output(out: &Path, wait: bool) -> Result<File, PackJobError> {
    let lock = out.join(PACK_LOCK);
    if out.exists()
        && let Err(e) = check_output(out)
        // A dataset completed by another writer meanwhile brings its tokenizer's files.
        && !out.join(DATASET_JSON).is_file()
    {
        return Err(e);
    }
    std::fs::create_dir_all(out).map_err(|e| out_err(out, e))?;
    lock_file(&lock, wait)
        .map_err(|e| out_err(&lock, e))?
        .ok_or_else(|| {
            out_err(
                out,
                "another `braid pack` (or a `braid train` packing on first use) is writing this folder: wait for it to finish or choose another --output",
            )
        })
}

/// An exclusive `flock` on the file at `path` (created if missing, never truncated):
/// waited for where `wait`, else `None` while another holder has it. The OS drops the lock
/// with the process, so a killed holder leaves none.
pub fn lock_file(path: &Path, wait: bool) -> std::io::Result<Option<File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    if wait {
        file.lock()?;
        return Ok(Some(file));
    }
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// Runs `job` under its output's lock (refusing a folder another pack holds). Replacing
/// an existing dataset (`overwrite`), the new one is packed beside it and moved in only
/// once complete: on any error the old dataset is untouched.
pub fn run_pack_locked(
    job: &PackJob,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<DatasetInfo, PackJobError> {
    let out = &job.output;
    let _lock = lock_output(out, false)?;
    if !(job.overwrite && out.join(DATASET_JSON).is_file()) {
        return run_pack(job, progress);
    }
    // The folder is a dataset (checked by `lock_output`): build the new one in staging.
    let staging = out.join(STAGING_DIR);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| out_err(&staging, e))?;
    }
    let staged = PackJob {
        output: staging.clone(),
        overwrite: false,
        ..job.clone()
    };
    let info = match run_pack(&staged, progress) {
        Ok(info) => info,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    // The old dataset goes (its dataset.json first, so that a crash from here on leaves a
    // folder without a dataset, which the next pack clears), the new one moves in
    // (its dataset.json last).
    let old: Vec<_> = std::fs::read_dir(out)
        .map_err(|e| out_err(out, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name != PACK_LOCK && name != STAGING_DIR
        })
        .collect();
    let json = out.join(DATASET_JSON);
    std::fs::remove_file(&json).map_err(|e| out_err(&json, e))?;
    for p in old.iter().filter(|p| **p != json) {
        std::fs::remove_file(p).map_err(|e| out_err(p, e))?;
    }
    let mut new: Vec<_> = std::fs::read_dir(&staging)
        .map_err(|e| out_err(&staging, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()) != Some(PACK_LOCK))
        .collect();
    // dataset.json last.
    new.sort_by_key(|p| p.file_name().and_then(|n| n.to_str()) == Some(DATASET_JSON));
    for p in new {
        let to = out.join(p.file_name().unwrap_or_default());
        std::fs::rename(&p, &to).map_err(|e| out_err(&to, e))?;
    }
    std::fs::remove_dir_all(&staging).map_err(|e| out_err(&staging, e))?;
    Ok(info)
}
