//! Tests of the stage cost model: splits, sends, memory and the stem's and head's stages.

use super::*;
use crate::dims::tests::llama_7b as llama7b;

fn layout(tp: usize, cp: usize, pp: usize, dp: usize) -> Layout {
    Layout { tp, cp, pp, dp }
}

/// A stage of `d` under `layout` on `c`, with the settings the tests vary from.
fn stage<'a>(d: &'a ModuleDims, c: &'a Cluster, layout: Layout) -> StageCost<'a> {
    StageCost {
        dims: d,
        layout,
        cluster: c,
        recompute: false,
        zero1: true,
        frozen: false,
        checkpoint_stages: false,
        overlap_sync: false,
        first_stage_layers: None,
        chunks: 1,
        first_gpu: 0,
        split_backward: false,
        sequence_parallel: true,
    }
}

#[test]
fn splitting_cuts_time_and_memory_and_costs_communication() {
    let c = Cluster::preset("h100").unwrap();
    let d = llama7b();
    let at = |tp, pp, recompute| StageCost {
        recompute,
        ..stage(&d, &c, layout(tp, 1, pp, 8))
    };
    let (t, sq) = (4096.0, 4096.0 * 4096.0);
    let one = at(1, 1, false).forward(0, t, sq);
    let tp2 = at(2, 1, false).forward(0, t, sq);
    assert!(tp2.compute < one.compute && tp2.compute > one.compute / 2.2);
    assert!(tp2.comm > 0.0 && one.comm == 0.0);
    // 7B at 4k tokens: ~55 TFLOP forward at ~650 TFLOP/s is ~90 ms.
    assert!(one.compute > 0.06 && one.compute < 0.15, "{}", one.compute);
    // Recomputation adds one forward to the backward, less the head (the loss and
    // lm_head run after the recomputed blocks): ~4 % of 7B's forward at 4k tokens.
    let b = at(1, 1, false).backward(0, t, sq);
    let br = at(1, 1, true).backward(0, t, sq);
    let again = br.compute - b.compute;
    assert!(
        again < one.compute && again > 0.9 * one.compute,
        "{again} {}",
        one.compute
    );
    let no_head = ModuleDims {
        vocab: 0,
        ..d.clone()
    };
    let headless = |recompute| StageCost {
        dims: &no_head,
        ..at(1, 1, recompute)
    };
    let (f, b0, b1) = (
        headless(false).forward(0, t, sq).compute,
        headless(false).backward(0, t, sq).compute,
        headless(true).backward(0, t, sq).compute,
    );
    assert!((b1 - b0 - f).abs() < 1e-12);
    assert!(b.compute > 2.0 * one.compute && b.compute < 2.5 * one.compute);
    // 6.74 B params: weights 13.5 GB, grads 27 GB, AdamW 81 GB / 8.
    let m = at(1, 1, false).memory(0, t, t);
    assert!((m.weights / 1e9 - 13.5).abs() < 0.1, "{}", m.weights);
    assert!((m.optimizer / 1e9 - 10.1).abs() < 0.1, "{}", m.optimizer);
    let r = at(1, 1, true).memory(0, t, t);
    assert!(r.activations < m.activations / 5.0);
    assert!(at(1, 2, false).params(0) < at(1, 1, false).params(0) * 0.6);
    let sync = at(1, 1, false).dp_sync(0);
    assert!(sync > 0.0);
    assert_eq!(at(1, 1, false).exposed_sync(0, 1.0, 1.0), sync);
    // Overlapped behind a long enough pass, only the last block's bucket waits.
    let over = StageCost {
        overlap_sync: true,
        ..at(1, 1, false)
    };
    assert!((over.exposed_sync(0, 10.0, 10.0) - sync / 32.0).abs() < 1e-12);
    assert!((over.exposed_sync(0, 0.0, 0.0) - sync).abs() < 1e-12);
}

/// An encoder's stem is charged on its first stage, its projector on its last.
#[test]
fn a_pass_is_linear_in_the_squared_length() {
    let c = Cluster::preset("h100").unwrap();
    let d = llama7b();
    for (recompute, frozen, cp) in [(false, false, 1), (true, false, 2), (false, true, 4)] {
        let sc = StageCost {
            recompute,
            frozen,
            ..stage(&d, &c, layout(2, cp, 2, 4))
        };
        for (stage, t) in [(0, 512.0), (1, 8192.0)] {
            let [f, b] = sc.linear_in_sq(stage, t);
            for sq in [0.0, t * 100.0, t * t] {
                let (fw, bw) = (
                    sc.forward(stage, t, sq).total(),
                    sc.backward(stage, t, sq).total(),
                );
                assert!(
                    (f.0 + f.1 * sq - fw).abs() <= 1e-12 * fw.max(1e-9),
                    "{f:?} {fw}"
                );
                assert!(
                    (b.0 + b.1 * sq - bw).abs() <= 1e-12 * bw.max(1e-9),
                    "{b:?} {bw}"
                );
            }
            assert!(f.1 > 0.0 && (b.1 > 0.0) != frozen);
        }
    }
}

#[test]
fn the_stem_runs_on_the_first_stage_and_the_projector_on_the_last() {
    let c = Cluster::preset("h100").unwrap();
    let plain = ModuleDims {
        vocab: 0,
        causal: false,
        ..llama7b()
    };
    let with = ModuleDims {
        stem_flops_per_token: 1e9,
        projector_flops_per_token: 3e9,
        ..plain.clone()
    };
    let at = |d| stage(d, &c, layout(1, 1, 4, 1));
    let extra = |stage| {
        let (t, sq) = (1024.0, 1024.0 * 1024.0);
        at(&with).forward(stage, t, sq).compute - at(&plain).forward(stage, t, sq).compute
    };
    assert!(extra(0) > 0.0);
    assert_eq!(extra(1), 0.0);
    assert_eq!(extra(2), 0.0);
    // 3x the FLOPs at the same GEMM rate.
    assert!(
        (extra(3) / extra(0) - 3.0).abs() < 1e-9,
        "{} {}",
        extra(0),
        extra(3)
    );
}

/// Without sequence parallelism every TP rank repeats the replicated share of the
/// elementwise work; with it (or with no replicated share) TP splits all of it.
#[test]
fn tp_without_sequence_parallelism_repeats_the_norms() {
    let mut c = Cluster::preset("h100").unwrap();
    c.elementwise_ns = 1.0;
    c.replicated_elementwise = 0.4;
    let d = llama7b();
    let at = |tp, sequence_parallel, c: &Cluster| {
        StageCost {
            sequence_parallel,
            ..stage(&d, c, layout(tp, 1, 1, 1))
        }
        .forward(0, 4096.0, 4096.0)
        .compute
    };
    let (one, sp, plain) = (at(1, true, &c), at(2, true, &c), at(2, false, &c));
    let values = d.layers as f64 * 4096.0 * d.hidden as f64 * 1e-9;
    // The elementwise part alone: halved with SP, 0.4 + 0.6 / 2 = 0.7 of it without.
    assert!(
        (plain - sp - 0.2 * values).abs() < 1e-9 * plain,
        "{sp} {plain}"
    );
    assert!(sp < one);
    c.replicated_elementwise = 0.0;
    assert!((at(2, false, &c) - sp).abs() < 1e-12);
}

/// Activations are counted in the cluster's compute width: an f32 rank (Braid's CPU
/// ranks) holds twice a bf16 rank's, the logits (f32 on both) aside.
#[test]
fn f32_ranks_hold_twice_the_activation_bytes() {
    let bf16 = Cluster::preset("h100").unwrap();
    let f32_ranks = Cluster {
        compute_bytes: 4.0,
        ..bf16.clone()
    };
    let no_head = ModuleDims {
        vocab: 0,
        ..llama7b()
    };
    for tp in [1, 2, 4] {
        let at = |c| stage(&no_head, c, layout(tp, 1, 2, 1)).memory(0, 8192.0, 4096.0);
        let (a, b) = (at(&bf16), at(&f32_ranks));
        assert!((b.activations - 2.0 * a.activations).abs() < 1e-6 * b.activations);
        assert!(a.activations > 0.0);
    }
}
