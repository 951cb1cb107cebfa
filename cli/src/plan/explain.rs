//! `braid plan`'s explanation: what binds the chosen plan, why the GPUs are split as they
//! are, and why it beats the LLM-centric layout or, where it does not, why not.

use braid_balancer::plan::bound::{BoundPart, Gap};
use braid_balancer::plan::search::Found;
use braid_balancer::{Layout, Module, Placement, Schedule};
use braid_train::planning::Planned;

use super::{bytes, secs};

/// What binds the chosen plan and why it beats the LLM-centric one (`g`: the pick's gap
/// from the bound).
pub(super) fn explain(
    p: &Planned,
    alone: Option<&Found>,
    closest: Option<&Found>,
    g: &Gap,
) -> Vec<String> {
    let o = &p.outcome;
    let (b, base) = (&o.best, &o.baseline);
    let usable = p.problem.cluster.usable_bytes();
    let mut out = Vec::new();
    let step = b.sim.step_s.max(1e-12);
    let shares: Vec<String> = b
        .sim
        .busy
        .iter()
        .map(|(m, s)| format!("{} {:.0}%", m.name(), 100.0 * s / step))
        .collect();
    let collectives = (b.sim.bubble - b.sim.idle).max(0.0);
    out.push(format!(
        "busy share of the step on each module's GPUs: {} (compute and its collectives; the collectives alone {:.0}%: TP, CP, PP sends and the exposed gradient sync {}); idle {:.0}% (pipeline bubbles, waits for the slowest replica and for the bridge {})",
        shares.join(", "),
        100.0 * collectives,
        secs(b.sim.dp_sync_s),
        100.0 * b.sim.idle,
        secs(b.sim.bridge_s)
    ));
    let mem = b.sim.peak_memory / usable;
    if mem > 0.85 {
        out.push(format!(
            "memory binds: the fullest GPU holds {} of {} usable, which rules out fewer pipeline stages or no recomputation",
            bytes(b.sim.peak_memory),
            bytes(usable)
        ));
    } else if b.sim.idle > 0.3 {
        out.push(format!(
            "bubbles bind: {:.0}% of GPU time is idle; more microbatches need more rows per replica",
            100.0 * b.sim.idle
        ));
    } else if collectives > 0.25 && collectives > b.sim.idle {
        out.push(format!(
            "bandwidth binds: {:.0}% of GPU time is collectives (TP and CP exchanges inside the blocks, PP sends, the gradient sync); less TP or CP would cut them but needs more memory per GPU or leaves fewer rows per replica",
            100.0 * collectives
        ));
    } else {
        out.push("compute binds: the GPUs are busy most of the step".into());
    }
    out.push(split_reason(b));
    out.push(format!(
        "work-conserving bound {} (the longest of: each module's work at its least wasteful layout that fits, spread over all {} GPUs, {}; the longest module's critical path at those layouts, pipeline fill and drain included, {}; the longest stage's gradient sync, on a lane of its own, {}; no bubble, no wait, no bridge); the plan is {:.2}x it: memory-forced layout work {}, gradient sync {}, imbalance {}, bridge {}, bubbles {}",
        secs(g.bound_s),
        p.gpus,
        secs(g.bound.work_s),
        secs(g.bound.path_s),
        secs(g.bound.sync_s),
        step / g.bound_s.max(1e-12),
        secs(g.memory_forced_s),
        secs(g.grad_sync_s),
        secs(g.imbalance_s),
        secs(g.bridge_s),
        secs(g.bubbles_s)
    ));
    let parts: Vec<String> = g.bound.layouts().map(bound_layout_str).collect();
    if !parts.is_empty() {
        out.push(format!(
            "the bound's layouts (each module alone on its own GPUs, so the memory the modules share in a plan binds none of them): {}",
            parts.join("; ")
        ));
    }
    if b.plan.placement == Placement::LlmCentric {
        out.push(format!(
            "the plan is the LLM-centric layout itself: no per-module plan `braid train` runs simulated faster (the search's best, {}, takes {}: {:.2}x slower)",
            plan_str(&o.searched),
            secs(o.searched.sim.step_s),
            o.searched.sim.step_s / step
        ));
    }
    out.push(format!(
        "the LLM-centric layout (llm {}{}, {} microbatch{}{}) runs every encoder inside the LLM's first pipeline stage with the LLM's TP, its items spread over that stage's DP x CP ranks; its step takes {} against {} here ({:.2}x)",
        layout_str(base.plan.llm),
        base.plan
            .llm_first_stage_layers
            .map(|f| format!(", first stage {f} layers"))
            .or_else(|| {
                (base.plan.llm_virtual_stages > 1)
                    .then(|| format!(", {} chunks per stage interleaved", base.plan.llm_virtual_stages))
            })
            .unwrap_or_default(),
        base.plan.microbatches,
        if base.plan.microbatches == 1 { "" } else { "es" },
        idle_note(base.plan.gpus(), p.gpus),
        secs(base.sim.step_s),
        secs(b.sim.step_s),
        base.sim.step_s / step
    ));
    if let Some(al) = alone
        && let Some(share) = gain_share(base.sim.step_s, step, al.sim.step_s)
    {
        let got = if share >= 0.005 {
            format!("this plan gets {:.0}% of that gain", 100.0 * share)
        } else {
            "this plan gets none of it".to_string()
        };
        out.push(format!(
            "the LLM alone (its best layout on {}, the encoders' work free) takes {}: no per-module layout can beat the LLM-centric one by more than {:.2}x on this workload; {got}{}",
            match (al.plan.gpus(), p.gpus) {
                (_, 1) => "the one GPU".to_string(),
                (n, g) if n < g => format!("{n} of the {g} GPUs, the most one tiles"),
                (_, g) => format!("all {g} GPUs"),
            },
            secs(al.sim.step_s),
            base.sim.step_s / al.sim.step_s,
            alone_past_bound(al.sim.step_s, g.bound_s),
        ));
    }
    if base.sim.step_s < b.sim.step_s && b.sim.step_s <= 1.01 * base.sim.step_s {
        out.push(format!(
            "the LLM-centric layout is within 1% of this plan ({} against {}): here per-module layouts have nothing to gain over it, and the plan pays the bridge's copies ({})",
            secs(base.sim.step_s),
            secs(b.sim.step_s),
            secs(b.sim.bridge_s)
        ));
    } else if base.sim.step_s < b.sim.step_s {
        out.push(baseline_wins(b, closest, usable));
        if base.plan.llm_first_stage_layers.is_none() {
            out.push("`braid train` runs the LLM-centric layout too (parallel.placement = \"centric\": the encoders inside the LLM's first stage, microbatch by microbatch): `--baseline-out FILE` writes its plan file".into());
        }
    }
    out
}

/// Why the LLM-centric layout beats the plan, from what `braid train` can run nearest to
/// it (`closest`: its LLM grid with the encoders colocated; `None` when it is pipelined).
fn baseline_wins(b: &Found, closest: Option<&Found>, usable: f64) -> String {
    let nearest = |f: &Found| {
        format!(
            "the nearest `braid train` runs, its LLM grid ({}) with the encoders colocated at its TP over its DP x CP ranks{}",
            layout_str(f.plan.llm),
            if f.plan.recompute_encoders {
                " and recomputed"
            } else {
                ""
            },
        )
    };
    // The bridge of a phased step: the nearest plan's where there is one, else the pick's
    // (when it is phased).
    let bridge = |f: &Found| {
        format!(
            "the phased step adds the bridge ({}) and its two all-to-alls, at which every replica waits for the slowest",
            secs(f.sim.bridge_s)
        )
    };
    match closest {
        Some(f) if f.sim.peak_memory > usable => format!(
            "the LLM-centric layout is faster here, and memory is why: {}, needs {} a GPU of the {} usable, since the phased step holds every microbatch's encoder inputs and outputs at once where the LLM-centric one holds one microbatch's",
            nearest(f),
            bytes(f.sim.peak_memory),
            bytes(usable)
        ),
        Some(f) => format!(
            "the LLM-centric layout is faster here: {}, takes {}: {}",
            nearest(f),
            secs(f.sim.step_s),
            bridge(f)
        ),
        None if b.plan.schedule == Schedule::Phased => format!(
            "the LLM-centric layout is faster here: its encoders share the first pipeline stage's GPUs one microbatch at a time, and {}",
            bridge(b)
        ),
        None if b.plan.placement == Placement::Disjoint => "the LLM-centric layout is faster here: its encoders share the first pipeline stage's GPUs one microbatch at a time, and the overlapped plans' disjoint GPUs split the work only as coarsely as whole grids allow".to_string(),
        None => "the LLM-centric layout is faster here: its encoders share the first pipeline stage's GPUs one microbatch at a time, where the colocated overlapped plan's LLM stages wait each round for their GPUs' encoder passes".to_string(),
    }
}

/// A found plan in a few words: its placement, schedule and each module's layout.
fn plan_str(f: &Found) -> String {
    let layouts: Vec<String> = [Module::Llm, Module::Vision, Module::Audio]
        .into_iter()
        .filter_map(|m| Some(format!("{} {}", m.name(), layout_str(f.plan.layout(m)?))))
        .collect();
    format!(
        "{}/{}: {}",
        f.plan.placement.name(),
        f.plan.schedule.name(),
        layouts.join(", ")
    )
}

/// Why the GPUs are split among the modules as they are: each module's share of the
/// busy GPU-seconds against its share of the GPUs.
fn split_reason(b: &Found) -> String {
    let work: Vec<(Module, f64, usize)> = b
        .sim
        .busy
        .iter()
        .filter_map(|&(m, busy)| {
            let g = b.plan.layout(m)?.gpus();
            Some((m, busy * g as f64, g))
        })
        .collect();
    let total: f64 = work.iter().map(|w| w.1).sum::<f64>().max(1e-30);
    let list = |f: &dyn Fn(&(Module, f64, usize)) -> String| {
        work.iter().map(f).collect::<Vec<_>>().join(", ")
    };
    let work_shares = list(&|w| format!("{} {:.0}%", w.0.name(), 100.0 * w.1 / total));
    match b.plan.placement {
        Placement::LlmCentric => "why this split: the LLM-centric layout, every encoder inside the LLM's first pipeline stage at a TP dividing the LLM's, encoding each microbatch's items there just before its first forward".to_string(),
        Placement::Disjoint => {
            let gpus: usize = work.iter().map(|w| w.2).sum::<usize>().max(1);
            format!(
                "why this split: disjoint GPUs sized to each module's work: {} of the GPUs for {} of the busy GPU-seconds",
                list(&|w| format!(
                    "{} {} ({:.0}%)",
                    w.0.name(),
                    w.2,
                    100.0 * w.2 as f64 / gpus as f64
                )),
                work_shares
            )
        }
        _ => format!(
            "why this split: colocated, every module runs on all the GPUs in turn ({work_shares} of the busy GPU-seconds), so none waits on a GPU share that whole nodes and grids cannot size to its work"
        ),
    }
}

/// How much of the gain up to the ceiling a plan realizes: 1 at the LLM-alone step, 0 at
/// the baseline's (negative when slower than the baseline); `None` when the baseline is
/// already as fast as the LLM alone (the encoders cost it nothing).
fn gain_share(baseline: f64, step: f64, alone: f64) -> Option<f64> {
    let room = baseline - alone;
    (room > 0.0).then(|| (baseline - step) / room)
}

/// Where the LLM alone already takes longer than the bound (its sync or its pipeline
/// exposed, which the bound puts on lanes of their own), the nearest any plan can come to
/// the bound under this cost model: a plan's step is never shorter than its LLM's.
fn alone_past_bound(alone_s: f64, bound_s: f64) -> String {
    let r = alone_s / bound_s.max(1e-12);
    if r >= 1.005 {
        format!(
            "; the LLM alone is {r:.2}x the work-conserving bound, so no plan comes nearer the bound than that"
        )
    } else {
        String::new()
    }
}

/// `llm tp2 cp1 pp8 v5 dp16 on 256 GPUs, recompute`: a module's layout in the bound.
fn bound_layout_str(b: &BoundPart) -> String {
    let l = b.layout;
    let mut s = format!("{} tp{} cp{} pp{}", b.module.name(), l.tp, l.cp, l.pp);
    if b.virtual_stages > 1 {
        s += &format!(" v{}", b.virtual_stages);
    }
    s += &format!(" dp{} on {} GPUs", l.dp, l.gpus());
    if let Some(f) = b.first_stage_layers {
        s += &format!(", first stage {f} layers");
    }
    if b.recompute {
        s += ", recompute";
    }
    s
}

/// `, on 992 of 1000 GPUs`: a layout that leaves GPUs idle because none tiles them all
/// (nothing when it uses every one).
pub(super) fn idle_note(used: usize, gpus: usize) -> String {
    if used < gpus {
        format!(", on {used} of {gpus} GPUs: none that fits tiles them all")
    } else {
        String::new()
    }
}

pub(super) fn layout_str(l: Layout) -> String {
    format!("tp{} cp{} pp{} dp{}", l.tp, l.cp, l.pp, l.dp)
}
