//! braid-train: run config, job assembly, pipeline schedules, optimizer, checkpoints and metrics.
