//! Pack-by-pack construction from a bounded pool of samples: minimum-bin-slack search (after Gupta
//! & Ho's MBS heuristic) with a node budget.
//!
//! Best-fit decreasing leaves gaps when the mix is dominated by mid-size samples (LLaVA-like: 62%
//! of samples are 626-876 tokens, few short ones to plug gaps: 97.1% fill at 4096). Here a pack
//! starts with the pool's oldest sample (so every sample leaves within a bounded delay and the pool
//! keeps the stream's mix; in the final drain, the longest), then a depth-first search over the
//! pool's distinct lengths (longest first) with an exact best-pair completion at every node looks
//! for the completion with the least slack, stopping at `tol` or after `budget` nodes. Short
//! samples (< cap / 8) are left out of that search and only plug what remains: they are the only
//! fit for the gaps long samples leave, and spending them on packs that mid-size samples can close
//! starves those.
//!
//! Pool: `BTreeMap<length, FIFO of samples>`; "longest available length <= x" is one range query,
//! so a pack costs O(budget * log D) (D distinct lengths in the pool).

use std::collections::{BTreeMap, VecDeque};

use super::bfd::{Bin, Item};

/// Samples waiting to be packed, grouped by length.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    by_len: BTreeMap<u32, VecDeque<Item>>,
    /// Arrival order: index -> length.
    arrival: BTreeMap<usize, u32>,
    len: usize,
}

impl Pool {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn insert(&mut self, it: Item) {
        self.by_len.entry(it.len).or_default().push_back(it);
        self.arrival.insert(it.index, it.len);
        self.len += 1;
    }

    /// Removes the oldest sample of length `l`.
    fn take(&mut self, l: u32) -> Option<Item> {
        let q = self.by_len.get_mut(&l)?;
        let it = q.pop_front();
        if q.is_empty() {
            self.by_len.remove(&l);
        }
        if let Some(it) = &it {
            self.arrival.remove(&it.index);
            self.len -= 1;
        }
        it
    }

    fn count(&self, l: u32) -> usize {
        self.by_len.get(&l).map_or(0, VecDeque::len)
    }

    /// Longest length in `[band.0, min(x, band.1)]` with a sample not already in `chosen`.
    fn pred(&self, x: u32, chosen: &[u32], band: (u32, u32)) -> Option<u32> {
        let (floor, mut x) = (band.0, x.min(band.1));
        loop {
            if x < floor {
                return None;
            }
            let (&l, q) = self.by_len.range(floor..=x).next_back()?;
            if q.len() > chosen.iter().filter(|&&c| c == l).count() {
                return Some(l);
            }
            x = l.checked_sub(1)?;
        }
    }

    /// Builds one pack: the oldest (or, `oldest = false`, the longest) sample plus the least-slack completion found within `budget`
    /// search nodes (stopping early at slack <= `tol`). None when the pool is empty.
    pub(crate) fn build_bin(
        &mut self,
        cap: u32,
        tol: u32,
        budget: usize,
        oldest: bool,
    ) -> Option<Bin> {
        let first_len = if oldest {
            *self.arrival.first_key_value()?.1
        } else {
            *self.by_len.keys().next_back()?
        };
        let first = self.take(first_len)?;
        let gap = cap.saturating_sub(first.len);
        // Short samples are the only fillers for the gaps long ones leave: first look for a
        // completion without them, and use them only when that one is not tight enough.
        let filler = (cap / 8).max(1);
        let (slack, mut best) = self.search(gap, tol, budget, (filler, cap));
        if slack > tol {
            // Then plug what is left with fillers (disjoint lengths: no double counting).
            let (_, plug) = self.search(slack, tol, budget, (1, filler - 1));
            best.extend(plug);
        }
        let mut bin = Bin::default();
        bin.push(first);
        for l in best {
            if let Some(it) = self.take(l) {
                bin.push(it);
            }
        }
        Some(bin)
    }

    /// Best completion of `gap` by at most two more samples (besides `chosen`): the pair with the
    /// largest sum `<= gap`, scanning the longer one downwards. Returns (slack, lengths); charges
    /// one node per length tried to `nodes`.
    fn best_pair(
        &self,
        gap: u32,
        chosen: &mut Vec<u32>,
        nodes: &mut usize,
        tol: u32,
        band: (u32, u32),
    ) -> (u32, [Option<u32>; 2]) {
        let mut best = (gap, [None, None]);
        let mut a = self.pred(gap, chosen, band);
        while let Some(x) = a {
            *nodes += 1;
            // The pair's sum is at most 2x: stop once that cannot beat the best.
            if 2 * (x as u64) < (gap - best.0) as u64 {
                break;
            }
            chosen.push(x);
            let y = self.pred((gap - x).min(x), chosen, band);
            chosen.pop();
            let slack = gap - x - y.unwrap_or(0);
            if slack < best.0 {
                best = (slack, [Some(x), y]);
                if slack <= tol {
                    break;
                }
            }
            a = x.checked_sub(1).and_then(|x1| self.pred(x1, chosen, band));
        }
        best
    }

    /// Depth-first search over prefixes (lengths non-increasing along a path, longest first), each
    /// completed by the best pair: the multiset of available lengths with the largest sum `<= gap`
    /// that the budget finds. Explicit stack: a path can be thousands of items deep.
    fn search(&self, gap: u32, tol: u32, budget: usize, band: (u32, u32)) -> (u32, Vec<u32>) {
        struct Frame {
            gap: u32,
            cand: Option<u32>,
        }
        let mut best_gap = gap;
        let mut best: Vec<u32> = Vec::new();
        if gap <= tol {
            return (gap, best);
        }
        let mut chosen: Vec<u32> = Vec::new();
        let mut nodes = 0usize;
        let (slack, pair) = self.best_pair(gap, &mut chosen, &mut nodes, tol, band);
        if slack < best_gap {
            best_gap = slack;
            best = pair.iter().flatten().copied().collect();
        }
        let mut stack = vec![Frame {
            gap,
            cand: self.pred(gap, &chosen, band),
        }];
        while let Some(top) = stack.last_mut() {
            if best_gap <= tol || nodes > budget {
                break;
            }
            let Some(c) = top.cand else {
                stack.pop();
                if !stack.is_empty() {
                    chosen.pop();
                }
                continue;
            };
            nodes += 1;
            // Next sibling: the next shorter available length (computed before c joins the path).
            top.cand = c.checked_sub(1).and_then(|x| self.pred(x, &chosen, band));
            let g = top.gap - c;
            chosen.push(c);
            let (slack, pair) = self.best_pair(g, &mut chosen, &mut nodes, tol, band);
            if slack < best_gap {
                best_gap = slack;
                best.clone_from(&chosen);
                best.extend(pair.iter().flatten());
            }
            let cand = self.pred(g.min(c), &chosen, band);
            stack.push(Frame { gap: g, cand });
        }
        debug_assert!(best.iter().all(|&l| self.count(l) > 0));
        (best_gap, best)
    }
}
