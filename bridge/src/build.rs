//! `routes_for`: the routing table from plain rank lists (encoder ranks per item, LLM CP shard per row, TP ranks per shard).
//!
//! Independent of the trainer's types: the caller resolves its grids and assignments
//! to world ranks; this module only turns them into [`ItemRoute`]s.

use crate::{BridgeError, Dest, ItemRoute, Result, Routes};

/// Where one item's embeddings are computed and where its placeholder tokens live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemPlacement {
    /// World ranks holding the item's projector output: every TP rank of the encoder
    /// replica (last pipeline stage) that computed it. The first one sends it; all of
    /// them get its grad back unless `frozen`. Non-empty.
    pub encoder_ranks: Vec<usize>,
    /// The item's encoder (and projector) gets no grads.
    pub frozen: bool,
    /// (rows) The LLM CP index whose shard holds each row's placeholder token, in row
    /// order; its length is the item's number of rows.
    pub row_cp: Vec<usize>,
    /// CP index -> the world ranks of that CP shard's TP ranks, in the LLM DP replica
    /// (first pipeline stage) that holds the item. Every one receives the shard's rows;
    /// the first returns their grads (TP ranks hold identical grads).
    pub llm_ranks: Vec<Vec<usize>>,
}

/// The routes of a step whose items are placed as `items` (index = item index), rows of
/// width `width` (the LLM hidden size), over a world of `world` ranks.
///
/// Item `i`: `src` = `encoder_ranks[0]`; `grad_to` = `encoder_ranks` (empty if frozen);
/// one `Dest` per TP rank of each CP shard holding any of its rows, asking for those
/// rows in increasing row order (a shard's placeholder tokens of one item keep the
/// sequence order, i.e. row order), `grad` on the shard's first TP rank only.
pub fn routes_for(items: &[ItemPlacement], width: usize, world: usize) -> Result<Routes> {
    let mut routes = Vec::with_capacity(items.len());
    for (i, p) in items.iter().enumerate() {
        let err = |msg: String| BridgeError::Placement { item: i, msg };
        let Some(&src) = p.encoder_ranks.first() else {
            return Err(err(
                "encoder_ranks is empty: some rank must compute the item".into(),
            ));
        };
        if let Some(k) = p.llm_ranks.iter().position(Vec::is_empty) {
            return Err(err(format!(
                "llm_ranks[{k}] (CP shard {k}) lists no TP ranks"
            )));
        }
        let rows = p.row_cp.len();
        if u32::try_from(rows).is_err() {
            return Err(err(format!("{rows} rows do not fit u32 row indices")));
        }
        // by_cp[k]: the rows whose placeholder tokens CP shard k holds, ascending.
        let mut by_cp: Vec<Vec<u32>> = vec![Vec::new(); p.llm_ranks.len()];
        for (r, &k) in p.row_cp.iter().enumerate() {
            let Some(shard) = by_cp.get_mut(k) else {
                return Err(err(format!(
                    "row {r} is placed on CP shard {k} but llm_ranks has {} shards",
                    p.llm_ranks.len()
                )));
            };
            shard.push(r as u32);
        }
        let mut dst = Vec::new();
        for (shard_rows, tp_ranks) in by_cp.into_iter().zip(&p.llm_ranks) {
            if shard_rows.is_empty() {
                continue;
            }
            for (j, &rank) in tp_ranks.iter().enumerate() {
                dst.push(Dest {
                    rank,
                    rows: shard_rows.clone(),
                    grad: j == 0 && !p.frozen,
                });
            }
        }
        routes.push(ItemRoute {
            rows,
            src,
            grad_to: if p.frozen {
                Vec::new()
            } else {
                p.encoder_ranks.clone()
            },
            dst,
        });
    }
    Routes::new(routes, width, world)
}
