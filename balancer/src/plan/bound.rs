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

use crate::dims::Module;
use crate::plan::baseline::first_stage_options;
use crate::plan::cost::StageCost;
use crate::plan::layout::{Layout, Plan, Schedule};
use crate::plan::options::{Knobs, Totals, llm_chunk_counts, slot};
use crate::plan::search::encoder_counts;
use crate::plan::span::{Ladder, Rates};
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
/// longest stage's gradient sync (`sync`, which the gap counts apart). Summed over the
/// modules, `parts` says which layout each module took.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Way {
    work: f64,
    path: f64,
    sync: f64,
    parts: [Option<BoundPart>; 3],
}

/// The layout one module takes in the bound: the least wasteful that fits in a GPU's
/// memory alone on its GPUs, as the bound's `min over layouts` chose it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BoundPart {
    pub module: Module,
    pub layout: Layout,
    pub recompute: bool,
    /// The LLM's shorter first stage, if the bound's layout has one.
    pub first_stage_layers: Option<usize>,
    /// The LLM's model chunks per stage (1: plain 1F1B).
    pub virtual_stages: usize,
    /// Its busy GPU-seconds (passes, their collectives and pipeline sends).
    pub work_gpu_s: f64,
    /// Its critical path's lower bound (s).
    pub path_s: f64,
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
    /// Each module's layout in the bound (LLM, vision, audio; `None` for a module the
    /// model lacks).
    pub parts: [Option<BoundPart>; 3],
}

impl Bound {
    /// The modules' layouts in the bound, LLM first.
    pub fn layouts(&self) -> impl Iterator<Item = &BoundPart> {
        self.parts.iter().flatten()
    }
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
        // A span holds for any chunking: one per layout, recomputation, first stage and
        // model chunks a stage.
        let mut paths: HashMap<(Layout, bool, Option<usize>, usize), Vec<Ladder>> = HashMap::new();
        let mut ways = Vec::new();
        for &g in &inp.counts {
            for &c in chunks {
                for o in self.options(m, g, (c, 0), None, k) {
                    let Some(sc) = self.cost(m, o.layout, o.recompute, k.zero1) else {
                        continue;
                    };
                    // The LLM's first stage may be shorter (as the LLM-centric baseline
                    // runs it): less to sync and hold there.
                    let firsts = match m {
                        Module::Llm => first_stage_options(self.model.llm.layers, o.layout.pp),
                        _ => vec![None],
                    };
                    // An even split may run interleaved (with the chunk counts the search
                    // may take): more chunks shorten the fill and drain and lengthen the
                    // chain of sends round the ring.
                    let split: Vec<(Option<usize>, usize)> = firsts
                        .into_iter()
                        .flat_map(|first| {
                            let counts = match (m, first) {
                                (Module::Llm, None) => llm_chunk_counts(
                                    self.model.llm.layers,
                                    o.layout.pp,
                                    o.microbatches,
                                ),
                                _ => vec![1],
                            };
                            counts.into_iter().map(move |v| (first, v))
                        })
                        .collect();
                    for (first, v) in split {
                        let sc = StageCost {
                            first_stage_layers: first,
                            chunks: v,
                            ..sc
                        };
                        let mem = match first {
                            None => o.mem,
                            Some(_) => self.llm_memory(&sc, o.microbatches, k.totals),
                        };
                        if mem <= budget {
                            let ladders = paths
                                .entry((o.layout, o.recompute, first, v))
                                .or_insert_with(|| {
                                    inp.each
                                        .iter()
                                        .map(|t| self.path(&sc, t, m, &rates))
                                        .collect()
                                });
                            let each = (inp.each.as_slice(), ladders.as_slice());
                            let mut way = self.way(&sc, o.microbatches, k.totals, m, each, &rates);
                            way.parts[slot(m)] = Some(BoundPart {
                                module: m,
                                layout: o.layout,
                                recompute: o.recompute,
                                first_stage_layers: first,
                                virtual_stages: v,
                                work_gpu_s: way.work,
                                path_s: way.path,
                            });
                            ways.push(way);
                        }
                    }
                }
            }
        }
        front(ways)
    }

    /// The LLM's memory per GPU as `sc` runs it with `mbs` microbatches a replica, as
    /// [`Problem::options`] estimates it for an even split.
    fn llm_memory(&self, sc: &StageCost, mbs: usize, totals: &Totals) -> f64 {
        let dp = sc.layout.dp;
        let (load, peak) = totals.dealt(Module::Llm, dp * mbs, dp, dp * mbs);
        self.estimate(sc, mbs, load, peak, &[], 0, None).mem
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
        // A send at every stage (or, interleaved, chunk) boundary, each way.
        let sends = sc.boundaries() * if sc.frozen { 1.0 } else { 2.0 };
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
            parts: [None; 3],
        }
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
                llm_rows: None,
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
            parts: [None; 3],
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
                        ways.iter().map(move |x| {
                            let mut parts = a.parts;
                            parts[slot(m)] = x.parts[slot(m)];
                            Way {
                                work: a.work + x.work,
                                path: a.path.max(x.path),
                                sync: a.sync.max(x.sync),
                                parts,
                            }
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
                parts: w.parts,
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
        let mut memory_forced_s = sim.step_s - bound_s - grad_sync_s - idle;
        let mut rest = [
            idle - imbalance_s - bridge_s,
            bridge_s,
            imbalance_s,
            grad_sync_s,
        ];
        // Below zero where the bound's layouts (the least step, not the least work: a
        // path-bound one) do more work than the plan's: then the time the bound holds
        // beyond its work (its path, its sync) covers some of the plan's waiting and
        // syncing twice, and that much less of it is the plan's own (bubbles first).
        for w in &mut rest {
            let take = (-memory_forced_s).max(0.0).min(w.max(0.0));
            *w -= take;
            memory_forced_s += take;
        }
        let [bubbles_s, bridge_s, imbalance_s, grad_sync_s] = rest;
        Gap {
            bound_s,
            bound: b,
            memory_forced_s,
            grad_sync_s,
            imbalance_s,
            bridge_s,
            bubbles_s,
        }
    }
}

#[cfg(test)]
#[path = "bound_tests.rs"]
pub(crate) mod tests;
