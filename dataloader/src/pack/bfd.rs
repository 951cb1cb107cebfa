//! The packer's item and bin types, and best-fit decreasing (the baseline the benchmark compares
//! against): O(n log n), bins indexed by remaining capacity in a `BTreeSet<(remaining, bin id)>`, so
//! "the fullest bin this item still fits in" is one range query.

use std::collections::BTreeSet;

/// One sample as the packer sees it: its length and its encoder loads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Item {
    /// Index into the packer's input.
    pub index: usize,
    pub len: u32,
    /// Vision-encoder cost (forward FLOPs).
    pub vision: f64,
    /// Audio-encoder cost (forward FLOPs).
    pub audio: f64,
}

/// A pack under construction.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bin {
    pub items: Vec<Item>,
    pub tokens: u32,
    pub vision: f64,
    pub audio: f64,
}

impl Bin {
    pub(crate) fn push(&mut self, it: Item) {
        self.tokens += it.len;
        self.vision += it.vision;
        self.audio += it.audio;
        self.items.push(it);
    }

    /// Loads summed afresh in index order (running sums drift after many swaps).
    pub(crate) fn exact_loads(&self) -> (f64, f64) {
        let mut its: Vec<&Item> = self.items.iter().collect();
        its.sort_by_key(|it| it.index);
        its.iter()
            .fold((0.0, 0.0), |(v, a), it| (v + it.vision, a + it.audio))
    }
}

/// Best-fit decreasing of `items` into `bins` (which may arrive partly filled, carried over from
/// an earlier window) with capacity `cap`; opens new bins as needed. Every item must have
/// `len <= cap`. Ties between equally full bins go to the older bin.
fn best_fit_decreasing(bins: &mut Vec<Bin>, mut items: Vec<Item>, cap: u32) {
    // Longest first; ties: lower index first, so the order is a pure function of the input.
    items.sort_unstable_by(|a, b| b.len.cmp(&a.len).then(a.index.cmp(&b.index)));
    let mut free: BTreeSet<(u32, usize)> = bins
        .iter()
        .enumerate()
        .filter(|(_, b)| b.tokens < cap)
        .map(|(id, b)| (cap - b.tokens, id))
        .collect();
    for it in items {
        let fit = free.range((it.len, 0)..).next().copied();
        let (rem, id) = match fit {
            Some(key) => {
                free.remove(&key);
                key
            }
            None => {
                bins.push(Bin::default());
                (cap, bins.len() - 1)
            }
        };
        if let Some(b) = bins.get_mut(id) {
            b.push(it);
        }
        let left = rem.saturating_sub(it.len);
        if left > 0 {
            free.insert((left, id));
        }
    }
}

/// Best-fit decreasing of bare lengths into bins of `cap`: the textbook baseline (what
/// `tools/bench_pack_py.py` implements in Python). Returns each bin's indices into `lengths`
/// (ascending); lengths of 0 or over `cap` are left out.
pub fn best_fit_decreasing_lengths(lengths: &[u32], cap: u32) -> Vec<Vec<usize>> {
    let items = lengths
        .iter()
        .enumerate()
        .filter(|(_, l)| **l > 0 && **l <= cap)
        .map(|(index, &len)| Item {
            index,
            len,
            vision: 0.0,
            audio: 0.0,
        })
        .collect();
    let mut bins = Vec::new();
    best_fit_decreasing(&mut bins, items, cap);
    bins.into_iter()
        .map(|b| {
            let mut v: Vec<usize> = b.items.iter().map(|it| it.index).collect();
            v.sort_unstable();
            v
        })
        .collect()
}
