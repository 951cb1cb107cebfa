//! The LLM-centric baseline `braid plan` compares against: every encoder inside the
//! LLM's first pipeline stage, searched over the LLM's layouts like a plan, on all the
//! GPUs or, where none of its layouts tiles them, on the most it fits on.

use crate::cluster::GIB;
use crate::dims::Module;
use crate::plan::cost::StageCost;
use crate::plan::layout::{Layout, Placement, Plan, Schedule};
use crate::plan::options::{Knobs, Totals, encoder_tps};
use crate::plan::pick::{Combo, pick};
use crate::plan::search::{Found, Space};
use crate::plan::step::Problem;
use crate::plan::windows::LlmRows;
use crate::workload::{RowShape, Workload};

/// The first-stage layer counts the baseline tries on `pp` stages of `layers` blocks: an
/// even split (`None`), and 1-3 steps shorter first stages whose remaining blocks still
/// split evenly over the other stages (as Megatron requires).
pub(crate) fn first_stage_options(layers: usize, pp: usize) -> Vec<Option<usize>> {
    let mut out = vec![None];
    if pp > 1 && layers.is_multiple_of(pp) {
        let even = layers / pp;
        out.extend(
            (1..=3)
                .map(|j| even as isize - (j * (pp - 1)) as isize)
                .filter(|&f| f >= 1)
                .map(|f| Some(f as usize)),
        );
    }
    out
}

/// The best LLM-centric plan for `workload` alone (what [`search`] compares against).
pub fn llm_centric(problem: &Problem, workload: &Workload, space: &Space) -> Result<Found, String> {
    let batches = workload.batches(space.batches);
    baseline(problem, &batches, &Totals::of(&batches), space, &mut 0)
}

/// The best LLM-centric plan (the strongest such baseline): the LLM's layouts, each
/// encoder inside stage 0 at any TP dividing the LLM's that its heads allow, a replica
/// on every `tp` of the stage's GPUs ([`Layout::centric_encoder_dp`]) with each
/// microbatch's items balanced over its replica's, that stage optionally shorter than the others
/// ([`first_stage_options`]), with and without recomputation. On all `space.gpus` GPUs,
/// or where no such layout tiles them (1,000 GPUs for a model whose stages need 32), on
/// the most of them one fits on, the rest idle, as a Megatron job would run.
pub(crate) fn baseline(
    p: &Problem,
    batches: &[Vec<RowShape>],
    t: &Totals,
    space: &Space,
    simulated: &mut usize,
) -> Result<Found, String> {
    let g = space.gpus;
    let budget = p.cluster.usable_bytes();
    let mut least = f64::INFINITY;
    // Counts whose estimates fit but whose simulations do not are simulated a few at most.
    let mut tries = 4;
    let mut lowest = g;
    for n in (g.div_ceil(2).max(1)..=g).rev() {
        lowest = n;
        let mut combos = baseline_combos(p, batches, t, space, n);
        if combos.is_empty() {
            continue;
        }
        match pick(
            p,
            batches,
            &mut combos,
            space.top_k,
            None,
            budget,
            simulated,
        )? {
            Ok(found) => return Ok(found),
            Err(l) => least = least.min(l),
        }
        tries -= 1;
        if tries == 0 {
            break;
        }
    }
    let counts = if lowest == g {
        format!("{g} GPUs")
    } else {
        format!("{lowest} to {g} GPUs")
    };
    Err(if least.is_finite() {
        format!(
            "no LLM-centric layout fits {counts}: the least memory simulated is {:.1} GiB of {:.1} usable",
            least / GIB,
            budget / GIB
        )
    } else {
        format!(
            "no LLM-centric layout on {counts} fits in {:.1} GiB a GPU by its estimate (or none tiles them)",
            budget / GIB
        )
    })
}

/// The LLM-centric candidates on `g` GPUs whose estimates fit in memory.
fn baseline_combos(
    p: &Problem,
    batches: &[Vec<RowShape>],
    t: &Totals,
    space: &Space,
    g: usize,
) -> Vec<Combo> {
    let rows = batches[0].len();
    let budget = p.cluster.usable_bytes();
    let encoders: Vec<Module> = [Module::Vision, Module::Audio]
        .into_iter()
        .filter(|&m| p.model.module(m).is_some())
        .collect();
    let mut combos = Vec::new();
    // The candidates are ranked by the LLM's rows dealt as the search's are (below): the
    // strongest baseline, not one whose estimate misses its fullest replica.
    let llm_rows = LlmRows::new(p, batches);
    let knobs = Knobs {
        totals: t,
        recompute: &space.recompute,
        zero1: space.zero1,
        rows,
        overlapped: false,
        llm_rows: None,
    };
    for o in p.options(Module::Llm, g, (1, 0), None, &knobs) {
        let Some(sc) = p.cost(Module::Llm, o.layout, o.recompute, space.zero1) else {
            continue;
        };
        let sc = StageCost {
            chunks: o.chunks,
            ..sc
        };
        let n = (o.layout.dp * o.microbatches) as f64;
        let llm = o.layout;
        let enc_layout = |tp: usize| Layout {
            tp,
            cp: 1,
            pp: 1,
            dp: llm.centric_encoder_dp(tp),
        };
        // Every pairing of the encoders' TPs (a lower TP runs more replicas on the
        // stage's GPUs, each with fewer TP collectives and more memory).
        let mut tps: Vec<Vec<usize>> = vec![Vec::new()];
        for &e in &encoders {
            tps = tps
                .iter()
                .flat_map(|pre| {
                    encoder_tps(p, e, llm.tp).into_iter().map(move |t| {
                        let mut v = pre.clone();
                        v.push(t);
                        v
                    })
                })
                .collect();
        }
        for (enc_tps, &rc) in tps
            .iter()
            .flat_map(|v| space.recompute.iter().map(move |rc| (v, rc)))
        {
            let tp_of = |m: Module| {
                encoders
                    .iter()
                    .position(|&e| e == m)
                    .map_or(1, |k| enc_tps[k])
            };
            let extra: Vec<_> = encoders
                .iter()
                .filter_map(|&e| {
                    let tot = t.module(e);
                    let tp = tp_of(e);
                    // Inside a 1F1B stage, an encoder checkpoints per block like the LLM.
                    let ec = StageCost {
                        checkpoint_stages: false,
                        ..p.cost(e, enc_layout(tp), rc, space.zero1)?
                    };
                    // A microbatch's items spread over the replica's encoder replicas.
                    let per = (llm.centric_encoder_dp(tp) / llm.dp) as f64;
                    Some((ec, (tot.0 / n / per, tot.1 / n / per)))
                })
                .collect();
            let (dp, mb) = (o.layout.dp, o.microbatches);
            let (load, peak) = llm_rows.fullest(dp, mb);
            // A shorter first stage, or interleaving (Megatron has both; Braid's
            // trainer splits its chunks evenly, so not the two at once).
            let firsts = if o.chunks > 1 {
                vec![None]
            } else {
                first_stage_options(p.model.llm.layers, o.layout.pp)
            };
            for first in firsts {
                let sc = StageCost {
                    first_stage_layers: first,
                    ..sc
                };
                let e = p.estimate(&sc, o.microbatches, load, peak, &extra, 0, None);
                if e.mem <= budget {
                    combos.push(Combo {
                        est: e.time + e.sync,
                        plan: Plan {
                            placement: Placement::LlmCentric,
                            schedule: Schedule::Phased,
                            microbatches: o.microbatches,
                            recompute: o.recompute,
                            recompute_encoders: rc,
                            recompute_audio: None,
                            llm_first_stage_layers: first,
                            llm_virtual_stages: o.chunks,
                            reverse_encoder_stages: false,
                            llm_zero_bubble: false,
                            zero1: space.zero1,
                            llm: o.layout,
                            vision: p
                                .model
                                .vision
                                .as_ref()
                                .map(|_| enc_layout(tp_of(Module::Vision))),
                            audio: p
                                .model
                                .audio
                                .as_ref()
                                .map(|_| enc_layout(tp_of(Module::Audio))),
                        },
                    });
                }
            }
        }
    }
    combos
}
