//! Attention forward: one query tile at a time, online softmax over key blocks.

use rayon::prelude::*;

use super::{BK, Qkv, Tile, exp_softmax, head_rows, max8, scatter, scores, sum8, tiles};
use crate::cpu::matmul::{MatRef, sgemm};
use crate::error::Result;
use crate::ops::attention::AttentionDims;

/// -> (out (T, NH, HS), lse (NH, T)).
pub(super) fn forward(x: &Qkv<'_>, cu_seqlens: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
    let AttentionDims { t, nh, hs, .. } = x.dims;
    let mut out = vec![0.0f32; t * nh * hs]; // (T, NH, HS)
    let mut lse = vec![0.0f32; nh * t]; // (NH, T)
    let work = tiles(cu_seqlens, nh, super::BQ);
    let done: Vec<(Vec<f32>, Vec<f32>)> = work
        .par_iter()
        .map(|tile| forward_tile(x, tile))
        .collect::<Result<_>>()?;
    let (blocks, lses): (Vec<_>, Vec<_>) = done.into_iter().unzip();
    scatter(&mut out, nh, hs, &work, &blocks);
    for (tile, l) in work.iter().zip(&lses) {
        let o = tile.head * t + tile.seq + tile.r0;
        lse[o..o + l.len()].copy_from_slice(l);
    }
    Ok((out, lse))
}

/// One query tile -> (out block (bq, HS), lse block (bq)).
fn forward_tile(x: &Qkv<'_>, tile: &Tile) -> Result<(Vec<f32>, Vec<f32>)> {
    let AttentionDims { nkv, hs, .. } = x.dims;
    let Tile {
        seq,
        len,
        head: h,
        r0: q0,
        r1: q1,
    } = *tile;
    let bq = q1 - q0;
    let kvh = h / x.group;
    // Causal: keys past the tile's last query are masked for every row: skip them.
    let kend = if x.spec.causal { q1 } else { len };
    let mut acc = vec![0.0f32; bq * hs]; // (bq, HS) unnormalized output
    let mut m = vec![f32::NEG_INFINITY; bq]; // (bq) running max of scores
    let mut l = vec![0.0f32; bq]; // (bq) running sum of exp(score - m)
    let mut s = vec![0.0f32; bq * BK]; // (bq, bk) scores, then probabilities
    for k0 in (0..kend).step_by(BK) {
        let bk = BK.min(kend - k0);
        let s = &mut s[..bq * bk];
        scores(x, s, seq, h, (q0, bq), (k0, bk))?;
        for (r, row) in s.chunks_exact_mut(bk).enumerate() {
            let m_new = m[r].max(max8(row));
            if m_new == f32::NEG_INFINITY {
                // Every key so far is hidden from this row: nothing to add yet.
                row.fill(0.0);
                continue;
            }
            // exp(-inf) = 0 on the first block, where acc and l are still 0.
            let corr = (m[r] - m_new).exp();
            row.iter_mut().for_each(|p| *p = exp_softmax(*p - m_new));
            l[r] = l[r] * corr + sum8(row);
            if corr != 1.0 {
                acc[r * hs..(r + 1) * hs]
                    .iter_mut()
                    .for_each(|a| *a *= corr);
            }
            m[r] = m_new;
        }
        // acc (bq, HS) += p (bq, bk) @ v_blk (bk, HS)
        sgemm(
            bq,
            hs,
            bk,
            MatRef::new(s, bk, false),
            head_rows(x.v, seq + k0, kvh, nkv, hs),
            &mut acc,
            hs,
            1.0,
            1.0,
            1,
        )?;
    }
    // Every row sees at least one key (itself when causal), so l > 0.
    let mut lse = vec![0.0f32; bq]; // (bq)
    for r in 0..bq {
        let inv = 1.0 / l[r];
        acc[r * hs..(r + 1) * hs].iter_mut().for_each(|a| *a *= inv);
        lse[r] = m[r] + l[r].ln();
    }
    Ok((acc, lse))
}
