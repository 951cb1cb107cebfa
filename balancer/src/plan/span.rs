//! A lower bound of one module's critical path at a layout, whatever its chunking: the
//! work-conserving bound's span ([`crate::plan::bound`]), and the rate curves it is timed at.

use crate::cluster::{Cluster, RatePoint};
use crate::dims::Module;
use crate::plan::cost::StageCost;
use crate::plan::options::Totals;
use crate::plan::step::Problem;

/// Lower bounds of a module's critical path by the size of its largest chunk (see
/// [`Problem::path`]): rungs `(c, t)`, `c` ascending, where `t` bounds every chunking
/// whose largest chunk holds at least the tokens of the rung before's `c` (or the
/// largest item's); up to the chunk size past which the chunk's own chain through the
/// stages sets the bound (`top`). `edges`: the longest fill and drain around a stage.
pub(crate) struct Ladder {
    rungs: Vec<(f64, f64)>,
    pub edges: f64,
}

impl Ladder {
    /// The bound over every chunking whose largest chunk holds at least `least` tokens;
    /// `None` past the ladder's top, where it is the chain of a chunk of `least` tokens
    /// (and at least the fill and drain).
    pub fn from(&self, least: f64) -> Option<f64> {
        self.rungs.iter().find(|r| r.0 >= least).map(|r| r.1)
    }
}

/// The matmul rates a module's span is timed at (see [`Problem::path`]).
pub(crate) struct Rates {
    pub peak: Cluster,
    pub envelope: Cluster,
    pub fill: Cluster,
}

impl Problem {
    /// The rate curves the span is timed at (each at least the cluster's at every GEMM
    /// size, so a pass timed at it is no longer than the cluster's): the peak for every
    /// size (attention in the fill and drain); the running maximum (each chunk's passes:
    /// a rate that never falls with GEMM size); and that raised where it grows faster
    /// than the GEMM (the fill and drain's matmuls: a time that never falls with size).
    /// Log-log interpolation keeps each property between the points.
    pub(crate) fn rates(&self) -> Rates {
        let pts = &self.cluster.matmul;
        let peak = pts.iter().map(|p| p.tflops).fold(0.0, f64::max);
        let mut best = 0.0f64;
        let envelope: Vec<RatePoint> = pts
            .iter()
            .map(|p| {
                best = best.max(p.tflops);
                RatePoint {
                    flops: p.flops,
                    tflops: best,
                }
            })
            .collect();
        let mut fill = envelope.clone();
        for i in (0..fill.len().saturating_sub(1)).rev() {
            let (a, b) = (fill[i], fill[i + 1]);
            fill[i].tflops = a.tflops.max(b.tflops * a.flops / b.flops);
        }
        Rates {
            fill: Cluster {
                matmul: fill,
                ..self.cluster.clone()
            },
            peak: Cluster {
                matmul: vec![RatePoint {
                    flops: 1.0,
                    tflops: peak,
                }],
                ..self.cluster.clone()
            },
            envelope: Cluster {
                matmul: envelope,
                ..self.cluster.clone()
            },
        }
    }

    /// A lower bound of module `m`'s critical path as `sc` runs it, whatever its
    /// chunking. Let `c` be the tokens of its largest chunk (at least its largest item).
    ///
    /// - The chunk of `c` tokens runs forward through every stage and back.
    /// - Each stage runs the fullest replica's load, at least the mean and at least the
    ///   largest item, in chunks of at most `c` tokens: at least `load / c` chunks, each
    ///   no faster per token than one of `c` tokens (the rates below never fall with
    ///   GEMM size and every chunk pays its fixed costs). It does so after the fill (the
    ///   first chunk's forward runs through every stage before this one first) and
    ///   before the drain (the last chunk's backward runs back through them; a frozen
    ///   module's last forward runs on through the stages after it). The first chunk
    ///   holds at least the smallest item, and so does the last; where a replica holds
    ///   two items or more, one of the two holds another item (see [`Totals::second`]).
    ///   Fill and drain are timed where a pass grows with its tokens and squared length
    ///   (see [`Problem::rates`]; below the rate curve's first points a smaller GEMM can
    ///   take longer).
    ///
    /// The first grows with `c` and the second shrinks, so over `c` in `[c0, c1]` the path
    /// is at least the longer of the first at `c0` and the second at `c1`. The ladder
    /// holds that on a geometric ladder of `c` from the largest item up, each rung the
    /// least of it over the rungs from there up: a plan of `k` chunks a replica has a
    /// largest chunk of at least a replica's mean load over `k` ([`Problem::way`]). A
    /// pipeline cannot both fill with one small chunk and run its load in one large one.
    pub(crate) fn path(&self, sc: &StageCost, totals: &Totals, m: Module, rates: &Rates) -> Ladder {
        let (total, big) = (totals.module(m), totals.largest(m));
        let (small, second) = (totals.smallest(m), totals.second(m));
        if total.0 <= 0.0 {
            return Ladder {
                rungs: vec![(f64::INFINITY, 0.0)],
                edges: 0.0,
            };
        }
        let l = sc.layout;
        let at = |c| StageCost { cluster: c, ..*sc };
        let (peak, env, fill) = (at(&rates.peak), at(&rates.envelope), at(&rates.fill));
        // Each stage's forward and backward of a chunk of at least `(t, q)`: its matmuls
        // at the fill curve, its attention (which a larger GEMM runs faster at the same
        // squared length) at the peak.
        let passes = |(t, q): (f64, f64)| -> [Vec<f64>; 3] {
            let per: Vec<[f64; 3]> = (0..l.pp)
                .map(|st| {
                    let (lin, att) = (fill.linear_in_sq(st, t), peak.linear_in_sq(st, t));
                    let [f, b] = [0, 1].map(|k| lin[k].0 + att[k].1 * q);
                    [f, b, fill.split_backward_chunk(st, 0, t, q).1.compute]
                })
                .collect();
            [0, 1, 2].map(|k| per.iter().map(|p| p[k]).collect())
        };
        // Fill and drain around each stage: the first chunk's forward through the stages
        // before, and the last one's backward back through them (a frozen module's
        // forward on through the stages after).
        // With `chunks` model chunks a stage (interleaved 1F1B) only the first chunk's
        // slice of each stage lies before or after it: at least `1 / chunks` of the stage
        // (the first chunk also holds the stem).
        // Split for zero-bubble pipelining, the drain is the last chunk's B back through
        // the stages before and the first stage's W after it, less what the stage's own
        // weight passes after its last B may cover: at most `pp - stage` of them (its
        // in-flight bound), each no longer than a chunk's of up to `c` tokens (`cover`).
        // Per stage `(fill, drain, split drain before that cover)`.
        let v = sc.chunks.max(1) as f64;
        let split = sc.may_split_backward();
        let edge = |first: &[Vec<f64>; 3], last: &[Vec<f64>; 3]| -> Vec<[f64; 3]> {
            let (mut fill, mut drain, mut b_only) = (0.0, 0.0, 0.0);
            let mut out = vec![[0.0; 3]; l.pp];
            for st in 0..l.pp {
                let drain_now = if sc.frozen { 0.0 } else { drain };
                out[st] = [fill, drain_now, b_only + last[2][0]];
                fill += first[0][st] / v;
                drain += last[1][st] / v;
                b_only += last[1][st] - last[2][st];
            }
            if sc.frozen {
                let mut after = 0.0;
                for st in (0..l.pp).rev() {
                    out[st][1] += after;
                    after += last[0][st] / v;
                }
            }
            out
        };
        // The weight passes a stage may run beside the drain, at rung `c`: each at most
        // the longest W of a chunk of up to `c` tokens at the cluster's own rates. A W
        // is a power of its tokens between two points of the (log-log) rate curve, so
        // the longest is at `c` or at a point's size below it.
        let d = sc.dims;
        let per_token = 2.0 * d.hidden as f64 * (d.ffn / l.tp.max(1)).max(1) as f64 / l.cp as f64;
        let sizes: Vec<f64> = sc
            .cluster
            .matmul
            .iter()
            .map(|p| p.flops / per_token)
            .collect();
        let cover = |st: usize, c: f64| {
            let w = |t: f64| sc.split_backward_chunk(st, 0, t, 0.0).1.compute;
            let longest = sizes
                .iter()
                .filter(|&&t| t < c)
                .map(|&t| w(t))
                .fold(w(c), f64::max);
            (l.pp - st) as f64 * longest
        };
        // Each stage's edges at rung `c` (past the ladder's top: no cover bound, so no
        // split drain), the least over `pairs` of first and last chunks.
        let edges_at = |pairs: &[Vec<[f64; 3]>], c: Option<f64>| -> Vec<f64> {
            (0..l.pp)
                .map(|st| {
                    pairs
                        .iter()
                        .map(|e| {
                            let [fill, drain, base] = e[st];
                            let drain = match (split, c) {
                                (false, _) => drain,
                                (true, Some(c)) => (base - cover(st, c)).max(0.0),
                                (true, None) => 0.0,
                            };
                            fill + drain
                        })
                        .fold(f64::INFINITY, f64::min)
                })
                .collect()
        };
        let s1 = passes(small);
        let one_pairs = vec![edge(&s1, &s1)];
        let dp = l.dp as f64;
        let mean = (total.0 / dp, total.1 / dp);
        // A replica above the mean holds two items or more when the mean exceeds the
        // largest item: its first and last chunks are two items apart (or one chunk of
        // both), so one of them holds at least the second-least tokens, one the
        // second-least squared length.
        let two_pairs = if mean.0 > big.0 {
            let (t1, q1, t2, q2) = (small.0, small.1, second.0, second.1);
            let (s2, a, b) = (passes((t2, q2)), passes((t1, q2)), passes((t2, q1)));
            vec![edge(&s1, &s2), edge(&s2, &s1), edge(&a, &b), edge(&b, &a)]
        } else {
            one_pairs.clone()
        };
        // Each stage's forward plus backward of a chunk of `c` tokens at the envelope
        // rate, as `a + b * sq`.
        let lin = |c: f64| -> Vec<(f64, f64)> {
            (0..l.pp)
                .map(|st| {
                    let [f, b] = env.linear_in_sq(st, c);
                    (f.0 + b.0, f.1 + b.1)
                })
                .collect()
        };
        // A load of (tokens, squared length) in chunks of at most `c` tokens: at least
        // `tokens / c` chunks at the per-token and per-pair cost of one of `c` tokens.
        let chunked = |(a, b): (f64, f64), load: (f64, f64), c: f64| load.0 / c * a + b * load.1;
        // The busiest stage when no chunk holds more than `c` tokens: the step waits for
        // every replica, so for the mean of them and for the largest item's; and for one
        // with at least the mean tokens, which holds two items or more where `two` differs
        // from `one` (its attention at least the least per token of any item, or all of it
        // with one replica).
        let density = totals.density(m);
        let most = if l.dp == 1 {
            mean
        } else {
            (mean.0, mean.0 * density)
        };
        let stages = |at: &[(f64, f64)], c: f64| {
            let (one, two) = (edges_at(&one_pairs, Some(c)), edges_at(&two_pairs, Some(c)));
            (0..l.pp)
                .map(|st| {
                    let at = at[st];
                    (one[st] + chunked(at, mean, c).max(chunked(at, big, c)))
                        .max(two[st] + chunked(at, most, c))
                })
                .fold(0.0, f64::max)
        };
        // The chunk of `c` tokens through every stage and back (at least the least
        // attention per token of any item), timed where time never falls with size.
        let chain = |c: f64| self.chain(sc, rates, c, density);
        let rung = 2f64.powf(0.25);
        // Up the ladder until the chain outgrows the stages: past there each rung is its
        // chain, which only grows (the ladder's top; a bounded climb in any case).
        let mut c = big.0.max(1.0);
        let mut rungs = Vec::new();
        let edges = edges_at(&two_pairs, None).into_iter().fold(0.0, f64::max);
        let mut crossed = false;
        for _ in 0..256 {
            let next = c * rung;
            let (through, busy) = (chain(c), stages(&lin(next), next));
            rungs.push((next, through.max(busy)));
            c = next;
            if through >= busy {
                crossed = true;
                break;
            }
        }
        if !crossed {
            // Every larger chunk at once.
            rungs.push((f64::INFINITY, chain(c).max(edges)));
        }
        // Least over the rungs from each one up.
        for k in (0..rungs.len().saturating_sub(1)).rev() {
            rungs[k].1 = rungs[k].1.min(rungs[k + 1].1);
        }
        Ladder { rungs, edges }
    }

    /// A chunk of `c` tokens (at least `density` squared length a token, the least of
    /// any item) through every stage of `sc` and back, with the sends between its
    /// stages, on the fill curve: its time never falls with `c` (at the envelope a larger
    /// GEMM can finish sooner), so a chunk of at least `c` tokens takes at least this.
    /// Where the backward may be split (zero-bubble pipelining), only the first stage's
    /// weight gradients lie on the way back: the others' may run beside it.
    pub(crate) fn chain(&self, sc: &StageCost, rates: &Rates, c: f64, density: f64) -> f64 {
        let env = StageCost {
            cluster: &rates.fill,
            ..*sc
        };
        let split = sc.may_split_backward();
        let passes: f64 = (0..sc.layout.pp)
            .map(|st| {
                let [f, b] = env.linear_in_sq(st, c);
                let beside = if split && st > 0 {
                    env.split_backward_chunk(st, 0, c, 0.0).1.compute
                } else {
                    0.0
                };
                f.0 + b.0 + (f.1 + b.1) * c * density - beside
            })
            .sum();
        // Its sends between chunks, each way (forward only when frozen): `pp - 1`
        // boundaries, `chunks * pp - 1` round an interleaved ring.
        let ways = if sc.frozen { 1.0 } else { 2.0 };
        passes + sc.boundaries() * ways * env.send(c)
    }
}
