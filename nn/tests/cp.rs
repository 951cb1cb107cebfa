//! Context parallelism: the plan (zigzag chunks, owners, balance, errors) and the
//! transformer block on CP ranks against the single-rank block (outputs, input grads,
//! parameter grads summed over ranks), causal with RoPE and GQA, bidirectional without
//! RoPE, ragged packed samples, CP combined with TP.
// Test code: a failed expectation is a panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use braid_comm::Comm;
use braid_comm::local::{LocalComm, run_local};
use braid_kernels::ops::Activation;
use braid_kernels::testing::assert_close;
use braid_kernels::{Device, Tensor};
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, CpPlan, DynamicNtk, MlpConfig, MlpKind, NormKind,
    Rope, SeqInfo, TransformerBlock,
};
use common::*;

const TIMEOUT: Duration = Duration::from_secs(30);

/// Bidirectional encoder block, no RoPE, MQA.
fn bidirectional_no_rope() -> BlockConfig {
    BlockConfig {
        attn: AttentionConfig {
            dims: AttentionDims {
                c: 6,
                nh: 3,
                nkv: 1,
                hs: 2,
            },
            causal: false,
            qkv_bias: true,
            o_bias: true,
            rope: None,
        },
        mlp: MlpConfig {
            c: 6,
            ff: 10,
            kind: MlpKind::Gelu(Activation::GeluErf),
            bias: true,
        },
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
    }
}

/// The block of `config` (same weights on every call), with dynamic NTK RoPE scaling
/// past 8 positions when it has RoPE.
fn block(config: BlockConfig, tp: Arc<dyn Comm>) -> TestResult<TransformerBlock> {
    let mut b = TransformerBlock::new(&test_init(21, Device::Cpu), "blocks.0", config, tp)?;
    if let Some(r) = config.attn.rope {
        b.self_attn.rope = Some(Rope::new(r)?.with_dynamic_ntk(DynamicNtk {
            theta: f64::from(r.theta),
            factor: 2.0,
            max_positions: 8,
        }));
    }
    Ok(b)
}

/// Forward + backward of `b` on x (T, C) -> (y, dx, param grads).
fn fwd_bwd(
    b: &mut TransformerBlock,
    x: &Tensor,
    seq: &SeqInfo,
    dy: &Tensor,
) -> TestResult<Outcome> {
    let (y, cache) = b.forward(x, seq)?;
    let dx = b.backward(cache, dy)?;
    Ok((y.to_vec_f32()?, dx.to_vec_f32()?, grads(b)?))
}

/// Param grads summed over ranks, in rank order.
fn sum_grads(all: &[NamedGrads]) -> NamedGrads {
    let mut sum = all[0].clone();
    for g in &all[1..] {
        for ((_, s), (_, x)) in sum.iter_mut().zip(g) {
            if let (Some(s), Some(x)) = (s, x) {
                s.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            }
        }
    }
    sum
}

fn assert_grads_close(what: &str, got: &NamedGrads, want: &NamedGrads) {
    assert_eq!(got.len(), want.len());
    for ((n, g), (m, w)) in got.iter().zip(want) {
        assert_eq!(n, m);
        let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
        assert_close(&format!("{what}: d{n}"), g, w, 1e-5, 1e-5);
    }
}

/// Runs the block on `cp` ranks (each given its local tokens of the full rows) ->
/// (y, dx) re-assembled in global order, and each rank's param grads.
fn run_cp(
    config: BlockConfig,
    lens: &[usize],
    cp: usize,
    x: &Tensor,
    dy: &Tensor,
) -> TestResult<(Vec<f32>, Vec<f32>, Vec<NamedGrads>)> {
    let full = SeqInfo::packed(lens);
    let plan = CpPlan::new(&full.cu_seqlens, cp, config.attn.causal)?;
    let ranks = run_local(cp, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
        let go = || -> TestResult<(Tensor, Tensor, NamedGrads)> {
            let rank = comm.rank();
            let mut b = block(config, single())?;
            b.self_attn.cp = Some(Arc::new(comm.clone()));
            let seq = plan.seq_info(rank, &full)?;
            let (xl, dyl) = (plan.local_rows(rank, x)?, plan.local_rows(rank, dy)?);
            let (y, cache) = b.forward(&xl, &seq)?;
            let dx = b.backward(cache, &dyl)?;
            Ok((y, dx, grads(&b)?))
        };
        go().map_err(|e| e.to_string())
    })?;
    let (mut ys, mut dxs, mut gs) = (Vec::new(), Vec::new(), Vec::new());
    for (y, dx, g) in ranks {
        ys.push(y);
        dxs.push(dx);
        gs.push(g);
    }
    Ok((
        plan.assemble(&ys)?.to_vec_f32()?,
        plan.assemble(&dxs)?.to_vec_f32()?,
        gs,
    ))
}

/// cp in {2, 3, 4}: outputs, input grads and summed param grads equal the single
/// rank's, on packed samples of ragged lengths (one shorter than 2 * cp, one of a
/// single token, one empty; long ones past the dynamic-NTK length 8).
#[test]
fn block_cp_matches_single_rank() -> TestResult {
    let lens = [13, 3, 1, 0, 22, 9];
    for config in [causal_rope_gqa(), bidirectional_no_rope()] {
        let c = config.attn.dims.c;
        let full = SeqInfo::packed(&lens);
        let t = full.num_tokens();
        let x = tensor(&randn(1, t * c), &[t, c], Device::Cpu)?;
        let dy = tensor(&randn(2, t * c), &[t, c], Device::Cpu)?;
        let (y, dx, g) = fwd_bwd(&mut block(config, single())?, &x, &full, &dy)?;
        for cp in [2, 3, 4] {
            let what = format!("cp {cp} causal {}", config.attn.causal);
            let (cy, cdx, cg) = run_cp(config, &lens, cp, &x, &dy)?;
            assert_close(&format!("{what}: y"), &cy, &y, 1e-5, 1e-5);
            assert_close(&format!("{what}: dx"), &cdx, &dx, 1e-5, 1e-5);
            assert_grads_close(&what, &sum_grads(&cg), &g);
        }
    }
    Ok(())
}

/// The same inputs give bitwise the same results on CP ranks.
#[test]
fn block_cp_is_deterministic() -> TestResult {
    let lens = [17, 5];
    let config = causal_rope_gqa();
    let t = 22;
    let x = tensor(&randn(3, t * 8), &[t, 8], Device::Cpu)?;
    let dy = tensor(&randn(4, t * 8), &[t, 8], Device::Cpu)?;
    let a = run_cp(config, &lens, 3, &x, &dy)?;
    let b = run_cp(config, &lens, 3, &x, &dy)?;
    assert!(a == b, "CP results differ between runs");
    Ok(())
}

/// TP = 2 and CP = 2 on 4 ranks (TP fastest: world rank = tp + 2 * cp): each TP rank's
/// results, re-assembled over its CP group and grads summed over it, equal the TP-only
/// run's on 2 ranks; outputs also equal the single rank's.
#[test]
fn block_tp2_cp2_matches_tp2() -> TestResult {
    let lens = [11, 2, 14];
    let config = causal_rope_gqa();
    let full = SeqInfo::packed(&lens);
    let t = full.num_tokens();
    let x = tensor(&randn(5, t * 8), &[t, 8], Device::Cpu)?;
    let dy = tensor(&randn(6, t * 8), &[t, 8], Device::Cpu)?;
    let (y1, dx1, _) = fwd_bwd(&mut block(config, single())?, &x, &full, &dy)?;
    // TP only.
    let tp_only = run_local(2, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
        let go = || -> TestResult<Outcome> {
            fwd_bwd(&mut block(config, Arc::new(comm.clone()))?, &x, &full, &dy)
        };
        go().map_err(|e| e.to_string())
    })?;
    // TP x CP.
    let plan = CpPlan::new(&full.cu_seqlens, 2, true)?;
    let both = run_local(4, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
        let go = || -> TestResult<(Tensor, Tensor, NamedGrads)> {
            let w = comm.rank();
            let (tp_rank, cp_rank) = (w % 2, w / 2);
            let tp = comm.subgroup(&[2 * cp_rank, 2 * cp_rank + 1])?;
            let cp = comm.subgroup(&[tp_rank, tp_rank + 2])?;
            let mut b = block(config, tp)?;
            b.self_attn.cp = Some(cp);
            let seq = plan.seq_info(cp_rank, &full)?;
            let (xl, dyl) = (
                plan.local_rows(cp_rank, &x)?,
                plan.local_rows(cp_rank, &dy)?,
            );
            let (y, cache) = b.forward(&xl, &seq)?;
            let dx = b.backward(cache, &dyl)?;
            Ok((y, dx, grads(&b)?))
        };
        go().map_err(|e| e.to_string())
    })?;
    for tp_rank in 0..2 {
        let (a, b) = (&both[tp_rank], &both[tp_rank + 2]);
        let y = plan
            .assemble(&[a.0.try_clone()?, b.0.try_clone()?])?
            .to_vec_f32()?;
        let dx = plan
            .assemble(&[a.1.try_clone()?, b.1.try_clone()?])?
            .to_vec_f32()?;
        let (ty, tdx, tg) = &tp_only[tp_rank];
        let what = format!("tp rank {tp_rank}");
        assert_close(&format!("{what}: y vs tp"), &y, ty, 1e-5, 1e-5);
        assert_close(&format!("{what}: y vs single"), &y, &y1, 1e-5, 1e-5);
        assert_close(&format!("{what}: dx vs tp"), &dx, tdx, 1e-5, 1e-5);
        assert_close(&format!("{what}: dx vs single"), &dx, &dx1, 1e-5, 1e-5);
        assert_grads_close(&what, &sum_grads(&[a.2.clone(), b.2.clone()]), tg);
    }
    Ok(())
}

/// Chunks, token lists, owners and local SeqInfo of a small plan, by hand.
#[test]
fn plan_layout() -> TestResult {
    // Samples of 10, 3 and 0 tokens over cp = 2: 4 chunks per sample.
    let full = SeqInfo::packed(&[10, 3, 0]);
    let plan = CpPlan::new(&full.cu_seqlens, 2, true)?;
    // Sample 0 [0, 10): chunks [0,2) [2,5) [5,7) [7,10); sample 1 [10, 13): [10,10)
    // [10,11) [11,12) [12,13). Rank 0: chunks 0 and 3; rank 1: chunks 1 and 2.
    assert_eq!(plan.tokens(0)?, &[0, 1, 7, 8, 9, 12]);
    assert_eq!(plan.tokens(1)?, &[2, 3, 4, 5, 6, 10, 11]);
    assert_eq!(plan.num_tokens(1)?, 7);
    for (r, toks) in [plan.tokens(0)?, plan.tokens(1)?].iter().enumerate() {
        for (i, &g) in toks.iter().enumerate() {
            assert_eq!(plan.owner(g)?, (r, i));
        }
    }
    let s0 = plan.seq_info(0, &full)?;
    assert_eq!(s0.cu_seqlens, vec![0, 2, 5, 5, 6, 6, 6]);
    assert_eq!(s0.positions, vec![0, 1, 7, 8, 9, 2]);
    let local = s0.cp.as_ref().ok_or("cp")?;
    assert_eq!(
        (
            local.rank(),
            local.cp(),
            local.total_tokens(),
            local.seq_len()
        ),
        (0, 2, 13, 10)
    );
    let segs: Vec<_> = local
        .segments()
        .iter()
        .map(|s| (s.q_start, s.q_len, s.k_start, s.k_len))
        .collect();
    // Causal: each chunk sees its sample's keys up to its own end.
    assert_eq!(segs, vec![(0, 2, 0, 2), (2, 3, 0, 10), (5, 1, 10, 3)]);
    let bidir = CpPlan::new(&full.cu_seqlens, 2, false)?;
    let s1 = bidir.seq_info(1, &full)?;
    let segs: Vec<_> = s1
        .cp
        .as_ref()
        .ok_or("cp")?
        .segments()
        .iter()
        .map(|s| (s.q_start, s.q_len, s.k_start, s.k_len))
        .collect();
    // Bidirectional: both chunks of a sample in one segment, whole sample as keys.
    assert_eq!(segs, vec![(0, 5, 0, 10), (5, 2, 10, 3)]);
    // local_rows / assemble are inverse.
    let x = tensor(&randn(7, 13 * 3), &[13, 3], Device::Cpu)?;
    let parts = [plan.local_rows(0, &x)?, plan.local_rows(1, &x)?];
    assert_eq!(parts[0].dims(), &[6, 3]);
    assert_eq!(plan.assemble(&parts)?.to_vec_f32()?, x.to_vec_f32()?);
    Ok(())
}

/// Under a causal mask, the zigzag gives every rank the same attention work (score
/// pairs) when samples divide evenly, and every token exactly one owner.
#[test]
fn plan_balances_causal_work() -> TestResult {
    let plan = CpPlan::new(&[0, 800, 1600], 4, true)?;
    let full = SeqInfo::packed(&[800, 800]);
    let mut work = Vec::new();
    let mut seen = vec![0usize; 1600];
    for r in 0..4 {
        let seq = plan.seq_info(r, &full)?;
        let local = seq.cp.as_ref().ok_or("cp")?;
        let pairs: usize = local
            .segments()
            .iter()
            .map(|s| s.q_len * (s.k_len - s.q_len) + s.q_len * (s.q_len + 1) / 2)
            .sum();
        work.push(pairs);
        for &g in plan.tokens(r)? {
            seen[g] += 1;
        }
        assert_eq!(plan.num_tokens(r)?, 400);
    }
    assert!(work.iter().all(|&w| w == work[0]), "unbalanced: {work:?}");
    assert!(seen.iter().all(|&n| n == 1));
    Ok(())
}

/// Bad plans and mismatched groups are errors that say what is wrong.
#[test]
fn cp_errors() -> TestResult {
    let msg = |r: braid_nn::Result<CpPlan>| r.expect_err("should fail").to_string();
    assert!(msg(CpPlan::new(&[0, 4], 0, true)).contains("cp must be >= 1"));
    assert!(msg(CpPlan::new(&[1, 4], 2, true)).contains("must start with 0"));
    assert!(msg(CpPlan::new(&[0, 4, 3], 2, true)).contains("nondecreasing"));
    let full = SeqInfo::packed(&[5, 4]);
    let plan = CpPlan::new(&full.cu_seqlens, 2, true)?;
    assert!(plan.tokens(2).is_err() && plan.owner(9).is_err());
    assert!(plan.seq_info(0, &SeqInfo::packed(&[4, 5])).is_err());
    let x = tensor(&randn(8, 9 * 8), &[9, 8], Device::Cpu)?;
    let xl = plan.local_rows(0, &x)?;
    let seq = plan.seq_info(0, &full)?;
    // A CP SeqInfo but no CP group; a CP group but no plan; wrong causality; a group
    // whose size is not the plan's.
    let b = block(causal_rope_gqa(), single())?;
    let e = b
        .forward(&xl, &seq)
        .map(|_| ())
        .expect_err("no group")
        .to_string();
    assert!(e.contains("no CP group"), "{e}");
    let res = run_local(
        2,
        TIMEOUT,
        |comm: LocalComm| -> Result<Vec<String>, String> {
            let rank = comm.rank();
            let group: Arc<dyn Comm> = Arc::new(comm);
            let mut errs = Vec::new();
            let mut b = block(causal_rope_gqa(), single()).map_err(|e| e.to_string())?;
            b.self_attn.cp = Some(Arc::clone(&group));
            let x = plan.local_rows(rank, &x).map_err(|e| e.to_string())?;
            let plain = SeqInfo::packed(&[x.dims()[0]]);
            errs.push(
                b.forward(&x, &plain)
                    .map(|_| ())
                    .expect_err("no plan")
                    .to_string(),
            );
            let bidir = CpPlan::new(&full.cu_seqlens, 2, false).map_err(|e| e.to_string())?;
            let seq = bidir.seq_info(rank, &full).map_err(|e| e.to_string())?;
            errs.push(
                b.forward(&x, &seq)
                    .map(|_| ())
                    .expect_err("causal")
                    .to_string(),
            );
            let other = plan.seq_info(1 - rank, &full).map_err(|e| e.to_string())?;
            let wrong = SeqInfo {
                cu_seqlens: vec![0, x.dims()[0]],
                positions: vec![0; x.dims()[0]],
                cp: other.cp,
            };
            errs.push(
                b.forward(&x, &wrong)
                    .map(|_| ())
                    .expect_err("rank")
                    .to_string(),
            );
            Ok(errs)
        },
    )?;
    for errs in res {
        assert!(errs[0].contains("has no CP plan"), "{}", errs[0]);
        assert!(errs[1].contains("causal = false"), "{}", errs[1]);
        assert!(errs[2].contains("CP plan"), "{}", errs[2]);
    }
    // A group without all_to_all_v (the minimal test group) fails cleanly.
    let errs = run_on_ranks(2, |r| {
        let rank = r.rank();
        let mut b = block(causal_rope_gqa(), single()).map_err(|e| e.to_string())?;
        b.self_attn.cp = Some(Arc::new(r));
        let x = plan.local_rows(rank, &x).map_err(|e| e.to_string())?;
        let seq = plan.seq_info(rank, &full).map_err(|e| e.to_string())?;
        Ok::<_, String>(
            b.forward(&x, &seq)
                .map(|_| ())
                .expect_err("unsupported")
                .to_string(),
        )
    });
    for e in errs {
        assert!(e?.contains("all_to_all_v"));
    }
    Ok(())
}
