//! Attention forward: one query tile at a time, online softmax over key blocks.

use rayon::prelude::*;

use super::kernel::mm;
use super::{Qkv, Seg, Tile, head_rows, max16, scatter, scores, tiles};
use crate::cpu::simd::exp;

/// Keys per block. Larger than the backward's 64: the per-row work of a step (max,
/// rescale) is then spread over more keys.
const BK: usize = 128;
use crate::cpu::matmul::MatRef;
use crate::error::Result;
use crate::ops::attention::AttentionDims;

/// -> (out (Tq, NH, HS), lse (NH, Tq)).
pub(super) fn forward(x: &Qkv<'_>, segs: &[Seg]) -> Result<(Vec<f32>, Vec<f32>)> {
    let AttentionDims { t, nh, hs, .. } = x.dims;
    let mut out = vec![0.0f32; t * nh * hs]; // (Tq, NH, HS)
    let mut lse = vec![0.0f32; nh * t]; // (NH, Tq)
    let work = tiles(segs, nh, super::BQ);
    let done: Vec<(Vec<f32>, Vec<f32>)> = work
        .par_iter()
        .map(|tile| forward_tile(x, tile))
        .collect::<Result<_>>()?;
    let (blocks, lses): (Vec<_>, Vec<_>) = done.into_iter().unzip();
    scatter(&mut out, nh, hs, &work, &blocks);
    for (tile, l) in work.iter().zip(&lses) {
        let o = tile.head * t + tile.seg.q + tile.r0;
        lse[o..o + l.len()].copy_from_slice(l);
    }
    Ok((out, lse))
}

// `softmax_step(simd, ..)`: [`softmax_step_imp`] for the given instruction set.
simd_fn!(softmax_step => softmax_step_imp(
    s: &mut [f32],
    bk: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
));

/// One online-softmax step over a block of scores `s` (bq, bk): turns them into
/// exp(s - m_new) in place and rescales the running sums `l` (bq) and the
/// accumulator rows `acc` (bq, HS) to the new running max `m` (bq).
#[inline(always)]
fn softmax_step_imp<const FMA: bool>(
    s: &mut [f32],
    bk: usize,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
) {
    let hs = acc.len() / m.len().max(1);
    for (r, row) in s.chunks_exact_mut(bk).enumerate() {
        let m_new = m[r].max(max16(row));
        if m_new == f32::NEG_INFINITY {
            // Every key so far is hidden from this row: nothing to add yet.
            row.fill(0.0);
            continue;
        }
        // exp(-inf) = 0 on the first block, where acc and l are still 0.
        let corr = exp::<FMA>(m[r] - m_new);
        l[r] = l[r] * corr + exp_sum::<FMA>(row, m_new);
        if corr != 1.0 {
            acc[r * hs..(r + 1) * hs]
                .iter_mut()
                .for_each(|a| *a *= corr);
        }
        m[r] = m_new;
    }
}

/// row <- exp(row - m) (every entry <= 0 after the shift); returns its sum, taken
/// in 16 lanes (fixed order -> deterministic).
#[inline(always)]
fn exp_sum<const FMA: bool>(row: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for (x, a) in c.iter_mut().zip(&mut acc) {
            *x = exp::<FMA>(*x - m);
            *a += *x;
        }
    }
    let mut tail = 0.0f32;
    for x in chunks.into_remainder() {
        *x = exp::<FMA>(*x - m);
        tail += *x;
    }
    acc.iter().sum::<f32>() + tail
}

/// One query tile -> (out block (bq, HS), lse block (bq)).
fn forward_tile(x: &Qkv<'_>, tile: &Tile) -> Result<(Vec<f32>, Vec<f32>)> {
    let AttentionDims { tk, hs, .. } = x.dims;
    let Tile {
        seg,
        head: h,
        r0: q0,
        r1: q1,
    } = *tile;
    let bq = q1 - q0;
    let kvh = h / x.group;
    // Causal: keys past the tile's last query are masked for every row: skip them.
    let kend = seg.kend(x.spec.causal, q1);
    let mut acc = vec![0.0f32; bq * hs]; // (bq, HS) unnormalized output
    let mut m = vec![f32::NEG_INFINITY; bq]; // (bq) running max of scores
    let mut l = vec![0.0f32; bq]; // (bq) running sum of exp(score - m)
    let mut s = vec![0.0f32; bq * BK]; // (bq, bk) scores, then probabilities
    for k0 in (0..kend).step_by(BK) {
        let bk = BK.min(kend - k0);
        let s = &mut s[..bq * bk];
        scores(x, s, &seg, h, (q0, bq), (k0, bk))?;
        softmax_step(x.simd, s, bk, &mut m, &mut l, &mut acc);
        // acc (bq, HS) += p (bq, bk) @ v_blk (bk, HS)
        mm(
            x.simd,
            bq,
            hs,
            bk,
            MatRef::new(s, bk, false),
            head_rows(x.v, seg.k + k0, kvh, tk, hs),
            &mut acc,
            hs,
            1.0,
            1.0,
        )?;
    }
    // Every row sees at least one key (validated: a segment with queries has keys,
    // and when causal at least as many as queries), so l > 0.
    let mut lse = vec![0.0f32; bq]; // (bq)
    for r in 0..bq {
        let inv = 1.0 / l[r];
        acc[r * hs..(r + 1) * hs].iter_mut().for_each(|a| *a *= inv);
        lse[r] = m[r] + l[r].ln();
    }
    Ok((acc, lse))
}
