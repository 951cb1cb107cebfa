//! Unit tests of the attention internals: the AVX-512 block product, and
//! the backward's two work schemes (bitwise equal), plus an ignored CPU-time bench.

use super::kernel::mm;
use super::{AttentionDims, AttentionSpec, Host, backward_host, forward_host, seqs};
use crate::cpu::matmul::MatRef;
use crate::cpu::simd::Simd;
use crate::rng::Rng;
use crate::testing::assert_close;

#[test]
fn mm_matches_reference() {
    let mut rng = Rng::new(1);
    for simd in Simd::available() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (6, 64, 64),
            (13, 70, 5),
            (7, 17, 64),
            (64, 24, 33),
        ] {
            for trans_a in [false, true] {
                for beta in [0.0f32, 1.0] {
                    let a = rng.normal_vec(m * k, 1.0);
                    let b_rs = n + 3; // (k, n) with padded rows
                    let b = rng.normal_vec(k * b_rs, 1.0);
                    let c_rs = n + 5;
                    let c0 = if beta == 0.0 {
                        vec![f32::NAN; m * c_rs]
                    } else {
                        rng.normal_vec(m * c_rs, 1.0)
                    };
                    let a_at =
                        |i: usize, p: usize| if trans_a { a[p * m + i] } else { a[i * k + p] };
                    let av = if trans_a {
                        MatRef::new(&a, m, true)
                    } else {
                        MatRef::new(&a, k, false)
                    };
                    let bv = MatRef {
                        data: &b,
                        rs: b_rs,
                        cs: 1,
                    };
                    let mut c = c0.clone();
                    mm(simd, m, n, k, av, bv, &mut c, c_rs, 0.5, beta).unwrap();
                    let (mut got, mut want) = (Vec::new(), Vec::new());
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f64 = (0..k)
                                .map(|p| f64::from(a_at(i, p)) * f64::from(b[p * b_rs + j]))
                                .sum();
                            let old = if beta == 0.0 {
                                0.0
                            } else {
                                f64::from(c0[i * c_rs + j])
                            };
                            want.push((0.5 * dot + old) as f32);
                            got.push(c[i * c_rs + j]);
                        }
                        // Padding columns are untouched.
                        let pad = &c[i * c_rs + n..(i + 1) * c_rs];
                        assert!(
                            pad.iter()
                                .zip(&c0[i * c_rs + n..])
                                .all(|(x, y)| x.to_bits() == y.to_bits())
                        );
                    }
                    let what = format!("{simd:?} ({m}, {n}, {k}) trans_a {trans_a} beta {beta}");
                    assert_close(&what, &got, &want, 1e-5, 1e-5);
                }
            }
        }
    }
}

/// Random inputs of one problem: (q, k, v, dout), lens -> cu_seqlens.
fn problem(
    seed: u64,
    lens: &[usize],
    (nh, nkv, hs): (usize, usize, usize),
) -> (Vec<Vec<f32>>, Vec<usize>) {
    let mut cu = vec![0];
    for &l in lens {
        cu.push(cu[cu.len() - 1] + l);
    }
    let t = cu[cu.len() - 1];
    let mut rng = Rng::new(seed);
    let bufs = vec![
        rng.normal_vec(t * nh * hs, 1.0),
        rng.normal_vec(t * nkv * hs, 1.0),
        rng.normal_vec(t * nkv * hs, 1.0),
        rng.normal_vec(t * nh * hs, 1.0),
    ];
    (bufs, cu)
}

/// The one-pass tasks (threads = 1) and the split tiles (many threads) give bitwise
/// the same grads, on every level, for MHA / GQA / MQA, causal or not, varlen.
#[test]
fn split_equals_one_pass() {
    let lens = [70, 0, 1, 130, 64];
    for simd in Simd::available() {
        for &(nh, nkv) in &[(4, 4), (4, 2), (4, 1)] {
            for causal in [true, false] {
                let hs = 24;
                let (b, cu) = problem(3, &lens, (nh, nkv, hs));
                let t = cu[cu.len() - 1];
                let h = Host {
                    q: &b[0],
                    k: &b[1],
                    v: &b[2],
                    dims: AttentionDims {
                        t,
                        tk: t,
                        nh,
                        nkv,
                        hs,
                    },
                    spec: AttentionSpec { causal, scale: 0.2 },
                };
                let (out, lse) = forward_host(&h, &seqs(&cu), simd).unwrap();
                let g = (&b[3][..], &out[..], &lse[..]);
                let one = backward_host(&h, g, &seqs(&cu), simd, 1).unwrap();
                // 3 threads split the 130-token sequence only; 1000 split all of them.
                for threads in [3, 1000] {
                    let split = backward_host(&h, g, &seqs(&cu), simd, threads).unwrap();
                    let what =
                        format!("{simd:?} nh {nh} nkv {nkv} causal {causal} threads {threads}");
                    assert!(one.0 == split.0, "dq differs: {what}");
                    assert!(one.1 == split.1, "dk differs: {what}");
                    assert!(one.2 == split.2, "dv differs: {what}");
                }
            }
        }
    }
}

/// The same with query ranges attending to other, overlapping key ranges (context
/// parallelism): causal diagonals shifted by offsets that are not multiples of the
/// block size, empty segments, one-token ones.
#[test]
fn split_equals_one_pass_ranges() {
    use super::Seg;
    // (q_len, k_start, k_len); queries consecutive from 0.
    let shape = [
        (50, 0, 130),
        (0, 10, 20),
        (70, 0, 70),
        (1, 129, 1),
        (100, 20, 130),
    ];
    let mut segs = Vec::new();
    let mut q = 0;
    for &(qlen, k, klen) in &shape {
        segs.push(Seg { q, qlen, k, klen });
        q += qlen;
    }
    let (tq, tk, hs) = (q, 150, 24);
    for simd in Simd::available() {
        for &(nh, nkv) in &[(4, 4), (4, 2), (4, 1)] {
            for causal in [true, false] {
                let mut rng = crate::rng::Rng::new(5);
                let b = [
                    rng.normal_vec(tq * nh * hs, 1.0),
                    rng.normal_vec(tk * nkv * hs, 1.0),
                    rng.normal_vec(tk * nkv * hs, 1.0),
                    rng.normal_vec(tq * nh * hs, 1.0),
                ];
                let h = Host {
                    q: &b[0],
                    k: &b[1],
                    v: &b[2],
                    dims: AttentionDims {
                        t: tq,
                        tk,
                        nh,
                        nkv,
                        hs,
                    },
                    spec: AttentionSpec { causal, scale: 0.2 },
                };
                let (out, lse) = forward_host(&h, &segs, simd).unwrap();
                let g = (&b[3][..], &out[..], &lse[..]);
                let one = backward_host(&h, g, &segs, simd, 1).unwrap();
                for threads in [3, 1000] {
                    let split = backward_host(&h, g, &segs, simd, threads).unwrap();
                    let what =
                        format!("{simd:?} nh {nh} nkv {nkv} causal {causal} threads {threads}");
                    assert!(one.0 == split.0, "dq differs: {what}");
                    assert!(one.1 == split.1, "dk differs: {what}");
                    assert!(one.2 == split.2, "dv differs: {what}");
                }
            }
        }
    }
}

/// HS = 0 (allowed by validation) runs without panicking, on every level and split.
#[test]
fn zero_head_size() {
    for simd in Simd::available() {
        for threads in [1, 1000] {
            let (b, cu) = problem(4, &[3, 0, 2], (2, 1, 0));
            let h = Host {
                q: &b[0],
                k: &b[1],
                v: &b[2],
                dims: AttentionDims {
                    t: 5,
                    tk: 5,
                    nh: 2,
                    nkv: 1,
                    hs: 0,
                },
                spec: AttentionSpec {
                    causal: true,
                    scale: 1.0,
                },
            };
            let (out, lse) = forward_host(&h, &seqs(&cu), simd).unwrap();
            assert!(out.is_empty() && lse.iter().all(|x| x.is_finite()));
            let (dq, dk, dv) =
                backward_host(&h, (&[], &[], &lse), &seqs(&cu), simd, threads).unwrap();
            assert!(dq.is_empty() && dk.is_empty() && dv.is_empty());
        }
    }
}

/// Process CPU time (user + system) in ms, from /proc/self/stat (10 ms ticks).
fn cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // Fields 14 and 15 of the line; `rest` starts at field 3.
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks * 10.0
}

/// The bench shape (T = 2048 causal, NH = NKV = 8, HS = 64) timed in CPU time on one
/// thread, which other processes on a busy machine disturb far less than wall time.
/// `cargo test --release -p braid-kernels --lib attention::tests::cpu_time -- --ignored --nocapture`
#[test]
#[ignore]
fn cpu_time() {
    let (t, nh, hs, runs) = (2048, 8, 64, 10);
    let (b, cu) = problem(0, &[t], (nh, nh, hs));
    let h = Host {
        q: &b[0],
        k: &b[1],
        v: &b[2],
        dims: AttentionDims {
            t,
            tk: t,
            nh,
            nkv: nh,
            hs,
        },
        spec: AttentionSpec {
            causal: true,
            scale: 0.125,
        },
    };
    let pool = crate::testing::thread_pool(1).unwrap();
    pool.install(|| {
        for simd in Simd::available() {
            let (out, lse) = forward_host(&h, &seqs(&cu), simd).unwrap();
            let c0 = cpu_ms();
            for _ in 0..runs {
                forward_host(&h, &seqs(&cu), simd).unwrap();
            }
            let c1 = cpu_ms();
            for _ in 0..runs {
                backward_host(&h, (&b[3], &out, &lse), &seqs(&cu), simd, 1).unwrap();
            }
            let c2 = cpu_ms();
            println!(
                "CPU ms per call, {simd:?}: fwd {:.1} bwd {:.1}",
                (c1 - c0) / runs as f64,
                (c2 - c1) / runs as f64
            );
        }
    });
}
