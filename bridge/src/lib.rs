//! braid-bridge: routing of modality embeddings from encoder ranks to LLM ranks, and of their grads back, for any pair of layouts.
//!
//! # Model
//!
//! A step's *items* are the images and audio clips of the global batch, numbered by their
//! index in the step's item list; every rank holds the same list (batch metadata is
//! global). Item `i` has `rows` embedding rows of width `C` (the LLM hidden size),
//! computed on one encoder rank, its *sender* ([`ItemRoute::src`]). Each LLM rank that
//! holds placeholder tokens of the item is a [`Dest`]: the rows it needs, in the order it
//! wants them. Every TP rank of an LLM shard receives a copy; only one copy per shard is
//! marked `grad`, because TP replicas hold identical grads.
//!
//! [`Routes`] is the validated table. It is a pure function of the batch metadata and the
//! layouts, so every rank builds the same one and no metadata is exchanged:
//!
//! - [`Routes::forward`]: one `all_to_all_v` of ragged `(n, C)` row blocks; rank `r` gets
//!   `(M_r, C)`, the rows it asked for, ordered by item index, then by the order inside
//!   its `Dest` ([`Routes::received`] lists them).
//! - [`Routes::backward`]: the transpose. Grads of the `grad` copies go back, one
//!   `all_to_all_v`, to every rank of the item's [`ItemRoute::grad_to`]; rows requested by
//!   several grad copies are summed (the adjoint of the fan-out), in ascending order of
//!   the copies' ranks, so the result is bitwise deterministic and identical on every
//!   `grad_to` rank.
//! - [`Routes::subset`] with [`Routes::forward_sends`] / [`Routes::forward_gather`] (and
//!   the backward pair): the same exchange as point-to-point messages between only the
//!   ranks involved, one microbatch's items at a time (the overlapped schedule).
//!
//! Nothing here assumes a relation between the encoder and LLM layouts (DP sizes need not
//! divide, CP and TP may be on either side, placement may be colocated or disjoint):
//! [`routes_for`] builds the table from plain rank lists.

mod build;
mod exchange;
mod p2p;
mod routes;

pub use build::{ItemPlacement, routes_for};
pub use routes::{Dest, ItemRoute, RouteStats, Routes};

use braid_comm::CommError;

/// A bridge error: a bad route (naming the item and rank), a bad argument to
/// forward/backward (naming the op and rank), or a failure of the comm or a kernel.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The routing table as a whole is invalid (width, world size).
    #[error("bridge routes: {0}")]
    Table(String),
    /// One item's route is invalid.
    #[error("bridge route of item {item}: {msg}")]
    Route { item: usize, msg: String },
    /// A layout handed to [`routes_for`] is invalid.
    #[error("bridge routes_for, item {item}: {msg}")]
    Placement { item: usize, msg: String },
    /// Forward/backward got arguments that do not match the routes.
    #[error("bridge {op} on rank {rank}: {msg}")]
    Input {
        op: &'static str,
        rank: usize,
        msg: String,
    },
    #[error("bridge {op} on rank {rank}: {source}")]
    Comm {
        op: &'static str,
        rank: usize,
        #[source]
        source: CommError,
    },
    #[error("bridge {op} on rank {rank}: {source}")]
    Kernel {
        op: &'static str,
        rank: usize,
        #[source]
        source: braid_kernels::Error,
    },
}

pub type Result<T, E = BridgeError> = std::result::Result<T, E>;
