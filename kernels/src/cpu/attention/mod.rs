//! CPU varlen attention, FlashAttention-2 style: blocked over keys with an online softmax.
//!
//! Work is cut into tiles of `BQ = 64` queries (or `BK = 64` keys in the dK/dV pass)
//! of one head of one sequence. A tile walks the key (query) blocks of its sequence
//! and keeps only `(64, 64)` score/probability blocks and `(64, HS)` accumulators, so
//! scratch memory is O(64 * (64 + HS)) per running tile — never the O(T^2) of
//! materialized scores; only outputs (and D, O(NH * T)) scale with T. Causal
//! tiles stop at the diagonal (fully masked blocks are never computed) and mask only
//! the diagonal block. 64 x 64 keeps a tile's working set (q, k, v blocks, scores,
//! accumulator: ~80 KiB at HS = 64) in L2 while giving the GEMM big enough products.
//!
//! Tiles run in parallel on rayon; each computes its output block alone, in a fixed
//! order, and blocks are then copied into place, so results are bitwise independent
//! of the thread count. The backward recomputes P from q, k and lse twice: once per
//! query tile for dQ, once per key tile for dK/dV (which also sums over the query
//! heads sharing the kv head, in head order) — no atomics, no reductions across tasks.
//!
//! Block products go through [`sgemm`], single-threaded inside a tile. Measured with
//! `cargo bench -p braid-kernels --bench kernels` on one thread (forward, one causal
//! sequence, T = 2048, NH = 8, HS = 64): 168-209 ms with sgemm against 464-541 ms
//! with tight loops over contiguous HS rows (8-lane dot for q·kᵀ, row axpy for p·v).
//! The loops compile for the baseline x86-64 target (SSE2, no FMA) while `gemm`
//! picks AVX2/AVX-512 FMA kernels at run time, hence the ~2.7x. The softmax's exp
//! is [`exp_softmax`], a vectorizable polynomial: libm's scalar `expf` was ~23 % of
//! the profile.

mod bwd;
mod fwd;

use super::CpuBackend;
use super::matmul::{MatRef, sgemm};
use crate::backend::AttentionKernels;
use crate::error::{Error, Result};
use crate::ops::attention::{AttentionDims, AttentionSpec, check_qkv};
use crate::tensor::Tensor;

/// Queries per tile (forward, dQ).
const BQ: usize = 64;
/// Keys per tile (forward key blocks, dK/dV tiles).
const BK: usize = 64;

/// Inputs shared by every tile: q (T, NH, HS), k/v (T, NKV, HS).
#[derive(Clone, Copy, Debug)]
struct Qkv<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dims: AttentionDims,
    /// Query heads per kv head (NH / NKV).
    group: usize,
    spec: AttentionSpec,
}

/// Rows `[r0, r1)` (relative to the sequence start `seq`) of one head of one sequence
/// of `len` tokens: the unit of parallel work.
#[derive(Clone, Copy, Debug)]
struct Tile {
    seq: usize,
    len: usize,
    head: usize,
    r0: usize,
    r1: usize,
}

/// Every `(sequence, head, block)` tile, blocks of `block` rows from each sequence start.
fn tiles(cu_seqlens: &[usize], heads: usize, block: usize) -> Vec<Tile> {
    let mut out = Vec::new();
    for w in cu_seqlens.windows(2) {
        let (seq, len) = (w[0], w[1] - w[0]);
        for head in 0..heads {
            for r0 in (0..len).step_by(block) {
                out.push(Tile {
                    seq,
                    len,
                    head,
                    r0,
                    r1: (r0 + block).min(len),
                });
            }
        }
    }
    out
}

/// Tokens `t0..` of head `h` of a (T, H, HS) buffer as a (rows, HS) view (row stride H * HS).
fn head_rows(data: &[f32], t0: usize, h: usize, heads: usize, hs: usize) -> MatRef<'_> {
    MatRef {
        data: data.get((t0 * heads + h) * hs..).unwrap_or(&[]),
        rs: heads * hs,
        cs: 1,
    }
}

/// The same rows read transposed: a (HS, rows) view.
fn head_rows_t(data: &[f32], t0: usize, h: usize, heads: usize, hs: usize) -> MatRef<'_> {
    MatRef {
        data: data.get((t0 * heads + h) * hs..).unwrap_or(&[]),
        rs: 1,
        cs: heads * hs,
    }
}

/// s (bq, bk) = scale * q_blk (bq, HS) @ k_blkᵀ for queries `q0..q0 + bq` and keys
/// `k0..k0 + bk` (relative to the sequence start `seq`) of query head `h`; when
/// causal, scores of keys after their query are set to -inf.
fn scores(
    x: &Qkv<'_>,
    s: &mut [f32],
    seq: usize,
    h: usize,
    (q0, bq): (usize, usize),
    (k0, bk): (usize, usize),
) -> Result<()> {
    let AttentionDims { nh, nkv, hs, .. } = x.dims;
    let kvh = h / x.group;
    sgemm(
        bq,
        bk,
        hs,
        head_rows(x.q, seq + q0, h, nh, hs),
        head_rows_t(x.k, seq + k0, kvh, nkv, hs),
        s,
        bk,
        x.spec.scale,
        0.0,
        1,
    )?;
    // Key k0 + c is hidden from query q0 + r when k0 + c > q0 + r; only blocks that
    // straddle the diagonal have such pairs.
    if x.spec.causal && k0 + bk > q0 + 1 {
        for (r, row) in s.chunks_exact_mut(bk).enumerate() {
            let first_hidden = (q0 + r + 1).saturating_sub(k0).min(bk);
            row[first_hidden..].fill(f32::NEG_INFINITY);
        }
    }
    Ok(())
}

/// Copies `(rows, HS)` tile blocks into their rows of a (T, H, HS) buffer.
fn scatter(dst: &mut [f32], heads: usize, hs: usize, tiles: &[Tile], blocks: &[Vec<f32>]) {
    for (tile, blk) in tiles.iter().zip(blocks) {
        for (r, src) in blk.chunks_exact(hs.max(1)).enumerate() {
            let o = ((tile.seq + tile.r0 + r) * heads + tile.head) * hs;
            dst[o..o + hs].copy_from_slice(src);
        }
    }
}

/// `a · b` with 8 independent partial sums (vectorizable; fixed order -> deterministic).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `e^x` for the `x <= 0` of a softmax (`score - max`, `score - lse`), -inf -> 0.
///
/// Cephes' `expf` (range reduction by ln 2, degree-6 polynomial, ~1 ulp) written
/// branch-free so loops over it vectorize; libm's scalar `expf` took ~23 % of the
/// attention time. Results below e^-87 (subnormal) are flushed to 0.
#[inline]
fn exp_softmax(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds an |f32| < 2^22 to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let n = (xc * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let er = p * r * r + r + 1.0;
    // 2^n: n + 127 lands in the low mantissa bits of (n + 127 + ROUND); shifting them
    // into the exponent field (the high bits fall off) builds the power of two.
    let two_n = f32::from_bits((n + (ROUND + 127.0)).to_bits() << 23);
    if x < -87.0 { 0.0 } else { er * two_n }
}

/// Largest element (-inf for an empty slice), with 8 independent lanes.
fn max8(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].max(c[i]);
        }
    }
    acc.iter().fold(tail, |a, &b| a.max(b))
}

/// Sum with 8 independent partial sums (vectorizable; fixed order -> deterministic).
fn sum8(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The f32 buffer of `t`, checked to hold `len` elements.
fn buf<'a>(op: &'static str, arg: &'static str, t: &'a Tensor, len: usize) -> Result<&'a [f32]> {
    let v = t.cpu_f32(op, arg)?;
    if v.len() != len {
        return Err(Error::shape(
            op,
            format!(
                "`{arg}` {} holds {} elements, expected {len}",
                t.shape(),
                v.len()
            ),
        ));
    }
    Ok(v)
}

impl AttentionKernels for CpuBackend {
    fn attention_fwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "attention_fwd";
        // Cheap, and keeps every slice index below in bounds even if called directly.
        let dims = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
        let AttentionDims { t, nh, nkv, hs } = dims;
        let x = Qkv {
            q: buf(OP, "q", q, t * nh * hs)?,
            k: buf(OP, "k", k, t * nkv * hs)?,
            v: buf(OP, "v", v, t * nkv * hs)?,
            dims,
            group: nh / nkv,
            spec: *spec,
        };
        let (out, lse) = fwd::forward(&x, cu_seqlens)?;
        Ok((
            Tensor::cpu_from_f32(out, [t, nh, hs])?,
            Tensor::cpu_from_f32(lse, [nh, t])?,
        ))
    }

    fn attention_bwd(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "attention_bwd";
        let dims = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
        let AttentionDims { t, nh, nkv, hs } = dims;
        let x = Qkv {
            q: buf(OP, "q", q, t * nh * hs)?,
            k: buf(OP, "k", k, t * nkv * hs)?,
            v: buf(OP, "v", v, t * nkv * hs)?,
            dims,
            group: nh / nkv,
            spec: *spec,
        };
        let dout = buf(OP, "dout", dout, t * nh * hs)?;
        let out = buf(OP, "out", out, t * nh * hs)?;
        let lse = buf(OP, "lse", lse, nh * t)?;
        let (dq, dk, dv) = bwd::backward(&x, dout, out, lse, cu_seqlens)?;
        Ok((
            Tensor::cpu_from_f32(dq, [t, nh, hs])?,
            Tensor::cpu_from_f32(dk, [t, nkv, hs])?,
            Tensor::cpu_from_f32(dv, [t, nkv, hs])?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::exp_softmax;

    /// The vectorizable exp agrees with f64 exp to a few ulp over the softmax range,
    /// and flushes -inf and deep negatives to exactly 0.
    #[test]
    fn exp_softmax_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 87.0 * i as f32 / 200_000.0;
            let want = f64::from(x).exp();
            let rel = (f64::from(exp_softmax(x)) - want).abs() / want;
            worst = worst.max(rel);
        }
        assert!(worst < 2e-7, "max relative error {worst}");
        assert_eq!(exp_softmax(0.0), 1.0);
        assert_eq!(exp_softmax(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_softmax(-1e30), 0.0);
    }
}
