//! The rendezvous store: a TCP key-value store served by rank 0 (set / get / wait / add,
//! every wait with a timeout), on which the processes of a world meet — the start
//! barrier, NCCL unique ids per group, and the check that every rank resolved the same
//! config and dataset.
//!
//! Protocol (one request, one reply, on a connection a client keeps open): a request is
//! an opcode byte, then length-prefixed fields (`u32` little-endian length + bytes); a
//! reply is a status byte, then one length-prefixed field. Keys and values are bytes.
//! Like torch's c10d TCPStore in spirit, not wire-compatible with it: Braid's store
//! listens on `MASTER_PORT + 1` under torchrun, whose agent already serves its own store
//! on `MASTER_PORT` (see [`crate::launch`]).
//!
//! `server.rs` serves the store (rank 0); `client.rs` is every rank's connection to it.

mod client;
mod server;

use std::io::Read;

pub use client::StoreClient;
pub use server::StoreServer;

/// What went wrong with the store, naming the address, the key and how long was waited.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("rendezvous store at {addr}: {what}: {source}")]
    Io {
        addr: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous store at {addr}: waited {waited_s:.1} s for `{key}`: {hint}")]
    Timeout {
        addr: String,
        key: String,
        waited_s: f64,
        hint: String,
    },
    #[error("rendezvous store at {addr}: {msg}")]
    Protocol { addr: String, msg: String },
    /// Ranks that disagree on what they run (config, dataset): names both.
    #[error("{0}")]
    Mismatch(String),
    /// Another rank's setup failed and it said so ([`StoreClient::abort`]): every wait
    /// ends at once with its rank and message instead of running into its timeout.
    #[error("{} failed: {why}", crate::rank_name(*rank))]
    Aborted { rank: usize, why: String },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

impl StoreError {
    /// As the error of collective `op` on world rank `rank` of `size`: another rank's
    /// abort is [`crate::CommError::Poisoned`] by that rank (this one only followed), the
    /// rest [`crate::CommError::Invalid`].
    pub fn into_comm(self, op: &'static str, rank: usize, size: usize) -> crate::CommError {
        match self {
            StoreError::Aborted { rank: by, why } => {
                crate::CommError::Poisoned { op, rank, by, why }
            }
            e => crate::CommError::Invalid {
                op,
                rank,
                size,
                msg: e.to_string(),
            },
        }
    }
}

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;

const ST_OK: u8 = 0;
const ST_MISSING: u8 = 1;
const ST_TIMEOUT: u8 = 2;
const ST_ABORTED: u8 = 3;

/// The key the first failing rank sets (`"{rank}\n{why}"`, [`StoreClient::abort`]):
/// while it is set, a wait for any other key answers with it ([`ST_ABORTED`]).
const ABORT: &str = "!abort";
/// Counts the ranks that called [`StoreClient::abort`]: the first one sets [`ABORT`].
const ABORT_CALLS: &str = "!abort/calls";
/// Counts the ranks that learned of the abort (see [`StoreClient::abort_seen`]).
const ABORT_SEEN: &str = "!abort/seen";

/// Largest field accepted (a config or an NCCL id is far smaller): a corrupt length
/// never makes the server allocate gigabytes.
const MAX_FIELD: u32 = 64 << 20;

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_field(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u32(r)?;
    if n > MAX_FIELD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("field of {n} bytes (limit {MAX_FIELD})"),
        ));
    }
    // Read as the bytes arrive: a client that announces 64 MiB and sends ten bytes costs
    // ten bytes, not 64 MiB.
    let mut v = Vec::new();
    r.take(u64::from(n)).read_to_end(&mut v)?;
    if v.len() != n as usize {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the connection closed inside a field",
        ));
    }
    Ok(v)
}

/// The [`StoreError::Aborted`] of an [`ABORT`] value (`"{rank}\n{why}"`).
fn parse_abort(v: &[u8]) -> StoreError {
    let text = String::from_utf8_lossy(v);
    let (rank, why) = text.split_once('\n').unwrap_or(("?", &text));
    StoreError::Aborted {
        rank: rank.parse().unwrap_or(usize::MAX),
        why: why.to_string(),
    }
}

fn write_field(w: &mut Vec<u8>, f: &[u8]) {
    w.extend_from_slice(&(f.len() as u32).to_le_bytes());
    w.extend_from_slice(f);
}
