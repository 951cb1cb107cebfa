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
    /// Which lengths are present, when the row is short enough for a bitset (<= 2^24): makes the
    /// search's "longest length <= x" a couple of word scans instead of a tree walk.
    bits: Option<LenBits>,
    /// Arrival order: index -> length.
    arrival: BTreeMap<usize, u32>,
    len: usize,
}

/// Two-level bitset over lengths `0..=cap`.
#[derive(Debug)]
struct LenBits {
    words: Vec<u64>,
    /// Bit w set iff `words[w] != 0`.
    summary: Vec<u64>,
}

impl LenBits {
    fn new(cap: u32) -> Self {
        let n = (cap as usize >> 6) + 1;
        LenBits {
            words: vec![0; n],
            summary: vec![0; (n >> 6) + 1],
        }
    }

    fn set(&mut self, l: u32, on: bool) {
        let w = l as usize >> 6;
        if let Some(word) = self.words.get_mut(w) {
            if on {
                *word |= 1 << (l & 63);
            } else {
                *word &= !(1 << (l & 63));
            }
            let nonempty = *word != 0;
            if let Some(s) = self.summary.get_mut(w >> 6) {
                if nonempty {
                    *s |= 1 << (w & 63);
                } else {
                    *s &= !(1 << (w & 63));
                }
            }
        }
    }

    /// Highest set bit `<= x` in `v` (a slice of words), searching word `i = x >> 6` down.
    fn highest_le(v: &[u64], x: usize) -> Option<usize> {
        let mut i = (x >> 6).min(v.len().checked_sub(1)?);
        let mut mask = if i == x >> 6 {
            u64::MAX >> (63 - (x & 63))
        } else {
            u64::MAX
        };
        loop {
            let m = v.get(i)? & mask;
            if m != 0 {
                return Some((i << 6) + 63 - m.leading_zeros() as usize);
            }
            i = i.checked_sub(1)?;
            mask = u64::MAX;
        }
    }

    /// Highest present length `<= x`.
    fn pred(&self, x: u32) -> Option<u32> {
        let x = (x as usize).min((self.words.len() << 6) - 1);
        let w = x >> 6;
        let in_word = self.words.get(w)? & (u64::MAX >> (63 - (x & 63)));
        if in_word != 0 {
            return Some(((w << 6) + 63 - in_word.leading_zeros() as usize) as u32);
        }
        let w2 = Self::highest_le(&self.summary, w.checked_sub(1)?)?;
        let m = *self.words.get(w2)?;
        (m != 0).then(|| ((w2 << 6) + 63 - m.leading_zeros() as usize) as u32)
    }
}

impl Pool {
    pub(crate) fn new(cap: u32) -> Self {
        Pool {
            bits: (cap <= 1 << 24).then(|| LenBits::new(cap)),
            ..Pool::default()
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn insert(&mut self, it: Item) {
        let q = self.by_len.entry(it.len).or_default();
        q.push_back(it);
        if q.len() == 1
            && let Some(b) = &mut self.bits
        {
            b.set(it.len, true);
        }
        self.arrival.insert(it.index, it.len);
        self.len += 1;
    }

    /// Removes the oldest sample of length `l`.
    fn take(&mut self, l: u32) -> Option<Item> {
        let q = self.by_len.get_mut(&l)?;
        let it = q.pop_front();
        if q.is_empty() {
            self.by_len.remove(&l);
            if let Some(b) = &mut self.bits {
                b.set(l, false);
            }
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
            let l = match &self.bits {
                Some(b) => b.pred(x).filter(|&l| l >= floor)?,
                None => *self.by_len.range(floor..=x).next_back()?.0,
            };
            let used = chosen.iter().filter(|&&c| c == l).count();
            if used == 0 || self.count(l) > used {
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

#[cfg(test)]
mod tests {
    use super::LenBits;

    /// The two-level bitset's predecessor against a linear scan, over random sets and caps.
    #[test]
    fn len_bits_pred_matches_scan() {
        let mut state = 12345u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for cap in [1u32, 63, 64, 65, 4095, 4096, 70_000] {
            let mut b = LenBits::new(cap);
            let mut present = vec![false; cap as usize + 1];
            for _ in 0..400 {
                let l = (next() % (cap as u64 + 1)) as u32;
                let on = next() % 3 != 0;
                b.set(l, on);
                present[l as usize] = on;
                let x = (next() % (cap as u64 + 70)) as u32;
                let want = (0..=x.min(cap)).rev().find(|&i| present[i as usize]);
                assert_eq!(b.pred(x), want, "cap {cap} x {x}");
            }
        }
    }
}
