//! Zero-bubble pipelining's split backward: a transformer block whose weight gradients
//! are deferred from each microbatch's backward and added in W passes later gives the
//! same input grads and the same weight grads, bit for bit, as the whole backward, on
//! one rank and over a TP group of two, holding each tensor it keeps for a W once.
// Test code: a failed expectation is a panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::Device;
use braid_nn::wgrad::{apply_deferred, defer_weight_grads, take_deferred};
use braid_nn::{Linear, Module, SeqInfo, TransformerBlock};
use common::*;

/// Per microbatch its dx, then every grad: three microbatches forward, then backward in
/// order, each W (`split`) one microbatch behind its B, as a pipeline stage runs them.
type Split = (Vec<Vec<f32>>, NamedGrads);

fn run(g: Arc<dyn Comm>, split: bool, dev: Device) -> TestResult<Split> {
    let tp = g.size();
    let mut b = TransformerBlock::new(&test_init(3, dev), "blocks.0", causal_rope_gqa(), g)?;
    let seqs = [vec![3, 2], vec![4], vec![1, 2, 2]];
    let mut caches = Vec::new();
    for (i, lens) in seqs.iter().enumerate() {
        let seq = SeqInfo::packed(lens);
        let x = randn(10 + i as u64, seq.num_tokens() * 8);
        caches.push(
            b.forward(&tensor(&x, &[seq.num_tokens(), 8], dev)?, &seq)?
                .1,
        );
    }
    defer_weight_grads(&mut b, split);
    let (mut dxs, mut pending) = (Vec::new(), Vec::new());
    for (i, cache) in caches.into_iter().enumerate() {
        let t: usize = seqs[i].iter().sum();
        let dy = randn(20 + i as u64, t * 8);
        dxs.push(
            b.backward(cache, &tensor(&dy, &[t, 8], dev)?)?
                .to_vec_f32()?,
        );
        let d = take_deferred(&mut b);
        // q, k, v, o, gate, up, down: seven weights deferred, none without deferring.
        assert_eq!(d.len(), if split { 7 } else { 0 });
        if split {
            // Held until its W: each linear's output grad and input, every tensor once
            // (q, k and v share theirs, gate and up theirs): per token 4 C + 2 q + 2 kv
            // + 3 ff values, what the planner charges (`ModuleDims::act_bytes_per_token`,
            // its sequence-parallel TP dividing the C terms too, which this TP does not).
            let (c, q, kv, ff) = (8, 16, 8, 12);
            let per_token = 4 * c + (2 * q + 2 * kv + 3 * ff) / tp;
            assert_eq!(d.held_bytes(), t * per_token * 4, "tp {tp}");
        }
        pending.push(d);
        if pending.len() == 2 {
            apply_deferred(&mut b, pending.remove(0))?;
        }
    }
    for d in pending {
        apply_deferred(&mut b, d)?;
    }
    Ok((dxs, grads(&b)?))
}

fn split_backward_equals_the_whole_backward(dev: Device) -> TestResult {
    let whole = run(single(), false, dev)?;
    assert!(
        whole == run(single(), true, dev)?,
        "one rank: the split backward differs"
    );
    let tp = |split: bool| {
        run_on_ranks(2, move |r| {
            run(Arc::new(r), split, dev).map_err(|e| e.to_string())
        })
    };
    for (a, b) in tp(false).into_iter().zip(tp(true)) {
        assert!(a? == b?, "TP 2: the split backward differs");
    }
    Ok(())
}

/// A frozen weight defers nothing; grads taken from one module are refused by another.
fn frozen_weights_defer_nothing_and_strangers_are_refused(dev: Device) -> TestResult {
    let mut b = TransformerBlock::new(&test_init(3, dev), "blocks.0", causal_rope_gqa(), single())?;
    b.freeze();
    defer_weight_grads(&mut b, true);
    let seq = SeqInfo::packed(&[3]);
    let x = tensor(&randn(1, 24), &[3, 8], dev)?;
    let (y, cache) = b.forward(&x, &seq)?;
    b.backward(cache, &y)?;
    assert!(take_deferred(&mut b).is_empty());
    b.unfreeze()?;
    let (y, cache) = b.forward(&x, &seq)?;
    b.backward(cache, &y)?;
    let d = take_deferred(&mut b);
    assert_eq!(d.len(), 7);
    let mut one = Linear::new(&test_init(4, dev), "lone", 8, 8, false)?;
    let e = apply_deferred(&mut one, d).unwrap_err().to_string();
    assert!(e.contains("not from this module"), "{e}");
    Ok(())
}

braid_kernels::test_on_devices!(
    split_backward_equals_the_whole_backward,
    frozen_weights_defer_nothing_and_strangers_are_refused,
);
