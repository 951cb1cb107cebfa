//! The search: per module, every layout that fits (divisibility, TP inside a node, rows
//! per replica) is costed analytically on the batch's mean loads; dominated options
//! (slower and larger) are dropped; combinations (a GPU split for disjoint placement, or
//! one grid per module over all GPUs for colocated) are ranked by the estimate; the
//! best are simulated on sampled batches, `top_k` at a time (`pick.rs`), and the
//! fastest that fits in memory wins. The LLM-centric baseline is searched the same way
//! over the LLM's layouts, and brute force (every combination simulated) runs where the
//! space is small enough.

use std::collections::HashMap;
use std::time::Instant;

use crate::cluster::GIB;
use crate::dims::Module;
use crate::plan::baseline::baseline as llm_baseline;
use crate::plan::layout::{Placement, Plan, Schedule};
use crate::plan::options::{Knobs, Opt, Totals, pareto};
use crate::plan::pick::{Combo, considered, keep_best, pick};
use crate::plan::step::{Problem, StepSim};
use crate::plan::windows::{ChunkMedia, LlmRows};
use crate::workload::Workload;

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
    /// Where brute force cannot run: also simulate this many of the best-estimated
    /// combinations (0: none), to check the pick at full scale.
    pub check: usize,
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
            check: 0,
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
    /// The plan to run: the fastest of the search's pick, brute force's and the check's.
    pub best: Found,
    /// The search's own pick (what brute force and the check measure the search by).
    pub searched: Found,
    pub baseline: Found,
    /// The best of every combination, when the space was small enough.
    pub brute: Option<Found>,
    /// With [`Space::check`]: how many of the best-estimated combinations were simulated,
    /// and the fastest of them that fits.
    pub checked: Option<(usize, Found)>,
    /// Combinations in the space, and how many were simulated.
    pub combinations: usize,
    pub simulated: usize,
    pub search_s: f64,
}

fn plan_of(
    placement: Placement,
    schedule: Schedule,
    zero1: bool,
    llm: &Opt,
    enc: &[(Module, Opt)],
) -> Plan {
    let get = |m: Module| enc.iter().find(|e| e.0 == m).map(|e| e.1.layout);
    let recomputes = |m: Module| enc.iter().find(|e| e.0 == m).map(|e| e.1.recompute);
    // The vision encoder's choice (the audio one's where there is no vision encoder),
    // and the audio one's where it differs.
    let encoders = recomputes(Module::Vision).or(recomputes(Module::Audio));
    let audio = recomputes(Module::Audio).filter(|&a| Some(a) != encoders);
    Plan {
        placement,
        schedule,
        microbatches: llm.microbatches,
        recompute: llm.recompute,
        recompute_encoders: encoders.unwrap_or(false),
        recompute_audio: audio,
        llm_first_stage_layers: None,
        llm_virtual_stages: llm.chunks,
        reverse_encoder_stages: false,
        llm_zero_bubble: false,
        zero1,
        llm: llm.layout,
        vision: get(Module::Vision),
        audio: get(Module::Audio),
    }
}

/// Turns a combination into its estimate and plan.
type MakePlan<'a> = dyn Fn(&Opt, &[(Module, Opt)]) -> (f64, Plan) + 'a;

/// Combinations of one option per module (each encoder with its own recomputation, as
/// `parallel.<module>.recompute` runs it), under the memory budget (summed on colocated
/// GPUs), ranked by `est`.
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
            let mem = if colocated {
                l.mem + chosen.iter().map(|c| c.1.mem).sum::<f64>()
            } else {
                chosen.iter().map(|c| c.1.mem).fold(l.mem, f64::max)
            };
            if mem <= budget && enc.iter().all(|e| !e.1.is_empty()) {
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

/// The step estimate of a combination: the modules' pipelines in the schedule's order;
/// the LLM's gradient sync overlaps the encoders' backward (two thirds of their time).
/// Colocated, under either schedule, the modules take turns on every GPU.
///
/// Overlapped on disjoint GPUs, the encoders' stages feed the LLM's as one 1F1B pipeline, and the step
/// is bound by whichever side is slower: the LLM's pipeline between the encoders' first
/// chunk (their forward) and their last (their backward, behind which the LLM's sync
/// runs), or the slowest encoder's pipeline plus its stall waiting for the LLM's first
/// gradient, less the forwards its 1F1B warm-up runs meanwhile (a forward is taken as a
/// third of a forward and backward).
fn combo_estimate(placement: Placement, schedule: Schedule, l: &Opt, enc: &[(Module, Opt)]) -> f64 {
    let enc_sum: f64 = enc.iter().map(|e| e.1.time).sum();
    let enc_max = enc.iter().map(|e| e.1.time).fold(0.0, f64::max);
    let enc_sync = enc.iter().map(|e| e.1.sync).fold(0.0, f64::max);
    let tail = |enc_t: f64| (l.sync - 2.0 / 3.0 * enc_t).max(enc_sync).max(0.0);
    match (placement, schedule) {
        // Colocated, every module takes turns on every GPU, as in the phased step (the
        // turns the encoders take in the LLM's fill and drain are the simulation's to
        // find).
        (Placement::Colocated, _) => l.time + enc_sum + tail(enc_sum),
        (_, Schedule::Overlapped) => {
            // One microbatch through every stage of a module (its pipeline fill).
            let first = |o: &Opt| o.time - o.microbatches.saturating_sub(1) as f64 * o.worst;
            let enc_first = enc.iter().map(|e| first(&e.1)).fold(0.0, f64::max);
            let llm_bound = enc_first + l.time + tail(enc_first);
            let enc_bound = enc
                .iter()
                .map(|(_, e)| {
                    let warmup = (e.layout.pp + l.lead).min(e.microbatches.max(1)) - 1;
                    let stall = (first(l) - warmup as f64 * e.worst / 3.0).max(0.0);
                    e.time + stall + e.sync
                })
                .fold(0.0, f64::max);
            llm_bound.max(enc_bound)
        }
        _ => l.time + enc_max + tail(enc_max),
    }
}

/// The distinct microbatch counts among `opts`, ascending.
fn microbatch_counts(opts: &[Opt]) -> Vec<usize> {
    let mut counts: Vec<usize> = opts.iter().map(|o| o.microbatches).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// The option with the least pipeline time plus sync among those that fit `budget`.
fn fastest<'a>(opts: impl IntoIterator<Item = &'a Opt>, budget: f64) -> Option<Opt> {
    opts.into_iter()
        .filter(|o| o.mem <= budget)
        .min_by(|a, b| (a.time + a.sync).total_cmp(&(b.time + b.sync)))
        .copied()
}

/// `bytes` in GiB with `decimals`, or in MiB below a GiB (a small cluster file's memory
/// would read "0 GiB").
fn size(bytes: f64, decimals: usize) -> String {
    if bytes >= GIB {
        format!("{:.*} GiB", decimals, bytes / GIB)
    } else {
        format!("{:.1} MiB", bytes / (GIB / 1024.0))
    }
}

/// Searches `space` for `problem` on `workload`.
pub fn search(problem: &Problem, workload: &Workload, space: &Space) -> Result<Outcome, String> {
    search_beside(problem, workload, space, None)
}

/// [`search`], with the LLM-centric `baseline` already found for the same GPUs and
/// batches (another schedule's search: the baseline does not depend on the schedule).
pub fn search_beside(
    problem: &Problem,
    workload: &Workload,
    space: &Space,
    baseline: Option<&Found>,
) -> Result<Outcome, String> {
    let t0 = Instant::now();
    let batches = workload.batches(space.batches);
    let t = Totals::of(&batches);
    let rows = workload.batch_rows;
    let g = space.gpus;
    let budget = problem.cluster.usable_bytes();
    let encoders: Vec<Module> = [Module::Vision, Module::Audio]
        .into_iter()
        .filter(|&m| problem.model.module(m).is_some())
        .collect();
    // Disjoint placement alone needs a GPU per module at least: say so, not that no
    // layout fits in memory.
    let modules = 1 + encoders.len();
    if g < modules && space.placements.iter().all(|&p| p == Placement::Disjoint) {
        return Err(format!(
            "disjoint placement gives each of the {modules} modules GPUs of its own: {g} GPU{} cannot hold them (colocated placement shares them)",
            if g == 1 { "" } else { "s" }
        ));
    }
    let overlapped = space.schedule == Schedule::Overlapped;
    // Overlapped, colocated and disjoint estimates do not rank against each other (the
    // colocated one leaves what the encoders fill of the LLM's waits to the
    // simulation), nor do plain and interleaved LLM stages (the estimate takes
    // interleaving's shorter fill and drain, not the encoder lead it costs): each
    // group's best-estimated candidates are simulated on their own. Phased: one group.
    // Each of those in two: the encoders recomputing alike, or each its own way (as
    // many again, near-equal estimates, that would crowd the first out of the rounds).
    let group_of = |c: &Combo| {
        let schedule = match overlapped {
            true => {
                2 * usize::from(c.plan.placement == Placement::Colocated)
                    + usize::from(c.plan.llm_virtual_stages > 1)
            }
            false => 0,
        };
        2 * schedule + usize::from(c.plan.own_audio_recompute().is_some())
    };
    let mut groups: Vec<Vec<Combo>> = (0..8).map(|_| Vec::new()).collect();
    // A group keeps only the best-estimated combinations `pick` and `--check` look at
    // (the 70B at 1,024 GPUs enumerates 1.5 million).
    let keep = considered(space.top_k).max(space.check);
    let mut enumerated = 0usize;
    let mut found: Vec<Combo> = Vec::new();
    let mut file = |found: &mut Vec<Combo>, groups: &mut [Vec<Combo>]| {
        enumerated += found.len();
        for c in found.drain(..) {
            groups[group_of(&c)].push(c);
        }
        for group in groups.iter_mut() {
            keep_best(group, keep);
        }
    };
    let mut full: Vec<Combo> = Vec::new();
    let mut combinations = 0usize;
    let llm_rows = LlmRows::new(problem, &batches);
    let knobs = Knobs {
        totals: &t,
        recompute: &space.recompute,
        zero1: space.zero1,
        rows,
        overlapped,
        llm_rows: Some(&llm_rows),
    };
    // An overlapped encoder's options depend on how far it runs ahead of the LLM
    // (its activations held); a phased one's do not (every chunk held).
    let lead_of = |l: &Opt| if overlapped { l.lead } else { 0 };
    // An overlapped encoder's options also depend on the LLM's replicas, which set how
    // full its chunks run (`Problem::chunk_media`).
    let mut media: HashMap<(usize, usize), [ChunkMedia; 2]> = HashMap::new();
    let mut cache: HashMap<(Module, usize, usize, usize, usize), Vec<Opt>> = HashMap::new();
    let mut opts = |m: Module, gm: usize, chunks: usize, lead: usize, llm_dp: usize| {
        let llm_dp = if overlapped && m != Module::Llm {
            llm_dp
        } else {
            0
        };
        if let Some(o) = cache.get(&(m, gm, chunks, lead, llm_dp)) {
            return o.clone();
        }
        let fed = (llm_dp > 0).then(|| {
            let both = media
                .entry((llm_dp, chunks))
                .or_insert_with(|| problem.chunk_media(&batches, llm_dp, chunks));
            &both[usize::from(m == Module::Audio)]
        });
        let o = problem.options(m, gm, (chunks, lead), fed, &knobs);
        cache.insert((m, gm, chunks, lead, llm_dp), o.clone());
        o
    };
    let same = |a: &Opt, b: &Opt| {
        a.layout == b.layout
            && a.microbatches == b.microbatches
            && a.recompute == b.recompute
            && a.chunks == b.chunks
    };
    for &placement in &space.placements {
        // Per placement: (GPUs of each encoder, GPUs of the LLM) splits to consider, and
        // which of them the pruned search takes.
        let splits: Vec<(Vec<usize>, usize, bool)> = match placement {
            Placement::Colocated => vec![(vec![g; encoders.len()], g, true)],
            Placement::Disjoint => {
                // Encoder GPU counts on a geometric grid: powers of two, and 3 x powers
                // of two in whole nodes, at most half the GPUs; splits ranked by the best
                // estimate of each module on its share, the best 8 searched.
                let counts = encoder_counts(g, problem.cluster.gpus_per_node);
                let all: Vec<Vec<usize>> = match encoders.len() {
                    0 => vec![vec![]],
                    1 => counts.iter().map(|&a| vec![a]).collect(),
                    _ => counts
                        .iter()
                        .flat_map(|&a| counts.iter().map(move |&b| vec![a, b]))
                        .filter(|s| s.iter().sum::<usize>() < g)
                        .collect(),
                };
                // Each split's estimate: per LLM microbatch count (it sets the encoders'
                // chunks and so their memory), the fastest option of each module that fits.
                let mut ranked: Vec<(f64, Vec<usize>)> = Vec::new();
                for s in all {
                    let gl = g - s.iter().sum::<usize>();
                    let llm = opts(Module::Llm, gl, 1, 0, 0);
                    let mut est = f64::INFINITY;
                    // Ranked by plain 1F1B LLM options: an interleaved one's longer
                    // encoder lead could leave no encoder option that fits where one
                    // chunk would, and drop the count.
                    for m in microbatch_counts(&llm) {
                        let with_m = llm.iter().filter(|o| o.microbatches == m && o.chunks == 1);
                        let Some(l) = fastest(with_m, budget) else {
                            continue;
                        };
                        let lead = lead_of(&l);
                        let enc: Option<Vec<(Module, Opt)>> = encoders
                            .iter()
                            .enumerate()
                            .map(|(k, &e)| {
                                let o = opts(e, s[k], m, lead, l.layout.dp);
                                Some((e, fastest(&o, budget)?))
                            })
                            .collect();
                        if let Some(enc) = enc {
                            est = est.min(combo_estimate(placement, space.schedule, &l, &enc));
                        }
                    }
                    if est.is_finite() {
                        ranked.push((est, s));
                    }
                }
                ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
                ranked
                    .into_iter()
                    .enumerate()
                    .map(|(rank, (_, s))| {
                        let gl = g - s.iter().sum::<usize>();
                        (s, gl, rank < 8)
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        let mk = |l: &Opt, c: &[(Module, Opt)]| {
            (
                combo_estimate(placement, space.schedule, l, c),
                plan_of(placement, space.schedule, space.zero1, l, c),
            )
        };
        let colocated = placement == Placement::Colocated;
        for (s, gl, searched) in splits {
            let llm = opts(Module::Llm, gl, 1, 0, 0);
            // Dominance only among equal microbatch counts: the count also sets the
            // encoders' chunks.
            // Overlapped, also only among plain or among interleaved options: those two
            // are simulated as groups of their own (below), and an interleaved option's
            // estimate leaves out the encoders' longer lead, so it must not prune the
            // plain ones.
            let class = |o: &Opt| (o.microbatches, overlapped && o.chunks > 1);
            let mut classes: Vec<(usize, bool)> = llm.iter().map(class).collect();
            classes.sort_unstable();
            classes.dedup();
            let front: Vec<Opt> = classes
                .into_iter()
                .flat_map(|c| pareto(llm.iter().filter(|o| class(o) == c).copied().collect()))
                .collect();
            for l in &llm {
                // Encoders run the LLM's microbatches as their chunks.
                let enc: Vec<(Module, Vec<Opt>)> = encoders
                    .iter()
                    .enumerate()
                    .map(|(k, &e)| (e, opts(e, s[k], l.microbatches, lead_of(l), l.layout.dp)))
                    .collect();
                let one = std::slice::from_ref(l);
                if searched && front.iter().any(|f| same(f, l)) {
                    let enc_front: Vec<(Module, Vec<Opt>)> =
                        enc.iter().map(|(m, v)| (*m, pareto(v.clone()))).collect();
                    combine(one, &enc_front, budget, colocated, &mk, &mut found);
                    file(&mut found, &mut groups);
                }
                combinations += enc.iter().map(|e| e.1.len()).product::<usize>();
                if combinations <= space.brute_limit {
                    combine(one, &enc, budget, colocated, &mk, &mut full);
                }
            }
        }
    }
    let debug = std::env::var("BRAID_PLAN_DEBUG").is_ok();
    if debug {
        eprintln!(
            "enumerated {enumerated} pruned combos in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    }
    let mut simulated = 0;
    let mut best: Result<Found, f64> = Err(f64::INFINITY);
    for group in groups.iter_mut().filter(|g| !g.is_empty()) {
        let found = pick(
            problem,
            &batches,
            group,
            space.top_k,
            Some(g),
            budget,
            &mut simulated,
        )?;
        best = match (best, found) {
            (Ok(x), Ok(y)) => Ok(if x.sim.step_s <= y.sim.step_s { x } else { y }),
            (Ok(x), Err(_)) | (Err(_), Ok(x)) => Ok(x),
            (Err(l1), Err(l2)) => Err(l1.min(l2)),
        };
    }
    let mut pruned: Vec<Combo> = groups.into_iter().flatten().collect();
    pruned.sort_by(|x, y| x.est.total_cmp(&y.est));
    let best = best.map_err(|least| {
        let why = if least.is_finite() {
            format!(
                "the {simulated} candidates simulated needed at least {}",
                size(least, 1)
            )
        } else {
            "every layout's estimate exceeds it".to_string()
        };
        format!(
            "no {} plan fits {g} GPU{} in {} each ({} usable; {why})",
            match space.schedule {
                Schedule::Phased => "phased",
                Schedule::Overlapped => "overlapped (1F1B across modules)",
            },
            if g == 1 { "" } else { "s" },
            size(problem.cluster.memory_gib * GIB, 0),
            size(budget, 0),
        )
    })?;
    if debug {
        eprintln!("simulated the best at {:.2} s", t0.elapsed().as_secs_f64());
    }
    let baseline = match baseline {
        Some(b) => b.clone(),
        None => llm_baseline(problem, &batches, &t, space, &mut simulated)?,
    };
    if debug {
        eprintln!("baseline at {:.2} s", t0.elapsed().as_secs_f64());
    }
    let brute = if combinations <= space.brute_limit && !full.is_empty() {
        let n = full.len();
        pick(
            problem,
            &batches,
            &mut full,
            n,
            Some(g),
            budget,
            &mut simulated,
        )?
        .ok()
    } else {
        None
    };
    // The check is not part of the search's time. `pick` left `pruned` sorted by estimate.
    let search_s = t0.elapsed().as_secs_f64();
    let checked = if brute.is_none() && space.check > 0 && !pruned.is_empty() {
        let n = space.check.min(pruned.len());
        if debug {
            eprintln!("checking the {n} best-estimated combinations");
        }
        let top = &mut pruned[..n];
        let found = pick(problem, &batches, top, n, Some(g), budget, &mut 0)?;
        found.ok().map(|f| (n, f))
    } else {
        None
    };
    // Where brute force or the check simulated a faster plan, that one is the plan to run.
    let searched = best.clone();
    let best = [brute.as_ref(), checked.as_ref().map(|c| &c.1)]
        .into_iter()
        .flatten()
        .fold(best, |b, f| {
            if f.sim.step_s < b.sim.step_s {
                f.clone()
            } else {
                b
            }
        });
    Ok(Outcome {
        best,
        searched,
        baseline,
        brute,
        checked,
        combinations,
        simulated,
        search_s,
    })
}

/// The GPU counts the disjoint search gives an encoder on `g` GPUs: powers of two, and 3 x
/// powers of two in whole nodes, at most half the GPUs (ascending).
pub(crate) fn encoder_counts(g: usize, node: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = (0..20)
        .flat_map(|k| [1usize << k, 3 << k])
        .filter(|&c| c <= g / 2 && (c.is_power_of_two() || c % node == 0))
        .collect();
    counts.sort_unstable();
    counts
}
