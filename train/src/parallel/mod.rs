//! Heterogeneous parallelism: each module (vision encoder, audio encoder, LLM) on its own
//! grid of ranks with its own TP/CP/PP/DP layout, the bridge between them, and the
//! multi-rank training loop.
//!
//! - [`layout`]: the grids from `[parallel]`, validated against the model;
//! - `braid_balancer::assign`: where each row, image and clip of a batch goes (the
//!   interface, with a round-robin default; the balancer's data-aware one plugs in);
//! - [`plan`]: one step's items, microbatches and bridge routes, the same on every rank;
//! - [`model`]: one rank's share of the model and its groups;
//! - [`schedule`]: the 1F1B pipeline order;
//! - [`engine`]: one rank's step (`encode`: its encoder stages);
//! - [`sync`]: gradient all-reduce, the global norm, ZeRO-1;
//! - [`ckpt`]: checkpoints that any layout can load;
//! - [`load`]: a rank's shard made without the full model (one process per rank);
//! - [`run`]: `braid train` with several ranks as threads.

mod centric;
mod chunks;
pub mod ckpt;
mod encode;
mod encode_phased;
pub mod engine;
pub mod graph;
pub mod layout;
mod llm_stage;
mod load;
pub mod model;
mod order;
mod overlapped;
pub mod plan;
pub mod procs;
pub mod run;
pub mod schedule;
pub mod sync;
