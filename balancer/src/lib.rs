//! braid-balancer: cost model, per-module layout search, pipeline simulator and per-batch
//! data-aware assignment. It knows no tensors: it works on model sizes ([`dims`]), a
//! cluster description ([`cluster`]) and the dataset's length statistics ([`workload`]).

pub mod assign;
pub mod balance;
pub mod cluster;
pub mod dims;
pub mod pipeline;
pub mod plan;
pub mod synthetic;
pub mod workload;
pub mod zero_bubble;

pub use assign::{AssignError, Assigner, Assignment, BatchShape, Replicas, RoundRobin};
pub use balance::{Balanced, Centric, Imbalance, PerMicrobatch, TokenCost};
pub use cluster::Cluster;
pub use dims::{ModelDims, Module, ModuleDims};
pub use plan::{Layout, Placement, Plan, Problem, Schedule, StepSim};
