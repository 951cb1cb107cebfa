//! The interleaved 1F1B in the simulator: its closed-form step on equal microbatches,
//! what it costs (sends, memory), the trainer's names on its timeline, and the search
//! choosing it only where `braid train` runs it.
#![allow(clippy::unwrap_used)]

use braid_balancer::plan::search::{Space, search};
use braid_balancer::{Plan, Schedule};

mod common;
use common::{equal_rows as rows, free_links, llm_only, pipeline, plan, problem};

fn interleaved(pp: usize, v: usize, m: usize) -> Plan {
    Plan {
        llm_virtual_stages: v,
        reverse_encoder_stages: false,
        llm_zero_bubble: false,
        ..plan(pipeline(pp), m)
    }
}

/// Equal microbatches, free links: 1F1B takes `m + P - 1` slots of a stage's forward
/// and backward, the interleaved 1F1B `m + (P - 1) / V` (Narayanan et al., 2021), for
/// whole groups of microbatches; a partial last group sits between the two.
#[test]
fn interleaving_cuts_the_bubble_by_the_chunk_count() {
    let p = problem(llm_only(24), free_links());
    for (pp, v, m) in [
        (2, 2, 4),
        (2, 3, 8),
        (4, 2, 8),
        (4, 3, 4),
        (3, 2, 6),
        (4, 6, 8),
    ] {
        let rows = rows(m);
        let one = p.simulate(&plan(pipeline(1), m), &rows).unwrap();
        let slot = one.step_s / m as f64 / pp as f64;
        let s = p.simulate(&interleaved(pp, v, m), &rows).unwrap();
        let want = (m as f64 + (pp - 1) as f64 / v as f64) * slot;
        assert!(
            (s.step_s / want - 1.0).abs() < 1e-9,
            "pp {pp} v {v} m {m}: {} vs {want}",
            s.step_s
        );
    }
    // Five microbatches over four stages: better than 1F1B, worse than whole groups.
    let rows5 = rows(5);
    let one = p.simulate(&plan(pipeline(1), 5), &rows5).unwrap();
    let slot = one.step_s / 5.0 / 4.0;
    let s = p.simulate(&interleaved(4, 2, 5), &rows5).unwrap();
    assert!(s.step_s < (5.0 + 3.0) * slot * (1.0 - 1e-9), "{}", s.step_s);
    assert!(s.step_s > (5.0 + 1.5) * slot * (1.0 - 1e-9), "{}", s.step_s);
}

/// With links that cost, each chunk boundary is a send: interleaving pays more of them;
/// and the first stage holds more chunk activations than 1F1B's microbatches.
#[test]
fn interleaving_pays_sends_and_memory() {
    let mut c = free_links();
    c.intra.bandwidth_gbs = 1.0; // slow enough that sends show
    c.inter = c.intra;
    let p = problem(llm_only(24), c);
    let rows = rows(8);
    let plain = p.simulate(&plan(pipeline(4), 8), &rows).unwrap();
    let free = problem(llm_only(24), free_links());
    let plain_free = free.simulate(&plan(pipeline(4), 8), &rows).unwrap();
    let v2 = p.simulate(&interleaved(4, 2, 8), &rows).unwrap();
    let v2_free = free.simulate(&interleaved(4, 2, 8), &rows).unwrap();
    // The sends' share of the step grows with the chunks.
    assert!(
        v2.step_s - v2_free.step_s > plain.step_s - plain_free.step_s,
        "sends: {} vs {}",
        v2.step_s - v2_free.step_s,
        plain.step_s - plain_free.step_s
    );
    // Stage 0 of 4 holds 4 microbatches under 1F1B; interleaved over 2 chunks
    // 2 * 3 + 4 + 1 = 11 chunks, 5.5 stages' worth.
    assert!(
        v2_free.peak_memory > plain_free.peak_memory,
        "{} vs {}",
        v2_free.peak_memory,
        plain_free.peak_memory
    );
}

/// The predicted timeline names each pass as the trainer's does ("llm fwd s1 c0 mb3"),
/// and every (stage, chunk, microbatch) runs once each way.
#[test]
fn the_timeline_names_chunks_as_the_trainer_does() {
    let p = problem(llm_only(8), free_links());
    let (pp, v, m) = (2, 2, 4);
    let (_, tl) = p.timeline(&interleaved(pp, v, m), &rows(m)).unwrap();
    for s in 0..pp {
        for k in 0..v {
            for j in 0..m {
                for what in ["fwd", "bwd"] {
                    let name = format!("llm {what} s{s} c{k} mb{j}");
                    let n = tl.spans.iter().filter(|x| x.1 == name).count();
                    assert_eq!(n, 1, "{name}");
                }
            }
        }
    }
    // Chunk 1 of microbatch 0 on stage 0 starts after chunk 0 left the last stage.
    let at = |name: &str| tl.spans.iter().find(|x| x.1 == name).unwrap().clone();
    assert!(at("llm fwd s0 c1 mb0").2 >= at("llm fwd s1 c0 mb0").3);
    assert!(at("llm bwd s1 c0 mb0").2 >= at("llm bwd s0 c1 mb0").3);
}

/// The search may interleave the LLM under either schedule (`braid train` runs both)
/// and finds it here, where few microbatches leave a deep pipeline a large bubble; and
/// the plan file keeps the count.
#[test]
fn the_search_interleaves_under_either_schedule() {
    let mut c = free_links();
    c.gpus_per_node = 4;
    let p = problem(llm_only(16), c);
    let w = braid_balancer::workload::Workload {
        rows: rows(4),
        batch_rows: 4,
        seq_len: 1024,
    };
    let mut space = Space::new(4);
    space.placements = vec![braid_balancer::Placement::Disjoint];
    let phased = search(&p, &w, &space).unwrap();
    let best = &phased.best.plan;
    assert!(
        best.llm_virtual_stages > 1 || best.llm.pp == 1,
        "phased pick {best:?}"
    );
    space.schedule = Schedule::Overlapped;
    let o = search(&p, &w, &space).unwrap().best.plan;
    assert!(
        o.llm_virtual_stages > 1 || o.llm.pp == 1,
        "overlapped pick {o:?}"
    );
    assert_eq!(
        (o.llm, o.llm_virtual_stages),
        (best.llm, best.llm_virtual_stages),
        "with the LLM alone both schedules run one pipeline"
    );
    let text = toml::to_string(&interleaved(4, 2, 8)).unwrap();
    assert!(text.contains("llm_virtual_stages = 2"), "{text}");
    let back: Plan = toml::from_str(&text).unwrap();
    assert_eq!(back.llm_virtual_stages, 2);
    let plain: Plan = toml::from_str(&toml::to_string(&plan(pipeline(2), 2)).unwrap()).unwrap();
    assert_eq!(plain.llm_virtual_stages, 1);
}

/// A plan file's chunk count is checked like its layouts: at least one, two or more
/// stages, a count that splits the layers, no shorter first stage; either schedule.
#[test]
fn a_plan_s_chunks_are_checked() {
    let p = problem(llm_only(8), free_links());
    let check = |plan: &Plan| plan.check(&p.model, &p.cluster, plan.gpus(), 8);
    assert!(check(&interleaved(2, 2, 4)).is_ok());
    assert!(check(&interleaved(2, 4, 4)).is_ok());
    let overlapped = Plan {
        schedule: Schedule::Overlapped,
        ..interleaved(2, 2, 4)
    };
    assert!(check(&overlapped).is_ok(), "{:?}", check(&overlapped));
    for (bad, needle) in [
        (interleaved(2, 0, 4), ">= 1"),
        (interleaved(2, 3, 4), "dividing"),
        (interleaved(1, 2, 4), "pp >= 2"),
        (
            Plan {
                llm_first_stage_layers: Some(3),
                ..interleaved(2, 2, 4)
            },
            "first_stage",
        ),
    ] {
        let e = check(&bad).unwrap_err();
        assert!(e.contains(needle), "{bad:?}: {e}");
    }
}
