//! The planner: the simulator against the closed-form 1F1B step, memory and
//! communication trends of the cost model, and the search against brute force and the
//! LLM-centric baseline on a space small enough to enumerate.
#![allow(clippy::unwrap_used)]

use braid_balancer::cluster::Cluster;
use braid_balancer::plan::search::{Space, search};
use braid_balancer::workload::RowShape;
use braid_balancer::{Layout, Module, Placement, Plan, Schedule};

mod common;
use common::{free_links, llm_only, plan, problem, small};

#[test]
fn uniform_one_f_one_b_matches_the_closed_form() {
    let p = problem(llm_only(8), free_links());
    // Eight equal rows: one per microbatch.
    let rows: Vec<RowShape> = (0..8)
        .map(|_| RowShape {
            samples: vec![1024],
            images: vec![],
            clips: vec![],
        })
        .collect();
    for (pp, m) in [(1, 8), (2, 8), (4, 8), (4, 4), (8, 8)] {
        let one = p
            .simulate(
                &plan(
                    Layout {
                        tp: 1,
                        cp: 1,
                        pp: 1,
                        dp: 1,
                    },
                    m,
                ),
                &rows,
            )
            .unwrap();
        let s = p
            .simulate(
                &plan(
                    Layout {
                        tp: 1,
                        cp: 1,
                        pp,
                        dp: 1,
                    },
                    m,
                ),
                &rows,
            )
            .unwrap();
        // A stage holds 1/pp of the work; (m + pp - 1) slots of one microbatch's stage time.
        let per_slot = one.step_s / m as f64 / pp as f64;
        let want = (m + pp - 1) as f64 * per_slot;
        assert!(
            (s.step_s / want - 1.0).abs() < 1e-9,
            "pp {pp} m {m}: {} vs {want}",
            s.step_s
        );
        let bubble = (pp - 1) as f64 / (m + pp - 1) as f64;
        assert!(
            (s.bubble - bubble).abs() < 1e-9,
            "pp {pp} m {m}: bubble {}",
            s.bubble
        );
    }
}

#[test]
fn a_shared_device_runs_the_same_work_in_its_sum() {
    let mut c = free_links();
    c.shared_compute = true;
    let p = problem(llm_only(8), c);
    let rows: Vec<RowShape> = (0..8)
        .map(|_| RowShape {
            samples: vec![512],
            images: vec![],
            clips: vec![],
        })
        .collect();
    let one = p.simulate(&plan(Layout::ONE, 8), &rows).unwrap();
    // Two data-parallel ranks on one CPU: no faster (the same device does all the work).
    let dp2 = p
        .simulate(
            &plan(
                Layout {
                    tp: 1,
                    cp: 1,
                    pp: 1,
                    dp: 2,
                },
                4,
            ),
            &rows,
        )
        .unwrap();
    assert!(
        (dp2.step_s / one.step_s - 1.0).abs() < 1e-6,
        "{} vs {}",
        dp2.step_s,
        one.step_s
    );
}

#[test]
fn more_stages_and_recomputation_cut_memory_and_tp_costs_communication() {
    let p = problem(llm_only(8), Cluster::preset("h100").unwrap());
    let rows: Vec<RowShape> = (0..8)
        .map(|_| RowShape {
            samples: vec![2048, 2048],
            images: vec![],
            clips: vec![],
        })
        .collect();
    let at = |l: Layout, recompute: bool| {
        let mut x = plan(l, 8);
        x.recompute = recompute;
        p.simulate(&x, &rows).unwrap()
    };
    let base = at(Layout::ONE, false);
    let pp4 = at(
        Layout {
            tp: 1,
            cp: 1,
            pp: 4,
            dp: 1,
        },
        false,
    );
    let re = at(Layout::ONE, true);
    assert!(pp4.peak_memory < base.peak_memory * 0.6);
    assert!(re.peak_memory < base.peak_memory);
    assert!(
        re.step_s > base.step_s * 1.2,
        "recomputation costs a forward"
    );
    let tp8 = at(
        Layout {
            tp: 8,
            cp: 1,
            pp: 1,
            dp: 1,
        },
        false,
    );
    assert!(tp8.step_s > base.step_s / 8.0, "TP is not free");
    assert!(tp8.step_s < base.step_s);
}

#[test]
fn the_search_is_within_five_percent_of_brute_force_and_beats_the_baseline() {
    // Four nodes of four GPUs, and three (a world whose LLM may take CP 3).
    for gpus in [16, 12] {
        search_against_brute_force(gpus);
    }
}

fn search_against_brute_force(gpus: usize) {
    let (p, w) = small();
    let mut space = Space::new(gpus);
    space.brute_limit = 200_000;
    space.batches = 2;
    space.recompute = vec![false];
    let o = search(&p, &w, &space).unwrap();
    let brute = o
        .brute
        .unwrap_or_else(|| panic!("brute force runs: {} combinations", o.combinations));
    assert!(o.combinations <= space.brute_limit);
    assert!(
        o.searched.sim.step_s <= brute.sim.step_s * 1.05,
        "search {} vs brute force {}",
        o.searched.sim.step_s,
        brute.sim.step_s
    );
    assert!(brute.sim.step_s <= o.searched.sim.step_s + 1e-12);
    // The plan to run is brute force's where it is faster.
    assert!(o.best.sim.step_s <= brute.sim.step_s.min(o.searched.sim.step_s));
    eprintln!(
        "{gpus} GPUs: search {:.4} s vs brute force {:.4} s ({:?}, {} combinations)",
        o.searched.sim.step_s, brute.sim.step_s, brute.plan, o.combinations
    );
    assert!(
        o.best.sim.step_s < o.baseline.sim.step_s,
        "{:?} vs {:?}",
        o.best.plan,
        o.baseline.plan
    );
    assert_eq!(o.best.plan.gpus(), gpus);
    assert!(o.best.sim.peak_memory <= p.cluster.usable_bytes());
    o.best
        .plan
        .check(&p.model, &p.cluster, gpus, w.batch_rows)
        .unwrap();
    // The overlapped schedule (disjoint plans, 1F1B across the modules): the search's
    // estimate must rank its pipelines as the simulator runs them, too.
    space.schedule = Schedule::Overlapped;
    space.placements = vec![Placement::Disjoint];
    let ov = search(&p, &w, &space).unwrap();
    assert_eq!(ov.best.plan.placement, Placement::Disjoint);
    let ov_brute = ov
        .brute
        .unwrap_or_else(|| panic!("brute force runs: {} combinations", ov.combinations));
    eprintln!(
        "overlapped: search {:.4} s ({:?}) vs brute force {:.4} s ({:?}, {} combinations)",
        ov.searched.sim.step_s,
        ov.searched.plan,
        ov_brute.sim.step_s,
        ov_brute.plan,
        ov.combinations
    );
    assert!(
        ov.searched.sim.step_s <= ov_brute.sim.step_s * 1.05,
        "overlapped: search {} vs brute force {}",
        ov.searched.sim.step_s,
        ov_brute.sim.step_s
    );
    // The work-conserving bound is below every plan's step, and the gap's parts add up.
    let batches: Vec<Vec<RowShape>> = (0..space.batches).map(|k| w.batch(k)).collect();
    for f in [&o.best, &o.searched, &o.baseline, &ov.best, &brute] {
        let g = p.gap(&f.plan, &batches, &f.sim);
        assert!(
            g.bound_s > 0.0 && g.bound_s <= f.sim.step_s,
            "{g:?} vs {}",
            f.sim.step_s
        );
        assert!(
            (g.step_s() - f.sim.step_s).abs() <= 1e-9 * f.sim.step_s,
            "{g:?}"
        );
        for part in [
            g.memory_forced_s,
            g.grad_sync_s,
            g.imbalance_s,
            g.bridge_s,
            g.bubbles_s,
        ] {
            assert!(part >= 0.0, "{g:?}");
        }
    }
}

/// On one GPU with free links, one microbatch and no encoders, the step is the bound:
/// nothing waits and nothing is communicated.
#[test]
fn one_gpu_of_pure_compute_meets_the_bound() {
    let p = problem(llm_only(4), free_links());
    let rows: Vec<RowShape> = (0..8)
        .map(|i| RowShape {
            samples: vec![256 + 64 * i],
            images: vec![],
            clips: vec![],
        })
        .collect();
    let one = Layout {
        tp: 1,
        cp: 1,
        pp: 1,
        dp: 1,
    };
    let plan = plan(one, 1);
    let sim = p.simulate(&plan, &rows).unwrap();
    let g = p.gap(&plan, &[rows], &sim);
    assert!(
        (g.bound_s - sim.step_s).abs() <= 1e-6 * sim.step_s,
        "{g:?} vs {}",
        sim.step_s
    );
}

/// Two rows cannot keep 8 GPUs busy without splitting them, and a split row pays TP/CP/PP
/// communication: the bound on 8 GPUs lies above perfect spreading of the 2-GPU work, and
/// never above the 2-GPU bound (the 2-GPU ways stay open on 8).
#[test]
fn the_bound_spreads_no_thinner_than_whole_rows_allow() {
    let mut c = Cluster::preset("h100").unwrap();
    c.layer_overhead_us = 0.0;
    let p = problem(llm_only(4), c);
    let rows: Vec<RowShape> = (0..2)
        .map(|_| RowShape {
            samples: vec![2048],
            images: vec![],
            clips: vec![],
        })
        .collect();
    let batches = [rows];
    let two = p.work_bound(2, &batches, 1).unwrap().step_s;
    let eight = p.work_bound(8, &batches, 1).unwrap().step_s;
    assert!(eight > two * 2.0 / 8.0 * 1.001, "{eight} vs {two}");
    assert!(eight <= two, "{eight} vs {two}");
    // The simulated step of every 8-GPU layout of this batch is at least the bound.
    for (tp, cp, pp, dp) in [
        (4, 1, 1, 2),
        (2, 2, 1, 2),
        (1, 2, 2, 2),
        (1, 1, 4, 2),
        (8, 1, 1, 1),
    ] {
        let l = Layout { tp, cp, pp, dp };
        let sim = p.simulate(&plan(l, 1), &batches[0]).unwrap();
        assert!(sim.step_s >= eight, "{l:?}: {} vs {eight}", sim.step_s);
    }
}

#[test]
fn an_impossible_world_is_an_error_naming_the_memory() {
    let (mut p, w) = small();
    p.cluster.memory_gib = 0.5;
    let e = search(&p, &w, &Space::new(16)).unwrap_err();
    // Below a GiB, in MiB.
    assert!(e.contains("in 512.0 MiB each (460.8 MiB usable"), "{e}");
}

/// With the sync overlapped, a data-parallel step waits only for what the last backward
/// and the first forward do not cover; without it, for the whole reduce-scatter and
/// all-gather after the backward.
#[test]
fn overlapping_the_gradient_sync_hides_it_behind_the_passes() {
    let mut c = Cluster::preset("h100").unwrap();
    c.layer_overhead_us = 0.0;
    let mut p = problem(llm_only(8), c);
    let rows: Vec<RowShape> = (0..64)
        .map(|_| RowShape {
            samples: vec![4096],
            images: vec![],
            clips: vec![],
        })
        .collect();
    // 16 replicas over two nodes: the sync crosses the network.
    let dp = plan(
        Layout {
            tp: 1,
            cp: 1,
            pp: 1,
            dp: 16,
        },
        1,
    );
    let serial = p.simulate(&dp, &rows).unwrap();
    p.overlap_sync = true;
    let over = p.simulate(&dp, &rows).unwrap();
    assert!(serial.dp_sync_s > 0.0);
    // The step shrinks by exactly the sync it no longer waits for.
    let saved = serial.dp_sync_s - over.dp_sync_s;
    assert!(saved > 0.5 * serial.dp_sync_s, "{serial:?} {over:?}");
    assert!(
        ((serial.step_s - over.step_s) / saved - 1.0).abs() < 1e-9,
        "{} - {} vs {saved}",
        serial.step_s,
        over.step_s
    );
    // One block's bucket (of 8) always waits.
    assert!(over.dp_sync_s >= serial.dp_sync_s / 8.0 - 1e-12);
}

/// The bound is at most the simulated step of every layout and microbatch count of a
/// 16-GPU world (two nodes), with the sync overlapped or not, on a compute-bound
/// cluster and on one whose links are so slow that every layout with data parallelism
/// waits on its gradient sync; rows of unequal length and packing, so a pipeline's fill
/// runs on short rows and its busiest stage on long ones.
#[test]
fn the_bound_holds_for_every_layout_of_two_nodes() {
    // Single long samples and packed rows of short ones: the fewest tokens and the
    // least attention sit in different rows.
    let rows: Vec<RowShape> = (0..16)
        .map(|i| RowShape {
            samples: if i % 2 == 0 {
                vec![256 + 128 * (i % 5)]
            } else {
                vec![48; 6 + i as usize % 4]
            },
            images: vec![],
            clips: vec![],
        })
        .collect();
    let mut slow = Cluster::preset("h100").unwrap();
    slow.inter.bandwidth_gbs = 0.05;
    slow.intra.bandwidth_gbs = 0.5;
    let mut checked = 0;
    for (name, cluster) in [("h100", Cluster::preset("h100").unwrap()), ("slow", slow)] {
        for overlap in [false, true] {
            let mut p = problem(llm_only(8), cluster.clone());
            p.overlap_sync = overlap;
            let b = p.work_bound(16, std::slice::from_ref(&rows), 1).unwrap();
            assert_eq!(b.step_s, b.work_s.max(b.path_s).max(b.sync_s), "{b:?}");
            for tp in [1, 2, 4, 8] {
                for cp in [1, 2, 4] {
                    for pp in [1, 2, 4, 8] {
                        let Some(dp) = 16usize.checked_div(tp * cp * pp) else {
                            continue;
                        };
                        if dp == 0 || tp * cp * pp * dp != 16 {
                            continue;
                        }
                        for (m, split) in [1, 2, 4, 8, 16]
                            .into_iter()
                            .flat_map(|m| [(m, false), (m, pp >= 2)])
                        {
                            let l = Layout { tp, cp, pp, dp };
                            // Zero-bubble pipelining too, where the LLM has stages.
                            let with = |m| braid_balancer::Plan {
                                llm_zero_bubble: split,
                                ..plan(l, m)
                            };
                            let Ok(sim) = p.simulate(&with(m), &rows) else {
                                continue;
                            };
                            checked += 1;
                            assert!(
                                sim.step_s >= b.step_s * (1.0 - 1e-9),
                                "{name}, overlap {overlap}, {l:?}, {m} mb, zero-bubble {split}: step {} < bound {b:?}",
                                sim.step_s
                            );
                            // The gap's parts add up to the step and none is negative.
                            let g = p.gap(&with(m), std::slice::from_ref(&rows), &sim);
                            assert!((g.step_s() - sim.step_s).abs() <= 1e-9 * sim.step_s);
                            let parts = [
                                g.memory_forced_s,
                                g.grad_sync_s,
                                g.imbalance_s,
                                g.bridge_s,
                                g.bubbles_s,
                            ];
                            assert!(
                                parts.iter().all(|&x| x >= -1e-12),
                                "{name}, overlap {overlap}, {l:?}, {m} mb: {g:?}"
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 100, "{checked} layouts simulated");
}

/// Colocated encoders take turns on the GPUs they share: on every GPU, every vision
/// forward there ends before the first audio forward there starts, and every audio
/// backward before the first vision backward (the vision backwards once started as soon
/// as the LLM's ended, beside the audio's on the same GPUs), whatever the encoders'
/// stages and the microbatches.
#[test]
fn colocated_encoders_take_turns_on_their_gpus() {
    let (p, w) = small();
    let batch = w.batch(0);
    let lay = |tp, pp, dp| Layout { tp, cp: 1, pp, dp };
    // The GPUs of a lane "<module> r<replica> s<stage>" (grid order TP, CP, DP, PP).
    let gpus_of = |l: Layout, label: &str| -> std::ops::Range<usize> {
        let num = |p: &str| {
            let t = label.split(' ').find(|t| t.starts_with(p)).unwrap();
            t[1..].parse::<usize>().unwrap()
        };
        let start = num("s") * l.tp * l.cp * l.dp + num("r") * l.tp * l.cp;
        start..start + l.tp * l.cp
    };
    let mut checked = 0;
    for (vision, audio) in [
        (lay(1, 1, 16), lay(1, 1, 16)),
        (lay(1, 2, 8), lay(1, 2, 8)),
        (lay(2, 2, 4), lay(1, 4, 4)),
        (lay(1, 4, 4), lay(2, 1, 8)),
    ] {
        for m in [2, 4, 8] {
            let plan = Plan {
                placement: Placement::Colocated,
                vision: Some(vision),
                audio: Some(audio),
                ..plan(lay(2, 2, 4), m)
            };
            let (sim, tl) = p.timeline(&plan, &batch).unwrap();
            // (first start, last end) of the spans named `prefix` on lanes over `gpu`.
            let on = |gpu: usize, prefix: &str, l: Layout| -> (f64, f64) {
                let (mut first, mut last) = (f64::INFINITY, 0.0f64);
                for (lane, name, a, b) in &tl.spans {
                    let label = &tl.lanes[*lane].0;
                    if name.starts_with(prefix) && gpus_of(l, label).contains(&gpu) {
                        first = first.min(*a);
                        last = last.max(*b);
                    }
                }
                assert!(first.is_finite(), "no {prefix} span on GPU {gpu}");
                (first, last)
            };
            let at = format!("{vision:?} {audio:?} {m} mb");
            for gpu in 0..16 {
                let (vf, af) = (on(gpu, "vision fwd", vision), on(gpu, "audio fwd", audio));
                let (vb, ab) = (on(gpu, "vision bwd", vision), on(gpu, "audio bwd", audio));
                assert!(
                    vf.1 <= af.0 + 1e-12,
                    "{at}, GPU {gpu}: forwards {vf:?} {af:?}"
                );
                assert!(
                    ab.1 <= vb.0 + 1e-12,
                    "{at}, GPU {gpu}: backwards {ab:?} {vb:?}"
                );
            }
            assert!(
                sim.bubble >= -1e-9,
                "{at}: busy share above 1: {}",
                sim.bubble
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
}

/// The bound names the layout each module takes in it, and those layouts account for
/// exactly its work (their busy GPU-seconds over the GPUs) and its critical path (the
/// longest of theirs); each fits the module alone in a GPU's memory.
#[test]
fn the_bound_names_each_modules_layout() {
    let (p, w) = small();
    let batches: Vec<_> = (0..2).map(|k| w.batch(k)).collect();
    for gpus in [4, 16, 64] {
        let b = p.work_bound(gpus, &batches, 4).unwrap();
        let parts: Vec<_> = b.layouts().collect();
        let names: Vec<_> = parts.iter().map(|x| x.module).collect();
        assert_eq!(names, [Module::Llm, Module::Vision, Module::Audio], "{b:?}");
        let work: f64 = parts.iter().map(|x| x.work_gpu_s).sum::<f64>() / gpus as f64;
        assert!(
            (work - b.work_s).abs() <= 1e-9 * b.work_s,
            "{work} vs {b:?}"
        );
        let path = parts.iter().map(|x| x.path_s).fold(0.0, f64::max);
        assert!(
            (path - b.path_s).abs() <= 1e-9 * b.path_s,
            "{path} vs {b:?}"
        );
        for x in &parts {
            let l = x.layout;
            assert!(l.gpus() >= 1 && l.gpus() <= gpus, "{gpus} GPUs: {x:?}");
            assert!(x.virtual_stages >= 1, "{x:?}");
            assert!(x.virtual_stages == 1 || x.module == Module::Llm, "{x:?}");
            assert!(x.work_gpu_s > 0.0 && x.path_s > 0.0, "{x:?}");
        }
    }
}
