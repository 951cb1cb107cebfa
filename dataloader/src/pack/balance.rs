//! Modality balancing of closed packs without touching fill: moves and swaps of samples between a
//! heavy and a light pack, kept only when both stay within capacity.
//!
//! Objective: `F = sum_p (v_p / mean_v)^2 + (a_p / mean_a)^2` over packs (vision and audio loads,
//! each normalized by its mean so the two modalities weigh alike; an absent modality drops out).
//! With the totals fixed, lower `F` means lower variance. Each round sorts packs by one modality's
//! load and pairs the k-th heaviest with the k-th lightest (then the next few lightest, until one
//! exchange applies); for each pair it tries every exchange of up to two samples each way (moves
//! included) and applies the best one that keeps both packs within capacity, lowers `F` and raises
//! neither pack's max load in either modality (so the global max never grows).
//! Cost per round: O(P log P) for the sort plus O(k^4) per pair, k = samples per pack (~5).

use super::bfd::{Bin, Item};

/// Light packs tried for each heavy one.
const PARTNERS: usize = 4;

/// Two-sample subsets are tried only in packs of at most this many samples.
const PAIRS_UP_TO: usize = 16;

/// Up to two samples of one pack (positions), with their summed length and loads.
#[derive(Clone, Copy, Debug, Default)]
struct Subset {
    idx: [Option<usize>; 2],
    len: u32,
    vision: f64,
    audio: f64,
}

/// Candidate exchange: samples at these positions of P go to Q and vice versa.
#[derive(Clone, Copy, Debug, Default)]
struct Exchange {
    from_p: [Option<usize>; 2],
    from_q: [Option<usize>; 2],
}

pub(crate) fn balance(bins: &mut [Bin], cap: u32, rounds: usize) {
    let n = bins.len();
    if n < 2 {
        return;
    }
    let mean_v = bins.iter().map(|b| b.vision).sum::<f64>() / n as f64;
    let mean_a = bins.iter().map(|b| b.audio).sum::<f64>() / n as f64;
    let wv = if mean_v > 0.0 {
        1.0 / (mean_v * mean_v)
    } else {
        0.0
    };
    let wa = if mean_a > 0.0 {
        1.0 / (mean_a * mean_a)
    } else {
        0.0
    };
    if wv == 0.0 && wa == 0.0 {
        return;
    }
    let dims: Vec<bool> = [(true, wv), (false, wa)]
        .iter()
        .filter(|(_, w)| *w > 0.0)
        .map(|(d, _)| *d)
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    for _ in 0..rounds {
        let mut improved = false;
        for &vision in &dims {
            let load = |b: &Bin| if vision { b.vision } else { b.audio };
            order.sort_by(|&i, &j| load(&bins[j]).total_cmp(&load(&bins[i])).then(i.cmp(&j)));
            for k in 0..n / 2 {
                // The k-th heaviest against the k-th lightest, then a few of the next lightest.
                for j in 0..PARTNERS.min(n / 2 - k) {
                    let (p, q) = (order[k], order[n - 1 - k - j]);
                    if load(&bins[p]) <= load(&bins[q]) {
                        break;
                    }
                    if improve_pair(bins, p, q, cap, wv, wa) {
                        improved = true;
                        break;
                    }
                }
            }
        }
        if !improved {
            break;
        }
    }
}

/// Applies the best admissible exchange between bins `p` and `q`; true if one was applied.
fn improve_pair(bins: &mut [Bin], p: usize, q: usize, cap: u32, wv: f64, wa: f64) -> bool {
    let (bp, bq) = (&bins[p], &bins[q]);
    let f = |v: f64, a: f64| wv * v * v + wa * a * a;
    let f0 = f(bp.vision, bp.audio) + f(bq.vision, bq.audio);
    // Relative threshold: ignore float-noise "improvements".
    let eps = 1e-9 * f0.max(f64::MIN_POSITIVE);
    let max_v = bp.vision.max(bq.vision) * (1.0 + 1e-12);
    let max_a = bp.audio.max(bq.audio) * (1.0 + 1e-12);
    // Every subset of size <= 2 of each pack (the empty one included: a plain move), with its
    // length and loads; Q's sorted by length so that only the exchanges that fit both packs,
    // `lq` in `[lp - room_q, lp + room_p]`, are visited: a narrow window when packs are full.
    let subsets = |b: &Bin| {
        let k = b.items.len();
        let mut v: Vec<Subset> = vec![Subset::default()];
        for (x, ix) in b.items.iter().enumerate() {
            v.push(Subset {
                idx: [Some(x), None],
                len: ix.len,
                vision: ix.vision,
                audio: ix.audio,
            });
            for (x2, ix2) in b
                .items
                .iter()
                .enumerate()
                .skip(x + 1)
                .take_while(|_| k <= PAIRS_UP_TO)
            {
                v.push(Subset {
                    idx: [Some(x), Some(x2)],
                    len: ix.len + ix2.len,
                    vision: ix.vision + ix2.vision,
                    audio: ix.audio + ix2.audio,
                });
            }
        }
        v
    };
    let sp = subsets(bp);
    let mut sq = subsets(bq);
    sq.sort_by_key(|s| s.len);
    let (room_p, room_q) = (cap.saturating_sub(bp.tokens), cap.saturating_sub(bq.tokens));
    let mut best: Option<(f64, Exchange)> = None;
    for a in &sp {
        // Moving every sample out of P would leave an empty pack.
        let moved = a.idx.iter().flatten().count();
        let lo = a.len.saturating_sub(room_q);
        let hi = a.len.saturating_add(room_p);
        let start = sq.partition_point(|s| s.len < lo);
        for b in sq[start..].iter().take_while(|s| s.len <= hi) {
            if (moved == 0 && b.idx[0].is_none()) || moved == bp.items.len() {
                continue;
            }
            let (nvp, nap) = (
                bp.vision - a.vision + b.vision,
                bp.audio - a.audio + b.audio,
            );
            let (nvq, naq) = (
                bq.vision - b.vision + a.vision,
                bq.audio - b.audio + a.audio,
            );
            if nvp.max(nvq) > max_v || nap.max(naq) > max_a {
                continue;
            }
            let delta = f(nvp, nap) + f(nvq, naq) - f0;
            if delta < -eps && best.as_ref().is_none_or(|(d, _)| delta < *d) {
                best = Some((
                    delta,
                    Exchange {
                        from_p: a.idx,
                        from_q: b.idx,
                    },
                ));
            }
        }
    }
    let Some((_, ex)) = best else {
        return false;
    };
    let take = |b: &mut Bin, idx: &[Option<usize>; 2]| -> Vec<Item> {
        let mut pos: Vec<usize> = idx.iter().flatten().copied().collect();
        pos.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::with_capacity(pos.len());
        for i in pos {
            if i < b.items.len() {
                out.push(b.items.swap_remove(i));
            }
        }
        for it in &out {
            b.tokens -= it.len;
            b.vision -= it.vision;
            b.audio -= it.audio;
        }
        out
    };
    let to_q = take(&mut bins[p], &ex.from_p);
    let to_p = take(&mut bins[q], &ex.from_q);
    for it in to_p {
        bins[p].push(it);
    }
    for it in to_q {
        bins[q].push(it);
    }
    true
}
