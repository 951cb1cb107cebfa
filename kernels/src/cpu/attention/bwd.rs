//! Attention backward, FlashAttention-2 style: P is rebuilt per block from q, k and
//! lse; dQ is computed per query tile and dK/dV per key tile, each by one task.
//!
//! With P = exp(S - lse), dO the output grad and D_i = rowsum(dO_i * O_i):
//! dV = Pᵀ dO, dP = dO Vᵀ, dS = P * (dP - D), dQ = scale * dS K, dK = scale * dSᵀ Q.

use rayon::prelude::*;

use super::{BK, BQ, Qkv, Tile, dot, exp_softmax, head_rows, head_rows_t, scatter, scores, tiles};
use crate::cpu::matmul::{MatRef, sgemm};
use crate::error::Result;
use crate::ops::attention::AttentionDims;

/// What the backward reads besides q, k, v.
#[derive(Clone, Copy)]
struct Grads<'a> {
    /// (T, NH, HS) grad of the output.
    dout: &'a [f32],
    /// (NH, T) log-sum-exp of the forward.
    lse: &'a [f32],
    /// (NH, T) D = rowsum(dout * out).
    dsum: &'a [f32],
}

/// -> (dq (T, NH, HS), dk (T, NKV, HS), dv (T, NKV, HS)).
pub(super) fn backward(
    x: &Qkv<'_>,
    dout: &[f32],
    out: &[f32],
    lse: &[f32],
    cu_seqlens: &[usize],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let AttentionDims { t, nh, nkv, hs } = x.dims;
    let mut dq = vec![0.0f32; t * nh * hs]; // (T, NH, HS)
    let mut dk = vec![0.0f32; t * nkv * hs]; // (T, NKV, HS)
    let mut dv = vec![0.0f32; t * nkv * hs]; // (T, NKV, HS)
    if t == 0 {
        return Ok((dq, dk, dv));
    }
    // D (NH, T): one row per head, computed once and shared by both passes.
    let mut dsum = vec![0.0f32; nh * t];
    dsum.par_chunks_mut(t).enumerate().for_each(|(h, row)| {
        for (ti, d) in row.iter_mut().enumerate() {
            let o = (ti * nh + h) * hs;
            *d = dot(&dout[o..o + hs], &out[o..o + hs]);
        }
    });
    let g = Grads {
        dout,
        lse,
        dsum: &dsum,
    };

    let q_tiles = tiles(cu_seqlens, nh, BQ);
    let dq_blocks: Vec<Vec<f32>> = q_tiles
        .par_iter()
        .map(|tile| dq_tile(x, &g, tile))
        .collect::<Result<_>>()?;
    scatter(&mut dq, nh, hs, &q_tiles, &dq_blocks);
    drop(dq_blocks);

    let kv_tiles = tiles(cu_seqlens, nkv, BK);
    let dkv_blocks: Vec<(Vec<f32>, Vec<f32>)> = kv_tiles
        .par_iter()
        .map(|tile| dkv_tile(x, &g, tile))
        .collect::<Result<_>>()?;
    let (dk_blocks, dv_blocks): (Vec<_>, Vec<_>) = dkv_blocks.into_iter().unzip();
    scatter(&mut dk, nkv, hs, &kv_tiles, &dk_blocks);
    scatter(&mut dv, nkv, hs, &kv_tiles, &dv_blocks);
    Ok((dq, dk, dv))
}

/// p (bq, bk) = exp(scores - lse) for query head `h`; then dp (bq, bk) = dO Vᵀ and
/// finally dp <- dS = p * (dp - D). Leaves P in `p` and dS in `dp`.
#[allow(clippy::too_many_arguments)]
fn block_grads(
    x: &Qkv<'_>,
    g: &Grads<'_>,
    p: &mut [f32],
    dp: &mut [f32],
    seq: usize,
    h: usize,
    (q0, bq): (usize, usize),
    (k0, bk): (usize, usize),
) -> Result<()> {
    let AttentionDims { t, nh, nkv, hs } = x.dims;
    let row0 = h * t + seq + q0;
    let (lse, dsum) = (&g.lse[row0..row0 + bq], &g.dsum[row0..row0 + bq]);
    scores(x, p, seq, h, (q0, bq), (k0, bk))?;
    for (row, &m) in p.chunks_exact_mut(bk).zip(lse) {
        // Masked scores are -inf: exp gives exactly 0.
        row.iter_mut().for_each(|s| *s = exp_softmax(*s - m));
    }
    // dp (bq, bk) = dO_blk (bq, HS) @ v_blkᵀ (HS, bk)
    sgemm(
        bq,
        bk,
        hs,
        head_rows(g.dout, seq + q0, h, nh, hs),
        head_rows_t(x.v, seq + k0, h / x.group, nkv, hs),
        dp,
        bk,
        1.0,
        0.0,
        1,
    )?;
    for ((dsr, pr), &d) in dp.chunks_exact_mut(bk).zip(p.chunks_exact(bk)).zip(dsum) {
        dsr.iter_mut()
            .zip(pr)
            .for_each(|(ds, &pv)| *ds = pv * (*ds - d));
    }
    Ok(())
}

/// One query tile -> dq block (bq, HS), summing over the key blocks in order.
fn dq_tile(x: &Qkv<'_>, g: &Grads<'_>, tile: &Tile) -> Result<Vec<f32>> {
    let AttentionDims { nkv, hs, .. } = x.dims;
    let Tile {
        seq,
        len,
        head: h,
        r0: q0,
        r1: q1,
    } = *tile;
    let bq = q1 - q0;
    let kend = if x.spec.causal { q1 } else { len };
    let mut dq = vec![0.0f32; bq * hs]; // (bq, HS)
    let mut p = vec![0.0f32; bq * BK]; // (bq, bk)
    let mut ds = vec![0.0f32; bq * BK]; // (bq, bk)
    for k0 in (0..kend).step_by(BK) {
        let bk = BK.min(kend - k0);
        let (p, ds) = (&mut p[..bq * bk], &mut ds[..bq * bk]);
        block_grads(x, g, p, ds, seq, h, (q0, bq), (k0, bk))?;
        // dq (bq, HS) += scale * ds (bq, bk) @ k_blk (bk, HS)
        sgemm(
            bq,
            hs,
            bk,
            MatRef::new(ds, bk, false),
            head_rows(x.k, seq + k0, h / x.group, nkv, hs),
            &mut dq,
            hs,
            x.spec.scale,
            1.0,
            1,
        )?;
    }
    Ok(dq)
}

/// One key tile of kv head `tile.head` -> (dk block (bk, HS), dv block (bk, HS)),
/// summing over the query heads of its group, then over query blocks, in order.
fn dkv_tile(x: &Qkv<'_>, g: &Grads<'_>, tile: &Tile) -> Result<(Vec<f32>, Vec<f32>)> {
    let AttentionDims { nh, hs, .. } = x.dims;
    let Tile {
        seq,
        len,
        head: kvh,
        r0: k0,
        r1: k1,
    } = *tile;
    let bk = k1 - k0;
    // Causal: query blocks wholly before the first key see none of these keys.
    let qstart = if x.spec.causal { k0 / BQ * BQ } else { 0 };
    let mut dk = vec![0.0f32; bk * hs]; // (bk, HS)
    let mut dv = vec![0.0f32; bk * hs]; // (bk, HS)
    let mut p = vec![0.0f32; BQ * bk]; // (bq, bk)
    let mut ds = vec![0.0f32; BQ * bk]; // (bq, bk)
    for h in kvh * x.group..(kvh + 1) * x.group {
        for q0 in (qstart..len).step_by(BQ) {
            let bq = BQ.min(len - q0);
            let (p, ds) = (&mut p[..bq * bk], &mut ds[..bq * bk]);
            block_grads(x, g, p, ds, seq, h, (q0, bq), (k0, bk))?;
            // dv (bk, HS) += pᵀ (bk, bq) @ dO_blk (bq, HS)
            sgemm(
                bk,
                hs,
                bq,
                MatRef::new(p, bk, true),
                head_rows(g.dout, seq + q0, h, nh, hs),
                &mut dv,
                hs,
                1.0,
                1.0,
                1,
            )?;
            // dk (bk, HS) += scale * dsᵀ (bk, bq) @ q_blk (bq, HS)
            sgemm(
                bk,
                hs,
                bq,
                MatRef::new(ds, bk, true),
                head_rows(x.q, seq + q0, h, nh, hs),
                &mut dk,
                hs,
                x.spec.scale,
                1.0,
                1,
            )?;
        }
    }
    Ok((dk, dv))
}
