//! Loss: next-token targets of packed rows with a loss mask, the mean cross-entropy
//! over valid targets against an f64 reference, and the vocab-parallel cross-entropy on
//! 2 thread ranks against the single-rank fused kernel.

#![allow(clippy::unwrap_used)]

mod common;

use braid_comm::SingleRank;
use braid_comm::testing::ThreadRank;
use braid_kernels::rng::Rng;
use braid_kernels::testing::assert_close;
use braid_kernels::{Device, Tensor, ops};
use braid_llm::{
    IGNORE_INDEX, Llm, cross_entropy_loss, next_token_targets, vocab_parallel_cross_entropy,
};
use braid_nn::{Init, SeqInfo};
use common::{TestResult, tiny_config};

const IG: u32 = IGNORE_INDEX;

fn targets_shift_within_samples(_dev: Device) -> TestResult {
    let ids = [10u32, 11, 12, 13, 20, 21, 22];
    let seq = SeqInfo::packed(&[4, 3]);
    let t = next_token_targets(&ids, &seq, None)?;
    assert_eq!(t, vec![11, 12, 13, IG, 21, 22, IG]);
    // Only tokens 2, 3 and 6 are to be predicted (e.g. the answers).
    let mask = [false, false, true, true, false, false, true];
    let t = next_token_targets(&ids, &seq, Some(&mask))?;
    assert_eq!(t, vec![IG, 12, 13, IG, IG, 22, IG]);
    assert!(next_token_targets(&ids, &seq, Some(&mask[..3])).is_err());
    assert!(next_token_targets(&ids[..5], &seq, None).is_err());
    Ok(())
}

/// f64 reference: (mean loss over valid rows, dlogits / n).
fn reference(x: &[f32], v: usize, targets: &[u32], n: usize) -> (f64, Vec<f32>) {
    let mut loss = 0.0;
    let mut d = vec![0.0f32; x.len()];
    for (i, &tg) in targets.iter().enumerate() {
        if tg == IG {
            continue;
        }
        let row = &x[i * v..(i + 1) * v];
        let mx = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &a| m.max(f64::from(a)));
        let s: f64 = row.iter().map(|&a| (f64::from(a) - mx).exp()).sum();
        loss += s.ln() + mx - f64::from(row[tg as usize]);
        for j in 0..v {
            let p = (f64::from(row[j]) - mx).exp() / s;
            let oh = if j == tg as usize { 1.0 } else { 0.0 };
            d[i * v + j] = ((p - oh) / n as f64) as f32;
        }
    }
    (loss / n as f64, d)
}

fn loss_is_mean_over_valid_targets(dev: Device) -> TestResult {
    let (t, v) = (7, 11);
    let x = Rng::new(5).normal_vec(t * v, 2.0);
    let logits = Tensor::from_vec(x.clone(), [t, v], dev)?;
    let targets = [3u32, IG, 0, 10, IG, IG, 7];
    let out = cross_entropy_loss(&logits, &targets, None)?;
    assert_eq!(out.n_valid, 4);
    let (want, dwant) = reference(&x, v, &targets, 4);
    assert!(
        (f64::from(out.loss) - want).abs() <= 1e-5 * want.abs(),
        "{} vs {want}",
        out.loss
    );
    let d = out.dlogits.to_vec_f32()?;
    assert_close("dlogits", &d, &dwant, 1e-7, 1e-5);
    // Ignored rows: exactly zero grad.
    assert!(d[v..2 * v].iter().all(|&g| g == 0.0));
    // A global normalizer (other microbatches hold more targets).
    let out = cross_entropy_loss(&logits, &targets, Some(10))?;
    let (want, dwant) = reference(&x, v, &targets, 10);
    assert!((f64::from(out.loss) - want).abs() <= 1e-5 * want.abs());
    assert_close(
        "dlogits / 10",
        &out.dlogits.to_vec_f32()?,
        &dwant,
        1e-7,
        1e-5,
    );
    assert!(cross_entropy_loss(&logits, &targets, Some(3)).is_err());
    // No valid target: loss 0, grad 0.
    let out = cross_entropy_loss(&logits, &[IG; 7], None)?;
    assert_eq!(out.loss, 0.0);
    assert!(out.dlogits.to_vec_f32()?.iter().all(|&g| g == 0.0));
    // Target out of range.
    assert!(cross_entropy_loss(&logits, &[11, IG, IG, IG, IG, IG, IG], None).is_err());
    Ok(())
}

/// `Llm::loss` on a model: the loss of its own logits, and only target tokens count.
fn model_loss_masks_non_targets(dev: Device) -> TestResult {
    let cfg = tiny_config(false, false);
    let v = cfg.vocab;
    let mut llm = Llm::new(&cfg, &Init::new(3, dev).with_std(0.3))?;
    let ids = [1u32, 2, 3, 4, 5, 6];
    let seq = SeqInfo::packed(&[3, 3]);
    let mask = [false, true, true, false, false, true];
    let targets = next_token_targets(&ids, &seq, Some(&mask))?;
    let idt = Tensor::from_vec_u32(ids.to_vec(), [6], dev)?;
    let (out, cache) = llm.loss(&idt, &seq, None, &targets, None)?;
    assert_eq!(out.n_valid, 3);
    let (logits, _) = llm.forward(&idt, &seq, None)?;
    let (want, dwant) = reference(&logits.to_vec_f32()?, v, &targets, 3);
    assert!((f64::from(out.loss) - want).abs() <= 1e-5 * want.abs());
    let d = out.dlogits.to_vec_f32()?;
    assert_close("model dlogits", &d, &dwant, 1e-7, 1e-5);
    llm.backward(cache, &out.dlogits)?;
    Ok(())
}

fn vocab_parallel_ce_two_ranks_equals_one(dev: Device) -> TestResult {
    let (t, v, tp) = (6usize, 10usize, 2usize);
    let vl = v / tp;
    let x = Rng::new(9).normal_vec(t * v, 3.0);
    // Targets on both shards, and ignored rows.
    let targets = vec![0u32, 7, IG, 4, 5, 9];
    let scale = 0.25;
    let logits = Tensor::from_vec(x.clone(), [t, v], dev)?;
    let tt = Tensor::from_vec_u32(targets.clone(), [t], dev)?;
    let (want_l, want_d) = ops::cross_entropy_fwd_bwd(&logits, &tt, IG, scale)?;
    let (want_l, want_d) = (want_l.to_vec_f32()?, want_d.to_vec_f32()?);
    // A group of one is the fused kernel itself.
    let (l1, d1) = vocab_parallel_cross_entropy(&SingleRank, &logits, 0, &tt, IG, scale)?;
    assert_eq!(l1.to_vec_f32()?, want_l);
    assert_eq!(d1.to_vec_f32()?, want_d);
    type RankOut = Result<(Vec<f32>, Vec<f32>), String>;
    let results: Vec<RankOut> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadRank::group(tp)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (x, targets) = (&x, &targets);
                s.spawn(move || -> RankOut {
                    let run = || -> TestResult<(Vec<f32>, Vec<f32>)> {
                        let shard: Vec<f32> = x
                            .chunks_exact(v)
                            .flat_map(|row| row[r * vl..(r + 1) * vl].to_vec())
                            .collect();
                        let shard = Tensor::from_vec(shard, [t, vl], dev)?;
                        let tt = Tensor::from_vec_u32(targets.clone(), [t], dev)?;
                        let (l, d) =
                            vocab_parallel_cross_entropy(&comm, &shard, r * vl, &tt, IG, scale)?;
                        Ok((l.to_vec_f32()?, d.to_vec_f32()?))
                    };
                    run().map_err(|e| e.to_string())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        let (l, d) = res?;
        assert_close(&format!("rank {r} losses"), &l, &want_l, 1e-6, 1e-6);
        let want_shard: Vec<f32> = want_d
            .chunks_exact(v)
            .flat_map(|row| row[r * vl..(r + 1) * vl].to_vec())
            .collect();
        assert_close(&format!("rank {r} dlogits"), &d, &want_shard, 1e-7, 1e-5);
        assert!(d[2 * vl..3 * vl].iter().all(|&g| g == 0.0), "ignored row");
    }
    Ok(())
}

fn vocab_parallel_ce_rejects_bad_arguments(dev: Device) -> TestResult {
    let logits = Tensor::from_vec(vec![0.0; 8], [2, 4], dev)?;
    let tt = Tensor::from_vec_u32(vec![1, 2], [2], dev)?;
    // A group of one must start at 0.
    assert!(vocab_parallel_cross_entropy(&SingleRank, &logits, 4, &tt, IG, 1.0).is_err());
    let short = Tensor::from_vec_u32(vec![1], [1], dev)?;
    assert!(vocab_parallel_cross_entropy(&SingleRank, &logits, 0, &short, IG, 1.0).is_err());
    // Out-of-range target across 2 ranks (V = 8).
    let errs: Vec<bool> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadRank::group(2)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                s.spawn(move || {
                    let logits = Tensor::from_vec(vec![0.0; 8], [2, 4], dev).unwrap();
                    let tt = Tensor::from_vec_u32(vec![1, 8], [2], dev).unwrap();
                    vocab_parallel_cross_entropy(&comm, &logits, r * 4, &tt, IG, 1.0).is_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(false)).collect()
    });
    assert_eq!(errs, vec![true, true]);
    Ok(())
}

braid_kernels::test_on_devices!(
    targets_shift_within_samples,
    loss_is_mean_over_valid_targets,
    model_loss_masks_non_targets,
    vocab_parallel_ce_two_ranks_equals_one,
    vocab_parallel_ce_rejects_bad_arguments,
);
