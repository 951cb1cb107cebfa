//! Picking a plan from ranked candidates: rounds of simulations spread over the LLM's
//! options, more rounds while none fits in memory, one round refining the winner.

use rayon::prelude::*;

use crate::cluster::GIB;
use crate::plan::layout::{Layout, Placement, Plan, Schedule};
use crate::plan::search::Found;
use crate::plan::step::{Problem, StepSim};
use crate::workload::RowShape;

/// A combination: per module its option; the estimate; the plan.
pub(crate) struct Combo {
    pub est: f64,
    pub plan: Plan,
}

/// Rounds of `k` candidates simulated at most while none of them fits in memory (the
/// estimate's memory takes mean loads, the simulator the fullest window of the batch).
const PICK_ROUNDS: usize = 8;

/// Rounds refining the winner's LLM option with encoder layouts not simulated yet.
const REFINE_ROUNDS: usize = 2;

/// The LLM option of a candidate (layout, microbatches, recomputation, chunks a stage):
/// it decides most of the step, and the estimate's error is larger than the gaps between
/// encoder layouts.
fn llm_key(plan: &Plan) -> (Layout, usize, bool, usize) {
    (
        plan.llm,
        plan.microbatches,
        plan.recompute,
        plan.llm_virtual_stages,
    )
}

/// `a` and `b` differ only where the estimate cannot see it (an encoder off the
/// critical path): the same LLM option and estimate.
fn twins(a: &Combo, b: &Combo) -> bool {
    llm_key(&a.plan) == llm_key(&b.plan) && (a.est - b.est).abs() <= 1e-4 * b.est.abs()
}

/// Takes from `pending` (best estimate first) up to `k` candidates that `admit` lets
/// into the round so far and that are no twin of one `taken` or already in the round.
fn next_round(
    combos: &[Combo],
    pending: &mut Vec<usize>,
    taken: &[usize],
    k: usize,
    admit: impl Fn(&[usize], &Combo) -> bool,
) -> Vec<usize> {
    let (mut round, mut rest) = (Vec::new(), Vec::new());
    for &i in pending.iter() {
        let c = &combos[i];
        let twin = taken.iter().chain(&round).any(|&f| twins(c, &combos[f]));
        if round.len() < k && !twin && admit(&round, c) {
            round.push(i);
        } else {
            rest.push(i);
        }
    }
    *pending = rest;
    round
}

/// Whether `c` may join `round` in a first round: fewer than `cap` of its LLM option are
/// in it, and each of those has a different layout for every encoder (variants that
/// share one encoder's layout and differ in another are left for the refinement).
fn spread(combos: &[Combo], round: &[usize], c: &Combo, cap: usize) -> bool {
    let same: Vec<&Plan> = round
        .iter()
        .map(|&f| &combos[f].plan)
        .filter(|o| llm_key(o) == llm_key(&c.plan))
        .collect();
    let shares = |o: &Plan| {
        (o.vision.is_some() && o.vision == c.plan.vision)
            || (o.audio.is_some() && o.audio == c.plan.audio)
    };
    same.len() < cap && !same.iter().any(|o| shares(o))
}

/// The simulated candidates so far: the fastest that fits, the least memory any needed.
struct Tally {
    best: Option<Found>,
    least: f64,
    simulated: usize,
}

/// The variants of `plan` the search simulates beside it, each and both where they
/// apply: its encoders' stages reversed (colocated and overlapped, each GPU running its
/// modules' passes in one order, so which encoder stage shares a GPU with which LLM
/// stage matters; an encoder of two stages or more), and its LLM's backward split for
/// zero-bubble pipelining (two stages or more, one model chunk a stage, beside its
/// encoders).
fn variants(plan: &Plan) -> Vec<Plan> {
    let staged = [plan.vision, plan.audio]
        .iter()
        .any(|l| l.is_some_and(|l| l.pp >= 2));
    let reverse = plan.placement == Placement::Colocated
        && plan.schedule == Schedule::Overlapped
        && staged
        && !plan.reverse_encoder_stages;
    let split = plan.llm.pp >= 2
        && plan.llm_virtual_stages <= 1
        && plan.placement != Placement::LlmCentric
        && !plan.llm_zero_bubble;
    let mut out = Vec::new();
    for (r, z) in [(true, false), (false, true), (true, true)] {
        if (r && !reverse) || (z && !split) {
            continue;
        }
        out.push(Plan {
            reverse_encoder_stages: plan.reverse_encoder_stages || r,
            llm_zero_bubble: plan.llm_zero_bubble || z,
            ..plan.clone()
        });
    }
    out
}

/// Simulates `round` (in parallel) into `tally`; each candidate with its [`variants`],
/// the fastest kept. `gpus`: check each plan against the
/// world first (the LLM-centric baseline is not a plan `braid train` runs: no check).
fn simulate_round(
    p: &Problem,
    batches: &[Vec<RowShape>],
    combos: &[Combo],
    round: &[usize],
    gpus: Option<usize>,
    budget: f64,
    tally: &mut Tally,
) -> Result<(), String> {
    let sims: Vec<Result<(StepSim, Option<Plan>), String>> = round
        .par_iter()
        .map(|&i| {
            let c = &combos[i];
            if let Some(g) = gpus {
                c.plan
                    .check(&p.model, &p.cluster, g, batches[0].len())
                    .map_err(|e| format!("internal: a candidate fails its own checks: {e}"))?;
            }
            let mut best = (mean_sim(p, &c.plan, batches)?, None);
            for v in variants(&c.plan) {
                let sim = mean_sim(p, &v, batches)?;
                if sim.step_s < best.0.step_s {
                    best = (sim, Some(v));
                }
            }
            Ok(best)
        })
        .collect();
    tally.simulated += sims.len();
    let debug = std::env::var("BRAID_PLAN_DEBUG").is_ok();
    for (&i, sim) in round.iter().zip(sims) {
        let (c, (sim, rev)) = (&combos[i], sim?);
        let plan = rev.as_ref().unwrap_or(&c.plan);
        if debug {
            eprintln!(
                "cand est {:.3} sim {:.3} mem {:.1} GiB {:?}",
                c.est,
                sim.step_s,
                sim.peak_memory / GIB,
                plan
            );
        }
        tally.least = tally.least.min(sim.peak_memory);
        let faster = tally
            .best
            .as_ref()
            .is_none_or(|b| sim.step_s < b.sim.step_s);
        if sim.peak_memory <= budget && faster {
            tally.best = Some(Found {
                plan: plan.clone(),
                sim,
            });
        }
    }
    Ok(())
}

/// How many of the best-estimated combinations [`pick`] looks at for `k` a round: the
/// search keeps no more than these (and `--check`'s) of each group.
pub(crate) fn considered(k: usize) -> usize {
    k.max(1) * PICK_ROUNDS * 8
}

/// Keeps the `keep` best-estimated of `group` once it holds more than twice that, in
/// the order one stable sort of everything pushed would give them: a combination dropped
/// here had `keep` at least as good before it, so it would never be among the `keep`
/// first (ties keep the order found).
pub(crate) fn keep_best(group: &mut Vec<Combo>, keep: usize) {
    if group.len() > 2 * keep {
        group.sort_by(|a, b| a.est.total_cmp(&b.est));
        group.truncate(keep);
    }
}

/// Simulates the best-estimated combinations, `k` at a time; the fastest that fits wins.
/// The first round spreads over LLM options (at most `ceil(k / 4)` of one, each with
/// its own encoder layouts; no twins); while none fits, the next round, up to [`PICK_ROUNDS`]; then one round
/// refines the winner's LLM option with the encoder layouts not simulated yet. With
/// `k` at least every combination (brute force), all are simulated at once.
/// Returns the winner, or the least memory any candidate needed.
pub(crate) fn pick(
    p: &Problem,
    batches: &[Vec<RowShape>],
    combos: &mut [Combo],
    k: usize,
    gpus: Option<usize>,
    budget: f64,
    simulated: &mut usize,
) -> Result<Result<Found, f64>, String> {
    combos.sort_by(|a, b| a.est.total_cmp(&b.est));
    let mut tally = Tally {
        best: None,
        least: f64::INFINITY,
        simulated: 0,
    };
    let k = k.max(1);
    if k >= combos.len() {
        let all: Vec<usize> = (0..combos.len()).collect();
        simulate_round(p, batches, combos, &all, gpus, budget, &mut tally)?;
    } else {
        let mut pending: Vec<usize> = (0..combos.len().min(considered(k))).collect();
        let mut taken: Vec<usize> = Vec::new();
        let cap = k.div_ceil(4);
        for _ in 0..PICK_ROUNDS {
            let mut round = next_round(combos, &mut pending, &taken, k, |r, c| {
                spread(combos, r, c, cap)
            });
            if round.is_empty() {
                // Only twins left.
                round = pending.drain(..k.min(pending.len())).collect();
            }
            if round.is_empty() {
                break;
            }
            simulate_round(p, batches, combos, &round, gpus, budget, &mut tally)?;
            taken.extend(round);
            if tally.best.is_some() {
                break;
            }
        }
        for _ in 0..REFINE_ROUNDS {
            let Some(key) = tally.best.as_ref().map(|b| llm_key(&b.plan)) else {
                break;
            };
            let round = next_round(combos, &mut pending, &taken, k, |_, c| {
                llm_key(&c.plan) == key
            });
            if round.is_empty() {
                break;
            }
            simulate_round(p, batches, combos, &round, gpus, budget, &mut tally)?;
            taken.extend(round);
        }
    }
    *simulated += tally.simulated;
    Ok(tally.best.ok_or(tally.least))
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
                a.idle += s.idle;
                a.bridge_s += s.bridge_s;
                a.dp_sync_s += s.dp_sync_s;
                a.busy_gpu_s += s.busy_gpu_s;
                a.sync_gpu_s += s.sync_gpu_s;
                a.imbalance_gpu_s += s.imbalance_gpu_s;
                a.peak_memory = a.peak_memory.max(s.peak_memory);
                for (x, y) in a.busy.iter_mut().zip(&s.busy) {
                    x.1 += y.1;
                }
                for (x, y) in a.busiest.iter_mut().zip(&s.busiest) {
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
    a.idle /= n;
    a.bridge_s /= n;
    a.dp_sync_s /= n;
    a.busy_gpu_s /= n;
    a.sync_gpu_s /= n;
    a.imbalance_gpu_s /= n;
    for x in a.busy.iter_mut().chain(a.busiest.iter_mut()) {
        x.1 /= n;
    }
    Ok(a)
}

/// The plan `braid train` runs that comes closest to the LLM-centric `baseline`, whose
/// encoders run inside the LLM's first stage one microbatch at a time (the trainer runs
/// them phased): for a one-stage LLM, its grid, microbatches and recomputation with every
/// encoder colocated at the baseline's TP over the LLM's DP x CP ranks. Of encoder
/// recomputation on and off, the fastest that fits in `budget` bytes a GPU, else the one
/// needing the least. `None` for a pipelined baseline (its encoders hold only the first
/// stage's GPUs, which no colocated plan does), a model without encoders, or a grid the
/// encoders cannot take.
pub fn closest_to_baseline(
    p: &Problem,
    baseline: &Plan,
    batches: &[Vec<RowShape>],
    budget: f64,
) -> Option<Found> {
    let l = baseline.llm;
    if l.pp != 1 || (baseline.vision.is_none() && baseline.audio.is_none()) {
        return None;
    }
    let gpus = l.gpus();
    if [baseline.vision, baseline.audio]
        .iter()
        .flatten()
        .any(|e| e.tp == 0 || !gpus.is_multiple_of(e.tp))
    {
        return None;
    }
    let beside = |e: Option<Layout>| {
        e.map(|e| Layout {
            tp: e.tp,
            cp: 1,
            pp: 1,
            dp: gpus / e.tp,
        })
    };
    let tried: Vec<Found> = [false, true]
        .into_iter()
        .filter_map(|recompute_encoders| {
            let plan = Plan {
                placement: Placement::Colocated,
                schedule: Schedule::Phased,
                recompute_encoders,
                recompute_audio: None,
                llm_first_stage_layers: None,
                llm_virtual_stages: 1,
                reverse_encoder_stages: false,
                llm_zero_bubble: false,
                vision: beside(baseline.vision),
                audio: beside(baseline.audio),
                ..baseline.clone()
            };
            let sim = mean_sim(p, &plan, batches).ok()?;
            Some(Found { plan, sim })
        })
        .collect();
    let fits = |f: &&Found| f.sim.peak_memory <= budget;
    match tried
        .iter()
        .filter(fits)
        .min_by(|a, b| a.sim.step_s.total_cmp(&b.sim.step_s))
    {
        Some(f) => Some(f.clone()),
        None => tried
            .into_iter()
            .min_by(|a, b| a.sim.peak_memory.total_cmp(&b.sim.peak_memory)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::layout::{Placement, Schedule};

    /// A candidate whose LLM has data-parallel degree `dp` and whose vision encoder has
    /// `v` replicas (what sets them apart within one LLM option).
    fn combo(dp: usize, v: usize, est: f64) -> Combo {
        let l = |dp| Layout {
            tp: 1,
            cp: 1,
            pp: 1,
            dp,
        };
        Combo {
            est,
            plan: Plan {
                placement: Placement::Colocated,
                schedule: Schedule::Phased,
                microbatches: 1,
                recompute: false,
                recompute_encoders: false,
                recompute_audio: None,
                llm_first_stage_layers: None,
                llm_virtual_stages: 1,
                reverse_encoder_stages: false,
                llm_zero_bubble: false,
                zero1: true,
                llm: l(dp),
                vision: Some(l(v)),
                audio: None,
            },
        }
    }

    #[test]
    fn variants_reverse_staged_colocated_encoders_and_split_pipelined_llms() {
        let lay = |pp| Layout {
            tp: 1,
            cp: 1,
            pp,
            dp: 2,
        };
        let base = combo(4, 4, 0.0).plan;
        let of = |placement, schedule, enc_pp, llm_pp, v| Plan {
            placement,
            schedule,
            vision: Some(lay(enc_pp)),
            llm: lay(llm_pp),
            llm_virtual_stages: v,
            ..base.clone()
        };
        let flags = |p: &Plan| {
            variants(p)
                .iter()
                .map(|v| (v.reverse_encoder_stages, v.llm_zero_bubble))
                .collect::<Vec<_>>()
        };
        let (col, ov, ph) = (Placement::Colocated, Schedule::Overlapped, Schedule::Phased);
        assert_eq!(
            flags(&of(col, ov, 2, 2, 1)),
            [(true, false), (false, true), (true, true)]
        );
        // Nothing else changes.
        let v = variants(&of(col, ov, 2, 2, 1)).remove(2);
        assert_eq!(
            Plan {
                reverse_encoder_stages: false,
                llm_zero_bubble: false,
                ..v
            },
            of(col, ov, 2, 2, 1)
        );
        assert_eq!(flags(&of(col, ov, 2, 1, 1)), [(true, false)]);
        assert_eq!(flags(&of(col, ov, 1, 2, 1)), [(false, true)]);
        assert_eq!(flags(&of(col, ov, 2, 2, 2)), [(true, false)]);
        assert_eq!(flags(&of(col, ph, 2, 2, 1)), [(false, true)]);
        assert_eq!(
            flags(&of(Placement::Disjoint, ov, 2, 2, 1)),
            [(false, true)]
        );
        assert_eq!(flags(&of(Placement::LlmCentric, ph, 1, 2, 1)), []);
        assert_eq!(flags(&of(col, ov, 1, 1, 1)), []);
        assert!(variants(&v).is_empty());
    }

    #[test]
    fn a_round_spreads_over_llm_options_and_skips_twins() {
        // Sorted by estimate: five variants of LLM option A (two of them twins), then B, C.
        let combos = vec![
            combo(8, 1, 1.00),
            combo(8, 2, 1.00), // twin of the first: same LLM option and estimate
            combo(8, 4, 1.01),
            combo(8, 8, 1.02),
            combo(8, 16, 1.03),
            combo(4, 1, 1.10),
            combo(2, 1, 1.20),
        ];
        let mut pending: Vec<usize> = (0..combos.len()).collect();
        let first = next_round(&combos, &mut pending, &[], 4, |r, c| {
            spread(&combos, r, c, 2)
        });
        assert_eq!(first, vec![0, 2, 5, 6]);
        // Refining option A takes its variants not simulated yet, twins last of all.
        let key = llm_key(&combos[0].plan);
        let refine = next_round(&combos, &mut pending, &first, 4, |_, c| {
            llm_key(&c.plan) == key
        });
        assert_eq!(refine, vec![3, 4]);
        assert_eq!(pending, vec![1]);
    }

    #[test]
    fn keeping_the_best_as_they_come_keeps_the_order_of_one_sort() {
        // Estimates with many ties, pushed in batches of every size, trimmed after each.
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for keep in [1, 3, 10] {
            let (mut all, mut kept) = (Vec::new(), Vec::new());
            for i in 0..400 {
                // The dp tells combinations apart; the estimate repeats.
                let est = (next() % 17) as f64 / 4.0;
                all.push(combo(i, 1, est));
                kept.push(combo(i, 1, est));
                if next() % 5 == 0 {
                    keep_best(&mut kept, keep);
                }
            }
            all.sort_by(|a, b| a.est.total_cmp(&b.est));
            kept.sort_by(|a, b| a.est.total_cmp(&b.est));
            let dps = |v: &[Combo]| {
                v.iter()
                    .take(keep)
                    .map(|c| c.plan.llm.dp)
                    .collect::<Vec<_>>()
            };
            assert!(kept.len() >= keep, "keep {keep}: {} left", kept.len());
            assert_eq!(dps(&kept), dps(&all), "keep {keep}");
        }
    }

    #[test]
    fn variants_of_one_llm_option_in_a_first_round_differ_in_every_encoder() {
        let with_audio = |v: usize, a: usize| {
            let mut c = combo(8, v, 1.0);
            c.plan.audio = c.plan.vision.map(|l| Layout { dp: a, ..l });
            c
        };
        let combos = vec![
            with_audio(1, 1),
            with_audio(1, 2),
            with_audio(2, 1),
            with_audio(2, 2),
        ];
        // The first is in; the next two share its vision or its audio layout.
        assert!(!spread(&combos, &[0], &combos[1], 4));
        assert!(!spread(&combos, &[0], &combos[2], 4));
        assert!(spread(&combos, &[0], &combos[3], 4));
        // And no more than `cap` of one LLM option.
        assert!(!spread(&combos, &[0], &combos[3], 1));
    }
}
