//! The run folder's lock: one `braid train` at a time in a `run.dir`, and nothing left behind by a start that failed.

use std::path::{Path, PathBuf};

use braid_dataloader::job_output::lock_file;

use crate::config::invalid;
use crate::error::{Result, io_err};

/// The lock file a run holds in its folder (`<run.dir>/.run.lock`).
pub const RUN_LOCK: &str = ".run.lock";

/// A run folder's lock, held while its trainer lives. Until [`RunLock::keep`], dropping
/// it (a start that failed) removes what taking it made: the lock file, and the folder
/// where it made that too and nothing else is in it.
#[derive(Debug)]
pub(crate) struct RunLock {
    _file: std::fs::File,
    dir: PathBuf,
    made_dir: bool,
    kept: bool,
}

impl RunLock {
    /// Takes `run_dir`'s lock (creating the folder), or fails naming it when another run
    /// holds it. The OS drops the lock with the process, so a killed run leaves none.
    pub(crate) fn take(run_dir: &Path) -> Result<RunLock> {
        let path = run_dir.join(RUN_LOCK);
        let made_dir = !run_dir.exists();
        std::fs::create_dir_all(run_dir).map_err(io_err(run_dir, "create"))?;
        let Some(file) = lock_file(&path, false).map_err(io_err(&path, "lock"))? else {
            // Another run's folder and lock: nothing of it to clean up.
            return Err(invalid(
                "run.dir",
                format!(
                    "{}: another braid train is running in this folder: wait for it, or set another run.dir",
                    run_dir.display()
                ),
            )
            .into());
        };
        Ok(RunLock {
            _file: file,
            dir: run_dir.to_path_buf(),
            made_dir,
            kept: false,
        })
    }

    /// The run started: the lock file stays with the run folder.
    pub(crate) fn keep(mut self) -> RunLock {
        self.kept = true;
        self
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(self.dir.join(RUN_LOCK));
            if self.made_dir {
                // Only if empty: remove_dir refuses a folder with anything in it.
                let _ = std::fs::remove_dir(&self.dir);
            }
        }
    }
}
