//! The search: per module, every layout that fits (divisibility, TP inside a node, rows
//! per replica) is costed analytically on the batch's mean loads; dominated options
//! (slower and larger) are dropped; combinations (a GPU split for disjoint placement, or
//! one grid per module over all GPUs for colocated) are ranked by the estimate; the
//! best `top_k` are simulated on sampled batches and the fastest that fits in memory
//! wins. The LLM-centric baseline is searched the same way over the LLM's layouts, and
//! brute force (every combination simulated) runs where the space is small enough.

use std::collections::HashMap;
use std::time::Instant;

use crate::dims::Module;
use crate::plan::cost::StageCost;
use crate::plan::layout::{Layout, Placement, Plan, Schedule};
use crate::plan::step::{Problem, StepSim};
use crate::workload::{RowShape, Workload, shape_of};

/// What the search may choose from.
#[derive(Clone, Debug)]
pub struct Space {
    pub gpus: usize,
    pub schedule: Schedule,
    pub placements: Vec<Placement>,
    pub recompute: Vec<bool>,
    pub zero1: bool,
    /// Candidates simulated after the analytic ranking.
    pub top_k: usize,
    /// Batches each simulated candidate is averaged over.
    pub batches: usize,
    /// Brute force runs when the space has at most this many combinations.
    pub brute_limit: usize,
}

impl Space {
    pub fn new(gpus: usize) -> Space {
        Space {
            gpus,
            schedule: Schedule::Phased,
            placements: vec![Placement::Colocated, Placement::Disjoint],
            recompute: vec![false, true],
            zero1: true,
            top_k: 12,
            batches: 3,
            brute_limit: 4000,
        }
    }
}

/// A plan and its mean simulated step.
#[derive(Clone, Debug)]
pub struct Found {
    pub plan: Plan,
    pub sim: StepSim,
}

/// What the search returns.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub best: Found,
    pub baseline: Found,
    /// The best of every combination, when the space was small enough.
    pub brute: Option<Found>,
    /// Combinations in the space, and how many were simulated.
    pub combinations: usize,
    pub simulated: usize,
    pub search_s: f64,
}

/// One module's option: a layout with its microbatches (LLM) and estimates.
#[derive(Clone, Copy, Debug)]
struct Opt {
    layout: Layout,
    microbatches: usize,
    recompute: bool,
    time: f64,
    mem: f64,
}

/// Mean per-batch (tokens, sum of squared lengths) of each module, and LLM rows.
struct Totals {
    llm: (f64, f64),
    vision: (f64, f64),
    audio: (f64, f64),
}

fn totals(p: &Problem, batches: &[Vec<RowShape>]) -> Totals {
    let n = batches.len().max(1) as f64;
    let (mut l, mut v, mut a) = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0));
    for rows in batches {
        let b = shape_of(rows);
        l.0 += b.row_tokens.iter().sum::<usize>() as f64 / n;
        l.1 += b.row_sq.iter().sum::<u64>() as f64 / n;
        for &t in &b.image_tokens {
            v.0 += t as f64 / n;
            v.1 += (t * t) as f64 / n;
        }
        for &f in &b.clip_frames {
            let t = f.div_ceil(2) as f64;
            a.0 += t / n;
            a.1 += t * t / n;
        }
    }
    let _ = p;
    Totals {
        llm: l,
        vision: v,
        audio: a,
    }
}

/// Powers of two up to `max` that divide `n`.
fn pow2_divisors(n: usize, max: usize) -> Vec<usize> {
    (0..16)
        .map(|k| 1usize << k)
        .take_while(|&d| d <= max)
        .filter(|d| n.is_multiple_of(*d))
        .collect()
}

/// Every layout of module `m` on `g` GPUs.
fn layouts(p: &Problem, m: Module, g: usize, rows: usize) -> Vec<Layout> {
    let Some(d) = p.model.module(m) else {
        return Vec::new();
    };
    let node = p.cluster.gpus_per_node;
    let mut out = Vec::new();
    for tp in pow2_divisors(node, node) {
        let cps: &[usize] = if m == Module::Llm {
            &[1, 2, 4, 8]
        } else {
            &[1, 2]
        };
        for &cp in cps {
            for pp in (1..=d.layers.min(32)).filter(|&pp| d.layers % pp == 0) {
                let block = tp * cp * pp;
                if !g.is_multiple_of(block) || d.fits(tp, pp).is_err() {
                    continue;
                }
                let dp = g / block;
                if m == Module::Llm && dp > rows {
                    continue;
                }
                out.push(Layout { tp, cp, pp, dp });
            }
        }
    }
    out
}

impl Problem {
    fn cost(
        &self,
        m: Module,
        layout: Layout,
        recompute: bool,
        zero1: bool,
    ) -> Option<StageCost<'_>> {
        Some(StageCost {
            dims: self.model.module(m)?,
            layout,
            cluster: &self.cluster,
            recompute,
            zero1,
            frozen: self.frozen.contains(&m),
        })
    }

    /// Analytic step estimate of a pipeline of `l.pp` stages running `mbs` microbatches
    /// of `(tokens, sq)` each, plus its gradient sync; and its fullest stage's memory.
    /// `extra` adds work (an LLM-centric encoder) to stage 0.
    fn estimate(
        &self,
        sc: &StageCost,
        mbs: usize,
        load: (f64, f64),
        extra: Option<(&StageCost, (f64, f64))>,
        hold_all: bool,
    ) -> (f64, f64) {
        let l = sc.layout;
        let (mut sum, mut worst, mut sync, mut mem) = (0.0, 0.0f64, 0.0f64, 0.0f64);
        for s in 0..l.pp {
            let mut t = sc.forward(s, load.0, load.1).total()
                + sc.backward(s, load.0, load.1).total()
                + 2.0 * sc.send(load.0);
            let held = if hold_all { mbs } else { (l.pp - s).min(mbs) };
            let inflight = load.0 * held as f64;
            let mut bytes = sc.memory(s, inflight, load.0).total();
            if s == 0
                && let Some((ec, e)) = extra
            {
                t += ec.forward(0, e.0, e.1).total() + ec.backward(0, e.0, e.1).total();
                bytes += ec.memory(0, e.0 * l.pp.min(mbs) as f64, e.0).total();
            }
            sum += t;
            worst = worst.max(t);
            sync = sync.max(sc.dp_sync(s));
            mem = mem.max(bytes);
        }
        (sum + (mbs as f64 - 1.0) * worst + sync, mem)
    }

    /// Options for module `m` on `g` GPUs (LLM: with microbatch counts).
    fn options(
        &self,
        m: Module,
        g: usize,
        t: &Totals,
        space: &Space,
        rows: usize,
        chunks: usize,
    ) -> Vec<Opt> {
        let mut out = Vec::new();
        let total = match m {
            Module::Llm => t.llm,
            Module::Vision => t.vision,
            Module::Audio => t.audio,
        };
        for layout in layouts(self, m, g, rows) {
            let per_rep = rows / layout.dp;
            let mbs: Vec<usize> = if m == Module::Llm {
                let mut v: Vec<usize> = (0..12)
                    .map(|k| 1usize << k)
                    .filter(|&x| x <= per_rep)
                    .collect();
                v.push(per_rep);
                v.dedup();
                v
            } else {
                vec![chunks]
            };
            for &recompute in &space.recompute {
                let Some(sc) = self.cost(m, layout, recompute, space.zero1) else {
                    continue;
                };
                for &mb in &mbs {
                    let n = (layout.dp * mb) as f64;
                    let phased_encoder = m != Module::Llm && chunks == 1;
                    let load = (total.0 / n, total.1 / n);
                    let (time, mut mem) = self.estimate(&sc, mb, load, None, phased_encoder);
                    if phased_encoder {
                        // Every chunk's activations wait for the LLM; the working set is
                        // one chunk (~1/8 of the replica's items at typical microbatch counts).
                        mem = (0..layout.pp)
                            .map(|s| sc.memory(s, load.0, load.0 / 8.0).total())
                            .fold(0.0, f64::max);
                    }
                    out.push(Opt {
                        layout,
                        microbatches: mb,
                        recompute,
                        time,
                        mem,
                    });
                }
            }
        }
        out
    }
}

/// Keeps the options no other option beats in both time and memory.
fn pareto(mut v: Vec<Opt>) -> Vec<Opt> {
    v.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.mem.total_cmp(&b.mem)));
    let mut out: Vec<Opt> = Vec::new();
    for o in v {
        if out.iter().all(|k| k.mem > o.mem) {
            out.push(o);
        }
    }
    out
}

/// A combination: per module its option; the estimate; the plan.
struct Combo {
    est: f64,
    plan: Plan,
}

fn plan_of(
    placement: Placement,
    schedule: Schedule,
    zero1: bool,
    llm: &Opt,
    enc: &[(Module, Opt)],
) -> Plan {
    let get = |m: Module| enc.iter().find(|e| e.0 == m).map(|e| e.1.layout);
    Plan {
        placement,
        schedule,
        microbatches: llm.microbatches,
        recompute: llm.recompute,
        recompute_encoders: enc.iter().any(|e| e.1.recompute),
        zero1,
        llm: llm.layout,
        vision: get(Module::Vision),
        audio: get(Module::Audio),
    }
}

/// Turns a combination into its estimate and plan.
type MakePlan<'a> = dyn Fn(&Opt, &[(Module, Opt)]) -> (f64, Plan) + 'a;

/// Combinations of one option per module with the same recomputation, under the memory
/// budget (summed on colocated GPUs), ranked by `est`.
fn combine(
    llm: &[Opt],
    enc: &[(Module, Vec<Opt>)],
    budget: f64,
    colocated: bool,
    mk: &MakePlan,
    out: &mut Vec<Combo>,
) {
    let mut idx = vec![0usize; enc.len()];
    for l in llm {
        loop {
            let chosen: Vec<(Module, Opt)> =
                enc.iter().zip(&idx).map(|(e, &i)| (e.0, e.1[i])).collect();
            let same = chosen
                .windows(2)
                .all(|w| w[0].1.recompute == w[1].1.recompute);
            let mem = if colocated {
                l.mem + chosen.iter().map(|c| c.1.mem).sum::<f64>()
            } else {
                chosen.iter().map(|c| c.1.mem).fold(l.mem, f64::max)
            };
            if same && mem <= budget && enc.iter().all(|e| !e.1.is_empty()) {
                let (est, plan) = mk(l, &chosen);
                out.push(Combo { est, plan });
            }
            // Next index tuple (odometer).
            let mut k = 0;
            while k < idx.len() {
                idx[k] += 1;
                if idx[k] < enc[k].1.len() {
                    break;
                }
                idx[k] = 0;
                k += 1;
            }
            if k == idx.len() {
                break;
            }
        }
    }
}

/// Searches `space` for `problem` on `workload`.
pub fn search(problem: &Problem, workload: &Workload, space: &Space) -> Result<Outcome, String> {
    let t0 = Instant::now();
    let batches: Vec<Vec<RowShape>> = (0..space.batches.max(1))
        .map(|k| workload.batch(k))
        .collect();
    let t = totals(problem, &batches);
    let rows = workload.batch_rows;
    let g = space.gpus;
    let budget = problem.cluster.usable_bytes();
    let encoders: Vec<Module> = [Module::Vision, Module::Audio]
        .into_iter()
        .filter(|&m| problem.model.module(m).is_some())
        .collect();
    let overlapped = space.schedule == Schedule::Overlapped;
    let mut pruned: Vec<Combo> = Vec::new();
    let mut full: Vec<Combo> = Vec::new();
    let mut combinations = 0usize;
    let mut cache: HashMap<(Module, usize, usize), Vec<Opt>> = HashMap::new();
    let mut opts = |m: Module, gm: usize, chunks: usize| -> Vec<Opt> {
        cache
            .entry((m, gm, chunks))
            .or_insert_with(|| problem.options(m, gm, &t, space, rows, chunks))
            .clone()
    };
    for &placement in &space.placements {
        match placement {
            Placement::Colocated if !overlapped => {
                let llm = opts(Module::Llm, g, 1);
                let enc: Vec<(Module, Vec<Opt>)> =
                    encoders.iter().map(|&e| (e, opts(e, g, 1))).collect();
                let mk = |l: &Opt, c: &[(Module, Opt)]| {
                    let est = l.time + c.iter().map(|x| x.1.time).sum::<f64>();
                    (est, plan_of(placement, space.schedule, space.zero1, l, c))
                };
                combine(
                    &pareto(llm.clone()),
                    &enc.iter()
                        .map(|(m, v)| (*m, pareto(v.clone())))
                        .collect::<Vec<_>>(),
                    budget,
                    true,
                    &mk,
                    &mut pruned,
                );
                let n = llm.len() * enc.iter().map(|e| e.1.len()).product::<usize>();
                combinations += n;
                if n <= space.brute_limit {
                    combine(&llm, &enc, budget, true, &mk, &mut full);
                }
            }
            Placement::Disjoint => {
                // Encoder GPU counts: powers of two and multiples of a node.
                let node = problem.cluster.gpus_per_node;
                // Encoder GPU counts on a geometric grid: powers of two, and 3 x powers of
                // two from a node up (whole nodes), at most half the GPUs.
                let mut counts: Vec<usize> = (0..20)
                    .flat_map(|k| [1usize << k, 3 << k])
                    .filter(|&c| c <= g / 2 && (c.is_power_of_two() || c % node == 0))
                    .collect();
                counts.sort_unstable();
                let splits: Vec<Vec<usize>> = match encoders.len() {
                    0 => vec![vec![]],
                    1 => counts.iter().map(|&a| vec![a]).collect(),
                    _ => counts
                        .iter()
                        .flat_map(|&a| counts.iter().map(move |&b| vec![a, b]))
                        .filter(|s| s.iter().sum::<usize>() < g)
                        .collect(),
                };
                let mut ranked: Vec<(f64, Vec<usize>)> = Vec::new();
                for s in &splits {
                    let gl = g - s.iter().sum::<usize>();
                    let best = |v: &[Opt]| {
                        v.iter()
                            .filter(|o| o.mem <= budget)
                            .map(|o| o.time)
                            .fold(f64::INFINITY, f64::min)
                    };
                    let mut enc_t = 0.0f64;
                    for (k, &e) in encoders.iter().enumerate() {
                        enc_t = enc_t.max(best(&opts(e, s[k], if overlapped { 8 } else { 1 })));
                    }
                    let llm_t = best(&opts(Module::Llm, gl, 1));
                    let est = if overlapped {
                        enc_t.max(llm_t)
                    } else {
                        enc_t + llm_t
                    };
                    if est.is_finite() {
                        ranked.push((est, s.clone()));
                    }
                }
                ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
                for (rank, (_, s)) in ranked.iter().enumerate() {
                    let gl = g - s.iter().sum::<usize>();
                    let llm = opts(Module::Llm, gl, 1);
                    let front = pareto(llm.clone());
                    for l in &llm {
                        let chunks = if overlapped { l.microbatches } else { 1 };
                        let enc: Vec<(Module, Vec<Opt>)> = encoders
                            .iter()
                            .enumerate()
                            .map(|(k, &e)| (e, opts(e, s[k], chunks)))
                            .collect();
                        let mk = |l: &Opt, c: &[(Module, Opt)]| {
                            let e = c.iter().map(|x| x.1.time).fold(0.0, f64::max);
                            let est = if overlapped {
                                l.time.max(e)
                            } else {
                                l.time + e
                            };
                            (est, plan_of(placement, space.schedule, space.zero1, l, c))
                        };
                        let one = std::slice::from_ref(l);
                        if rank < 8
                            && front.iter().any(|f| {
                                f.layout == l.layout
                                    && f.microbatches == l.microbatches
                                    && f.recompute == l.recompute
                            })
                        {
                            let enc_front: Vec<(Module, Vec<Opt>)> =
                                enc.iter().map(|(m, v)| (*m, pareto(v.clone()))).collect();
                            combine(one, &enc_front, budget, false, &mk, &mut pruned);
                        }
                        combinations += enc.iter().map(|e| e.1.len()).product::<usize>();
                        if combinations <= space.brute_limit {
                            combine(one, &enc, budget, false, &mk, &mut full);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let mut simulated = 0;
    let best = pick(
        problem,
        &batches,
        &mut pruned,
        space.top_k,
        g,
        budget,
        &mut simulated,
    )?
    .ok_or_else(|| {
        format!(
            "no plan fits {g} GPUs in {:.0} GiB each",
            problem.cluster.memory_gib
        )
    })?;
    let baseline = baseline(problem, &batches, &t, space, &mut simulated)?;
    let brute = if combinations <= space.brute_limit && !full.is_empty() {
        let n = full.len();
        pick(problem, &batches, &mut full, n, g, budget, &mut simulated)?
    } else {
        None
    };
    Ok(Outcome {
        best,
        baseline,
        brute,
        combinations,
        simulated,
        search_s: t0.elapsed().as_secs_f64(),
    })
}

/// Simulates the `k` best-estimated combinations; the fastest that fits wins.
fn pick(
    p: &Problem,
    batches: &[Vec<RowShape>],
    combos: &mut [Combo],
    k: usize,
    gpus: usize,
    budget: f64,
    simulated: &mut usize,
) -> Result<Option<Found>, String> {
    combos.sort_by(|a, b| a.est.total_cmp(&b.est));
    let mut best: Option<Found> = None;
    for c in combos.iter().take(k) {
        c.plan
            .check(&p.model, &p.cluster, gpus, batches[0].len())
            .map_err(|e| format!("internal: a candidate fails its own checks: {e}"))?;
        let sim = mean_sim(p, &c.plan, batches)?;
        *simulated += 1;
        if std::env::var("BRAID_PLAN_DEBUG").is_ok() {
            eprintln!(
                "cand est {:.3} sim {:.3} mem {:.1} GiB {:?} {:?}",
                c.est,
                sim.step_s,
                sim.peak_memory / 1073741824.0,
                sim.memory
                    .iter()
                    .map(|m| (m.0, m.1 / 1073741824.0))
                    .collect::<Vec<_>>(),
                c.plan
            );
        }
        if sim.peak_memory > budget {
            continue;
        }
        if best.as_ref().is_none_or(|b| sim.step_s < b.sim.step_s) {
            best = Some(Found {
                plan: c.plan.clone(),
                sim,
            });
        }
    }
    Ok(best)
}

/// The mean over `batches` of the simulated step (peak memory: the largest).
pub fn mean_sim(p: &Problem, plan: &Plan, batches: &[Vec<RowShape>]) -> Result<StepSim, String> {
    let mut acc: Option<StepSim> = None;
    for rows in batches {
        let s = p.simulate(plan, rows)?;
        acc = Some(match acc {
            None => s,
            Some(mut a) => {
                a.step_s += s.step_s;
                a.bubble += s.bubble;
                a.bridge_s += s.bridge_s;
                a.dp_sync_s += s.dp_sync_s;
                a.peak_memory = a.peak_memory.max(s.peak_memory);
                for (x, y) in a.busy.iter_mut().zip(&s.busy) {
                    x.1 += y.1;
                }
                for (x, y) in a.memory.iter_mut().zip(&s.memory) {
                    x.1 = x.1.max(y.1);
                }
                a
            }
        });
    }
    let mut a = acc.ok_or("no batches")?;
    let n = batches.len() as f64;
    a.step_s /= n;
    a.bubble /= n;
    a.bridge_s /= n;
    a.dp_sync_s /= n;
    for x in a.busy.iter_mut() {
        x.1 /= n;
    }
    Ok(a)
}

/// The best LLM-centric plan: the LLM's layouts, each encoder inside stage 0 with the
/// LLM's TP and DP.
fn baseline(
    p: &Problem,
    batches: &[Vec<RowShape>],
    t: &Totals,
    space: &Space,
    simulated: &mut usize,
) -> Result<Found, String> {
    let rows = batches[0].len();
    let g = space.gpus;
    let budget = p.cluster.usable_bytes();
    let mut combos = Vec::new();
    for o in p.options(Module::Llm, g, t, space, rows, 1) {
        let Some(sc) = p.cost(Module::Llm, o.layout, o.recompute, space.zero1) else {
            continue;
        };
        let n = (o.layout.dp * o.microbatches) as f64;
        let mut est = 0.0f64;
        let mut mem = 0.0f64;
        for (m, tot) in [(Module::Vision, t.vision), (Module::Audio, t.audio)] {
            let el = Layout {
                tp: o.layout.tp,
                cp: 1,
                pp: 1,
                dp: o.layout.dp,
            };
            if let Some(ec) = p.cost(m, el, o.recompute, space.zero1) {
                if p.model.module(m).is_some_and(|d| d.fits(el.tp, 1).is_err()) {
                    est = f64::INFINITY;
                }
                let (e, b) = p.estimate(
                    &sc,
                    o.microbatches,
                    (t.llm.0 / n, t.llm.1 / n),
                    Some((&ec, (tot.0 / n, tot.1 / n))),
                    false,
                );
                est = est.max(e);
                mem = mem.max(b);
            }
        }
        if est == 0.0 {
            est = o.time;
            mem = o.mem;
        }
        if est.is_finite() && mem <= budget {
            combos.push(Combo {
                est,
                plan: Plan {
                    placement: Placement::LlmCentric,
                    schedule: Schedule::Phased,
                    microbatches: o.microbatches,
                    recompute: o.recompute,
                    recompute_encoders: o.recompute,
                    zero1: space.zero1,
                    llm: o.layout,
                    vision: p.model.vision.as_ref().map(|_| Layout {
                        tp: o.layout.tp,
                        cp: 1,
                        pp: 1,
                        dp: o.layout.dp,
                    }),
                    audio: p.model.audio.as_ref().map(|_| Layout {
                        tp: o.layout.tp,
                        cp: 1,
                        pp: 1,
                        dp: o.layout.dp,
                    }),
                },
            });
        }
    }
    combos.sort_by(|a, b| a.est.total_cmp(&b.est));
    let mut best: Option<Found> = None;
    for c in combos.iter().take(space.top_k) {
        let sim = mean_sim(p, &c.plan, batches)?;
        *simulated += 1;
        if sim.peak_memory <= budget && best.as_ref().is_none_or(|b| sim.step_s < b.sim.step_s) {
            best = Some(Found {
                plan: c.plan.clone(),
                sim,
            });
        }
    }
    best.ok_or_else(|| format!("no LLM-centric layout fits {g} GPUs"))
}
