//! The work-conserving bound of a step and how far a plan is from it.
//!
//! The bound is the step with no bubble, no waiting, no bridge and no gradient sync:
//! every module's busy GPU-seconds at a layout of its own that fits in a GPU's memory
//! (alone on its GPUs), summed over the modules and divided by all the GPUs. Two things
//! keep it honest where a plain sum would promise a step no plan can run:
//!
//! - each module's layout is the one that makes the bound least, among every layout on
//!   every GPU count dividing the cluster (so its work is what the least wasteful layout
//!   that fits costs, TP/CP/PP communication and recomputation included);
//! - no module finishes before its own critical path at that layout: its fullest
//!   replica's whole rows (images, clips), chunk by chunk through its pipeline stages in
//!   1F1B. A batch of 1,024 rows cannot keep 4,096 GPUs busy without splitting rows, a
//!   split row pays its TP/CP communication, and a row cut into pipeline stages runs
//!   them one after another unless there are other rows to fill them.
//!
//! So the bound is `min over layouts of max(sum of work / GPUs, each module's critical
//! path)`, at most every plan's step (a test checks it against brute force). A module's
//! own pipeline fill and drain can thus be part of the bound (where the critical path
//! sets it); the bubbles below are the rest. A plan's
//! step splits into the bound and five parts (seconds of the step, i.e. GPU-seconds over
//! the GPUs):
//!
//! - **memory-forced choices**: the plan's own busy work beyond the bound's (layouts the
//!   plan takes because its modules share memory or GPUs: more TP, CP and PP
//!   communication, recomputation, smaller matmuls), taken as the rest of the step once
//!   the other parts are counted;
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
/// (its critical path: the fullest replica's whole items through its pipeline).
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

impl Problem {
    /// Every way to run module `m` alone on a GPU count dividing `gpus` that fits in a
    /// GPU's memory, on the batch loads of `k` (the Pareto front of work and span).
    fn ways(&self, m: Module, gpus: usize, k: &Knobs) -> Vec<Way> {
        let budget = self.cluster.usable_bytes();
        let total = k.totals.module(m);
        // An encoder's chunks (its 1F1B microbatches); the LLM's own option list tries
        // every microbatch count.
        let chunks: &[usize] = match m {
            Module::Llm => &[1],
            _ => &[1, 2, 4, 8, 16, 32, 64],
        };
        let mut ways = Vec::new();
        for g in (1..=gpus).filter(|g| gpus.is_multiple_of(*g)) {
            for &c in chunks {
                for o in self.options(m, g, c, 0, k) {
                    if o.mem > budget {
                        continue;
                    }
                    let Some(sc) = self.cost(m, o.layout, o.recompute, k.zero1) else {
                        continue;
                    };
                    let l = o.layout;
                    let n = (l.dp * o.microbatches) as f64;
                    let (t, s) = (total.0 / n, total.1 / n);
                    let per_chunk: f64 = (0..l.pp)
                        .map(|st| {
                            sc.forward(st, t, s).total()
                                + sc.backward(st, t, s).total()
                                + 2.0 * sc.send(t)
                        })
                        .sum();
                    // The span is the option's pipeline time: its fullest replica's
                    // whole rows (items), chunk by chunk through its stages in 1F1B.
                    ways.push(Way {
                        work: n * per_chunk * l.block() as f64,
                        span: o.time,
                    });
                }
            }
        }
        front(ways)
    }

    /// The work-conserving bound of a step on `gpus` GPUs over `batches` (seconds), or
    /// `None` when some module fits in no layout.
    pub fn work_bound(&self, gpus: usize, batches: &[Vec<RowShape>]) -> Option<f64> {
        let totals = Totals::of(batches);
        let k = Knobs {
            totals: &totals,
            recompute: &[false, true],
            zero1: true,
            rows: batches.first().map_or(1, |b| b.len()).max(1),
            overlapped: true,
        };
        let g = gpus.max(1) as f64;
        let mut best: Vec<(f64, f64)> = vec![(0.0, 0.0)]; // (work, longest span)
        for m in [Module::Llm, Module::Vision, Module::Audio] {
            if self.model.module(m).is_none() {
                continue;
            }
            let ways = self.ways(m, gpus, &k);
            if ways.is_empty() {
                return None;
            }
            let next: Vec<(f64, f64)> = best
                .iter()
                .flat_map(|&(w, s)| ways.iter().map(move |x| (w + x.work, s.max(x.span))))
                .collect();
            best = next;
        }
        best.iter()
            .map(|&(w, s)| (w / g).max(s))
            .min_by(|a, b| a.total_cmp(b))
    }

    /// `sim` (the simulated step of `plan`, the mean over `batches`) split into the
    /// bound and its parts.
    pub fn gap(&self, plan: &Plan, batches: &[Vec<RowShape>], sim: &StepSim) -> Gap {
        let g = plan.gpus().max(1) as f64;
        let bound_s = self.work_bound(plan.gpus(), batches).unwrap_or(0.0);
        let idle = (g * sim.step_s - sim.busy_gpu_s).max(0.0) / g;
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
