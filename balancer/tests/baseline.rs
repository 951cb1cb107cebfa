//! The LLM-centric baseline beside `braid train`'s plans: the nearest plan the trainer
//! runs to it, and the baseline on fewer GPUs where none of its layouts tiles them all.
#![allow(clippy::unwrap_used)]

use braid_balancer::cluster::RatePoint;
use braid_balancer::plan::baseline::llm_centric;
use braid_balancer::plan::search::{Space, search};
use braid_balancer::plan::{closest_to_baseline, mean_sim};
use braid_balancer::workload::RowShape;
use braid_balancer::{Layout, Placement, Plan, Schedule};

mod common;
use common::{block, free_links, problem, small};

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
        recompute_audio: None,
        llm_first_stage_layers: None,
        llm_virtual_stages: 1,
        reverse_encoder_stages: false,
        llm_zero_bubble: false,
        zero1: true,
        llm: layout(2, 2, 1, 4),
        vision: Some(layout(2, 1, 1, 8)),
        audio: Some(layout(1, 1, 1, 16)),
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
            recompute_audio: None,
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

/// The simulated baseline runs the encoders as `parallel.placement = "centric"` does: a
/// replica on every encoder-TP of an LLM replica's first-stage GPUs (`llm.tp / tp x
/// cp` of them), each microbatch's items balanced over them. With the ViT at TP 1 inside
/// an LLM at TP 4, four images of one microbatch run side by side on four replicas (the
/// earlier simulator counted one replica per CP rank: all four in turn).
#[test]
fn the_baseline_runs_an_encoder_replica_on_every_encoder_tp_of_the_first_stage() {
    let mut model = common::llm_only(4);
    model.llm = block(4, 1024, 16, true, 0);
    model.vision = Some(block(8, 1024, 16, false, 0));
    model.vision_llm_ratio = 1.0 / 64.0;
    // One GEMM rate at every size, so an encoder's time is linear in its tokens.
    let mut cluster = free_links();
    cluster.matmul = vec![RatePoint {
        flops: 1.0,
        tflops: 400.0,
    }];
    cluster.backward_overhead_us = Some(0.0);
    let p = problem(model, cluster);
    let layout = |tp, cp, pp, dp| Layout { tp, cp, pp, dp };
    let row = |images: usize| RowShape {
        samples: vec![2048],
        images: vec![4096; images],
        clips: vec![],
    };
    let plan = |vision_tp: usize, cp: usize| Plan {
        placement: Placement::LlmCentric,
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
        llm: layout(4 / cp, cp, 1, 1),
        // The plan's DP is what the planner writes; the simulator derives its own.
        vision: Some(layout(vision_tp, 1, 1, 1)),
        audio: None,
    };
    let step = |plan: &Plan, images: usize| p.simulate(plan, &[row(images)]).unwrap().step_s;
    for (vision_tp, cp) in [(1, 1), (1, 2), (2, 2), (4, 1)] {
        let pl = plan(vision_tp, cp);
        let replicas = pl.llm.centric_encoder_dp(vision_tp);
        assert_eq!(replicas, 4 / vision_tp);
        let (none, one, four) = (step(&pl, 0), step(&pl, 1), step(&pl, 4));
        // Four images take the time of ceil(4 / replicas) one after the other (within
        // the few LLM tokens they add).
        let per_image = one - none;
        let expected = per_image * 4usize.div_ceil(replicas) as f64;
        assert!(per_image > 0.0, "tp {vision_tp} cp {cp}: {none} {one}");
        assert!(
            ((four - none) - expected).abs() <= 0.05 * expected,
            "tp {vision_tp} cp {cp}: 4 images add {} s, 1 image {per_image} s, {replicas} replicas",
            four - none
        );
    }
}
