//! The work-conserving bound of a step and how far a plan is from it.
//!
//! The bound is the step with no bubble, no waiting, no bridge and no gradient sync:
//! every module's busy GPU-seconds at a layout of its own that fits in a GPU's memory
//! (alone on its GPUs), summed over the modules and divided by all the GPUs. Two things
//! keep it honest where a plain sum would promise a step no plan can run:
//!
//! - each module's layout is the one that makes the bound least, among every layout on
//!   every GPU count a plan may give it (the divisors of the cluster, the disjoint
//!   search's encoder counts and what they leave the LLM), so its work is what the least
//!   wasteful layout that fits costs, TP/CP/PP communication and recomputation included;
//! - no module finishes before a lower bound of its critical path at that layout,
//!   whatever its chunking: its busiest stage runs at least the fullest replica's load
//!   (at least the mean share, at least the largest row, image or clip), and the largest
//!   item runs through every stage. A batch of 1,024 rows cannot keep 4,096 GPUs busy
//!   without splitting rows, and a split row pays its TP/CP communication.
//!
//! So the bound is `min over layouts of max(sum of work / GPUs, each module's critical
//! path)`, at most every plan's step (tests check it against the search's picks, the
//! baseline, brute force, and layouts of a 2-row batch on 8 GPUs). A plan's step splits
//! into the bound and five parts (seconds of the step, i.e. GPU-seconds over the GPUs);
//! idle time the bound already holds (where a critical path sets it) is not counted
//! again:
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

use crate::dims::Module;
use crate::plan::layout::{Plan, Schedule};
use crate::plan::options::{Knobs, Totals};
use crate::plan::search::encoder_counts;
use crate::plan::step::{Problem, StepSim};
use crate::workload::RowShape;

/// A plan's distance from the bound, split into its parts (seconds of the step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Gap {
    pub bound_s: f64,
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

/// One way to run a module alone: its busy GPU-seconds and the least time it can take
/// (a lower bound of its critical path, whatever the chunking).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Way {
    work: f64,
    span: f64,
}

/// The ways no other way beats in both work and span.
fn front(mut ways: Vec<Way>) -> Vec<Way> {
    ways.sort_by(|a, b| a.work.total_cmp(&b.work).then(a.span.total_cmp(&b.span)));
    let mut out: Vec<Way> = Vec::new();
    for w in ways {
        if out.last().is_none_or(|l| w.span < l.span) {
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

/// What the bound is built from: the batch loads (with each module's largest item), the
/// GPU counts and encoder chunk counts to try.
struct Inputs<'a> {
    knobs: Knobs<'a>,
    counts: Vec<usize>,
    chunks: Vec<usize>,
}

impl Problem {
    /// Every way to run module `m` alone that fits in a GPU's memory (the Pareto front of
    /// work and span). The work is the option's passes and pipeline sends over its
    /// chunks; the span holds for any chunking: the busiest stage runs at least the
    /// fullest replica's load (at least the mean, at least the largest item), as one
    /// chunk (the fewest fixed costs), and the largest item runs through every stage.
    fn ways(&self, m: Module, inp: &Inputs) -> Vec<Way> {
        let k = &inp.knobs;
        let budget = self.cluster.usable_bytes();
        let total = k.totals.module(m);
        let big = k.totals.largest(m);
        // An encoder's chunks (its 1F1B microbatches); the LLM's own option list tries
        // every microbatch count.
        let chunks: &[usize] = match m {
            Module::Llm => &[1],
            _ => &inp.chunks,
        };
        let mut ways = Vec::new();
        for &g in &inp.counts {
            for &c in chunks {
                for o in self.options(m, g, c, 0, k) {
                    if o.mem > budget {
                        continue;
                    }
                    let Some(sc) = self.cost(m, o.layout, o.recompute, k.zero1) else {
                        continue;
                    };
                    let l = o.layout;
                    let pass = |st: usize, t: f64, q: f64| {
                        sc.forward(st, t, q).total() + sc.backward(st, t, q).total()
                    };
                    let n = (l.dp * o.microbatches) as f64;
                    let (t, q) = (total.0 / n, total.1 / n);
                    let sends = (l.pp - 1) as f64 * if sc.frozen { 1.0 } else { 2.0 };
                    let per_chunk =
                        (0..l.pp).map(|st| pass(st, t, q)).sum::<f64>() + sends * sc.send(t);
                    let dp = l.dp as f64;
                    let replica = ((total.0 / dp).max(big.0), (total.1 / dp).max(big.1));
                    let busiest = (0..l.pp)
                        .map(|st| pass(st, replica.0, replica.1))
                        .fold(0.0, f64::max);
                    let chain: f64 = (0..l.pp).map(|st| pass(st, big.0, big.1)).sum();
                    ways.push(Way {
                        work: n * per_chunk * l.block() as f64,
                        span: busiest.max(chain),
                    });
                }
            }
        }
        front(ways)
    }

    /// The work-conserving bound of a step on `gpus` GPUs over `batches` and, of it, the
    /// modules' work over the GPUs (seconds; the rest is a critical path's). `chunks`:
    /// an encoder chunk count to try besides powers of two up to 64 (a plan's
    /// microbatches). `None` when some module fits in no layout.
    pub fn work_bound(
        &self,
        gpus: usize,
        batches: &[Vec<RowShape>],
        chunks: usize,
    ) -> Option<(f64, f64)> {
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
        };
        let g = gpus.max(1) as f64;
        // Partial sums over the modules so far: (work, longest span), kept to its front.
        let mut best = vec![Way {
            work: 0.0,
            span: 0.0,
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
                            span: a.span.max(x.span),
                        })
                    })
                    .collect(),
            );
        }
        best.iter()
            .map(|w| ((w.work / g).max(w.span), w.work / g))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    }

    /// `sim` (the simulated step of `plan`, the mean over `batches`) split into the
    /// bound and its parts.
    pub fn gap(&self, plan: &Plan, batches: &[Vec<RowShape>], sim: &StepSim) -> Gap {
        let g = plan.gpus().max(1) as f64;
        let (bound_s, work_s) = self
            .work_bound(plan.gpus(), batches, plan.microbatches)
            .unwrap_or((0.0, 0.0));
        // Idle time the bound already holds (a module's critical path above the work
        // spread over the GPUs) is not counted again below.
        let held = (bound_s - work_s).max(0.0);
        let idle = ((g * sim.step_s - sim.busy_gpu_s).max(0.0) / g - held).max(0.0);
        let imbalance_s = (sim.imbalance_gpu_s / g).min(idle);
        let exposed_bridge = match plan.schedule {
            Schedule::Phased => sim.bridge_s,
            Schedule::Overlapped => sim.bridge_s / plan.microbatches.max(1) as f64,
        };
        let bridge_s = exposed_bridge.min(idle - imbalance_s);
        let grad_sync_s = sim.sync_gpu_s / g;
        // The plan's busy work beyond the bound's, taken as what is left so that the
        // parts add up to the step (lanes of colocated modules that overlap on shared
        // GPUs would otherwise count twice).
        Gap {
            bound_s,
            memory_forced_s: sim.step_s - bound_s - grad_sync_s - idle,
            grad_sync_s,
            imbalance_s,
            bridge_s,
            bubbles_s: idle - imbalance_s - bridge_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_s_gpu_counts_are_all_tried() {
        let c = module_counts(64, 8);
        // Divisors, encoder counts (powers of two, 24 = 3 nodes) and what they leave.
        for g in [1, 2, 16, 24, 32, 64, 40, 48, 56, 63, 62] {
            assert!(c.contains(&g), "{g} missing from {c:?}");
        }
        assert!(c.windows(2).all(|w| w[0] < w[1]), "{c:?}");
        assert!(c.iter().all(|&g| (1..=64).contains(&g)), "{c:?}");
    }

    #[test]
    fn the_front_keeps_only_unbeaten_ways() {
        let w = |work, span| Way { work, span };
        let f = front(vec![
            w(3.0, 1.0),
            w(1.0, 3.0),
            w(2.0, 3.0),
            w(2.0, 2.0),
            w(4.0, 1.0),
        ]);
        assert_eq!(f, vec![w(1.0, 3.0), w(2.0, 2.0), w(3.0, 1.0)]);
    }
}
