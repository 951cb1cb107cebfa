//! The routing table: where each item's embedding rows come from and where they go, validated once per step.

use std::collections::HashSet;

use braid_kernels::{DType, Device};

use crate::{BridgeError, Result};

/// One LLM rank's copy of (some of) an item's rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dest {
    /// World rank that receives the rows.
    pub rank: usize,
    /// Which of the item's rows this rank needs, in the order it wants them (each at
    /// most once). An LLM CP shard lists the rows whose placeholder tokens it holds.
    pub rows: Vec<u32>,
    /// Whether this copy's grads are sent back in backward. Of the TP ranks that hold
    /// identical copies (identical grads) exactly one should say `true`.
    pub grad: bool,
}

/// Where one item's rows come from and go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemRoute {
    /// Number of embedding rows of the item (0 is allowed: nothing moves).
    pub rows: usize,
    /// World rank that produces the item's `(rows, C)` embeddings in forward.
    pub src: usize,
    /// World ranks that receive the item's `(rows, C)` grad in backward (every TP rank of
    /// the encoder replica that computed it); empty when the encoder is frozen.
    pub grad_to: Vec<usize>,
    /// The LLM ranks that need rows of the item; at most one `Dest` per rank.
    pub dst: Vec<Dest>,
}

/// Traffic of one step, for logging: counts of rows (each `C` wide), computed from the
/// table alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteStats {
    /// Rows requested by all dests together (forward, including same-rank copies).
    pub rows_requested: usize,
    /// Forward rows whose dest is not their sender: what crosses the interconnect.
    pub rows_sent_off_rank: usize,
    /// Largest number of forward rows one rank receives from other ranks.
    pub max_rows_received_off_rank: usize,
    /// Largest forward output of one rank (`M_r`, same-rank copies included).
    pub max_rows_received: usize,
    /// Backward grad rows that cross ranks (each grad copy's rows times the
    /// `grad_to` ranks other than the copy's own).
    pub grad_rows_sent_off_rank: usize,
}

/// The validated routing table of one step: items, the width `C` of every row, the world
/// size, and the device the exchanged tensors live on. Every rank builds the same one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routes {
    items: Vec<ItemRoute>,
    width: usize,
    world: usize,
    device: Device,
    /// The dtype of the exchanged rows (f32, or bf16 under mixed precision).
    dtype: DType,
}

impl Routes {
    /// Validates `items` against `width` (C, >= 1) and `world` (>= 1): every rank `<
    /// world`; every row index `< rows`; no row twice in one dest; no rank in two dests
    /// of one item (a rank's rows of an item form one block); no rank twice in
    /// `grad_to`; no `grad` copy of an item whose `grad_to` is empty (its grads would be
    /// dropped: a frozen encoder's dests say `grad: false`); row indices fit u32. Tensors
    /// live on the CPU unless [`Routes::with_device`] says otherwise.
    pub fn new(items: Vec<ItemRoute>, width: usize, world: usize) -> Result<Routes> {
        if width == 0 {
            return Err(BridgeError::Table("width C must be >= 1, got 0".into()));
        }
        if world == 0 {
            return Err(BridgeError::Table("world size must be >= 1, got 0".into()));
        }
        let mut total_rows = 0usize;
        for (i, item) in items.iter().enumerate() {
            validate_item(i, item, world)?;
            total_rows = total_rows.saturating_add(item.rows);
        }
        // Index tensors are u32 and a rank's stacked rows are at most all rows of all items.
        if total_rows > u32::MAX as usize {
            return Err(BridgeError::Table(format!(
                "{total_rows} rows over all items do not fit the u32 row indices (max {})",
                u32::MAX
            )));
        }
        Ok(Routes {
            items,
            width,
            world,
            device: Device::Cpu,
            dtype: DType::F32,
        })
    }

    /// The same routes, exchanging tensors on `device` (every rank's tensors, sent and
    /// received, live there).
    pub fn with_device(mut self, device: Device) -> Routes {
        self.device = device;
        self
    }

    /// The same routes, exchanging rows of `dtype` (f32 unless said otherwise).
    pub fn with_dtype(mut self, dtype: DType) -> Routes {
        self.dtype = dtype;
        self
    }

    pub fn items(&self) -> &[ItemRoute] {
        &self.items
    }

    /// The width C of every row.
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The dtype of every exchanged row (and of the grads sent back).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `rank`'s dest of item `i`, if any.
    pub(crate) fn dest_of(&self, i: usize, rank: usize) -> Option<&Dest> {
        self.items[i].dst.iter().find(|d| d.rank == rank)
    }

    /// The `(item, row)` of each row of [`Routes::forward`]'s output on `rank`, in order:
    /// by item index, then in the order of the rank's `Dest`. This is also the row order
    /// backward expects of the grad.
    pub fn received(&self, rank: usize) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        for i in 0..self.items.len() {
            if let Some(d) = self.dest_of(i, rank) {
                out.extend(d.rows.iter().map(|&r| (i, r)));
            }
        }
        out
    }

    /// `M_r`: the number of rows of `rank`'s forward output.
    pub fn rows_received(&self, rank: usize) -> usize {
        (0..self.items.len())
            .filter_map(|i| self.dest_of(i, rank))
            .map(|d| d.rows.len())
            .sum()
    }

    /// The items `rank` produces (passes to forward), ascending.
    pub fn produced_by(&self, rank: usize) -> Vec<usize> {
        (0..self.items.len())
            .filter(|&i| self.items[i].src == rank)
            .collect()
    }

    /// The items whose grads backward returns on `rank`, ascending.
    pub fn grads_for(&self, rank: usize) -> Vec<usize> {
        (0..self.items.len())
            .filter(|&i| self.items[i].grad_to.contains(&rank))
            .collect()
    }

    /// Whether forward moves any row (otherwise every rank skips its exchange).
    pub(crate) fn moves_rows(&self) -> bool {
        self.items
            .iter()
            .flat_map(|it| &it.dst)
            .any(|d| !d.rows.is_empty())
    }

    /// Whether backward moves any grad row (a `grad` copy implies a non-empty `grad_to`).
    pub(crate) fn moves_grads(&self) -> bool {
        self.items
            .iter()
            .flat_map(|it| &it.dst)
            .any(|d| d.grad && !d.rows.is_empty())
    }

    /// Traffic counts of this table.
    pub fn stats(&self) -> RouteStats {
        let mut s = RouteStats::default();
        let mut recv = vec![0usize; self.world];
        let mut recv_off = vec![0usize; self.world];
        for item in &self.items {
            for d in &item.dst {
                let n = d.rows.len();
                s.rows_requested += n;
                recv[d.rank] += n;
                if d.rank != item.src {
                    s.rows_sent_off_rank += n;
                    recv_off[d.rank] += n;
                }
                if d.grad {
                    let others = item.grad_to.iter().filter(|&&g| g != d.rank).count();
                    s.grad_rows_sent_off_rank += n * others;
                }
            }
        }
        s.max_rows_received = recv.into_iter().max().unwrap_or(0);
        s.max_rows_received_off_rank = recv_off.into_iter().max().unwrap_or(0);
        s
    }
}

fn validate_item(i: usize, item: &ItemRoute, world: usize) -> Result<()> {
    let err = |msg: String| BridgeError::Route { item: i, msg };
    if item.src >= world {
        return Err(err(format!(
            "src rank {} is outside the world of {world} ranks",
            item.src
        )));
    }
    let mut seen = HashSet::new();
    for &g in &item.grad_to {
        if g >= world {
            return Err(err(format!(
                "grad_to rank {g} is outside the world of {world} ranks"
            )));
        }
        if !seen.insert(g) {
            return Err(err(format!("grad_to names rank {g} twice")));
        }
    }
    let mut dest_ranks = HashSet::new();
    for d in &item.dst {
        if d.rank >= world {
            return Err(err(format!(
                "dest rank {} is outside the world of {world} ranks",
                d.rank
            )));
        }
        if !dest_ranks.insert(d.rank) {
            return Err(err(format!(
                "rank {} appears in two dests (a rank's rows of one item must be one dest)",
                d.rank
            )));
        }
        if d.grad && item.grad_to.is_empty() {
            return Err(err(format!(
                "dest rank {} has grad = true but grad_to is empty (a frozen encoder's \
                 dests must say grad = false)",
                d.rank
            )));
        }
        let mut rows = vec![false; item.rows];
        for &r in &d.rows {
            let Some(slot) = rows.get_mut(r as usize) else {
                return Err(err(format!(
                    "dest rank {} asks for row {r} of an item of {} rows",
                    d.rank, item.rows
                )));
            };
            if std::mem::replace(slot, true) {
                return Err(err(format!("dest rank {} asks for row {r} twice", d.rank)));
            }
        }
    }
    Ok(())
}
