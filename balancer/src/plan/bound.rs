//! The work-conserving bound of a step and how far a plan is from it.
//!
//! The bound is the step with no bubble, no waiting and no bridge: every module's busy
//! GPU-seconds at a layout of its own that fits in a GPU's memory (alone on its GPUs),
//! summed over the modules and divided by all the GPUs. Three things keep it honest
//! where a plain sum would promise a step no plan can run:
//!
//! - each module's layout is the one that makes the bound least, among every layout on
//!   every GPU count a plan may give it (the divisors of the cluster, the disjoint
//!   search's encoder counts and what they leave the LLM), so its work is what the least
//!   wasteful layout that fits costs, TP/CP/PP communication and recomputation included;
//! - no module finishes before a lower bound of its critical path at that layout,
//!   whatever its chunking: each stage runs at least the fullest replica's load (at
//!   least the mean share, at least the largest row, image or clip) between the
//!   pipeline's fill and drain (the smallest item through the stages before it), and
//!   the largest item runs through every stage. A batch of 1,024 rows cannot keep 4,096
//!   GPUs busy without splitting rows, and a split row pays its TP/CP communication;
//! - nor before its gradient sync at that layout: the sync runs on a lane of its own,
//!   which in a steady state of steps carries one sync a step.
//!
//! So the bound is `min over layouts of max(sum of work / GPUs, each module's critical
//! path, each module's sync)`, at most the step of every plan `braid plan` makes: its
//! LLM microbatch counts are the ones the search tries (powers of two up to the rows a
//! replica, and that count; a count between two of them could pair the smaller's work
//! with the larger's shorter path), and its encoders chunk by those. Tests check it
//! against the search's picks, the baseline, brute force, every layout of a two-node
//! world, layouts of a 2-row batch on 8 GPUs, and every chunking of small pipelines. A
//! plan's step splits into the bound and five parts (seconds of the step, i.e.
//! GPU-seconds over the GPUs); time the bound already holds (where a critical path or a
//! sync sets it) is not counted again:
//!
//! - **memory-forced choices**: the plan's own busy work beyond the bound's (layouts the
//!   plan takes because its modules share memory or GPUs, or to cut the gradient sync:
//!   more TP, CP and PP communication, recomputation, smaller matmuls), taken as the rest
//!   of the step once the other parts are counted (negative where the plan's layouts do
//!   less work than the bound's, which trade work for a shorter critical path);
//! - **gradient sync**: the exposed part of each lane's gradient reduction;
//! - **imbalance**: the time a replica's lane waits for the busiest replica of its
//!   module and stage;
//! - **bridge**: the bridge transfers on the step's critical path (all of them in the
//!   phased schedule, a chunk's each way in the overlapped one), at most the idle time
//!   left;
//! - **bubbles**: the rest of the idle time (pipeline fill and drain, waiting on other
//!   modules).

use std::collections::HashMap;

use crate::cluster::{Cluster, RatePoint};
use crate::dims::Module;
use crate::plan::cost::StageCost;
use crate::plan::layout::{Layout, Plan, Schedule};
use crate::plan::options::{Knobs, Totals};
use crate::plan::search::{encoder_counts, first_stage_options};
use crate::plan::step::{Problem, StepSim};
use crate::workload::RowShape;

/// A plan's distance from the bound, split into its parts (seconds of the step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Gap {
    pub bound_s: f64,
    /// What sets the bound.
    pub bound: Bound,
    pub memory_forced_s: f64,
    pub grad_sync_s: f64,
    pub imbalance_s: f64,
    pub bridge_s: f64,
    pub bubbles_s: f64,
}

impl Gap {
    /// The step time these parts add up to.
    pub fn step_s(&self) -> f64 {
        self.bound_s
            + self.memory_forced_s
            + self.grad_sync_s
            + self.imbalance_s
            + self.bridge_s
            + self.bubbles_s
    }
}

/// One way to run a module alone: its busy GPU-seconds and the least time it can take:
/// at least a lower bound of its critical path (`path`, whatever the chunking) and of its
/// longest stage's gradient sync (`sync`, which the gap counts apart).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Way {
    work: f64,
    path: f64,
    sync: f64,
}

impl Way {
    fn span(&self) -> f64 {
        self.path.max(self.sync)
    }
}

/// The bound of a step and what sets it (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Bound {
    /// The bound: the longest of the next three.
    pub step_s: f64,
    /// The modules' work spread over the GPUs.
    pub work_s: f64,
    /// The longest module's critical path.
    pub path_s: f64,
    /// The longest stage's gradient sync.
    pub sync_s: f64,
}

/// The ways no other way beats in both work and span.
fn front(mut ways: Vec<Way>) -> Vec<Way> {
    ways.sort_by(|a, b| {
        a.work
            .total_cmp(&b.work)
            .then(a.span().total_cmp(&b.span()))
    });
    let mut out: Vec<Way> = Vec::new();
    for w in ways {
        if out.last().is_none_or(|l| w.span() < l.span()) {
            out.push(w);
        }
    }
    out
}

/// GPU counts a plan on `gpus` GPUs may give one module: the divisors of `gpus`, the
/// disjoint search's encoder counts, and what two of those leave the LLM.
fn module_counts(gpus: usize, node: usize) -> Vec<usize> {
    let enc = encoder_counts(gpus, node);
    let mut out: Vec<usize> = (1..=gpus).filter(|g| gpus.is_multiple_of(*g)).collect();
    out.extend(&enc);
    for &a in &enc {
        out.push(gpus - a);
        for &b in &enc {
            if a + b < gpus {
                out.push(gpus - a - b);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Lower bounds of a module's critical path by the size of its largest chunk (see
/// [`Problem::path`]): rungs `(c, t)`, `c` ascending, where `t` bounds every chunking
/// whose largest chunk holds at least the tokens of the rung before's `c` (or the
/// largest item's); up to the chunk size past which the chunk's own chain through the
/// stages sets the bound (`top`). `edges`: the longest fill and drain around a stage.
struct Ladder {
    rungs: Vec<(f64, f64)>,
    edges: f64,
}

impl Ladder {
    /// The bound over every chunking whose largest chunk holds at least `least` tokens;
    /// `None` past the ladder's top, where it is the chain of a chunk of `least` tokens
    /// (and at least the fill and drain).
    fn from(&self, least: f64) -> Option<f64> {
        self.rungs.iter().find(|r| r.0 >= least).map(|r| r.1)
    }
}

/// The matmul rates a module's span is timed at (see [`Problem::path`]).
struct Rates {
    peak: Cluster,
    envelope: Cluster,
    fill: Cluster,
}

/// What the bound is built from: the batch loads (with each module's largest item), the
/// GPU counts and encoder chunk counts to try.
struct Inputs<'a> {
    knobs: Knobs<'a>,
    counts: Vec<usize>,
    chunks: Vec<usize>,
    /// Each batch's loads on its own: a critical path is bounded batch by batch (the
    /// least over chunk sizes of a mean is not the mean of the least).
    each: Vec<Totals>,
}

impl Problem {
    /// Every way to run module `m` alone that fits in a GPU's memory (the Pareto front of
    /// work and span; see [`Problem::way`]).
    fn ways(&self, m: Module, inp: &Inputs) -> Vec<Way> {
        let k = &inp.knobs;
        let budget = self.cluster.usable_bytes();
        // An encoder's chunks (its 1F1B microbatches); the LLM's own option list tries
        // every microbatch count.
        let chunks: &[usize] = match m {
            Module::Llm => &[1],
            _ => &inp.chunks,
        };
        let rates = self.rates();
        // A span holds for any chunking: one per layout, recomputation and first stage.
        let mut paths: HashMap<(Layout, bool, Option<usize>), Vec<Ladder>> = HashMap::new();
        let mut ways = Vec::new();
        for &g in &inp.counts {
            for &c in chunks {
                for o in self.options(m, g, c, 0, k) {
                    let Some(sc) = self.cost(m, o.layout, o.recompute, k.zero1) else {
                        continue;
                    };
                    // The LLM's first stage may be shorter (as the LLM-centric baseline
                    // runs it): less to sync and hold there.
                    let firsts = match m {
                        Module::Llm => first_stage_options(self.model.llm.layers, o.layout.pp),
                        _ => vec![None],
                    };
                    for first in firsts {
                        let sc = StageCost {
                            first_stage_layers: first,
                            ..sc
                        };
                        let mem = match first {
                            None => o.mem,
                            Some(_) => self.llm_memory(&sc, o.microbatches, k.totals),
                        };
                        if mem <= budget {
                            let ladders = paths
                                .entry((o.layout, o.recompute, first))
                                .or_insert_with(|| {
                                    inp.each
                                        .iter()
                                        .map(|t| self.path(&sc, t, m, &rates))
                                        .collect()
                                });
                            let each = (inp.each.as_slice(), ladders.as_slice());
                            ways.push(self.way(&sc, o.microbatches, k.totals, m, each, &rates));
                        }
                    }
                }
            }
        }
        front(ways)
    }

    /// The rate curves the span is timed at (each at least the cluster's at every GEMM
    /// size, so a pass timed at it is no longer than the cluster's): the peak for every
    /// size (attention in the fill and drain); the running maximum (each chunk's passes:
    /// a rate that never falls with GEMM size); and that raised where it grows faster
    /// than the GEMM (the fill and drain's matmuls: a time that never falls with size).
    /// Log-log interpolation keeps each property between the points.
    fn rates(&self) -> Rates {
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

    /// The LLM's memory per GPU as `sc` runs it with `mbs` microbatches a replica, as
    /// [`Problem::options`] estimates it for an even split.
    fn llm_memory(&self, sc: &StageCost, mbs: usize, totals: &Totals) -> f64 {
        let dp = sc.layout.dp;
        let (load, peak) = totals.dealt(Module::Llm, dp * mbs, dp, dp * mbs);
        self.estimate(sc, mbs, load, peak, &[], 0).mem
    }

    /// Module `m` run alone as `sc` says, its batch load (`totals`, the mean over the
    /// batches) in `microbatches` chunks a replica: the work is its passes and pipeline
    /// sends over those chunks; the span is the critical path of any such chunking (the
    /// mean over the batches of each one's, from its loads and [`Problem::path`]'s
    /// ladder in `each`: its largest chunk holds at least a replica's mean load over its
    /// chunks) and the longest stage's gradient sync on a lane of its own (which in a
    /// steady state of steps carries one sync a step).
    fn way(
        &self,
        sc: &StageCost,
        microbatches: usize,
        totals: &Totals,
        m: Module,
        each: (&[Totals], &[Ladder]),
        rates: &Rates,
    ) -> Way {
        let total = totals.module(m);
        let l = sc.layout;
        let n = (l.dp * microbatches) as f64;
        let (t, q) = (total.0 / n, total.1 / n);
        let pass = |st: usize| sc.forward(st, t, q).total() + sc.backward(st, t, q).total();
        let sends = (l.pp - 1) as f64 * if sc.frozen { 1.0 } else { 2.0 };
        let per_chunk = (0..l.pp).map(pass).sum::<f64>() + sends * sc.send(t);
        Way {
            work: n * per_chunk * l.block() as f64,
            path: each
                .0
                .iter()
                .zip(each.1)
                .map(|(b, ladder)| {
                    let least = b.module(m).0 / n;
                    ladder.from(least).unwrap_or_else(|| {
                        self.chain(sc, rates, least, b.density(m)).max(ladder.edges)
                    })
                })
                .sum::<f64>()
                / each.0.len().max(1) as f64,
            sync: (0..l.pp).map(|st| sc.dp_sync(st)).fold(0.0, f64::max),
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
    fn path(&self, sc: &StageCost, totals: &Totals, m: Module, rates: &Rates) -> Ladder {
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
        let passes = |(t, q): (f64, f64)| -> [Vec<f64>; 2] {
            let per: Vec<[f64; 2]> = (0..l.pp)
                .map(|st| {
                    let (lin, att) = (fill.linear_in_sq(st, t), peak.linear_in_sq(st, t));
                    [0, 1].map(|k| lin[k].0 + att[k].1 * q)
                })
                .collect();
            [0, 1].map(|k| per.iter().map(|p| p[k]).collect())
        };
        // Fill and drain around each stage: the first chunk's forward through the stages
        // before, and the last one's backward back through them (a frozen module's
        // forward on through the stages after).
        let edge = |first: &[Vec<f64>; 2], last: &[Vec<f64>; 2]| -> Vec<f64> {
            let (mut fill, mut drain) = (0.0, 0.0);
            let mut out = vec![0.0; l.pp];
            for st in 0..l.pp {
                out[st] = fill + if sc.frozen { 0.0 } else { drain };
                fill += first[0][st];
                drain += last[1][st];
            }
            if sc.frozen {
                let mut after = 0.0;
                for st in (0..l.pp).rev() {
                    out[st] += after;
                    after += last[0][st];
                }
            }
            out
        };
        let s1 = passes(small);
        let one = edge(&s1, &s1);
        let dp = l.dp as f64;
        let mean = (total.0 / dp, total.1 / dp);
        // A replica above the mean holds two items or more when the mean exceeds the
        // largest item: its first and last chunks are two items apart (or one chunk of
        // both), so one of them holds at least the second-least tokens, one the
        // second-least squared length.
        let two = if mean.0 > big.0 {
            let (t1, q1, t2, q2) = (small.0, small.1, second.0, second.1);
            let (s2, a, b) = (passes((t2, q2)), passes((t1, q2)), passes((t2, q1)));
            let pairs = [edge(&s1, &s2), edge(&s2, &s1), edge(&a, &b), edge(&b, &a)];
            (0..l.pp)
                .map(|st| pairs.iter().map(|p| p[st]).fold(f64::INFINITY, f64::min))
                .collect()
        } else {
            one.clone()
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
        let edges = two.iter().copied().fold(0.0, f64::max);
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
    /// any item) through every stage of `sc` and back, on the fill curve: its time never
    /// falls with `c` (at the envelope a larger GEMM can finish sooner), so a chunk of at
    /// least `c` tokens takes at least this.
    fn chain(&self, sc: &StageCost, rates: &Rates, c: f64, density: f64) -> f64 {
        let env = StageCost {
            cluster: &rates.fill,
            ..*sc
        };
        (0..sc.layout.pp)
            .map(|st| {
                let [f, b] = env.linear_in_sq(st, c);
                f.0 + b.0 + (f.1 + b.1) * c * density
            })
            .sum()
    }

    /// The work-conserving bound of a step on `gpus` GPUs over `batches` and what sets
    /// it. `chunks`:
    /// an encoder chunk count to try besides powers of two up to 64 (a plan's
    /// microbatches). `None` when some module fits in no layout.
    pub fn work_bound(
        &self,
        gpus: usize,
        batches: &[Vec<RowShape>],
        chunks: usize,
    ) -> Option<Bound> {
        let totals = Totals::of(batches);
        let mut enc_chunks: Vec<usize> = (0..7).map(|k| 1usize << k).collect();
        enc_chunks.push(chunks.max(1));
        let inp = Inputs {
            knobs: Knobs {
                totals: &totals,
                recompute: &[false, true],
                zero1: true,
                rows: batches.first().map_or(1, |b| b.len()).max(1),
                overlapped: true,
            },
            counts: module_counts(gpus.max(1), self.cluster.gpus_per_node),
            chunks: enc_chunks,
            each: batches
                .iter()
                .map(|b| Totals::of(std::slice::from_ref(b)))
                .collect(),
        };
        let g = gpus.max(1) as f64;
        // Partial sums over the modules so far: (work, longest path and sync), kept to
        // its front.
        let mut best = vec![Way {
            work: 0.0,
            path: 0.0,
            sync: 0.0,
        }];
        for m in [Module::Llm, Module::Vision, Module::Audio] {
            if self.model.module(m).is_none() {
                continue;
            }
            let ways = self.ways(m, &inp);
            if ways.is_empty() {
                return None;
            }
            best = front(
                best.iter()
                    .flat_map(|a| {
                        ways.iter().map(move |x| Way {
                            work: a.work + x.work,
                            path: a.path.max(x.path),
                            sync: a.sync.max(x.sync),
                        })
                    })
                    .collect(),
            );
        }
        best.iter()
            .map(|w| Bound {
                step_s: (w.work / g).max(w.span()),
                work_s: w.work / g,
                path_s: w.path,
                sync_s: w.sync,
            })
            .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
    }

    /// `sim` (the simulated step of `plan`, the mean over `batches`) split into the
    /// bound and its parts.
    pub fn gap(&self, plan: &Plan, batches: &[Vec<RowShape>], sim: &StepSim) -> Gap {
        let g = plan.gpus().max(1) as f64;
        let b = self
            .work_bound(plan.gpus(), batches, plan.microbatches)
            .unwrap_or_default();
        let bound_s = b.step_s;
        // Time the bound already holds beyond the work spread over the GPUs is not counted
        // again below: a critical path's as idle time, a sync's beyond it as sync.
        let held_idle = (b.path_s - b.work_s).max(0.0);
        let held_sync = (b.sync_s - b.path_s.max(b.work_s)).max(0.0);
        // Held sync beyond the plan's exposed sync (averaged over all GPUs, some of which
        // wait idle while others sync) is idle time too.
        let exposed = sim.sync_gpu_s / g;
        let held_idle = held_idle + (held_sync - exposed).max(0.0);
        let idle = ((g * sim.step_s - sim.busy_gpu_s).max(0.0) / g - held_idle).max(0.0);
        let imbalance_s = (sim.imbalance_gpu_s / g).min(idle);
        let exposed_bridge = match plan.schedule {
            Schedule::Phased => sim.bridge_s,
            Schedule::Overlapped => sim.bridge_s / plan.microbatches.max(1) as f64,
        };
        let bridge_s = exposed_bridge.min(idle - imbalance_s);
        let grad_sync_s = (exposed - held_sync).max(0.0);
        // The plan's busy work beyond the bound's, taken as what is left so that the
        // parts add up to the step (lanes of colocated modules that overlap on shared
        // GPUs would otherwise count twice).
        Gap {
            bound_s,
            bound: b,
            memory_forced_s: sim.step_s - bound_s - grad_sync_s - idle,
            grad_sync_s,
            imbalance_s,
            bridge_s,
            bubbles_s: idle - imbalance_s - bridge_s,
        }
    }
}

#[cfg(test)]
#[path = "bound_tests.rs"]
mod tests;
