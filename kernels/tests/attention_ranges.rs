//! Attention of query ranges against other, possibly overlapping, key ranges
//! (`attention_fwd_ranges` / `attention_bwd_ranges`, what context parallelism runs):
//! against a slow f64 reference written from the segment definition, bitwise equal to
//! the `cu_seqlens` ops when ranges coincide, chunked queries == the whole sample,
//! finite differences, determinism, errors naming the segment.

use braid_kernels::ops::attention::{QkSegment, attention_bwd_ranges, attention_fwd_ranges};
use braid_kernels::ops::{self, AttentionSpec};
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

/// Host (out, lse, dq, dk, dv).
type FwdBwd = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn spec(causal: bool, hs: usize) -> AttentionSpec {
    AttentionSpec {
        causal,
        scale: 1.0 / (hs as f32).sqrt(),
    }
}

fn is_shape<T>(r: Result<T>) -> bool {
    matches!(r, Err(Error::Shape { .. }))
}

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

    /// Self-attention over samples of `lens`: q ranges == k ranges. -> (it, cu_seqlens)
    fn varlen(seed: u64, lens: &[usize], heads: (usize, usize, usize)) -> (Self, Vec<usize>) {
        let mut cu = vec![0];
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l);
        }
        let t = cu[cu.len() - 1];
        let shape: Vec<_> = cu
            .windows(2)
            .map(|w| (w[1] - w[0], w[0], w[1] - w[0]))
            .collect();
        (Ranged::new(seed, t, &shape, heads), cu)
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

    /// Forward + backward of the `cu_seqlens` ops (q ranges == k ranges).
    fn varlen_fwd_bwd(
        &self,
        dev: Device,
        cu: &[usize],
        dout: &[f32],
        sp: &AttentionSpec,
    ) -> Result<FwdBwd> {
        let [q, k, v] = self.tensors(dev, &self.q, &self.k, &self.v)?;
        let (out, lse) = ops::attention_fwd(&q, &k, &v, cu, sp)?;
        let dout = Tensor::from_vec(dout.to_vec(), [self.tq, self.nh, self.hs], dev)?;
        let (dq, dk, dv) = ops::attention_bwd(&dout, &q, &k, &v, &out, &lse, cu, sp)?;
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
        let (r, cu) = Ranged::varlen(41, &lens, (4, 2, 24));
        let dout = Rng::new(42).normal_vec(r.q.len(), 1.0);
        let sp = spec(causal, 24);
        let varlen = r.varlen_fwd_bwd(dev, &cu, &dout, &sp)?;
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
        let (mut r, cu) = Ranged::varlen(51, &lens, (nh, nkv, hs));
        let dout = Rng::new(52).normal_vec(r.q.len(), 1.0);
        let sp = spec(causal, hs);
        let whole = r.varlen_fwd_bwd(dev, &cu, &dout, &sp)?;
        // Chunk bounds within each sample (uneven, one empty).
        let cuts: [&[usize]; 3] = [&[0, 37, 37, 101, 150], &[0, 3, 7], &[0, 64, 65, 90]];
        let mut segs = Vec::new();
        for (w, cut) in cu.windows(2).zip(cuts) {
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
        r.segs = segs;
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
    ranges_match_reference,
    ranges_equal_varlen,
    chunks_equal_whole,
    ranges_finite_differences,
    ranges_deterministic,
    ranges_errors,
);
