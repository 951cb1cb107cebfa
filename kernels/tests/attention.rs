//! Varlen attention: forward and backward against a slow f64 reference (materialized
//! scores per sequence), packed == per sample, finite differences, errors, determinism.
//! Query ranges against other key ranges: `attention_ranges.rs`.

use braid_kernels::ops::{self, AttentionSpec};
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

/// Sizes of one attention problem: q (T, NH, HS), k/v (T, NKV, HS).
#[derive(Clone, Copy, Debug)]
struct Dims {
    t: usize,
    nh: usize,
    nkv: usize,
    hs: usize,
}

/// Host inputs of one problem.
struct Case {
    d: Dims,
    cu: Vec<usize>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Case {
    fn new(seed: u64, lens: &[usize], nh: usize, nkv: usize, hs: usize, std: f32) -> Self {
        let mut cu = vec![0];
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l);
        }
        let t = cu[cu.len() - 1];
        let mut rng = Rng::new(seed);
        Case {
            d: Dims { t, nh, nkv, hs },
            cu,
            q: rng.normal_vec(t * nh * hs, std),
            k: rng.normal_vec(t * nkv * hs, std),
            v: rng.normal_vec(t * nkv * hs, 1.0),
        }
    }

    fn q_shape(&self) -> [usize; 3] {
        [self.d.t, self.d.nh, self.d.hs]
    }

    fn kv_shape(&self) -> [usize; 3] {
        [self.d.t, self.d.nkv, self.d.hs]
    }
}

fn spec(causal: bool, hs: usize) -> AttentionSpec {
    AttentionSpec {
        causal,
        scale: 1.0 / (hs as f32).sqrt(),
    }
}

/// Forward on `dev` -> (out (T, NH, HS), lse (NH, T)) on the host.
fn run_fwd(
    dev: Device,
    c: &Case,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sp: &AttentionSpec,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let qt = Tensor::from_vec(q.to_vec(), c.q_shape(), dev)?;
    let kt = Tensor::from_vec(k.to_vec(), c.kv_shape(), dev)?;
    let vt = Tensor::from_vec(v.to_vec(), c.kv_shape(), dev)?;
    let (out, lse) = ops::attention_fwd(&qt, &kt, &vt, &c.cu, sp)?;
    assert_eq!(out.dims(), &c.q_shape());
    assert_eq!(lse.dims(), &[c.d.nh, c.d.t]);
    Ok((out.to_vec_f32()?, lse.to_vec_f32()?))
}

/// Forward + backward on `dev` -> (out, lse, dq, dk, dv) on the host.
type FwdBwd = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
fn run_fwd_bwd(dev: Device, c: &Case, dout: &[f32], sp: &AttentionSpec) -> Result<FwdBwd> {
    let qt = Tensor::from_vec(c.q.clone(), c.q_shape(), dev)?;
    let kt = Tensor::from_vec(c.k.clone(), c.kv_shape(), dev)?;
    let vt = Tensor::from_vec(c.v.clone(), c.kv_shape(), dev)?;
    let (out, lse) = ops::attention_fwd(&qt, &kt, &vt, &c.cu, sp)?;
    let dot_ = Tensor::from_vec(dout.to_vec(), c.q_shape(), dev)?;
    let (dq, dk, dv) = ops::attention_bwd(&dot_, &qt, &kt, &vt, &out, &lse, &c.cu, sp)?;
    assert_eq!(dq.dims(), &c.q_shape());
    assert_eq!(dk.dims(), &c.kv_shape());
    assert_eq!(dv.dims(), &c.kv_shape());
    Ok((
        out.to_vec_f32()?,
        lse.to_vec_f32()?,
        dq.to_vec_f32()?,
        dk.to_vec_f32()?,
        dv.to_vec_f32()?,
    ))
}

/// The obvious attention in f64: per sequence and head, the full (L, L) score matrix,
/// a softmax, and the textbook backward. -> (out, lse, dq, dk, dv).
fn reference(c: &Case, dout: &[f32], sp: &AttentionSpec) -> FwdBwd {
    let Dims { t, nh, nkv, hs } = c.d;
    let group = nh / nkv;
    let qi = |ti: usize, h: usize, e: usize| (ti * nh + h) * hs + e;
    let ki = |ti: usize, h: usize, e: usize| (ti * nkv + h) * hs + e;
    let f = |x: f32| f64::from(x);
    let scale = f64::from(sp.scale);
    let mut out = vec![0.0f64; t * nh * hs];
    let mut lse = vec![0.0f64; nh * t];
    let mut dq = vec![0.0f64; t * nh * hs];
    let mut dk = vec![0.0f64; t * nkv * hs];
    let mut dv = vec![0.0f64; t * nkv * hs];
    for w in c.cu.windows(2) {
        let (s0, n) = (w[0], w[1] - w[0]);
        for h in 0..nh {
            let kh = h / group;
            // p[i][j]: softmax over visible keys j of query i (0 where hidden).
            let mut p = vec![vec![0.0f64; n]; n];
            for i in 0..n {
                let visible = if sp.causal { i + 1 } else { n };
                let s: Vec<f64> = (0..visible)
                    .map(|j| {
                        (0..hs)
                            .map(|e| f(c.q[qi(s0 + i, h, e)]) * f(c.k[ki(s0 + j, kh, e)]))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                lse[h * t + s0 + i] = m + z.ln();
                for j in 0..visible {
                    p[i][j] = (s[j] - m).exp() / z;
                }
                for e in 0..hs {
                    out[qi(s0 + i, h, e)] = (0..visible)
                        .map(|j| p[i][j] * f(c.v[ki(s0 + j, kh, e)]))
                        .sum();
                }
            }
            for i in 0..n {
                // dp[j] = dO_i · v_j; ds = p * (dp - sum_j p dp)
                let dp: Vec<f64> = (0..n)
                    .map(|j| {
                        (0..hs)
                            .map(|e| f(dout[qi(s0 + i, h, e)]) * f(c.v[ki(s0 + j, kh, e)]))
                            .sum()
                    })
                    .collect();
                let dsum: f64 = (0..n).map(|j| p[i][j] * dp[j]).sum();
                for j in 0..n {
                    let ds = p[i][j] * (dp[j] - dsum);
                    for e in 0..hs {
                        dv[ki(s0 + j, kh, e)] += p[i][j] * f(dout[qi(s0 + i, h, e)]);
                        dq[qi(s0 + i, h, e)] += scale * ds * f(c.k[ki(s0 + j, kh, e)]);
                        dk[ki(s0 + j, kh, e)] += scale * ds * f(c.q[qi(s0 + i, h, e)]);
                    }
                }
            }
        }
    }
    let g = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    (g(out), g(lse), g(dq), g(dk), g(dv))
}

/// Packed sequences of 70 and 130 tokens (more than one 64-block), an empty one and a
/// single token; HS = 24 (not a power of two); MHA, GQA, MQA; causal and not.
fn matches_reference(dev: Device) -> Result<()> {
    let lens = [70, 0, 1, 130, 5];
    for (seed, &(nh, nkv)) in [(4, 4), (4, 2), (4, 1)].iter().enumerate() {
        for causal in [true, false] {
            let c = Case::new(seed as u64 + 10, &lens, nh, nkv, 24, 1.0);
            let dout = Rng::new(99).normal_vec(c.q.len(), 1.0);
            let sp = spec(causal, 24);
            let got = run_fwd_bwd(dev, &c, &dout, &sp)?;
            let want = reference(&c, &dout, &sp);
            let what = |x: &str| format!("{x} (nh {nh}, nkv {nkv}, causal {causal})");
            assert_close(&what("out"), &got.0, &want.0, 1e-5, 1e-4);
            assert_close(&what("lse"), &got.1, &want.1, 1e-5, 1e-5);
            assert_close(&what("dq"), &got.2, &want.2, 1e-5, 1e-4);
            assert_close(&what("dk"), &got.3, &want.3, 1e-5, 1e-4);
            assert_close(&what("dv"), &got.4, &want.4, 1e-5, 1e-4);
        }
    }
    Ok(())
}

/// Peaked softmaxes (scores in the hundreds) stay finite and exact: the online
/// softmax rescales by its running max.
fn large_scores(dev: Device) -> Result<()> {
    let c = Case::new(3, &[150, 20], 2, 1, 16, 6.0);
    let dout = Rng::new(4).normal_vec(c.q.len(), 1.0);
    for causal in [true, false] {
        let sp = spec(causal, 16);
        let got = run_fwd_bwd(dev, &c, &dout, &sp)?;
        let want = reference(&c, &dout, &sp);
        assert!(got.0.iter().chain(&got.2).all(|x| x.is_finite()));
        assert_close("out", &got.0, &want.0, 1e-4, 1e-4);
        assert_close("lse", &got.1, &want.1, 1e-4, 1e-5);
        assert_close("dq", &got.2, &want.2, 1e-3, 1e-3);
        assert_close("dk", &got.3, &want.3, 1e-3, 1e-3);
        assert_close("dv", &got.4, &want.4, 1e-4, 1e-4);
    }
    Ok(())
}

/// Rows `[t0, t1)` of a (T, H, HS) buffer.
fn rows(x: &[f32], t0: usize, t1: usize, heads: usize, hs: usize) -> Vec<f32> {
    x[t0 * heads * hs..t1 * heads * hs].to_vec()
}

/// Running a packed batch equals running each sample alone, outputs and grads.
fn packed_equals_separate(dev: Device) -> Result<()> {
    let lens = [70, 0, 1, 130, 33];
    let (nh, nkv, hs) = (4, 2, 24);
    for causal in [true, false] {
        let c = Case::new(21, &lens, nh, nkv, hs, 1.0);
        let dout = Rng::new(22).normal_vec(c.q.len(), 1.0);
        let sp = spec(causal, hs);
        let packed = run_fwd_bwd(dev, &c, &dout, &sp)?;
        for w in c.cu.windows(2) {
            let (t0, t1) = (w[0], w[1]);
            let one = Case {
                d: Dims { t: t1 - t0, ..c.d },
                cu: vec![0, t1 - t0],
                q: rows(&c.q, t0, t1, nh, hs),
                k: rows(&c.k, t0, t1, nkv, hs),
                v: rows(&c.v, t0, t1, nkv, hs),
            };
            let alone = run_fwd_bwd(dev, &one, &rows(&dout, t0, t1, nh, hs), &sp)?;
            let lse_rows: Vec<f32> = (0..nh)
                .flat_map(|h| packed.1[h * c.d.t + t0..h * c.d.t + t1].to_vec())
                .collect();
            let what = |x: &str| format!("{x} of sample [{t0}, {t1}) causal {causal}");
            assert_close(
                &what("out"),
                &rows(&packed.0, t0, t1, nh, hs),
                &alone.0,
                1e-6,
                1e-6,
            );
            assert_close(&what("lse"), &lse_rows, &alone.1, 1e-6, 1e-6);
            assert_close(
                &what("dq"),
                &rows(&packed.2, t0, t1, nh, hs),
                &alone.2,
                1e-6,
                1e-6,
            );
            assert_close(
                &what("dk"),
                &rows(&packed.3, t0, t1, nkv, hs),
                &alone.3,
                1e-6,
                1e-6,
            );
            assert_close(
                &what("dv"),
                &rows(&packed.4, t0, t1, nkv, hs),
                &alone.4,
                1e-6,
                1e-6,
            );
        }
    }
    Ok(())
}

/// dq, dk, dv by central differences of loss = dot(out, r) on tiny GQA shapes.
fn grads_by_finite_differences(dev: Device) -> Result<()> {
    // Two sequences (3 and 4 tokens) plus an empty one, NH = 4 sharing NKV = 2 heads.
    for causal in [true, false] {
        let c = Case::new(5, &[3, 0, 4], 4, 2, 3, 1.0);
        let sp = spec(causal, 3);
        let r = Rng::new(6).normal_vec(c.q.len(), 1.0);
        let (_, _, dq, dk, dv) = run_fwd_bwd(dev, &c, &r, &sp)?;
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> Result<f64> {
            Ok(dot(&run_fwd(dev, &c, q, k, v, &sp)?.0, &r))
        };
        let tol = FdTolerance::default();
        check_grad("dq", &c.q, &dq, tol, |q| loss(q, &c.k, &c.v))?;
        check_grad("dk", &c.k, &dk, tol, |k| loss(&c.q, k, &c.v))?;
        check_grad("dv", &c.v, &dv, tol, |v| loss(&c.q, &c.k, v))?;
    }
    Ok(())
}

/// The same inputs give bitwise the same outputs, also on a one-thread pool.
fn deterministic(dev: Device) -> Result<()> {
    let c = Case::new(7, &[130, 70, 1], 4, 2, 24, 1.0);
    let dout = Rng::new(8).normal_vec(c.q.len(), 1.0);
    let sp = spec(true, 24);
    let a = run_fwd_bwd(dev, &c, &dout, &sp)?;
    let b = run_fwd_bwd(dev, &c, &dout, &sp)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| Error::invalid("test", e.to_string()))?;
    let one = pool.install(|| run_fwd_bwd(dev, &c, &dout, &sp))?;
    for other in [&b, &one] {
        assert!(a.0 == other.0 && a.1 == other.1, "forward differs");
        assert!(
            a.2 == other.2 && a.3 == other.3 && a.4 == other.4,
            "backward differs"
        );
    }
    Ok(())
}

/// An empty batch (T = 0) and all-empty sequences are fine.
fn empty_batch(dev: Device) -> Result<()> {
    let c = Case::new(9, &[0, 0], 2, 1, 8, 1.0);
    let (out, lse, dq, dk, dv) = run_fwd_bwd(dev, &c, &[], &spec(true, 8))?;
    assert!(out.is_empty() && lse.is_empty() && dq.is_empty() && dk.is_empty() && dv.is_empty());
    Ok(())
}

fn is_invalid<T>(r: Result<T>) -> bool {
    matches!(r, Err(Error::Invalid { .. }))
}

fn is_shape<T>(r: Result<T>) -> bool {
    matches!(r, Err(Error::Shape { .. }))
}

fn is_dtype<T>(r: Result<T>) -> bool {
    matches!(r, Err(Error::DType { .. }))
}

/// Bad arguments are errors of the right kind, never panics.
fn errors(dev: Device) -> Result<()> {
    let (t, nh, nkv, hs) = (6, 4, 2, 8);
    let q = Tensor::zeros([t, nh, hs], DType::F32, dev)?;
    let k = Tensor::zeros([t, nkv, hs], DType::F32, dev)?;
    let v = Tensor::zeros([t, nkv, hs], DType::F32, dev)?;
    let sp = spec(true, hs);
    let cu = [0, 2, 6];
    let fwd =
        |q: &Tensor, k: &Tensor, v: &Tensor, cu: &[usize]| ops::attention_fwd(q, k, v, cu, &sp);
    assert!(fwd(&q, &k, &v, &cu).is_ok());

    // cu_seqlens: not starting at 0, not ending at T, decreasing, too short.
    for bad in [
        &[1, 6][..],
        &[0, 2, 5],
        &[0, 4, 2, 6],
        &[0, 2, 7],
        &[0],
        &[],
    ] {
        assert!(is_invalid(fwd(&q, &k, &v, bad)), "cu_seqlens {bad:?}");
    }
    // NH % NKV != 0.
    let k3 = Tensor::zeros([t, 3, hs], DType::F32, dev)?;
    assert!(is_shape(fwd(&q, &k3, &k3, &cu)));
    // Mismatched HS, mismatched T, v unlike k, wrong rank.
    let k_hs = Tensor::zeros([t, nkv, hs + 1], DType::F32, dev)?;
    assert!(is_shape(fwd(&q, &k_hs, &k_hs, &cu)));
    let k_t = Tensor::zeros([t + 1, nkv, hs], DType::F32, dev)?;
    assert!(is_shape(fwd(&q, &k_t, &k_t, &cu)));
    assert!(is_shape(fwd(&q, &k, &k_hs, &cu)));
    let q2 = Tensor::zeros([t, nh * hs], DType::F32, dev)?;
    assert!(is_shape(fwd(&q2, &k, &v, &cu)));
    // Wrong dtypes: a u32 tensor, mixed bf16/f32, and all-bf16 (storage only on CPU).
    let qu = Tensor::from_vec_u32(vec![0; t * nh * hs], [t, nh, hs], dev)?;
    assert!(is_dtype(fwd(&qu, &k, &v, &cu)));
    let kb = ops::cast(&k, DType::BF16)?;
    assert!(is_dtype(fwd(&q, &kb, &v, &cu)));
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    let (qb, vb) = (ops::cast(&q, DType::BF16)?, ops::cast(&v, DType::BF16)?);
    assert!(fwd(&qb, &kb, &vb, &cu).is_ok());
    // Non-finite scale.
    let nan = AttentionSpec {
        causal: false,
        scale: f32::NAN,
    };
    assert!(is_invalid(ops::attention_fwd(&q, &k, &v, &cu, &nan)));

    // Backward: dout/out/lse shapes and dtypes, and the same checks on q, k, v.
    let (out, lse) = fwd(&q, &k, &v, &cu)?;
    let bwd = |dout: &Tensor, out: &Tensor, lse: &Tensor, k: &Tensor, cu: &[usize]| {
        ops::attention_bwd(dout, &q, k, &v, out, lse, cu, &sp)
    };
    assert!(bwd(&out, &out, &lse, &k, &cu).is_ok());
    let lse_t = Tensor::zeros([t, nh], DType::F32, dev)?;
    assert!(is_shape(bwd(&out, &out, &lse_t, &k, &cu)));
    let short = Tensor::zeros([t - 1, nh, hs], DType::F32, dev)?;
    assert!(is_shape(bwd(&short, &out, &lse, &k, &cu)));
    assert!(is_shape(bwd(&out, &short, &lse, &k, &cu)));
    let lse_u = Tensor::from_vec_u32(vec![0; nh * t], [nh, t], dev)?;
    assert!(is_dtype(bwd(&out, &out, &lse_u, &k, &cu)));
    let dout_b = ops::cast(&out, DType::BF16)?;
    assert!(is_dtype(bwd(&dout_b, &out, &lse, &k, &cu)));
    assert!(is_invalid(bwd(&out, &out, &lse, &k, &[0, 7])));
    assert!(is_shape(bwd(&out, &out, &lse, &k3, &cu)));
    Ok(())
}

braid_kernels::test_on_devices!(
    matches_reference,
    large_scores,
    packed_equals_separate,
    grads_by_finite_differences,
    deterministic,
    empty_batch,
    errors,
);
