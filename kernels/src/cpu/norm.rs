//! CPU LayerNorm and RMSNorm: rows in parallel, row statistics in f64, parameter grads
//! summed per block of columns in row order, so results are bitwise the same for any
//! number of threads. Tensors too small to split run on the calling thread, without a
//! round trip through rayon's pool.

use rayon::prelude::*;

use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::NormKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// Columns per task of a parameter-grad reduction: wide enough that each row read is a
/// couple of cache lines, narrow enough that C = 768 already gives 12 tasks.
const COL_BLOCK: usize = 64;

/// Rows per rayon task so that a task has at least [`PAR_MIN_ELEMS`] elements; at most
/// this many rows run on the calling thread, where splitting costs more than it saves.
pub(super) fn min_rows(c: usize) -> usize {
    PAR_MIN_ELEMS.div_ceil(c.max(1))
}

/// `out[j] += sum_n term(n, j)` for a `(rows, C)` reduction over rows, C = `out.len()`.
///
/// `row_term(n, j0, acc)` adds row n's terms for columns `j0 .. j0 + acc.len()` into
/// `acc`. Each column block is one task summing its rows in order in f64: no atomics,
/// no scheduling-dependent order, and f64 keeps a sum over 10^5 rows accurate.
pub(super) fn add_column_sums<F>(out: &mut [f32], rows: usize, row_term: F)
where
    F: Fn(usize, usize, &mut [f64]) + Sync,
{
    let block = |(blk, o): (usize, &mut [f32])| {
        let mut acc = vec![0.0f64; o.len()];
        for n in 0..rows {
            row_term(n, blk * COL_BLOCK, &mut acc);
        }
        for (o, a) in o.iter_mut().zip(acc) {
            *o += a as f32;
        }
    };
    // One column block, or too little work to hand to the pool: the calling thread.
    if out.len() <= COL_BLOCK || rows * out.len() <= PAR_MIN_ELEMS {
        out.chunks_mut(COL_BLOCK).enumerate().for_each(block);
    } else {
        out.par_chunks_mut(COL_BLOCK).enumerate().for_each(block);
    }
}

/// Mean and `1 / sqrt(biased var + eps)` of one row, two-pass in f64 (a one-pass
/// `E[x^2] - E[x]^2` loses every digit when |mean| >> std).
fn mean_rstd(xr: &[f32], eps: f32) -> (f32, f32) {
    let c = xr.len() as f64;
    let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / c;
    let var = xr
        .iter()
        .map(|&v| {
            let d = f64::from(v) - mean;
            d * d
        })
        .sum::<f64>()
        / c;
    (mean as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32)
}

/// `1 / sqrt(mean(x^2) + eps)` of one row, accumulated in f64.
fn rms_rstd(xr: &[f32], eps: f32) -> f32 {
    let ms = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / xr.len() as f64;
    (1.0 / (ms + f64::from(eps)).sqrt()) as f32
}

impl NormKernels for CpuBackend {
    fn layer_norm_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if super::bf16::any(&[x, w]) || super::bf16::any_opt(&[b]) {
            return super::bf16::layer_norm_fwd(self, x, w, b, eps);
        }
        const OP: &str = "layer_norm_fwd";
        let xv = x.cpu_f32(OP, "x")?; // (N, C)
        let wv = w.cpu_f32(OP, "w")?; // (C)
        let bv = b.map(|b| b.cpu_f32(OP, "b")).transpose()?; // (C)
        let c = wv.len().max(1);
        let n = xv.len() / c;
        let mut y = vec![0.0f32; xv.len()]; // (N, C)
        let mut mean = vec![0.0f32; n]; // (N)
        let mut rstd = vec![0.0f32; n]; // (N)
        let row = |yr: &mut [f32], xr: &[f32], m: &mut f32, r: &mut f32| {
            let (mu, rs) = mean_rstd(xr, eps);
            (*m, *r) = (mu, rs);
            // Normalize with the f32 statistics the backward will see, so that
            // forward and backward agree on xhat bit for bit.
            for ((yv, &xv), &wv) in yr.iter_mut().zip(xr).zip(wv) {
                *yv = (xv - mu) * rs * wv;
            }
            if let Some(bv) = bv {
                yr.iter_mut().zip(bv).for_each(|(yv, &bv)| *yv += bv);
            }
        };
        if n <= min_rows(c) {
            y.chunks_mut(c)
                .zip(xv.chunks(c))
                .zip(mean.iter_mut().zip(rstd.iter_mut()))
                .for_each(|((yr, xr), (m, r))| row(yr, xr, m, r));
        } else {
            y.par_chunks_mut(c)
                .zip(xv.par_chunks(c))
                .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
                .with_min_len(min_rows(c))
                .for_each(|((yr, xr), (m, r))| row(yr, xr, m, r));
        }
        Ok((
            Tensor::cpu_from_f32(y, x.shape().clone())?,
            Tensor::cpu_from_f32(mean, [n])?,
            Tensor::cpu_from_f32(rstd, [n])?,
        ))
    }

    fn layer_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        if super::bf16::any(&[dy, x, w]) || super::bf16::any_opt(&[dw.as_deref(), db.as_deref()]) {
            return super::bf16::layer_norm_bwd(self, dy, x, w, mean, rstd, dw, db);
        }
        const OP: &str = "layer_norm_bwd";
        let dyv = dy.cpu_f32(OP, "dy")?; // (N, C)
        let xv = x.cpu_f32(OP, "x")?; // (N, C)
        let wv = w.cpu_f32(OP, "w")?; // (C)
        let mv = mean.cpu_f32(OP, "mean")?; // (N)
        let rv = rstd.cpu_f32(OP, "rstd")?; // (N)
        let c = wv.len().max(1);
        let n = mv.len();
        let mut dx = vec![0.0f32; xv.len()]; // (N, C)
        // With xhat = (x - mean) rstd and g = dy w (the grad w.r.t. xhat):
        // dx = rstd (g - mean(g) - xhat mean(g xhat)).
        let row = |dxr: &mut [f32], dyr: &[f32], xr: &[f32], mu: f32, rs: f32| {
            let (mut sum_g, mut sum_gx) = (0.0f64, 0.0f64);
            for ((&d, &xv), &wv) in dyr.iter().zip(xr).zip(wv) {
                let g = d * wv;
                sum_g += f64::from(g);
                sum_gx += f64::from(g * ((xv - mu) * rs));
            }
            let mean_g = (sum_g / c as f64) as f32;
            let mean_gx = (sum_gx / c as f64) as f32;
            for (((o, &d), &xv), &wv) in dxr.iter_mut().zip(dyr).zip(xr).zip(wv) {
                let xhat = (xv - mu) * rs;
                *o = (d * wv - mean_g - xhat * mean_gx) * rs;
            }
        };
        if n <= min_rows(c) {
            dx.chunks_mut(c)
                .zip(dyv.chunks(c).zip(xv.chunks(c)))
                .zip(mv.iter().zip(rv))
                .for_each(|((dxr, (dyr, xr)), (&mu, &rs))| row(dxr, dyr, xr, mu, rs));
        } else {
            dx.par_chunks_mut(c)
                .zip(dyv.par_chunks(c).zip(xv.par_chunks(c)))
                .zip(mv.par_iter().zip(rv.par_iter()))
                .with_min_len(min_rows(c))
                .for_each(|((dxr, (dyr, xr)), (&mu, &rs))| row(dxr, dyr, xr, mu, rs));
        }
        if let Some(dw) = dw {
            // dw (C) += sum_n dy[n] * xhat[n]
            add_column_sums(dw.cpu_f32_mut(OP, "dw")?, n, |r, j0, acc| {
                let row = r * c + j0..r * c + j0 + acc.len();
                let (mu, rs) = (mv[r], rv[r]);
                for ((a, &d), &xv) in acc.iter_mut().zip(&dyv[row.clone()]).zip(&xv[row]) {
                    *a += f64::from(d * ((xv - mu) * rs));
                }
            });
        }
        if let Some(db) = db {
            // db (C) += sum_n dy[n]
            add_column_sums(db.cpu_f32_mut(OP, "db")?, n, |r, j0, acc| {
                let row = &dyv[r * c + j0..r * c + j0 + acc.len()];
                acc.iter_mut()
                    .zip(row)
                    .for_each(|(a, &d)| *a += f64::from(d));
            });
        }
        Tensor::cpu_from_f32(dx, x.shape().clone())
    }

    fn rms_norm_fwd(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        if super::bf16::any(&[x, w]) {
            return super::bf16::rms_norm_fwd(self, x, w, eps);
        }
        const OP: &str = "rms_norm_fwd";
        let xv = x.cpu_f32(OP, "x")?; // (N, C)
        let wv = w.cpu_f32(OP, "w")?; // (C)
        let c = wv.len().max(1);
        let n = xv.len() / c;
        let mut y = vec![0.0f32; xv.len()]; // (N, C)
        let mut rstd = vec![0.0f32; n]; // (N)
        let row = |yr: &mut [f32], xr: &[f32], r: &mut f32| {
            let rs = rms_rstd(xr, eps);
            *r = rs;
            // HF order: normalize first, then scale by the weight.
            for ((yv, &xv), &wv) in yr.iter_mut().zip(xr).zip(wv) {
                *yv = (xv * rs) * wv;
            }
        };
        if n <= min_rows(c) {
            y.chunks_mut(c)
                .zip(xv.chunks(c))
                .zip(rstd.iter_mut())
                .for_each(|((yr, xr), r)| row(yr, xr, r));
        } else {
            y.par_chunks_mut(c)
                .zip(xv.par_chunks(c))
                .zip(rstd.par_iter_mut())
                .with_min_len(min_rows(c))
                .for_each(|((yr, xr), r)| row(yr, xr, r));
        }
        Ok((
            Tensor::cpu_from_f32(y, x.shape().clone())?,
            Tensor::cpu_from_f32(rstd, [n])?,
        ))
    }

    fn rms_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        if super::bf16::any(&[dy, x, w]) || super::bf16::any_opt(&[dw.as_deref()]) {
            return super::bf16::rms_norm_bwd(self, dy, x, w, rstd, dw);
        }
        const OP: &str = "rms_norm_bwd";
        let dyv = dy.cpu_f32(OP, "dy")?; // (N, C)
        let xv = x.cpu_f32(OP, "x")?; // (N, C)
        let wv = w.cpu_f32(OP, "w")?; // (C)
        let rv = rstd.cpu_f32(OP, "rstd")?; // (N)
        let c = wv.len().max(1);
        let n = rv.len();
        let mut dx = vec![0.0f32; xv.len()]; // (N, C)
        // With xhat = x rstd and g = dy w: dx = rstd (g - xhat mean(g xhat)).
        let row = |dxr: &mut [f32], dyr: &[f32], xr: &[f32], rs: f32| {
            let sum_gx: f64 = dyr
                .iter()
                .zip(xr)
                .zip(wv)
                .map(|((&d, &xv), &wv)| f64::from((d * wv) * (xv * rs)))
                .sum();
            let mean_gx = (sum_gx / c as f64) as f32;
            for (((o, &d), &xv), &wv) in dxr.iter_mut().zip(dyr).zip(xr).zip(wv) {
                *o = (d * wv - (xv * rs) * mean_gx) * rs;
            }
        };
        if n <= min_rows(c) {
            dx.chunks_mut(c)
                .zip(dyv.chunks(c).zip(xv.chunks(c)))
                .zip(rv)
                .for_each(|((dxr, (dyr, xr)), &rs)| row(dxr, dyr, xr, rs));
        } else {
            dx.par_chunks_mut(c)
                .zip(dyv.par_chunks(c).zip(xv.par_chunks(c)))
                .zip(rv.par_iter())
                .with_min_len(min_rows(c))
                .for_each(|((dxr, (dyr, xr)), &rs)| row(dxr, dyr, xr, rs));
        }
        if let Some(dw) = dw {
            // dw (C) += sum_n dy[n] * xhat[n]
            add_column_sums(dw.cpu_f32_mut(OP, "dw")?, n, |r, j0, acc| {
                let row = r * c + j0..r * c + j0 + acc.len();
                let rs = rv[r];
                for ((a, &d), &xv) in acc.iter_mut().zip(&dyv[row.clone()]).zip(&xv[row]) {
                    *a += f64::from(d * (xv * rs));
                }
            });
        }
        Tensor::cpu_from_f32(dx, x.shape().clone())
    }
}
