//! Zero-bubble pipelining in the simulator: the LLM's backward split into B and W
//! passes, in `braid_balancer::zero_bubble`'s order, on equal rows over free links.
#![allow(clippy::unwrap_used)]

use braid_balancer::Plan;

mod common;
use common::{equal_rows, free_links, llm_only, pipeline, plan, problem};

/// Every stage runs each microbatch's W after its B and the step gets shorter, in the
/// same memory (recomputed or not), never below the bound.
#[test]
fn split_backwards_fill_the_pipeline_in_1f1b_memory() {
    let p = problem(llm_only(8), free_links());
    let rows = equal_rows(8);
    for (pp, m) in [(2, 8), (4, 8), (4, 4), (8, 8), (2, 2)] {
        let l = pipeline(pp);
        let split = Plan {
            llm_zero_bubble: true,
            ..plan(l, m)
        };
        let (whole, (zb, tl)) = (
            p.simulate(&plan(l, m), &rows).unwrap(),
            p.timeline(&split, &rows).unwrap(),
        );
        let at = format!("pp{pp} m{m}");
        assert!(
            zb.step_s < whole.step_s,
            "{at}: {} !< {}",
            zb.step_s,
            whole.step_s
        );
        assert_eq!(zb.peak_memory, whole.peak_memory, "{at}");
        // Recomputing saves memory unsplit; split, a microbatch waiting for its W holds
        // its linears' inputs and output gradients, the whole activations' size.
        let rec = Plan {
            recompute: true,
            ..plan(l, m)
        };
        let rec_split = Plan {
            llm_zero_bubble: true,
            ..rec.clone()
        };
        let (rec, rec_split) = (
            p.simulate(&rec, &rows).unwrap(),
            p.simulate(&rec_split, &rows).unwrap(),
        );
        assert!(rec.peak_memory < whole.peak_memory, "{at}");
        assert_eq!(rec_split.peak_memory, whole.peak_memory, "{at}");
        // The same work, moved: busy time equal to rounding.
        let busy = |s: &braid_balancer::StepSim| s.busy.iter().map(|b| b.1).sum::<f64>();
        assert!(
            (busy(&zb) - busy(&whole)).abs() <= 1e-9 * busy(&whole),
            "{at}"
        );
        let bound = p.work_bound(pp, std::slice::from_ref(&rows), 1).unwrap();
        assert!(zb.step_s >= bound.step_s * (1.0 - 1e-9), "{at}: {bound:?}");
        let span = |name: &str| {
            tl.spans
                .iter()
                .find(|s| s.1 == name)
                .map(|s| (s.2, s.3))
                .unwrap_or_else(|| panic!("{at}: no span {name}"))
        };
        for s in 0..pp {
            for j in 0..m {
                let (b, w) = (
                    span(&format!("llm bwd s{s} mb{j}")),
                    span(&format!("llm wgt s{s} mb{j}")),
                );
                assert!(w.0 >= b.1 - 1e-12, "{at}: s{s} mb{j}");
            }
        }
    }
}
