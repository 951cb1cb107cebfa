//! `TrainError`: everything that stops a run, with the file, key or step it concerns.

use std::path::{Path, PathBuf};

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] braid_nn::Error),
    #[error(transparent)]
    Kernel(#[from] braid_kernels::Error),
    #[error(transparent)]
    Comm(#[from] braid_comm::CommError),
    #[error(transparent)]
    Bridge(#[from] braid_bridge::BridgeError),
    #[error(transparent)]
    Assign(#[from] braid_balancer::AssignError),
    #[error("data: {0}")]
    Data(String),
    #[error("{}: cannot {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },
    #[error(
        "step {step}: {count} steps in a row had a non-finite loss or grad norm (loss {loss}, grad norm {grad_norm}); stopping (train.max_nonfinite_in_a_row)"
    )]
    NonFinite {
        step: u64,
        count: u64,
        loss: f64,
        grad_norm: f64,
    },
    /// A stop request (SIGINT, SIGTERM) ended the run after `step`, whose checkpoint is
    /// `checkpoint`; `--resume` continues it.
    #[error(
        "stopped by {} after step {step}; checkpoint written to {} (continue with --resume)",
        crate::stop::signal_name(*signal),
        checkpoint.display()
    )]
    Interrupted {
        signal: i32,
        step: u64,
        checkpoint: PathBuf,
    },
    #[error("{0}")]
    Other(String),
}

pub(crate) fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.to_path_buf();
    move |source| TrainError::Io { path, op, source }
}

pub type Result<T, E = TrainError> = std::result::Result<T, E>;
