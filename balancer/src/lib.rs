//! braid-balancer: cost model, per-module layout search, pipeline simulator and per-batch data-aware assignment.
//!
//! Today: the per-batch assignment interface ([`assign`]) the trainer calls every step,
//! with a round-robin default, and the data-aware [`Balanced`] assigner ([`balance`]).

pub mod assign;
pub mod balance;
pub mod synthetic;

pub use assign::{AssignError, Assigner, Assignment, BatchShape, Replicas, RoundRobin};
pub use balance::{Balanced, Imbalance, TokenCost};
