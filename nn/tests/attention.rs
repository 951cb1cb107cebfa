//! Attention and the transformer block: forward against a slow reference,
// Test code: a failed expectation is a panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used)]
//! finite-difference grads, packed (varlen) samples, determinism, names, validation
//! and tensor-parallel equivalence.

mod common;

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::ops::Activation;
use braid_kernels::testing::{FdTolerance, assert_close};
use braid_kernels::{Device, Tensor};
use braid_nn::{
    Attention, AttentionConfig, AttentionDims, BlockConfig, BlockSaved, MlpConfig, MlpKind, Module,
    NormKind, RopeConfig, SeqInfo, TransformerBlock,
};
use common::*;

/// Causal, RoPE, GQA 4 query / 2 kv heads (the shared block's attention).
fn gqa_rope_causal() -> AttentionConfig {
    causal_rope_gqa().attn
}

fn bidirectional_partial_rope() -> AttentionConfig {
    AttentionConfig {
        dims: AttentionDims {
            c: 6,
            nh: 2,
            nkv: 2,
            hs: 4,
        },
        causal: false,
        qkv_bias: false,
        o_bias: true,
        rope: Some(RopeConfig {
            theta: 10.0,
            rot_dim: 2,
        }),
    }
}

fn no_rope_mqa() -> AttentionConfig {
    AttentionConfig {
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
    }
}

/// y = x Wᵀ + b on the host in f64: x (T, K), w (N, K).
fn lin(x: &[f64], w: &[f32], b: Option<&[f32]>, k: usize) -> Vec<f64> {
    let n = w.len() / k;
    x.chunks(k)
        .flat_map(|row| {
            (0..n).map(move |o| {
                let s: f64 = (0..k).map(|i| row[i] * f64::from(w[o * k + i])).sum();
                s + b.map_or(0.0, |b| f64::from(b[o]))
            })
        })
        .collect()
}

/// The obvious attention layer, in f64 with plain loops.
fn reference_attention(a: &Attention, x: &[f32], seq: &SeqInfo) -> TestResult<Vec<f32>> {
    let AttentionDims { c, nh, nkv, hs } = a.config.dims;
    let p = |n: &str| param_host(a, &format!("{}.{n}", a.name)).map(|p| p.0);
    let opt = |n: &str| {
        if a.config.qkv_bias {
            p(n).map(Some)
        } else {
            Ok(None)
        }
    };
    let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let (qb, kb, vb) = (
        opt("q_proj.bias")?,
        opt("k_proj.bias")?,
        opt("v_proj.bias")?,
    );
    let mut q = lin(&x, &p("q_proj.weight")?, qb.as_deref(), c); // (T, NH * HS)
    let mut k = lin(&x, &p("k_proj.weight")?, kb.as_deref(), c); // (T, NKV * HS)
    let v = lin(&x, &p("v_proj.weight")?, vb.as_deref(), c); // (T, NKV * HS)
    if let Some(r) = a.config.rope {
        let half = r.rot_dim / 2;
        let rot = |buf: &mut [f64], heads: usize| {
            for (t, &pos) in seq.positions.iter().enumerate() {
                for h in 0..heads {
                    let base = (t * heads + h) * hs;
                    for i in 0..half {
                        let inv = 1.0 / f64::from(r.theta).powf(2.0 * i as f64 / r.rot_dim as f64);
                        let ang = f64::from(pos) * inv;
                        let (x1, x2) = (buf[base + i], buf[base + i + half]);
                        buf[base + i] = x1 * ang.cos() - x2 * ang.sin();
                        buf[base + i + half] = x2 * ang.cos() + x1 * ang.sin();
                    }
                }
            }
        };
        rot(&mut q, nh);
        rot(&mut k, nkv);
    }
    let scale = 1.0 / (hs as f64).sqrt();
    let mut out = vec![0.0f64; seq.num_tokens() * nh * hs]; // (T, NH * HS)
    for w in seq.cu_seqlens.windows(2) {
        for i in w[0]..w[1] {
            for h in 0..nh {
                let g = h / (nh / nkv);
                let keys: Vec<usize> = (w[0]..w[1])
                    .filter(|&j| !a.config.causal || j <= i)
                    .collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        (0..hs)
                            .map(|d| q[(i * nh + h) * hs + d] * k[(j * nkv + g) * hs + d])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for (&j, sj) in keys.iter().zip(&s) {
                    let pj = (sj - m).exp() / z;
                    for d in 0..hs {
                        out[(i * nh + h) * hs + d] += pj * v[(j * nkv + g) * hs + d];
                    }
                }
            }
        }
    }
    let ob = if a.config.o_bias {
        Some(p("o_proj.bias")?)
    } else {
        None
    };
    Ok(lin(&out, &p("o_proj.weight")?, ob.as_deref(), nh * hs)
        .iter()
        .map(|&v| v as f32)
        .collect())
}

fn attention_forward_matches_reference(dev: Device) -> TestResult {
    for (config, lens) in [
        (gqa_rope_causal(), vec![3, 2, 4]),
        (bidirectional_partial_rope(), vec![5]),
        (no_rope_mqa(), vec![2, 3]),
    ] {
        let a = Attention::new(&test_init(1, dev), "attn", config, single())?;
        let seq = SeqInfo::packed(&lens);
        let c = config.dims.c;
        let x = randn(2, seq.num_tokens() * c);
        let (y, _) = a.forward(&tensor(&x, &[seq.num_tokens(), c], dev)?, &seq)?;
        assert_close(
            "attention forward",
            &y.to_vec_f32()?,
            &reference_attention(&a, &x, &seq)?,
            1e-5,
            1e-4,
        );
    }
    Ok(())
}

fn attention_grads(dev: Device) -> TestResult {
    for (config, lens) in [
        (gqa_rope_causal(), vec![3, 2, 4]),
        (bidirectional_partial_rope(), vec![2, 3]),
        (no_rope_mqa(), vec![4]),
    ] {
        let mut a = Attention::new(&test_init(3, dev), "attn", config, single())?;
        let seq = SeqInfo::packed(&lens);
        let c = config.dims.c;
        let x = randn(4, seq.num_tokens() * c);
        check_layer(
            &format!("attention {lens:?}"),
            &mut a,
            &x,
            &[seq.num_tokens(), c],
            dev,
            FdTolerance::default(),
            |a, x| Ok(a.forward(x, &seq)?.0),
            |a, x, dy| {
                let (_, cache) = a.forward(x, &seq)?;
                Ok(a.backward(cache, dy)?)
            },
        )?;
    }
    Ok(())
}

fn ln_gelu() -> BlockConfig {
    BlockConfig {
        attn: bidirectional_partial_rope(),
        mlp: MlpConfig {
            c: 6,
            ff: 8,
            kind: MlpKind::Gelu(Activation::GeluTanh),
            bias: true,
        },
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
    }
}

fn block_grads(dev: Device) -> TestResult {
    for (config, lens) in [(ln_gelu(), vec![3, 2]), (causal_rope_gqa(), vec![2, 4, 1])] {
        let mut b = TransformerBlock::new(&test_init(5, dev), "blocks.0", config, single())?;
        let seq = SeqInfo::packed(&lens);
        let c = config.attn.dims.c;
        let x = randn(6, seq.num_tokens() * c);
        check_layer(
            &format!("block {:?}", config.norm),
            &mut b,
            &x,
            &[seq.num_tokens(), c],
            dev,
            FdTolerance::default(),
            |b, x| Ok(b.forward(x, &seq)?.0),
            |b, x, dy| {
                let (_, cache) = b.forward(x, &seq)?;
                Ok(b.backward(cache, dy)?)
            },
        )?;
    }
    Ok(())
}

/// A block on packed samples equals the block run on each sample alone: outputs and
/// input grads per sample, param grads summed over the samples.
fn packed_block_equals_separate_samples(dev: Device) -> TestResult {
    let config = causal_rope_gqa();
    let c = config.attn.dims.c;
    let lens = [3usize, 5, 2];
    let seq = SeqInfo::packed(&lens);
    let t = seq.num_tokens();
    let x = randn(7, t * c);
    let dy = randn(8, t * c);
    let mut b = TransformerBlock::new(&test_init(9, dev), "blocks.1", config, single())?;
    let (y, cache) = b.forward(&tensor(&x, &[t, c], dev)?, &seq)?;
    let dx = b.backward(cache, &tensor(&dy, &[t, c], dev)?)?;
    let packed_grads = grads(&b)?;
    let (y, dx) = (y.to_vec_f32()?, dx.to_vec_f32()?);

    b.zero_grads()?;
    for w in seq.cu_seqlens.windows(2) {
        let (s, e) = (w[0] * c, w[1] * c);
        let one = SeqInfo::single(w[1] - w[0]);
        let (ys, cache) = b.forward(&tensor(&x[s..e], &[w[1] - w[0], c], dev)?, &one)?;
        let dxs = b.backward(cache, &tensor(&dy[s..e], &[w[1] - w[0], c], dev)?)?;
        assert_close("per-sample y", &ys.to_vec_f32()?, &y[s..e], 1e-6, 1e-5);
        assert_close("per-sample dx", &dxs.to_vec_f32()?, &dx[s..e], 1e-6, 1e-5);
    }
    for ((name, g_packed), (_, g_sum)) in packed_grads.iter().zip(grads(&b)?) {
        assert_close(
            name,
            &g_sum.ok_or("grad")?,
            g_packed.as_ref().ok_or("grad")?,
            1e-5,
            1e-4,
        );
    }
    Ok(())
}

/// Same seed -> bitwise-equal params and outputs, run after run.
fn block_is_deterministic(dev: Device) -> TestResult {
    let seq = SeqInfo::packed(&[4, 3]);
    let x = randn(10, 7 * 8);
    let run = || -> TestResult<(NamedValues, Vec<f32>, Vec<f32>)> {
        let mut b = TransformerBlock::new(
            &braid_nn::Init::new(11, dev),
            "blocks.0",
            causal_rope_gqa(),
            single(),
        )?;
        let mut params = Vec::new();
        for (n, _) in b.param_shapes() {
            params.push((n.clone(), param_host(&b, &n)?.0));
        }
        let (y, cache) = b.forward(&tensor(&x, &[7, 8], dev)?, &seq)?;
        let dx = b.backward(cache, &y)?;
        Ok((params, y.to_vec_f32()?, dx.to_vec_f32()?))
    };
    let first = run()?;
    assert!(first == run()?, "two runs with the same seed differ");
    Ok(())
}

/// Recomputation keeps only the block's input and gives the same output, input grad
/// and param grads bit for bit; without the packing the backward cannot recompute and
/// says so.
fn recomputed_block_equals_kept_activations(dev: Device) -> TestResult {
    let seq = SeqInfo::packed(&[4, 3]);
    let x = randn(12, 7 * 8);
    let dy = randn(13, 7 * 8);
    let run = |recompute: bool| -> TestResult<Outcome> {
        let mut b =
            TransformerBlock::new(&test_init(14, dev), "blocks.0", causal_rope_gqa(), single())?;
        let (y, saved) = b.forward_saving(tensor(&x, &[7, 8], dev)?, &seq, recompute)?;
        assert_eq!(matches!(saved, BlockSaved::Input(_)), recompute);
        let dx = b.backward_saved(saved, Some(&seq), &tensor(&dy, &[7, 8], dev)?)?;
        Ok((y.to_vec_f32()?, dx.to_vec_f32()?, grads(&b)?))
    };
    let (kept, again) = (run(false)?, run(true)?);
    assert!(kept == again, "recomputing changed the output or a grad");
    let mut b =
        TransformerBlock::new(&test_init(14, dev), "blocks.0", causal_rope_gqa(), single())?;
    let (_, saved) = b.forward_saving(tensor(&x, &[7, 8], dev)?, &seq, true)?;
    let e = b
        .backward_saved(saved, None, &tensor(&dy, &[7, 8], dev)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("blocks.0") && e.contains("SeqInfo"), "{e}");
    Ok(())
}

fn block_param_names_and_shapes(dev: Device) -> TestResult {
    let b = TransformerBlock::new(&test_init(1, dev), "blocks.3", causal_rope_gqa(), single())?;
    let want: Vec<(String, Vec<usize>)> = [
        ("blocks.3.input_layernorm.weight", vec![8]),
        ("blocks.3.self_attn.q_proj.weight", vec![16, 8]),
        ("blocks.3.self_attn.q_proj.bias", vec![16]),
        ("blocks.3.self_attn.k_proj.weight", vec![8, 8]),
        ("blocks.3.self_attn.k_proj.bias", vec![8]),
        ("blocks.3.self_attn.v_proj.weight", vec![8, 8]),
        ("blocks.3.self_attn.v_proj.bias", vec![8]),
        ("blocks.3.self_attn.o_proj.weight", vec![8, 16]),
        ("blocks.3.post_attention_layernorm.weight", vec![8]),
        ("blocks.3.mlp.gate_proj.weight", vec![12, 8]),
        ("blocks.3.mlp.up_proj.weight", vec![12, 8]),
        ("blocks.3.mlp.down_proj.weight", vec![8, 12]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    assert_eq!(b.param_shapes(), want);
    assert_eq!(
        b.num_params(),
        want.iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum::<usize>()
    );
    // Rank 1 of 2 holds half the heads and half the hidden units.
    let tp = TransformerBlock::new(
        &test_init(1, dev),
        "blocks.3",
        causal_rope_gqa(),
        Arc::new(EchoRank { rank: 1, size: 2 }),
    )?;
    let shapes = tp.param_shapes();
    assert_eq!(
        shapes[1],
        ("blocks.3.self_attn.q_proj.weight".into(), vec![8, 8])
    );
    assert_eq!(
        shapes[3],
        ("blocks.3.self_attn.k_proj.weight".into(), vec![4, 8])
    );
    assert_eq!(
        shapes[7],
        ("blocks.3.self_attn.o_proj.weight".into(), vec![8, 8])
    );
    assert_eq!(
        shapes[11],
        ("blocks.3.mlp.down_proj.weight".into(), vec![8, 6])
    );
    Ok(())
}

fn config_errors_say_what_is_wrong(dev: Device) -> TestResult {
    let init = test_init(1, dev);
    let msg = |cfg: AttentionConfig, g: Arc<dyn Comm>| {
        Attention::new(&init, "attn", cfg, g)
            .map(|_| ())
            .expect_err("invalid config")
            .to_string()
    };
    let mut cfg = gqa_rope_causal();
    cfg.dims = AttentionDims {
        c: 8,
        nh: 6,
        nkv: 4,
        hs: 4,
    };
    assert_eq!(
        msg(cfg, single()),
        "invalid AttentionDims: nh = 6 is not a multiple of nkv = 4"
    );
    cfg.dims = AttentionDims {
        c: 8,
        nh: 4,
        nkv: 1,
        hs: 4,
    };
    assert_eq!(
        msg(cfg, Arc::new(EchoRank { rank: 0, size: 2 })),
        "invalid AttentionDims: nkv = 1 key/value heads cannot be split across a TP group of 2"
    );
    cfg.dims = AttentionDims {
        c: 8,
        nh: 4,
        nkv: 2,
        hs: 3,
    };
    cfg.rope = Some(RopeConfig {
        theta: 1e4,
        rot_dim: 3,
    });
    assert_eq!(
        msg(cfg, single()),
        "invalid RopeConfig: rot_dim = 3 must be even and > 0"
    );
    cfg.rope = Some(RopeConfig {
        theta: 1e4,
        rot_dim: 4,
    });
    assert_eq!(
        msg(cfg, single()),
        "invalid RopeConfig: rot_dim = 4 is larger than the head size hs = 3"
    );
    cfg.dims.c = 0;
    assert!(msg(cfg, single()).contains("must all be > 0"));

    let mut bc = causal_rope_gqa();
    bc.mlp.c = 6;
    let err = TransformerBlock::new(&init, "b", bc, single())
        .map(|_| ())
        .expect_err("c mismatch");
    assert_eq!(
        err.to_string(),
        "invalid BlockConfig: mlp.c = 6 differs from attn.dims.c = 8"
    );

    // Runtime input errors: the offsets must describe exactly the tokens given.
    let a = Attention::new(&init, "blocks.0.self_attn", gqa_rope_causal(), single())?;
    let x = Tensor::zeros([5, 8], braid_kernels::DType::F32, dev)?;
    let err = a
        .forward(&x, &SeqInfo::packed(&[2, 2]))
        .map(|_| ())
        .expect_err("4 != 5 tokens");
    assert_eq!(
        err.to_string(),
        "blocks.0.self_attn: invalid input: SeqInfo: invalid input: cu_seqlens ends at 4 but the input has T = 5 tokens"
    );
    let bad = SeqInfo {
        cu_seqlens: vec![0, 3, 2, 5],
        positions: vec![0; 5],
        cp: None,
    };
    assert!(a.forward(&x, &bad).is_err());
    let err = a
        .forward(
            &Tensor::zeros([5, 7], braid_kernels::DType::F32, dev)?,
            &SeqInfo::single(5),
        )
        .map(|_| ());
    assert!(
        err.expect_err("C = 7")
            .to_string()
            .contains("x must be (T, C = 8) packed tokens, got shape [5, 7]")
    );
    Ok(())
}

/// Two ranks as threads (heads split 2 + 2 query, 1 + 1 key/value) reproduce the
/// single-rank block: outputs, input grads, and each rank's shard of the weight grads.
fn block_tp2_matches_single_rank(dev: Device) -> TestResult {
    let seq = SeqInfo::packed(&[3, 4]);
    let x = randn(12, 7 * 8);
    let dy = randn(13, 7 * 8);
    let run = |g: Arc<dyn Comm>| -> TestResult<Outcome> {
        let mut b = TransformerBlock::new(&test_init(14, dev), "blocks.0", causal_rope_gqa(), g)?;
        let (y, cache) = b.forward(&tensor(&x, &[7, 8], dev)?, &seq)?;
        let dx = b.backward(cache, &tensor(&dy, &[7, 8], dev)?)?;
        Ok((y.to_vec_f32()?, dx.to_vec_f32()?, grads(&b)?))
    };
    let (y, dx, g) = run(single())?;
    let results = run_on_ranks(2, |r| run(Arc::new(r)).map_err(|e| e.to_string()));
    let mut q_grad = Vec::new();
    for r in results {
        let (ry, rdx, rg) = r?;
        assert_close("tp2 block y", &ry, &y, 1e-5, 1e-5);
        assert_close("tp2 block dx", &rdx, &dx, 1e-5, 1e-4);
        // Replicated params (norm weights) get the full grad on every rank.
        assert_close(
            "tp2 norm grad",
            rg[0].1.as_ref().ok_or("grad")?,
            g[0].1.as_ref().ok_or("grad")?,
            1e-5,
            1e-4,
        );
        q_grad.extend(rg[1].1.clone().ok_or("grad")?);
    }
    assert_close(
        "tp2 q_proj grad",
        &q_grad,
        g[1].1.as_ref().ok_or("grad")?,
        1e-5,
        1e-4,
    );
    Ok(())
}

braid_kernels::test_on_devices!(
    attention_forward_matches_reference,
    attention_grads,
    block_grads,
    packed_block_equals_separate_samples,
    block_is_deterministic,
    recomputed_block_equals_kept_activations,
    block_param_names_and_shapes,
    config_errors_say_what_is_wrong,
    block_tp2_matches_single_rank,
);
