//! The LLM-centric baseline beside `braid train`'s plans: the nearest plan the trainer
//! runs to it, and the baseline on fewer GPUs where none of its layouts tiles them all.
#![allow(clippy::unwrap_used)]

use braid_balancer::plan::baseline::llm_centric;
use braid_balancer::plan::search::{Space, search};
use braid_balancer::plan::{closest_to_baseline, mean_sim};
use braid_balancer::{Layout, Placement, Plan, Schedule};

mod common;
use common::small;

#[test]
fn the_nearest_runnable_plan_to_the_baseline_tiles_its_grid_with_colocated_encoders() {
    let (p, w) = small();
    let batches = vec![w.batch(0)];
    let layout = |tp, cp, pp, dp| Layout { tp, cp, pp, dp };
    let base = Plan {
        placement: Placement::LlmCentric,
        schedule: Schedule::Phased,
        microbatches: 2,
        recompute: false,
        recompute_encoders: false,
        llm_first_stage_layers: None,
        llm_virtual_stages: 1,
        zero1: true,
        llm: layout(2, 2, 1, 4),
        vision: Some(layout(2, 1, 1, 8)),
        audio: Some(layout(1, 1, 1, 8)),
    };
    let near = closest_to_baseline(&p, &base, &batches, f64::INFINITY).unwrap();
    assert_eq!(near.plan.placement, Placement::Colocated);
    assert_eq!(near.plan.schedule, Schedule::Phased);
    assert_eq!((near.plan.llm, near.plan.microbatches), (base.llm, 2));
    // Every encoder over all 16 GPUs at the baseline's TP.
    assert_eq!(near.plan.vision, Some(layout(2, 1, 1, 8)));
    assert_eq!(near.plan.audio, Some(layout(1, 1, 1, 16)));
    assert_eq!(near.plan.gpus(), 16);
    // The faster of encoder recomputation on and off where memory is no limit, the
    // smaller where nothing fits.
    let sim = |rc: bool| {
        let plan = Plan {
            recompute_encoders: rc,
            ..near.plan.clone()
        };
        mean_sim(&p, &plan, &batches).unwrap()
    };
    let (off, on) = (sim(false), sim(true));
    assert!(on.peak_memory < off.peak_memory && on.step_s > off.step_s);
    assert_eq!(near.sim.step_s, off.step_s);
    let tight = closest_to_baseline(&p, &base, &batches, 0.0).unwrap();
    assert!(tight.plan.recompute_encoders);
    assert_eq!(tight.sim.peak_memory, on.peak_memory);
    let between = closest_to_baseline(&p, &base, &batches, on.peak_memory).unwrap();
    assert!(between.plan.recompute_encoders);
    // No colocated plan holds encoders on the first stage's GPUs only, nor splits an
    // encoder's TP unevenly over the grid.
    let piped = Plan {
        llm: layout(2, 2, 2, 2),
        ..base.clone()
    };
    assert!(closest_to_baseline(&p, &piped, &batches, f64::INFINITY).is_none());
    let uneven = Plan {
        vision: Some(layout(3, 1, 1, 1)),
        ..base
    };
    assert!(closest_to_baseline(&p, &uneven, &batches, f64::INFINITY).is_none());
}

#[test]
fn where_no_layout_tiles_the_gpus_the_baseline_runs_on_fewer() {
    let (mut p, w) = small();
    // Too little memory for the LLM without TP: no LLM-centric layout tiles 17 GPUs.
    p.cluster.memory_gib = 3.5;
    let mut space = Space::new(17);
    space.batches = 1;
    let o = search(&p, &w, &space).unwrap();
    assert!(o.baseline.plan.llm.tp >= 2, "{:?}", o.baseline.plan);
    assert_eq!(o.baseline.plan.gpus(), 16, "{:?}", o.baseline.plan);
    assert!(o.baseline.sim.peak_memory <= p.cluster.usable_bytes());
    // Braid's own plan still tiles all 17 (disjoint), and the baseline alone agrees.
    assert_eq!(o.best.plan.gpus(), 17, "{:?}", o.best.plan);
    assert_eq!(llm_centric(&p, &w, &space).unwrap().plan, o.baseline.plan);
    // Where it does tile them, all of them.
    space.gpus = 16;
    assert_eq!(llm_centric(&p, &w, &space).unwrap().plan.gpus(), 16);
}
