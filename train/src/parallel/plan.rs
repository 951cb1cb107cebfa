//! One step's plan, computed identically on every rank from the global batch's metadata:
//! the items (images and clips) and where they are encoded, each LLM microbatch's rows
//! and how its tokens are split over the CP ranks, and the bridge's routes between them.

use braid_bridge::{ItemPlacement, Routes, routes_for};
use braid_comm::grid::{Axis, Coord, Grid};
use braid_dataloader::loader::Row;
use braid_nn::CpPlan;

use super::layout::Layouts;
use crate::data::rows_to_text;
use crate::error::{Result, TrainError};
use crate::mllm::Freeze;
use braid_balancer::{Assignment, BatchShape};

/// An image or a clip of the global batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ItemKind {
    Image,
    Clip,
}

/// One image or clip: where it comes from, where it is encoded, where it goes.
#[derive(Clone, Debug)]
pub struct Item {
    pub kind: ItemKind,
    /// Its row in the global batch and its index among that row's images (or clips).
    pub row: usize,
    pub index: usize,
    /// Embedding rows it becomes (= its placeholder tokens).
    pub rows: usize,
    /// Encoder dp replica.
    pub enc_dp: usize,
    /// LLM dp replica and microbatch.
    pub llm_dp: usize,
    pub mb: usize,
    /// Its first placeholder token within its microbatch's packed tokens.
    pub start: usize,
}

/// How one microbatch's tokens are split over the CP ranks.
#[derive(Clone, Debug)]
pub struct TokenSplit {
    /// Per token of the microbatch: (cp rank, index among that rank's tokens).
    pub owner: Vec<(usize, usize)>,
    /// Per cp rank: its tokens, as indices into the microbatch.
    pub tokens: Vec<Vec<usize>>,
    /// The CP plan (load-balanced chunks per sample); `None` without CP.
    pub plan: Option<CpPlan>,
}

impl TokenSplit {
    /// No CP: every token on rank 0.
    pub fn whole(t: usize) -> TokenSplit {
        TokenSplit {
            owner: (0..t).map(|i| (0, i)).collect(),
            tokens: vec![(0..t).collect()],
            plan: None,
        }
    }

    /// The causal CP split of a microbatch with samples `cu_seqlens` over `cp` ranks.
    pub fn causal(cu_seqlens: &[usize], cp: usize) -> Result<TokenSplit> {
        let t = cu_seqlens.last().copied().unwrap_or(0);
        if cp == 1 {
            return Ok(TokenSplit::whole(t));
        }
        let plan = CpPlan::new(cu_seqlens, cp, true)?;
        let tokens = (0..cp)
            .map(|r| plan.tokens(r).map(<[usize]>::to_vec))
            .collect::<braid_nn::Result<Vec<_>>>()?;
        let owner = (0..t)
            .map(|i| plan.owner(i))
            .collect::<braid_nn::Result<Vec<_>>>()?;
        Ok(TokenSplit {
            owner,
            tokens,
            plan: Some(plan),
        })
    }
}

/// One LLM microbatch of one replica.
#[derive(Clone, Debug)]
pub struct Microbatch {
    pub dp: usize,
    pub mb: usize,
    /// Global row indices, in order.
    pub rows: Vec<usize>,
    /// Packed token count.
    pub tokens: usize,
    /// Sample boundaries of the packed tokens.
    pub cu_seqlens: Vec<usize>,
    pub split: TokenSplit,
}

/// Everything every rank knows about one step.
#[derive(Debug)]
pub struct StepPlan {
    pub items: Vec<Item>,
    /// Every replica's microbatches, by (dp, then mb) order; empty microbatches skipped.
    pub microbatches: Vec<Microbatch>,
    /// Valid targets in the whole global batch (the loss normalizer).
    pub targets: usize,
    pub tokens: usize,
}

/// Every image and clip of `rows` with the encoder replica `a` gives it: `(kind, row,
/// index in the row's images or clips, replica)`. The assignment numbers images, and
/// clips, in row order; this is the one place that reads it so (the step's plan and
/// each rank's media filter both go through it).
pub fn media_items(rows: &[Row], a: &Assignment) -> Vec<(ItemKind, usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut image, mut clip) = (0, 0);
    for (r, row) in rows.iter().enumerate() {
        for index in 0..row.images.len() {
            out.push((ItemKind::Image, r, index, a.images[image]));
            image += 1;
        }
        for index in 0..row.audio.len() {
            out.push((ItemKind::Clip, r, index, a.clips[clip]));
            clip += 1;
        }
    }
    out
}

/// The batch's shape as an assigner sees it.
pub fn batch_shape(rows: &[Row]) -> BatchShape {
    BatchShape {
        row_tokens: rows.iter().map(Row::len).collect(),
        row_sq: rows
            .iter()
            .map(|r| {
                r.sample_offsets
                    .windows(2)
                    .map(|w| u64::from(w[1] - w[0]).pow(2))
                    .sum()
            })
            .collect(),
        row_images: rows.iter().map(|r| r.images.len()).collect(),
        image_tokens: rows
            .iter()
            .flat_map(|r| r.images.iter().map(|im| im.patches))
            .collect(),
        row_clips: rows.iter().map(|r| r.audio.len()).collect(),
        clip_frames: rows
            .iter()
            .flat_map(|r| r.audio.iter().map(|a| a.frames))
            .collect(),
    }
}

/// Valid next-token targets of one row.
fn row_targets(r: &Row) -> Result<usize> {
    let text = rows_to_text(&[r])?;
    Ok(text
        .targets
        .iter()
        .filter(|&&x| x != braid_llm::IGNORE_INDEX)
        .count())
}

impl StepPlan {
    /// The plan of `rows` under assignment `a`; `split` cuts a microbatch's tokens
    /// (given its sample boundaries) over the LLM's CP ranks.
    pub fn new(
        rows: &[Row],
        a: &Assignment,
        llm_dp: usize,
        split: &dyn Fn(&[usize]) -> Result<TokenSplit>,
    ) -> Result<StepPlan> {
        let mut microbatches = Vec::new();
        // (dp, mb) -> index into microbatches, and each row's token offset in its mb.
        let mut row_offset = vec![0usize; rows.len()];
        for dp in 0..llm_dp {
            for mb in 0..a.microbatches_of(dp) {
                let members = a.rows_of(dp, mb);
                if members.is_empty() {
                    continue;
                }
                let mut cu = vec![0usize];
                let mut off = 0;
                for &r in &members {
                    row_offset[r] = off;
                    cu.extend(
                        rows[r]
                            .sample_offsets
                            .iter()
                            .skip(1)
                            .map(|&o| off + o as usize),
                    );
                    off += rows[r].len();
                }
                microbatches.push(Microbatch {
                    dp,
                    mb,
                    rows: members,
                    tokens: off,
                    split: split(&cu)?,
                    cu_seqlens: cu,
                });
            }
        }
        let mut items = Vec::new();
        for (kind, r, index, enc_dp) in media_items(rows, a) {
            let (dp, mb) = a.rows[r];
            let (len, start) = match kind {
                ItemKind::Image => (rows[r].images[index].len, rows[r].images[index].start),
                ItemKind::Clip => (rows[r].audio[index].len, rows[r].audio[index].start),
            };
            items.push(Item {
                kind,
                row: r,
                index,
                rows: len,
                enc_dp,
                llm_dp: dp,
                mb,
                start: row_offset[r] + start,
            });
        }
        // Images first, then clips: the bridge's item order.
        items.sort_by_key(|it| (it.kind == ItemKind::Clip, it.row, it.index));
        let targets = rows.iter().map(row_targets).sum::<Result<usize>>()?;
        Ok(StepPlan {
            items,
            microbatches,
            targets,
            tokens: rows.iter().map(Row::len).sum(),
        })
    }

    pub fn microbatch(&self, dp: usize, mb: usize) -> Option<&Microbatch> {
        self.microbatches.iter().find(|m| m.dp == dp && m.mb == mb)
    }

    /// The microbatches of replica `dp`, in order.
    pub fn microbatches_of(&self, dp: usize) -> Vec<&Microbatch> {
        self.microbatches.iter().filter(|m| m.dp == dp).collect()
    }

    /// The bridge's routes: item `i` from its encoder replica's first TP/CP rank of the
    /// last stage (its grad back to all TP and CP ranks of that stage, unless its branch
    /// is frozen) to the LLM's
    /// first stage of its replica: to each CP rank the rows whose placeholders it holds,
    /// to every TP rank of it, the grad taken from TP rank 0.
    pub fn routes(&self, layouts: &Layouts, width: usize, freeze: Freeze) -> Result<Routes> {
        let llm = &layouts.llm;
        let placements = self
            .items
            .iter()
            .map(|it| {
                let (grid, frozen) = match it.kind {
                    ItemKind::Image => (layouts.vision, freeze.vision && freeze.vision_projector),
                    ItemKind::Clip => (layouts.audio, freeze.audio && freeze.audio_projector),
                };
                let grid: Grid = grid.ok_or_else(|| {
                    TrainError::Other(format!(
                        "the batch has a {:?} but the model has no encoder for it",
                        it.kind
                    ))
                })?;
                // The encoder's last stage holds the output, on every TP and CP rank
                // (CP gathers it); TP/CP rank 0 sends, all of them take the grad.
                let src = grid.rank(Coord {
                    tp: 0,
                    cp: 0,
                    dp: it.enc_dp,
                    pp: grid.dims.pp - 1,
                });
                let mb = self.microbatch(it.llm_dp, it.mb).ok_or_else(|| {
                    TrainError::Other(format!("item of row {} has no microbatch", it.row))
                })?;
                let row_cp = (0..it.rows)
                    .map(|k| mb.split.owner[it.start + k].0)
                    .collect();
                let llm_ranks = (0..llm.dims.cp)
                    .map(|cp| {
                        (0..llm.dims.tp)
                            .map(|tp| {
                                llm.rank(Coord {
                                    tp,
                                    cp,
                                    dp: it.llm_dp,
                                    pp: 0,
                                })
                            })
                            .collect()
                    })
                    .collect();
                Ok(ItemPlacement {
                    encoder_ranks: grid.group(src, &[Axis::Tp, Axis::Cp]).unwrap_or_default(),
                    frozen,
                    row_cp,
                    llm_ranks,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        routes_for(&placements, width, layouts.world)
            .map_err(|e| TrainError::Other(format!("bridge routes: {e}")))
    }
}
