//! CPU varlen attention, FlashAttention-2 style: blocked over keys with an online softmax.
//!
//! Work is described by segments ([`Seg`]): a run of query rows and the run of key
//! rows it attends to, causal masks bottom-right aligned. Self-attention over
//! `cu_seqlens` is the case where both runs are the sequence; context parallelism
//! gives a rank's query chunks against key prefixes gathered from all ranks, whose
//! key runs overlap (their dK/dV are summed in segment order).
//!
//! The forward cuts work into tiles of `BQ = 64` queries of one head of one segment;
//! a tile walks the 128-key blocks of its key run and keeps only a (64, 128) score
//! block and (64, HS) accumulators — never the O(T^2) of materialized scores; only
//! outputs (and D, O(NH * T)) scale with T. Causal tiles stop at the diagonal (fully
//! masked blocks are never computed) and mask only the diagonal block.
//!
//! The backward ([`bwd`]) makes dQ, dK and dV in one pass per (sequence, kv head)
//! task: 5 block products per (64, 64) block pair, P built once. Tasks that would hold
//! more than a thread's share of the work (MQA on one sequence, one long sequence
//! among short ones) are split FA2-style into dQ tiles and dK/dV tiles; both schemes
//! give bitwise-identical grads (see `bwd`), so the thread count never shows.
//!
//! Tiles and tasks run in parallel on rayon; each computes its own output blocks in a
//! fixed order, and blocks are then copied into place: results are bitwise independent
//! of the thread count — no atomics, no reductions across tasks.
//!
//! Speed (why the code looks the way it does):
//! - Block products go through [`kernel::mm`]: register-tiled AVX-512 (6 x 64) or
//!   AVX2+FMA (6 x 16) kernels that read operands in place, picked at run time, or
//!   `gemm` elsewhere (aarch64, old x86). `gemm` packs both operands on every call,
//!   which at 64 x 64 x 64 cost about as much as the product itself.
//! - Inputs are copied once per call into head-major layouts — q, k, v, dO as
//!   (H, T, HS), kᵀ and vᵀ as (H, HS, LD) with a padded LD — so every block is a
//!   contiguous run of rows: blocks whose rows are NH * HS floats (2 KiB) or T floats
//!   (8 KiB) apart fall in a few L1 sets and thrash.
//! - Softmax and dS loops ([`super::simd::exp`], a branch-free polynomial) are compiled
//!   per instruction set (`simd_fn!`, [`super::simd`]) so they vectorize 16 (8) lanes wide with FMA;
//!   results are deterministic per machine, and every level passes the tests.
//!
//! Measured, one causal sequence, T = 2048, NH = NKV = 8, HS = 64, ms, on a 2-core
//! AVX-512 VM shared with other builds (load 3-4: timings vary by up to 2x, and
//! 2 threads barely beat 1 since the second core was rarely free). "before" = the
//! two-pass, `gemm`-based version; before/after interleaved, median of 6 runs of
//! `cargo bench --bench kernels`; torch and "after (vs torch)" from
//! `tools/bench_vs_torch.py`, median of 3 runs:
//!
//! | threads | pass     | before | after | after (vs torch) | PyTorch eager |
//! |---------|----------|--------|-------|------------------|---------------|
//! | 1       | forward  | 115.6  | 71.9  | 65.0             | 54.0          |
//! | 1       | backward | 346.6  | 115.9 | 135.7            | 136.9         |
//! | 2       | forward  | 107.1  | 60.6  | 52.1             | 56.0          |
//! | 2       | backward | 288.0  | 120.7 | 109.8            | 108.6         |
//!
//! Steps, one thread (CPU time where wall time was too noisy): one-pass backward +
//! in-place AVX-512 kernel + pre-transposed kᵀ/vᵀ: backward ~300 -> ~157, forward
//! ~145 -> ~80; head-major copies with padded LD and per-ISA elementwise loops:
//! backward -> ~130, forward -> ~68; forward 128-key blocks, fused exp + sum, FMA
//! exp, plain-compare max: forward -> ~52-57 (softmax 13 % -> 6 % of the profile).
//! Per level (`cpu_time` unit test, CPU ms, forward / backward): AVX-512 50 / 135,
//! AVX2 86 / 213, portable 87 / 166 — "portable" still gets `gemm`'s AVX-512
//! kernels on this machine, so it does not show how an AVX2-only CPU fares. The
//! block products are now ~70 % of the backward, at ~120 GFLOP/s.

mod bwd;
mod fwd;
mod kernel;
mod math;

use rayon::prelude::*;

use self::kernel::mm;
use self::math::dot;
use super::CpuBackend;
use super::matmul::MatRef;
use super::simd::{Simd, max16};
use crate::backend::AttentionKernels;
use crate::error::{Error, Result};
use crate::ops::attention::{AttentionDims, AttentionSpec, QkSegment, check_qk_ranges, check_qkv};
use crate::tensor::Tensor;

/// Queries per tile (forward, dQ).
const BQ: usize = 64;
/// Keys per tile (forward key blocks, dK/dV tiles).
const BK: usize = 64;

/// Inputs shared by every tile, head-major: q (NH, Tq, HS), k/v (NKV, Tk, HS), and
/// kᵀ (NKV, HS, LD) with LD = [`padded`]`(Tk)`.
#[derive(Clone, Copy, Debug)]
struct Qkv<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    kt: &'a [f32],
    dims: AttentionDims,
    /// Query heads per kv head (NH / NKV).
    group: usize,
    spec: AttentionSpec,
    /// Instruction set of the block products and elementwise loops.
    simd: Simd,
}

/// Query rows `q..q + qlen` attend to key rows `k..k + klen` (a validated
/// [`QkSegment`]); causal: query `i` sees keys `j <= klen - qlen + i`.
#[derive(Clone, Copy, Debug)]
struct Seg {
    q: usize,
    qlen: usize,
    k: usize,
    klen: usize,
}

impl Seg {
    fn new(s: &QkSegment) -> Self {
        Seg {
            q: s.q_start,
            qlen: s.q_len,
            k: s.k_start,
            klen: s.k_len,
        }
    }

    /// How many keys the causal diagonal is shifted right: `klen - qlen`.
    fn offset(&self) -> usize {
        self.klen.saturating_sub(self.qlen)
    }

    /// Keys `0..kend` are the ones some query of rows `..q1` sees.
    fn kend(&self, causal: bool, q1: usize) -> usize {
        if causal {
            (self.offset() + q1).min(self.klen)
        } else {
            self.klen
        }
    }
}

/// Rows `[r0, r1)` of one head of one segment — query rows (forward, dQ tiles) or key
/// rows (dK/dV tiles), relative to the segment's start: the unit of parallel work.
#[derive(Clone, Copy, Debug)]
struct Tile {
    seg: Seg,
    head: usize,
    r0: usize,
    r1: usize,
}

/// Every `(segment, head, block)` query tile, blocks of `block` rows from each
/// segment's first query.
fn tiles(segs: &[Seg], heads: usize, block: usize) -> Vec<Tile> {
    let mut out = Vec::new();
    for &seg in segs {
        for head in 0..heads {
            for r0 in (0..seg.qlen).step_by(block) {
                out.push(Tile {
                    seg,
                    head,
                    r0,
                    r1: (r0 + block).min(seg.qlen),
                });
            }
        }
    }
    out
}

/// (T, H, HS) -> (H, T, HS). The block products read a (64, HS) block of one head
/// as one contiguous run: rows H * HS apart (2 KiB at H * HS = 512) fall in a few
/// L1 sets and evict each other, which cost ~30 % of the product time.
fn to_heads(x: &[f32], t: usize, heads: usize, hs: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; heads * t * hs]; // (H, T, HS)
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(t * hs).enumerate().for_each(|(h, dst)| {
        for (src, d) in x.chunks_exact(heads * hs).zip(dst.chunks_exact_mut(hs)) {
            d.copy_from_slice(&src[h * hs..(h + 1) * hs]);
        }
    });
    out
}

/// Row stride of a transposed (HS, T) head: T rounded up to an odd multiple of 16, so
/// rows start 64 B-aligned but never a multiple of 4 KiB apart (same L1 set).
fn padded(t: usize) -> usize {
    let ld = t.next_multiple_of(16);
    if (ld / 16).is_multiple_of(2) {
        ld + 16
    } else {
        ld
    }
}

/// (T, H, HS) -> (H, HS, LD): each head transposed once, so that the block products
/// read kᵀ and vᵀ blocks as contiguous rows.
fn transpose_heads(x: &[f32], t: usize, heads: usize, hs: usize) -> Vec<f32> {
    let ld = padded(t);
    let mut out = vec![0.0f32; heads * hs * ld]; // (H, HS, LD)
    if out.is_empty() {
        return out;
    }
    // 64 tokens at a time: their 64 source rows stay in L1 while each of the HS
    // destination rows gets a contiguous run of 64 values.
    out.par_chunks_mut(hs * ld).enumerate().for_each(|(h, xt)| {
        for (b, rows) in x.chunks(64 * heads * hs).enumerate() {
            let t0 = b * 64;
            let n = rows.len() / (heads * hs);
            for e in 0..hs {
                let dst = &mut xt[e * ld + t0..e * ld + t0 + n];
                for (d, row) in dst.iter_mut().zip(rows.chunks_exact(heads * hs)) {
                    *d = row[h * hs + e];
                }
            }
        }
    });
    out
}

/// Tokens `t0..` of head `h` of a head-major (H, T, HS) buffer as a (rows, HS) view.
fn head_rows(data: &[f32], t0: usize, h: usize, t: usize, hs: usize) -> MatRef<'_> {
    MatRef {
        data: data.get((h * t + t0) * hs..).unwrap_or(&[]),
        rs: hs,
        cs: 1,
    }
}

/// Tokens `t0..` of head `h` of a (H, HS, LD) buffer as an (HS, cols) view.
fn head_cols(xt: &[f32], t0: usize, h: usize, t: usize, hs: usize) -> MatRef<'_> {
    let ld = padded(t);
    MatRef {
        data: xt.get(h * hs * ld + t0..).unwrap_or(&[]),
        rs: ld,
        cs: 1,
    }
}

/// s (bq, bk) = scale * q_blk (bq, HS) @ k_blkᵀ for queries `q0..q0 + bq` and keys
/// `k0..k0 + bk` (relative to the segment's query and key starts) of query head `h`;
/// when causal, scores of keys past their query's diagonal are set to -inf.
fn scores(
    x: &Qkv<'_>,
    s: &mut [f32],
    seg: &Seg,
    h: usize,
    (q0, bq): (usize, usize),
    (k0, bk): (usize, usize),
) -> Result<()> {
    let AttentionDims { t, tk, hs, .. } = x.dims;
    mm(
        x.simd,
        bq,
        bk,
        hs,
        head_rows(x.q, seg.q + q0, h, t, hs),
        head_cols(x.kt, seg.k + k0, h / x.group, tk, hs),
        s,
        bk,
        x.spec.scale,
        0.0,
    )?;
    // Key k0 + c is hidden from query q0 + r when k0 + c > off + q0 + r; only blocks
    // that straddle the (shifted) diagonal have such pairs.
    let off = seg.offset();
    if x.spec.causal && k0 + bk > off + q0 + 1 {
        for (r, row) in s.chunks_exact_mut(bk).enumerate() {
            let first_hidden = (off + q0 + r + 1).saturating_sub(k0).min(bk);
            row[first_hidden..].fill(f32::NEG_INFINITY);
        }
    }
    Ok(())
}

/// Copies `(rows, HS)` query-tile blocks into their rows of a (Tq, H, HS) buffer.
fn scatter(dst: &mut [f32], heads: usize, hs: usize, tiles: &[Tile], blocks: &[Vec<f32>]) {
    for (tile, blk) in tiles.iter().zip(blocks) {
        scatter_one(dst, heads, hs, (tile.seg.q + tile.r0, tile.head), blk);
    }
}

/// Copies one `(rows, HS)` block into rows `row0..` of head `head` of a (T, H, HS)
/// buffer.
fn scatter_one(
    dst: &mut [f32],
    heads: usize,
    hs: usize,
    (row0, head): (usize, usize),
    blk: &[f32],
) {
    for (r, src) in blk.chunks_exact(hs.max(1)).enumerate() {
        let o = ((row0 + r) * heads + head) * hs;
        dst[o..o + hs].copy_from_slice(src);
    }
}

/// Adds one `(rows, HS)` block into rows `row0..` of head `head` of a (T, H, HS)
/// buffer (key rows shared by several segments sum their grads).
fn scatter_add_one(
    dst: &mut [f32],
    heads: usize,
    hs: usize,
    (row0, head): (usize, usize),
    blk: &[f32],
) {
    for (r, src) in blk.chunks_exact(hs.max(1)).enumerate() {
        let o = ((row0 + r) * heads + head) * hs;
        dst[o..o + hs]
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d += s);
    }
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

/// Row-major host inputs: q (Tq, NH, HS), k/v (Tk, NKV, HS).
#[derive(Clone, Copy)]
struct Host<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dims: AttentionDims,
    spec: AttentionSpec,
}

/// Runs `f` on head-major copies of the inputs (see [`Qkv`]).
fn with_qkv<R>(h: &Host<'_>, simd: Simd, f: impl FnOnce(&Qkv<'_>) -> R) -> R {
    let AttentionDims { t, tk, nh, nkv, hs } = h.dims;
    let q = to_heads(h.q, t, nh, hs); // (NH, Tq, HS)
    let kt = transpose_heads(h.k, tk, nkv, hs); // (NKV, HS, LD)
    let k = to_heads(h.k, tk, nkv, hs); // (NKV, Tk, HS)
    let v = to_heads(h.v, tk, nkv, hs); // (NKV, Tk, HS)
    f(&Qkv {
        q: &q,
        k: &k,
        v: &v,
        kt: &kt,
        dims: h.dims,
        group: nh / nkv,
        spec: h.spec,
        simd,
    })
}

/// -> (out (Tq, NH, HS), lse (NH, Tq)).
fn forward_host(h: &Host<'_>, segs: &[Seg], simd: Simd) -> Result<(Vec<f32>, Vec<f32>)> {
    with_qkv(h, simd, |x| fwd::forward(x, segs))
}

/// `dout`, `out` (Tq, NH, HS), `lse` (NH, Tq) -> (dq, dk, dv), row-major like q, k, v.
/// `threads` only decides how work is split, never the result.
fn backward_host(
    h: &Host<'_>,
    (dout, out, lse): (&[f32], &[f32], &[f32]),
    segs: &[Seg],
    simd: Simd,
    threads: usize,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let AttentionDims { tk, nkv, hs, .. } = h.dims;
    let vt = transpose_heads(h.v, tk, nkv, hs); // (NKV, HS, LD)
    with_qkv(h, simd, |x| {
        bwd::backward(x, &vt, dout, out, lse, segs, threads)
    })
}

/// The segments of self-attention over `cu_seqlens` (checked already).
fn seqs(cu_seqlens: &[usize]) -> Vec<Seg> {
    QkSegment::from_cu_seqlens(cu_seqlens)
        .iter()
        .map(Seg::new)
        .collect()
}

/// Host views of q, k, v, checked against `dims`.
fn host<'a>(
    op: &'static str,
    (q, k, v): (&'a Tensor, &'a Tensor, &'a Tensor),
    dims: AttentionDims,
    spec: &AttentionSpec,
) -> Result<Host<'a>> {
    let AttentionDims { t, tk, nh, nkv, hs } = dims;
    Ok(Host {
        q: buf(op, "q", q, t * nh * hs)?,
        k: buf(op, "k", k, tk * nkv * hs)?,
        v: buf(op, "v", v, tk * nkv * hs)?,
        dims,
        spec: *spec,
    })
}

/// Forward on host buffers -> tensors (out (Tq, NH, HS), lse (NH, Tq)).
fn forward_tensors(h: &Host<'_>, segs: &[Seg]) -> Result<(Tensor, Tensor)> {
    let AttentionDims { t, nh, hs, .. } = h.dims;
    let (out, lse) = forward_host(h, segs, Simd::detect())?;
    Ok((
        Tensor::cpu_from_f32(out, [t, nh, hs])?,
        Tensor::cpu_from_f32(lse, [nh, t])?,
    ))
}

/// Backward on host buffers -> tensors (dq, dk, dv).
fn backward_tensors(
    op: &'static str,
    h: &Host<'_>,
    (dout, out, lse): (&Tensor, &Tensor, &Tensor),
    segs: &[Seg],
) -> Result<(Tensor, Tensor, Tensor)> {
    let AttentionDims { t, tk, nh, nkv, hs } = h.dims;
    let grads = (
        buf(op, "dout", dout, t * nh * hs)?,
        buf(op, "out", out, t * nh * hs)?,
        buf(op, "lse", lse, nh * t)?,
    );
    let threads = rayon::current_num_threads();
    let (dq, dk, dv) = backward_host(h, grads, segs, Simd::detect(), threads)?;
    Ok((
        Tensor::cpu_from_f32(dq, [t, nh, hs])?,
        Tensor::cpu_from_f32(dk, [tk, nkv, hs])?,
        Tensor::cpu_from_f32(dv, [tk, nkv, hs])?,
    ))
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
        if super::bf16::any(&[q, k, v]) {
            return super::bf16::attention_fwd(self, (q, k, v), cu_seqlens, spec);
        }
        const OP: &str = "attention_fwd";
        // Cheap, and keeps every slice index below in bounds even if called directly.
        let dims = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
        forward_tensors(&host(OP, (q, k, v), dims, spec)?, &seqs(cu_seqlens))
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
        if super::bf16::any(&[dout, q, k, v, out]) {
            return super::bf16::attention_bwd(
                self,
                (dout, q, k, v, out, lse),
                super::bf16::Keys::Seqlens(cu_seqlens),
                spec,
            );
        }
        const OP: &str = "attention_bwd";
        let dims = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
        let h = host(OP, (q, k, v), dims, spec)?;
        backward_tensors(OP, &h, (dout, out, lse), &seqs(cu_seqlens))
    }

    fn attention_fwd_ranges(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        if super::bf16::any(&[q, k, v]) {
            return super::bf16::attention_fwd_ranges(self, (q, k, v), segs, spec);
        }
        const OP: &str = "attention_fwd_ranges";
        let dims = check_qk_ranges(OP, q, k, v, segs, spec)?;
        let segs: Vec<Seg> = segs.iter().map(Seg::new).collect();
        forward_tensors(&host(OP, (q, k, v), dims, spec)?, &segs)
    }

    fn attention_bwd_ranges(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if super::bf16::any(&[dout, q, k, v, out]) {
            return super::bf16::attention_bwd(
                self,
                (dout, q, k, v, out, lse),
                super::bf16::Keys::Ranges(segs),
                spec,
            );
        }
        const OP: &str = "attention_bwd_ranges";
        let dims = check_qk_ranges(OP, q, k, v, segs, spec)?;
        let segs: Vec<Seg> = segs.iter().map(Seg::new).collect();
        let h = host(OP, (q, k, v), dims, spec)?;
        backward_tensors(OP, &h, (dout, out, lse), &segs)
    }
}

#[cfg(test)]
mod tests;
