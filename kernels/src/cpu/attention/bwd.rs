//! Attention backward, FlashAttention-2 style: P is rebuilt per block from q, k and
//! lse, once per (query block, key block) pair.
//!
//! With P = exp(S - lse), dO the output grad and D_i = rowsum(dO_i * O_i):
//! dV = Pᵀ dO, dP = dO Vᵀ, dS = P * (dP - D), dQ = scale * dS K, dK = scale * dSᵀ Q.
//!
//! The unit of work is a (segment, kv head) task: it makes dK/dV of that kv head over
//! the segment's keys and the dQ rows of the query heads of its group, so one pass
//! over its block pairs makes all three grads with 5 products per pair. Segments'
//! key ranges may overlap (context parallelism): each task's dK/dV block is then added
//! into the full grads in segment order, a fixed order whatever the threads. A task bigger
//! than a thread's fair share (e.g. MQA on one sequence) is instead split FA2-style
//! into dQ tiles (one query block of one head) and dK/dV tiles (one key block), which
//! recompute P and dP twice but run in parallel. Both schemes make every block of
//! P and dS from the same calls and add the same products into each grad block in the
//! same order (dQ over key blocks; dK/dV over heads, then query blocks; every key
//! block is a full `BK` rows or the segment's last ones in both), so they give
//! bitwise-identical results: which one a task uses — it depends on the thread
//! count — never shows in the output.

use rayon::prelude::*;

use super::kernel::mm;
use super::{BK, BQ, Qkv, Seg, Tile, dot, head_cols, head_rows, scores};
use super::{scatter_add_one, scatter_one, tiles, to_heads};
use crate::cpu::matmul::MatRef;
use crate::cpu::simd::exp;
use crate::error::Result;
use crate::ops::attention::AttentionDims;

// Both schemes cut the keys into the same blocks (k0 a multiple of BK, bk =
// min(BK, klen - k0)); with BQ == BK the causal diagonal of an unshifted segment falls
// on block boundaries, so no block is computed that the mask hides entirely.
const _: () = assert!(BQ == BK);

/// What the backward reads besides q, k, v.
#[derive(Clone, Copy)]
struct Grads<'a> {
    /// (NH, Tq, HS) grad of the output, head-major.
    dout: &'a [f32],
    /// (NH, Tq) log-sum-exp of the forward.
    lse: &'a [f32],
    /// (NH, Tq) D = rowsum(dout * out).
    dsum: &'a [f32],
    /// (NKV, HS, LD) v transposed per head.
    vt: &'a [f32],
}

/// One unit of parallel work.
enum Work {
    /// All grads of kv head `kvh` of a segment.
    Task { seg: Seg, kvh: usize },
    /// dQ of one query tile.
    Dq(Tile),
    /// dK/dV of one key tile (rows relative to the segment's first key).
    Dkv(Tile),
}

/// Its result.
enum Done {
    /// dq (group, qlen, HS) of the group's query heads, dk and dv (klen, HS).
    Task(Vec<f32>, Vec<f32>, Vec<f32>),
    /// (bq, HS)
    Dq(Vec<f32>),
    /// dk, dv (bk, HS)
    Dkv(Vec<f32>, Vec<f32>),
}

/// Score pairs a head of a segment computes: the cost unit of a task.
fn pairs(seg: &Seg, causal: bool) -> usize {
    if causal {
        // Query i sees offset + i + 1 keys.
        seg.qlen * seg.offset() + seg.qlen * (seg.qlen + 1) / 2
    } else {
        seg.qlen * seg.klen
    }
}

/// The work list: a task per (segment, kv head), split into tiles where one task
/// would hold more than `1 / threads` of all the work.
fn plan(x: &Qkv<'_>, segs: &[Seg], threads: usize) -> Vec<Work> {
    let nkv = x.dims.nkv;
    let causal = x.spec.causal;
    let total: usize = segs.iter().map(|s| pairs(s, causal) * nkv).sum();
    let mut work = Vec::new();
    for &seg in segs {
        if seg.qlen == 0 || seg.klen == 0 {
            continue;
        }
        let split = threads > 1 && pairs(&seg, causal) * threads > total;
        for kvh in 0..nkv {
            if !split {
                work.push(Work::Task { seg, kvh });
                continue;
            }
            for h in kvh * x.group..(kvh + 1) * x.group {
                for mut tile in tiles(&[seg], 1, BQ) {
                    tile.head = h;
                    work.push(Work::Dq(tile));
                }
            }
            for k0 in (0..seg.klen).step_by(BK) {
                work.push(Work::Dkv(Tile {
                    seg,
                    head: kvh,
                    r0: k0,
                    r1: (k0 + BK).min(seg.klen),
                }));
            }
        }
    }
    work
}

/// `vt` (NKV, HS, LD), `dout` and `out` (Tq, NH, HS), `lse` (NH, Tq)
/// -> (dq (Tq, NH, HS), dk (Tk, NKV, HS), dv (Tk, NKV, HS)).
pub(super) fn backward(
    x: &Qkv<'_>,
    vt: &[f32],
    dout: &[f32],
    out: &[f32],
    lse: &[f32],
    segs: &[Seg],
    threads: usize,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let AttentionDims { t, tk, nh, nkv, hs } = x.dims;
    let mut dq = vec![0.0f32; t * nh * hs]; // (Tq, NH, HS)
    let mut dk = vec![0.0f32; tk * nkv * hs]; // (Tk, NKV, HS)
    let mut dv = vec![0.0f32; tk * nkv * hs]; // (Tk, NKV, HS)
    if t == 0 {
        return Ok((dq, dk, dv));
    }
    // D (NH, Tq): one row per head, computed once and shared by every task.
    let mut dsum = vec![0.0f32; nh * t];
    dsum.par_chunks_mut(t).enumerate().for_each(|(h, row)| {
        for (ti, d) in row.iter_mut().enumerate() {
            let o = (ti * nh + h) * hs;
            *d = dot(&dout[o..o + hs], &out[o..o + hs]);
        }
    });
    let dout = to_heads(dout, t, nh, hs); // (NH, Tq, HS)
    let g = Grads {
        dout: &dout,
        lse,
        dsum: &dsum,
        vt,
    };

    let work = plan(x, segs, threads);
    let done: Vec<Done> = work
        .par_iter()
        .map(|w| match *w {
            Work::Task { seg, kvh } => task(x, &g, &seg, kvh),
            Work::Dq(ref tile) => dq_tile(x, &g, tile).map(Done::Dq),
            Work::Dkv(ref tile) => dkv_tile(x, &g, tile).map(|(k, v)| Done::Dkv(k, v)),
        })
        .collect::<Result<_>>()?;
    // In work order, i.e. segment order: dK/dV rows shared by segments sum in a fixed
    // order. dQ rows belong to one segment each.
    for (w, d) in work.iter().zip(&done) {
        match (w, d) {
            (&Work::Task { seg, kvh }, Done::Task(tq, tk, tv)) => {
                scatter_add_one(&mut dk, nkv, hs, (seg.k, kvh), tk);
                scatter_add_one(&mut dv, nkv, hs, (seg.k, kvh), tv);
                for (i, blk) in tq.chunks_exact((seg.qlen * hs).max(1)).enumerate() {
                    scatter_one(&mut dq, nh, hs, (seg.q, kvh * x.group + i), blk);
                }
            }
            (Work::Dq(tile), Done::Dq(b)) => {
                scatter_one(&mut dq, nh, hs, (tile.seg.q + tile.r0, tile.head), b);
            }
            (Work::Dkv(tile), Done::Dkv(bk, bv)) => {
                let at = (tile.seg.k + tile.r0, tile.head);
                scatter_add_one(&mut dk, nkv, hs, at, bk);
                scatter_add_one(&mut dv, nkv, hs, at, bv);
            }
            _ => {}
        }
    }
    Ok((dq, dk, dv))
}

// `ds_rows(simd, ..)`: [`ds_rows_imp`] for the given instruction set.
simd_fn!(ds_rows => ds_rows_imp(
    p: &mut [f32],
    dp: &mut [f32],
    bk: usize,
    lse: &[f32],
    dsum: &[f32],
));

/// p <- P = exp(s - lse) and dp <- dS = P * (dp - D) for rows of `bk` columns.
#[inline(always)]
fn ds_rows_imp<const FMA: bool>(
    p: &mut [f32],
    dp: &mut [f32],
    bk: usize,
    lse: &[f32],
    dsum: &[f32],
) {
    for (((pr, dsr), &m), &d) in p
        .chunks_exact_mut(bk)
        .zip(dp.chunks_exact_mut(bk))
        .zip(lse)
        .zip(dsum)
    {
        // Masked scores are -inf: exp gives exactly 0.
        for (pv, ds) in pr.iter_mut().zip(dsr.iter_mut()) {
            *pv = exp::<FMA>(*pv - m);
            *ds = *pv * (*ds - d);
        }
    }
}

/// p (bq, bk) = exp(scores - lse) for query head `h`; then dp (bq, bk) = dO Vᵀ and
/// finally dp <- dS = p * (dp - D). Leaves P in `p` and dS in `dp`.
#[allow(clippy::too_many_arguments)]
fn block_grads(
    x: &Qkv<'_>,
    g: &Grads<'_>,
    p: &mut [f32],
    dp: &mut [f32],
    seg: &Seg,
    h: usize,
    (q0, bq): (usize, usize),
    (k0, bk): (usize, usize),
) -> Result<()> {
    let AttentionDims { t, tk, hs, .. } = x.dims;
    let row0 = h * t + seg.q + q0;
    let (lse, dsum) = (&g.lse[row0..row0 + bq], &g.dsum[row0..row0 + bq]);
    scores(x, p, seg, h, (q0, bq), (k0, bk))?;
    // dp (bq, bk) = dO_blk (bq, HS) @ v_blkᵀ (HS, bk)
    mm(
        x.simd,
        bq,
        bk,
        hs,
        head_rows(g.dout, seg.q + q0, h, t, hs),
        head_cols(g.vt, seg.k + k0, h / x.group, tk, hs),
        dp,
        bk,
        1.0,
        0.0,
    )?;
    ds_rows(x.simd, p, dp, bk, lse, dsum);
    Ok(())
}

/// dq (bq, HS, row stride `dq_rs`) += scale * ds (bq, bk) @ k_blk (bk, HS).
#[allow(clippy::too_many_arguments)]
fn add_dq(
    x: &Qkv<'_>,
    dq: &mut [f32],
    ds: &[f32],
    seg: &Seg,
    kvh: usize,
    bq: usize,
    (k0, bk): (usize, usize),
) -> Result<()> {
    let AttentionDims { tk, hs, .. } = x.dims;
    mm(
        x.simd,
        bq,
        hs,
        bk,
        MatRef::new(ds, bk, false),
        head_rows(x.k, seg.k + k0, kvh, tk, hs),
        dq,
        hs,
        x.spec.scale,
        1.0,
    )
}

/// dv (bk, HS) += pᵀ @ dO_blk and dk (bk, HS) += scale * dsᵀ @ q_blk, for the query
/// rows `q0..q0 + bq` of head `h`.
#[allow(clippy::too_many_arguments)]
fn add_dkv(
    x: &Qkv<'_>,
    g: &Grads<'_>,
    (dk, dv): (&mut [f32], &mut [f32]),
    (p, ds): (&[f32], &[f32]),
    seg: &Seg,
    h: usize,
    (q0, bq): (usize, usize),
    bk: usize,
) -> Result<()> {
    let AttentionDims { t, hs, .. } = x.dims;
    // dv (bk, HS) += pᵀ (bk, bq) @ dO_blk (bq, HS)
    mm(
        x.simd,
        bk,
        hs,
        bq,
        MatRef::new(p, bk, true),
        head_rows(g.dout, seg.q + q0, h, t, hs),
        dv,
        hs,
        1.0,
        1.0,
    )?;
    // dk (bk, HS) += scale * dsᵀ (bk, bq) @ q_blk (bq, HS)
    mm(
        x.simd,
        bk,
        hs,
        bq,
        MatRef::new(ds, bk, true),
        head_rows(x.q, seg.q + q0, h, t, hs),
        dk,
        hs,
        x.spec.scale,
        1.0,
    )
}

/// One (segment, kv head) task: every block pair once, in the order (head, query
/// block, key block). -> Done::Task.
fn task(x: &Qkv<'_>, g: &Grads<'_>, seg: &Seg, kvh: usize) -> Result<Done> {
    let hs = x.dims.hs;
    let (qlen, klen) = (seg.qlen, seg.klen);
    let mut dq = vec![0.0f32; x.group * qlen * hs]; // (group, qlen, HS)
    let mut dk = vec![0.0f32; klen * hs]; // (klen, HS)
    let mut dv = vec![0.0f32; klen * hs]; // (klen, HS)
    let mut p = vec![0.0f32; BQ * BK]; // (bq, bk)
    let mut ds = vec![0.0f32; BQ * BK]; // (bq, bk)
    for (i, h) in (kvh * x.group..(kvh + 1) * x.group).enumerate() {
        for q0 in (0..qlen).step_by(BQ) {
            let q1 = (q0 + BQ).min(qlen);
            let bq = q1 - q0;
            let kend = seg.kend(x.spec.causal, q1);
            let dq_blk = &mut dq[(i * qlen + q0) * hs..(i * qlen + q1) * hs];
            for k0 in (0..kend).step_by(BK) {
                // Always a full key tile's rows (or the segment's last ones), as in
                // dkv_tile, so the blocks match the split scheme's bitwise.
                let bk = BK.min(klen - k0);
                let (p, ds) = (&mut p[..bq * bk], &mut ds[..bq * bk]);
                block_grads(x, g, p, ds, seg, h, (q0, bq), (k0, bk))?;
                add_dq(x, dq_blk, ds, seg, kvh, bq, (k0, bk))?;
                let (dk_blk, dv_blk) = (
                    &mut dk[k0 * hs..(k0 + bk) * hs],
                    &mut dv[k0 * hs..(k0 + bk) * hs],
                );
                add_dkv(x, g, (dk_blk, dv_blk), (p, ds), seg, h, (q0, bq), bk)?;
            }
        }
    }
    Ok(Done::Task(dq, dk, dv))
}

/// One query tile -> dq block (bq, HS), summing over the key blocks in order.
fn dq_tile(x: &Qkv<'_>, g: &Grads<'_>, tile: &Tile) -> Result<Vec<f32>> {
    let Tile {
        seg,
        head: h,
        r0: q0,
        r1: q1,
    } = *tile;
    let bq = q1 - q0;
    let kend = seg.kend(x.spec.causal, q1);
    let mut dq = vec![0.0f32; bq * x.dims.hs]; // (bq, HS)
    let mut p = vec![0.0f32; bq * BK]; // (bq, bk)
    let mut ds = vec![0.0f32; bq * BK]; // (bq, bk)
    for k0 in (0..kend).step_by(BK) {
        let bk = BK.min(seg.klen - k0);
        let (p, ds) = (&mut p[..bq * bk], &mut ds[..bq * bk]);
        block_grads(x, g, p, ds, &seg, h, (q0, bq), (k0, bk))?;
        add_dq(x, &mut dq, ds, &seg, h / x.group, bq, (k0, bk))?;
    }
    Ok(dq)
}

/// One key tile of kv head `tile.head` -> (dk block (bk, HS), dv block (bk, HS)),
/// summing over the query heads of its group, then over query blocks, in order.
fn dkv_tile(x: &Qkv<'_>, g: &Grads<'_>, tile: &Tile) -> Result<(Vec<f32>, Vec<f32>)> {
    let hs = x.dims.hs;
    let Tile {
        seg,
        head: kvh,
        r0: k0,
        r1: k1,
    } = *tile;
    let bk = k1 - k0;
    let mut dk = vec![0.0f32; bk * hs]; // (bk, HS)
    let mut dv = vec![0.0f32; bk * hs]; // (bk, HS)
    let mut p = vec![0.0f32; BQ * bk]; // (bq, bk)
    let mut ds = vec![0.0f32; BQ * bk]; // (bq, bk)
    for h in kvh * x.group..(kvh + 1) * x.group {
        for q0 in (0..seg.qlen).step_by(BQ) {
            let q1 = (q0 + BQ).min(seg.qlen);
            // Exactly the query blocks whose task visits this key block: causal
            // blocks wholly before the keys see none of them.
            if k0 >= seg.kend(x.spec.causal, q1) {
                continue;
            }
            let bq = q1 - q0;
            let (p, ds) = (&mut p[..bq * bk], &mut ds[..bq * bk]);
            block_grads(x, g, p, ds, &seg, h, (q0, bq), (k0, bk))?;
            add_dkv(x, g, (&mut dk, &mut dv), (p, ds), &seg, h, (q0, bq), bk)?;
        }
    }
    Ok((dk, dv))
}
