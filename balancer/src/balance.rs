//! Data-aware assignment of one global batch: rows to LLM replicas and microbatches,
//! images and clips to encoder replicas, each balanced by its estimated cost with the
//! longest-processing-time rule (largest first, to the least-loaded bin), O(n log n).
//!
//! Costs are forward FLOPs per module, as in the dataloader's per-sample cost: a linear
//! term per token and an attention term per (query, key) pair of each packed sample
//! (causal: half). Relative costs are all that matter here.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::assign::{Assigner, Assignment, BatchShape, Replicas, RoundRobin};

/// FLOPs of a module per token and per attended (query, key) pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenCost {
    pub per_token: f64,
    pub per_pair: f64,
}

impl TokenCost {
    /// A transformer of `layers` blocks of width `hidden`, MLP width `ff` (`mlp_mats` weight
    /// matrices: 2 for GELU, 3 for SwiGLU), plus `extra` matmul parameters per token (an
    /// LM head); `causal` halves the attention pairs.
    pub fn transformer(
        layers: usize,
        hidden: usize,
        ff: usize,
        mlp_mats: usize,
        extra: usize,
        causal: bool,
    ) -> TokenCost {
        let (l, h, f) = (layers as f64, hidden as f64, ff as f64);
        let per_layer = 4.0 * h * h + mlp_mats as f64 * h * f; // matmul weights a token meets
        TokenCost {
            per_token: 2.0 * (l * per_layer + extra as f64),
            per_pair: 4.0 * l * h * if causal { 0.5 } else { 1.0 },
        }
    }

    /// `tokens` tokens in sequences whose squared lengths sum to `sq`.
    pub fn of(&self, tokens: f64, sq: f64) -> f64 {
        self.per_token * tokens + self.per_pair * sq
    }
}

/// The costs of the three modules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Balanced {
    pub llm: TokenCost,
    pub vision: TokenCost,
    pub audio: TokenCost,
}

/// Per-item costs of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchCosts {
    pub rows: Vec<f64>,
    pub images: Vec<f64>,
    pub clips: Vec<f64>,
}

impl Balanced {
    pub fn costs(&self, b: &BatchShape) -> BatchCosts {
        BatchCosts {
            rows: self.row_costs(b),
            images: b
                .image_tokens
                .iter()
                .map(|&p| self.vision.of(p as f64, (p * p) as f64))
                .collect(),
            // The conv stem halves the mel frames.
            clips: b
                .clip_frames
                .iter()
                .map(|&f| {
                    let t = f.div_ceil(2) as f64;
                    self.audio.of(t, t * t)
                })
                .collect(),
        }
    }
}

/// The bin of each item: largest first, each to the least-loaded bin (ties to the lowest
/// bin, then the earlier item), so the result is deterministic.
pub fn lpt(costs: &[f64], bins: usize) -> Vec<usize> {
    let bins = bins.max(1);
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    // Min-heap of (load, bin); loads as ordered bits (costs are >= 0).
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (0..bins).map(|b| Reverse((0, b))).collect();
    let mut out = vec![0; costs.len()];
    for i in order {
        let Some(Reverse((load, bin))) = heap.pop() else {
            break;
        };
        out[i] = bin;
        let next = f64::from_bits(load) + costs[i].max(0.0);
        heap.push(Reverse((next.to_bits(), bin)));
    }
    out
}

impl Balanced {
    /// [`Balanced`]'s rows alone: each row's (LLM replica, microbatch), by the rows' LLM
    /// costs (what an overlapped encoder's chunks follow, without placing their items).
    pub fn assign_rows(&self, b: &BatchShape, r: &Replicas) -> Vec<(usize, usize)> {
        rows_of(&self.row_costs(b), r)
    }

    /// Each row's LLM cost.
    fn row_costs(&self, b: &BatchShape) -> Vec<f64> {
        b.row_tokens
            .iter()
            .zip(&b.row_sq)
            .map(|(&t, &sq)| self.llm.of(t as f64, sq as f64))
            .collect()
    }
}

/// Rows of LLM costs `costs` to replicas by LPT, then each replica's into its
/// microbatches by LPT.
fn rows_of(costs: &[f64], r: &Replicas) -> Vec<(usize, usize)> {
    let replica = lpt(costs, r.llm_dp);
    let mut rows = vec![(0, 0); costs.len()];
    for dp in 0..r.llm_dp {
        let mine: Vec<usize> = (0..costs.len()).filter(|&i| replica[i] == dp).collect();
        // Microbatches of near-equal cost shrink the pipeline's bubbles.
        let mbs = r.microbatches.clamp(1, mine.len().max(1));
        let of_mine: Vec<f64> = mine.iter().map(|&i| costs[i]).collect();
        for (k, mb) in lpt(&of_mine, mbs).into_iter().enumerate() {
            rows[mine[k]] = (dp, mb);
        }
    }
    rows
}

impl Assigner for Balanced {
    fn assign(&self, b: &BatchShape, r: &Replicas) -> Assignment {
        let c = self.costs(b);
        Assignment {
            rows: rows_of(&c.rows, r),
            images: lpt(&c.images, r.vision_dp),
            clips: lpt(&c.clips, r.audio_dp),
        }
    }
}

/// [`Balanced`] for the overlapped schedule, where each encoder replica runs one chunk
/// per LLM microbatch: rows as [`Balanced`] places them, then each microbatch's images
/// (and clips) balanced over the encoder replicas on their own, since the chunks reach
/// the LLM one after another (the planner's overlapped step assumes the same); ties go
/// to the replica with the least work so far.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PerMicrobatch(pub Balanced);

impl Assigner for PerMicrobatch {
    fn assign(&self, b: &BatchShape, r: &Replicas) -> Assignment {
        let mut a = self.0.assign(b, r);
        let c = self.0.costs(b);
        let chunk_of = |per_row: &[usize]| -> Vec<usize> {
            per_row
                .iter()
                .enumerate()
                .flat_map(|(row, &n)| std::iter::repeat_n(a.rows[row].1, n))
                .collect()
        };
        let (image_chunks, clip_chunks) = (chunk_of(&b.row_images), chunk_of(&b.row_clips));
        a.images = lpt_within(&c.images, &image_chunks, r.vision_dp);
        a.clips = lpt_within(&c.clips, &clip_chunks, r.audio_dp);
        a
    }
}

/// The LLM-centric placement's assignment (encoders inside the LLM's first pipeline
/// stage): rows as the wrapped assigner places them, then each image (and clip) to one
/// of the encoder replicas of its row's LLM replica (`encoder dp / llm dp` of them,
/// numbered replica by replica), each (replica, microbatch)'s items balanced on their
/// own, since each microbatch's are encoded inside that microbatch's forward.
#[derive(Debug)]
pub struct Centric<A: Assigner>(pub A, pub Balanced);

impl<A: Assigner> Assigner for Centric<A> {
    fn assign(&self, b: &BatchShape, r: &Replicas) -> Assignment {
        let mut a = self.0.assign(b, r);
        let c = self.1.costs(b);
        // (LLM replica, microbatch) of each image or clip, by its row.
        let group_of = |per_row: &[usize]| -> Vec<(usize, usize)> {
            per_row
                .iter()
                .enumerate()
                .flat_map(|(row, &n)| std::iter::repeat_n(a.rows[row], n))
                .collect()
        };
        let place = |costs: &[f64], groups: &[(usize, usize)], dp: usize| -> Vec<usize> {
            let per = (dp / r.llm_dp.max(1)).max(1);
            let mut out = vec![0; costs.len()];
            let mut keys: Vec<(usize, usize)> = groups.to_vec();
            keys.sort_unstable();
            keys.dedup();
            let mut before = vec![vec![0.0; per]; r.llm_dp.max(1)];
            for key in keys {
                let members: Vec<usize> = (0..costs.len()).filter(|&i| groups[i] == key).collect();
                let sub: Vec<f64> = members.iter().map(|&i| costs[i]).collect();
                let Some(loads) = before.get_mut(key.0) else {
                    continue;
                };
                for (&i, bin) in members.iter().zip(lpt_after(&sub, loads)) {
                    out[i] = key.0 * per + bin;
                }
            }
            out
        };
        let (images, clips) = (group_of(&b.row_images), group_of(&b.row_clips));
        a.images = place(&c.images, &images, r.vision_dp);
        a.clips = place(&c.clips, &clips, r.audio_dp);
        a
    }
}

/// [`lpt`] of the items of each group (`group[i]`, ascending) on its own, ties between
/// bins broken by the load of the groups before (so that groups of fewer items than
/// bins do not all land on the first bins).
fn lpt_within(costs: &[f64], group: &[usize], bins: usize) -> Vec<usize> {
    let mut out = vec![0; costs.len()];
    let mut groups: Vec<usize> = group.to_vec();
    groups.sort_unstable();
    groups.dedup();
    let mut before = vec![0.0; bins.max(1)];
    for g in groups {
        let members: Vec<usize> = (0..costs.len()).filter(|&i| group[i] == g).collect();
        let sub: Vec<f64> = members.iter().map(|&i| costs[i]).collect();
        for (&i, bin) in members.iter().zip(lpt_after(&sub, &mut before)) {
            out[i] = bin;
        }
    }
    out
}

/// One group's [`lpt`] over `before.len()` bins: each item, largest first, to the bin
/// least loaded in this group, ties to the bin least loaded `before` (then the lowest);
/// adds the group's loads to `before`. O(items x bins).
pub fn lpt_after(costs: &[f64], before: &mut [f64]) -> Vec<usize> {
    let bins = before.len().max(1);
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut now = vec![0.0f64; bins];
    let mut out = vec![0; costs.len()];
    for i in order {
        let bin = (0..bins)
            .min_by(|&x, &y| {
                now[x]
                    .total_cmp(&now[y])
                    .then(
                        before
                            .get(x)
                            .copied()
                            .unwrap_or(0.0)
                            .total_cmp(&before.get(y).copied().unwrap_or(0.0)),
                    )
                    .then(x.cmp(&y))
            })
            .unwrap_or(0);
        out[i] = bin;
        now[bin] += costs[i].max(0.0);
    }
    for (b, n) in before.iter_mut().zip(&now) {
        *b += n;
    }
    out
}

/// Max over mean of the bins' loads (1 = perfect; 1 when there is no load).
pub fn max_over_mean(loads: &[f64]) -> f64 {
    let total: f64 = loads.iter().sum();
    if loads.is_empty() || total <= 0.0 {
        return 1.0;
    }
    let max = loads.iter().copied().fold(0.0, f64::max);
    max / (total / loads.len() as f64)
}

/// How even an assignment is, per module: max/mean load over the LLM replicas, over every
/// (replica, microbatch), over the vision and over the audio replicas.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Imbalance {
    pub llm: f64,
    pub microbatch: f64,
    pub vision: f64,
    pub audio: f64,
}

impl Balanced {
    /// The [`Imbalance`] of `a` under these costs.
    pub fn imbalance(&self, b: &BatchShape, r: &Replicas, a: &Assignment) -> Imbalance {
        let c = self.costs(b);
        let mut llm = vec![0.0; r.llm_dp];
        let mut mb = vec![0.0; r.llm_dp * r.microbatches];
        for (i, &(d, m)) in a.rows.iter().enumerate() {
            llm[d] += c.rows[i];
            mb[d * r.microbatches + m] += c.rows[i];
        }
        let used: Vec<f64> = mb.into_iter().filter(|&x| x > 0.0).collect();
        let load = |costs: &[f64], to: &[usize], n: usize| {
            let mut l = vec![0.0; n];
            costs.iter().zip(to).for_each(|(x, &d)| l[d] += x);
            max_over_mean(&l)
        };
        Imbalance {
            llm: max_over_mean(&llm),
            microbatch: max_over_mean(&used),
            vision: load(&c.images, &a.images, r.vision_dp),
            audio: load(&c.clips, &a.clips, r.audio_dp),
        }
    }

    /// The imbalance of the round-robin default and of this assigner on one batch.
    pub fn report(&self, b: &BatchShape, r: &Replicas) -> (Imbalance, Imbalance) {
        let before = RoundRobin.assign(b, r);
        let after = self.assign(b, r);
        (self.imbalance(b, r, &before), self.imbalance(b, r, &after))
    }
}
