//! braid-balancer: cost model, per-module layout search, pipeline simulator and per-batch data-aware assignment.
//!
//! Today: the per-batch assignment interface ([`assign`]) the trainer calls every step,
//! with a round-robin default.

pub mod assign;

pub use assign::{AssignError, Assigner, Assignment, BatchShape, Replicas, RoundRobin};
