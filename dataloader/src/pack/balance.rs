//! Modality balancing of closed packs without touching fill: moves and swaps of samples between a
//! heavy and a light pack, kept only when both stay within capacity.
//!
//! Objective: `F = sum_p (v_p / mean_v)^2 + (a_p / mean_a)^2` over packs (vision and audio loads,
//! each normalized by its mean so the two modalities weigh alike; an absent modality drops out).
//! With the totals fixed, lower `F` means lower variance. Each round sorts packs by one modality's
//! load and pairs the k-th heaviest with the k-th lightest; for each pair it tries every move of one
//! sample, every 1-for-1 swap and every 2-for-1 / 1-for-2 swap and applies the best one that lowers
//! `F` and raises neither pack's max load in either modality (so the global max never grows).
//! Cost per round: O(P log P) for the sort plus O(k^3) per pair, k = samples per pack (~5).

use super::bfd::{Bin, Item};

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
                let (p, q) = (order[k], order[n - 1 - k]);
                if load(&bins[p]) <= load(&bins[q]) {
                    break;
                }
                improved |= improve_pair(bins, p, q, cap, wv, wa);
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
    let mut best: Option<(f64, Exchange)> = None;
    let mut consider = |ex: Exchange| {
        let sum = |b: &Bin, idx: &[Option<usize>; 2]| {
            idx.iter()
                .flatten()
                .filter_map(|&i| b.items.get(i))
                .fold((0u32, 0.0, 0.0), |(l, v, a), it| {
                    (l + it.len, v + it.vision, a + it.audio)
                })
        };
        let (lp, vp, ap) = sum(bp, &ex.from_p);
        let (lq, vq, aq) = sum(bq, &ex.from_q);
        let tp = bp.tokens - lp + lq;
        let tq = bq.tokens - lq + lp;
        let moved_all = ex.from_p.iter().flatten().count() == bp.items.len();
        if tp > cap || tq > cap || moved_all {
            return;
        }
        let (nvp, nap) = (bp.vision - vp + vq, bp.audio - ap + aq);
        let (nvq, naq) = (bq.vision - vq + vp, bq.audio - aq + ap);
        if nvp.max(nvq) > max_v || nap.max(naq) > max_a {
            return;
        }
        let delta = f(nvp, nap) + f(nvq, naq) - f0;
        if delta < -eps && best.as_ref().is_none_or(|(d, _)| delta < *d) {
            best = Some((delta, ex));
        }
    };
    let (np, nq) = (bp.items.len(), bq.items.len());
    for x in 0..np {
        // Move x from P to Q.
        consider(Exchange {
            from_p: [Some(x), None],
            from_q: [None, None],
        });
        for y in 0..nq {
            consider(Exchange {
                from_p: [Some(x), None],
                from_q: [Some(y), None],
            });
            for y2 in y + 1..nq {
                consider(Exchange {
                    from_p: [Some(x), None],
                    from_q: [Some(y), Some(y2)],
                });
            }
        }
        for x2 in x + 1..np {
            for y in 0..nq {
                consider(Exchange {
                    from_p: [Some(x), Some(x2)],
                    from_q: [Some(y), None],
                });
            }
        }
    }
    for y in 0..nq {
        // Move y from Q to P (helps when the light pack holds a sample that is heavy in the other modality).
        consider(Exchange {
            from_p: [None, None],
            from_q: [Some(y), None],
        });
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
