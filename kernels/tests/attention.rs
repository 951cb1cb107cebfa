//! Varlen attention: forward and backward against a slow f64 reference (materialized
//! scores per sequence), packed == per sample, finite differences, errors, determinism;
//! and the same for query ranges against other (overlapping) key ranges.

use braid_kernels::ops::attention::{QkSegment, attention_bwd_ranges, attention_fwd_ranges};
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
    if dev == Device::Cpu {
        let (qb, vb) = (ops::cast(&q, DType::BF16)?, ops::cast(&v, DType::BF16)?);
        assert!(is_dtype(fwd(&qb, &kb, &vb, &cu)));
    }
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

// ---- query ranges against key ranges ---------------------------------------------

/// Host inputs of a ranged problem: q (Tq, NH, HS), k/v (Tk, NKV, HS).
struct Ranged {
    tq: usize,
    tk: usize,
    nh: usize,
    nkv: usize,
    hs: usize,
    segs: Vec<QkSegment>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Ranged {
    /// `shape`: (q_len, k_start, k_len) per segment, queries consecutive from 0.
    fn new(
        seed: u64,
        tk: usize,
        shape: &[(usize, usize, usize)],
        heads: (usize, usize, usize),
    ) -> Self {
        let (nh, nkv, hs) = heads;
        let mut segs = Vec::new();
        let mut tq = 0;
        for &(q_len, k_start, k_len) in shape {
            segs.push(QkSegment {
                q_start: tq,
                q_len,
                k_start,
                k_len,
            });
            tq += q_len;
        }
        let mut rng = Rng::new(seed);
        Ranged {
            tq,
            tk,
            nh,
            nkv,
            hs,
            segs,
            q: rng.normal_vec(tq * nh * hs, 1.0),
            k: rng.normal_vec(tk * nkv * hs, 1.0),
            v: rng.normal_vec(tk * nkv * hs, 1.0),
        }
    }

    fn tensors(&self, dev: Device, q: &[f32], k: &[f32], v: &[f32]) -> Result<[Tensor; 3]> {
        Ok([
            Tensor::from_vec(q.to_vec(), [self.tq, self.nh, self.hs], dev)?,
            Tensor::from_vec(k.to_vec(), [self.tk, self.nkv, self.hs], dev)?,
            Tensor::from_vec(v.to_vec(), [self.tk, self.nkv, self.hs], dev)?,
        ])
    }

    /// Forward -> (out, lse) on the host.
    fn fwd(
        &self,
        dev: Device,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        sp: &AttentionSpec,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let [q, k, v] = self.tensors(dev, q, k, v)?;
        let (out, lse) = attention_fwd_ranges(&q, &k, &v, &self.segs, sp)?;
        assert_eq!(out.dims(), &[self.tq, self.nh, self.hs]);
        assert_eq!(lse.dims(), &[self.nh, self.tq]);
        Ok((out.to_vec_f32()?, lse.to_vec_f32()?))
    }

    /// Forward + backward -> (out, lse, dq, dk, dv) on the host.
    fn fwd_bwd(&self, dev: Device, dout: &[f32], sp: &AttentionSpec) -> Result<FwdBwd> {
        let [q, k, v] = self.tensors(dev, &self.q, &self.k, &self.v)?;
        let (out, lse) = attention_fwd_ranges(&q, &k, &v, &self.segs, sp)?;
        let dout = Tensor::from_vec(dout.to_vec(), [self.tq, self.nh, self.hs], dev)?;
        let (dq, dk, dv) = attention_bwd_ranges(&dout, &q, &k, &v, &out, &lse, &self.segs, sp)?;
        assert_eq!(dq.dims(), q.dims());
        assert_eq!(dk.dims(), k.dims());
        assert_eq!(dv.dims(), v.dims());
        Ok((
            out.to_vec_f32()?,
            lse.to_vec_f32()?,
            dq.to_vec_f32()?,
            dk.to_vec_f32()?,
            dv.to_vec_f32()?,
        ))
    }

    /// The textbook attention in f64, segment by segment, written from the definition
    /// of [`QkSegment`] (query i sees keys j <= k_len - q_len + i when causal).
    fn reference(&self, dout: &[f32], sp: &AttentionSpec) -> FwdBwd {
        let (nh, nkv, hs, tq) = (self.nh, self.nkv, self.hs, self.tq);
        let qi = |ti: usize, h: usize, e: usize| (ti * nh + h) * hs + e;
        let ki = |ti: usize, h: usize, e: usize| (ti * nkv + h) * hs + e;
        let f = |x: f32| f64::from(x);
        let scale = f64::from(sp.scale);
        let mut out = vec![0.0f64; self.q.len()];
        let mut lse = vec![0.0f64; nh * tq];
        let mut dq = vec![0.0f64; self.q.len()];
        let mut dk = vec![0.0f64; self.k.len()];
        let mut dv = vec![0.0f64; self.k.len()];
        for s in &self.segs {
            for h in 0..nh {
                let kh = h / (nh / nkv);
                for i in 0..s.q_len {
                    let qt = s.q_start + i;
                    let visible = if sp.causal {
                        s.k_len - s.q_len + i + 1
                    } else {
                        s.k_len
                    };
                    let keys: Vec<usize> = (s.k_start..s.k_start + visible).collect();
                    let sc: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            (0..hs)
                                .map(|e| f(self.q[qi(qt, h, e)]) * f(self.k[ki(j, kh, e)]))
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    lse[h * tq + qt] = m + z.ln();
                    let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / z).collect();
                    let dp: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            (0..hs)
                                .map(|e| f(dout[qi(qt, h, e)]) * f(self.v[ki(j, kh, e)]))
                                .sum()
                        })
                        .collect();
                    let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for (n, &j) in keys.iter().enumerate() {
                        let ds = p[n] * (dp[n] - dsum);
                        for e in 0..hs {
                            out[qi(qt, h, e)] += p[n] * f(self.v[ki(j, kh, e)]);
                            dv[ki(j, kh, e)] += p[n] * f(dout[qi(qt, h, e)]);
                            dq[qi(qt, h, e)] += scale * ds * f(self.k[ki(j, kh, e)]);
                            dk[ki(j, kh, e)] += scale * ds * f(self.q[qi(qt, h, e)]);
                        }
                    }
                }
            }
        }
        let g = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        (g(out), g(lse), g(dq), g(dk), g(dv))
    }
}

/// Segments with causal offsets that are not block multiples (50 queries against 130
/// keys), overlapping key ranges, an empty segment, one token against one key, keys
/// no segment reads (rows 140..150: zero grads); MHA, GQA, MQA; causal and not.
fn ranges_match_reference(dev: Device) -> Result<()> {
    let shape = [
        (50, 0, 130),
        (0, 10, 20),
        (70, 0, 70),
        (1, 129, 1),
        (100, 5, 135),
    ];
    for (seed, &(nh, nkv)) in [(4, 4), (4, 2), (4, 1)].iter().enumerate() {
        for causal in [true, false] {
            let c = Ranged::new(seed as u64 + 30, 150, &shape, (nh, nkv, 24));
            let dout = Rng::new(31).normal_vec(c.q.len(), 1.0);
            let sp = spec(causal, 24);
            let got = c.fwd_bwd(dev, &dout, &sp)?;
            let want = c.reference(&dout, &sp);
            let what = |x: &str| format!("{x} (nh {nh}, nkv {nkv}, causal {causal})");
            assert_close(&what("out"), &got.0, &want.0, 1e-5, 1e-4);
            assert_close(&what("lse"), &got.1, &want.1, 1e-5, 1e-5);
            assert_close(&what("dq"), &got.2, &want.2, 1e-5, 1e-4);
            assert_close(&what("dk"), &got.3, &want.3, 1e-5, 1e-4);
            assert_close(&what("dv"), &got.4, &want.4, 1e-5, 1e-4);
            let unread = 140 * nkv * 24;
            assert!(
                got.3[unread..]
                    .iter()
                    .chain(&got.4[unread..])
                    .all(|&x| x == 0.0)
            );
        }
    }
    Ok(())
}

/// With q ranges == k ranges, the ranged ops are exactly (bitwise) the cu_seqlens ops.
fn ranges_equal_varlen(dev: Device) -> Result<()> {
    let lens = [70, 0, 1, 130, 33];
    for causal in [true, false] {
        let c = Case::new(41, &lens, 4, 2, 24, 1.0);
        let dout = Rng::new(42).normal_vec(c.q.len(), 1.0);
        let sp = spec(causal, 24);
        let varlen = run_fwd_bwd(dev, &c, &dout, &sp)?;
        let r = Ranged {
            tq: c.d.t,
            tk: c.d.t,
            nh: 4,
            nkv: 2,
            hs: 24,
            segs: QkSegment::from_cu_seqlens(&c.cu),
            q: c.q.clone(),
            k: c.k.clone(),
            v: c.v.clone(),
        };
        let ranged = r.fwd_bwd(dev, &dout, &sp)?;
        assert!(
            varlen == ranged,
            "causal {causal}: ranged differs from varlen"
        );
    }
    Ok(())
}

/// Context parallelism's identity: a sample's queries cut into chunks, each chunk
/// attending to its key prefix (causal) or the whole sample, give the sample's
/// attention; dK/dV of the chunks summed over chunks give the sample's.
fn chunks_equal_whole(dev: Device) -> Result<()> {
    let lens = [150, 7, 90];
    let (nh, nkv, hs) = (4, 2, 16);
    for causal in [true, false] {
        let c = Case::new(51, &lens, nh, nkv, hs, 1.0);
        let dout = Rng::new(52).normal_vec(c.q.len(), 1.0);
        let sp = spec(causal, hs);
        let whole = run_fwd_bwd(dev, &c, &dout, &sp)?;
        // Chunk bounds within each sample (uneven, one empty).
        let cuts: [&[usize]; 3] = [&[0, 37, 37, 101, 150], &[0, 3, 7], &[0, 64, 65, 90]];
        let mut segs = Vec::new();
        for (w, cut) in c.cu.windows(2).zip(cuts) {
            for b in cut.windows(2) {
                let (q0, q1) = (w[0] + b[0], w[0] + b[1]);
                let (k_start, k_len) = if causal {
                    (w[0], b[1])
                } else {
                    (w[0], w[1] - w[0])
                };
                segs.push(QkSegment {
                    q_start: q0,
                    q_len: q1 - q0,
                    k_start,
                    k_len,
                });
            }
        }
        let r = Ranged {
            tq: c.d.t,
            tk: c.d.t,
            nh,
            nkv,
            hs,
            segs,
            q: c.q.clone(),
            k: c.k.clone(),
            v: c.v.clone(),
        };
        let chunked = r.fwd_bwd(dev, &dout, &sp)?;
        let what = |x: &str| format!("{x} causal {causal}");
        assert_close(&what("out"), &chunked.0, &whole.0, 1e-6, 1e-5);
        assert_close(&what("lse"), &chunked.1, &whole.1, 1e-6, 1e-6);
        assert_close(&what("dq"), &chunked.2, &whole.2, 1e-6, 1e-5);
        assert_close(&what("dk"), &chunked.3, &whole.3, 1e-5, 1e-5);
        assert_close(&what("dv"), &chunked.4, &whole.4, 1e-5, 1e-5);
    }
    Ok(())
}

/// dq, dk, dv of the ranged ops by central differences, with overlapping keys and a
/// shifted causal diagonal.
fn ranges_finite_differences(dev: Device) -> Result<()> {
    let shape = [(2, 0, 5), (3, 1, 4), (0, 0, 2), (2, 3, 3)];
    for causal in [true, false] {
        let c = Ranged::new(61, 6, &shape, (4, 2, 3));
        let sp = spec(causal, 3);
        let r = Rng::new(62).normal_vec(c.q.len(), 1.0);
        let (_, _, dq, dk, dv) = c.fwd_bwd(dev, &r, &sp)?;
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> Result<f64> {
            Ok(dot(&c.fwd(dev, q, k, v, &sp)?.0, &r))
        };
        let tol = FdTolerance::default();
        check_grad("dq", &c.q, &dq, tol, |q| loss(q, &c.k, &c.v))?;
        check_grad("dk", &c.k, &dk, tol, |k| loss(&c.q, k, &c.v))?;
        check_grad("dv", &c.v, &dv, tol, |v| loss(&c.q, &c.k, v))?;
    }
    Ok(())
}

/// Bitwise the same on a one-thread pool (dK/dV of overlapping ranges sum in segment
/// order whatever the split).
fn ranges_deterministic(dev: Device) -> Result<()> {
    let shape = [(130, 0, 200), (70, 50, 150), (1, 0, 1)];
    let c = Ranged::new(71, 200, &shape, (4, 1, 24));
    let dout = Rng::new(72).normal_vec(c.q.len(), 1.0);
    let sp = spec(true, 24);
    let a = c.fwd_bwd(dev, &dout, &sp)?;
    let one = braid_kernels::testing::in_pool(1, || c.fwd_bwd(dev, &dout, &sp))?;
    assert!(a == one, "ranged attention depends on the thread count");
    Ok(())
}

fn invalid_names<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(e @ Error::Invalid { .. }) => {
            assert!(
                e.to_string().contains(what),
                "error {e} should mention {what:?}"
            )
        }
        other => panic!("expected an Invalid error mentioning {what:?}, got {other:?}"),
    }
}

/// Bad segments and shapes are errors naming the segment, never panics.
fn ranges_errors(dev: Device) -> Result<()> {
    let (tq, tk, nh, nkv, hs) = (6, 9, 4, 2, 8);
    let q = Tensor::zeros([tq, nh, hs], DType::F32, dev)?;
    let k = Tensor::zeros([tk, nkv, hs], DType::F32, dev)?;
    let v = Tensor::zeros([tk, nkv, hs], DType::F32, dev)?;
    let seg = |q_start, q_len, k_start, k_len| QkSegment {
        q_start,
        q_len,
        k_start,
        k_len,
    };
    let causal = spec(true, hs);
    let bidir = spec(false, hs);
    let ok = [seg(0, 2, 0, 9), seg(2, 4, 3, 4)];
    assert!(attention_fwd_ranges(&q, &k, &v, &ok, &causal).is_ok());
    let fwd = |segs: &[QkSegment], sp: &AttentionSpec| attention_fwd_ranges(&q, &k, &v, segs, sp);
    // A gap, an overlap, queries past Tq, too few queries covered, keys past Tk.
    invalid_names(
        fwd(&[seg(0, 2, 0, 9), seg(3, 3, 0, 9)], &causal),
        "segment 1",
    );
    invalid_names(
        fwd(&[seg(0, 3, 0, 9), seg(2, 4, 0, 9)], &causal),
        "segment 1",
    );
    invalid_names(
        fwd(&[seg(0, 2, 0, 9), seg(2, 5, 0, 9)], &bidir),
        "queries past Tq",
    );
    invalid_names(
        fwd(&[seg(0, 2, 0, 9), seg(2, 3, 0, 9)], &bidir),
        "cover queries 0..5",
    );
    invalid_names(
        fwd(&[seg(0, 2, 0, 9), seg(2, 4, 6, 4)], &bidir),
        "keys past Tk",
    );
    invalid_names(fwd(&[seg(0, 6, usize::MAX, 2)], &bidir), "keys past Tk");
    // Causal with more queries than keys; queries with no keys.
    invalid_names(
        fwd(&[seg(0, 2, 0, 9), seg(2, 4, 0, 3)], &causal),
        "segment 1",
    );
    invalid_names(fwd(&[seg(0, 6, 0, 0)], &bidir), "no keys");
    // No segments for nonempty q; HS mismatch; v unlike k; NH % NKV.
    invalid_names(fwd(&[], &bidir), "cover queries 0..0");
    let k_hs = Tensor::zeros([tk, nkv, hs + 1], DType::F32, dev)?;
    assert!(is_shape(attention_fwd_ranges(
        &q, &k_hs, &k_hs, &ok, &causal
    )));
    assert!(is_shape(attention_fwd_ranges(&q, &k, &q, &ok, &causal)));
    let k3 = Tensor::zeros([tk, 3, hs], DType::F32, dev)?;
    assert!(is_shape(attention_fwd_ranges(&q, &k3, &k3, &ok, &causal)));
    // Backward: lse of (NH, Tk) instead of (NH, Tq), and a bad segment.
    let (out, lse) = fwd(&ok, &causal)?;
    assert!(attention_bwd_ranges(&out, &q, &k, &v, &out, &lse, &ok, &causal).is_ok());
    let lse_k = Tensor::zeros([nh, tk], DType::F32, dev)?;
    assert!(is_shape(attention_bwd_ranges(
        &out, &q, &k, &v, &out, &lse_k, &ok, &causal
    )));
    let bad = [seg(0, 2, 0, 9), seg(2, 4, 8, 4)];
    invalid_names(
        attention_bwd_ranges(&out, &q, &k, &v, &out, &lse, &bad, &causal),
        "segment 1",
    );
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
    ranges_match_reference,
    ranges_equal_varlen,
    chunks_equal_whole,
    ranges_finite_differences,
    ranges_deterministic,
    ranges_errors,
);
