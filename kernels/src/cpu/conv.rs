//! CPU conv1d (im2col + GEMM) and patchify.
//!
//! conv1d unrolls each batch item's input into a column matrix so that the
//! convolution is one GEMM with the weight read as `(CO, CI*K)`; the backward runs
//! the same GEMMs transposed and folds the column grads back (col2im). Every output
//! element is written by one task in a fixed order, so results do not depend on the
//! number of threads.

use rayon::prelude::*;

use super::matmul::{MatRef, sgemm};
use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::ConvKernels;
use crate::error::{Error, Result};
use crate::ops::conv::{Conv1dDims, Conv1dSpec};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// im2col of one batch item: `col[ci*K + kk, o] = x[ci, o*stride + kk - pad]` (0 in the
/// padding). xb (CI, L) -> col (CI*K, LO).
fn im2col(d: &Conv1dDims, xb: &[f32], col: &mut [f32]) {
    for (r, crow) in col.chunks_mut(d.lo).enumerate() {
        let (c, kk) = (r / d.k, r % d.k);
        let xrow = &xb[c * d.l..(c + 1) * d.l];
        for (o, v) in crow.iter_mut().enumerate() {
            *v = d.src(o, kk).map_or(0.0, |i| xrow[i]);
        }
    }
}

/// col2im of one batch item, the adjoint of [`im2col`]: dxb (CI, L) += dcol (CI*K, LO)
/// folded back. Each dxb row is summed over (kk, o) in a fixed order.
fn col2im(d: &Conv1dDims, dcol: &[f32], dxb: &mut [f32]) {
    for (c, dxrow) in dxb.chunks_mut(d.l).enumerate() {
        for kk in 0..d.k {
            let drow = &dcol[(c * d.k + kk) * d.lo..(c * d.k + kk + 1) * d.lo];
            for (o, &g) in drow.iter().enumerate() {
                if let Some(i) = d.src(o, kk) {
                    dxrow[i] += g;
                }
            }
        }
    }
}

/// The patch size, re-checked against H and W (the ops layer already did) because the
/// copies below index whole patches.
fn patch_size(op: &'static str, h: usize, w: usize, patch: usize) -> Result<usize> {
    if patch == 0 || !h.is_multiple_of(patch) || !w.is_multiple_of(patch) {
        return Err(Error::shape(
            op,
            format!("H = {h}, W = {w} are not multiples of the patch size {patch}"),
        ));
    }
    Ok(patch)
}

impl ConvKernels for CpuBackend {
    fn conv1d_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        spec: &Conv1dSpec,
    ) -> Result<Tensor> {
        if super::bf16::any(&[x, w]) || super::bf16::any_opt(&[b]) {
            return super::bf16::conv1d_fwd(self, x, w, b, spec);
        }
        const OP: &str = "conv1d_fwd";
        let d = Conv1dDims::new(OP, x, w, spec)?;
        let xv = x.cpu_f32(OP, "x")?; // (B, CI, L)
        let wv = w.cpu_f32(OP, "w")?; // (CO, CI*K)
        let bv = b.map(|b| b.cpu_f32(OP, "b")).transpose()?; // (CO)
        let mut y = vec![0.0f32; d.b * d.co * d.lo]; // (B, CO, LO)
        if y.is_empty() {
            return Tensor::cpu_from_f32(y, [d.b, d.co, d.lo]);
        }
        let threads = d.gemm_threads();
        let x_item = d.ci * d.l;
        y.par_chunks_mut(d.co * d.lo)
            .enumerate()
            .try_for_each(|(bi, yb)| -> Result<()> {
                let xb = &xv[bi * x_item..(bi + 1) * x_item]; // (CI, L)
                let mut col = vec![0.0f32; d.cik() * d.lo]; // (CI*K, LO)
                im2col(&d, xb, &mut col);
                // yb (CO, LO) = w (CO, CI*K) @ col (CI*K, LO)
                sgemm(
                    d.co,
                    d.lo,
                    d.cik(),
                    MatRef::new(wv, d.cik(), false),
                    MatRef::new(&col, d.lo, false),
                    yb,
                    d.lo,
                    1.0,
                    0.0,
                    threads,
                )?;
                if let Some(bv) = bv {
                    for (row, &bias) in yb.chunks_mut(d.lo).zip(bv) {
                        row.iter_mut().for_each(|v| *v += bias);
                    }
                }
                Ok(())
            })?;
        Tensor::cpu_from_f32(y, [d.b, d.co, d.lo])
    }

    fn conv1d_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        spec: &Conv1dSpec,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        if super::bf16::any(&[dy, x, w]) || super::bf16::any_opt(&[dw.as_deref(), db.as_deref()]) {
            return super::bf16::conv1d_bwd(self, (dy, x, w), spec, dw, db);
        }
        const OP: &str = "conv1d_bwd";
        let d = Conv1dDims::new(OP, x, w, spec)?;
        let dyv = dy.cpu_f32(OP, "dy")?; // (B, CO, LO)
        if dyv.len() != d.b * d.co * d.lo {
            return Err(Error::shape(
                OP,
                format!(
                    "dy {} does not fit x {} and w {}",
                    dy.shape(),
                    x.shape(),
                    w.shape()
                ),
            ));
        }
        let xv = x.cpu_f32(OP, "x")?; // (B, CI, L)
        let wv = w.cpu_f32(OP, "w")?; // (CO, CI*K)
        let mut dx = vec![0.0f32; d.b * d.ci * d.l]; // (B, CI, L)
        let (cik, lo) = (d.cik(), d.lo);
        let threads = d.gemm_threads();

        // dx: per batch item, dcol (CI*K, LO) = wᵀ (CI*K, CO) @ dy_b (CO, LO), then col2im.
        if !dx.is_empty() {
            dx.par_chunks_mut(d.ci * d.l)
                .enumerate()
                .try_for_each(|(bi, dxb)| -> Result<()> {
                    let dyb = &dyv[bi * d.co * lo..(bi + 1) * d.co * lo]; // (CO, LO)
                    let mut dcol = vec![0.0f32; cik * lo]; // (CI*K, LO)
                    sgemm(
                        cik,
                        lo,
                        d.co,
                        MatRef::new(wv, cik, true),
                        MatRef::new(dyb, lo, false),
                        &mut dcol,
                        lo,
                        1.0,
                        0.0,
                        threads,
                    )?;
                    col2im(&d, &dcol, dxb);
                    Ok(())
                })?;
        }

        // dw (CO, CI*K) += sum_b dy_b (CO, LO) @ col_bᵀ (LO, CI*K). The batch items are
        // summed one after the other (a fixed order) with a multi-threaded GEMM each;
        // the column matrix is rebuilt rather than kept from the forward: im2col is a
        // copy, the GEMM dominates.
        if let Some(dw) = dw {
            let dwv = dw.cpu_f32_mut(OP, "dw")?;
            let all = rayon::current_num_threads();
            let mut col = vec![0.0f32; cik * lo]; // (CI*K, LO)
            for bi in 0..d.b {
                let xb = &xv[bi * d.ci * d.l..(bi + 1) * d.ci * d.l];
                let dyb = &dyv[bi * d.co * lo..(bi + 1) * d.co * lo];
                im2col(&d, xb, &mut col);
                sgemm(
                    d.co,
                    cik,
                    lo,
                    MatRef::new(dyb, lo, false),
                    MatRef::new(&col, lo, true),
                    dwv,
                    cik,
                    1.0,
                    1.0,
                    all,
                )?;
            }
        }

        // db (CO) += sum over (b, o) of dy[b, co, o], in f64, one task per channel.
        if let Some(db) = db {
            let dbv = db.cpu_f32_mut(OP, "db")?;
            dbv.par_iter_mut().enumerate().for_each(|(c, g)| {
                let mut acc = 0.0f64;
                for bi in 0..d.b {
                    let row = &dyv[(bi * d.co + c) * lo..(bi * d.co + c + 1) * lo];
                    acc += row.iter().map(|&v| f64::from(v)).sum::<f64>();
                }
                *g += acc as f32;
            });
        }
        Tensor::cpu_from_f32(dx, [d.b, d.ci, d.l])
    }

    fn patchify(&self, images: &Tensor, patch: usize) -> Result<Tensor> {
        if super::bf16::any(&[images]) {
            return super::bf16::patchify(self, images, patch);
        }
        const OP: &str = "patchify";
        let [b, c, h, w] = images.shape().dims_n::<4>(OP, "images")?;
        let p = patch_size(OP, h, w, patch)?;
        let (hp, wp) = (h / p, w / p);
        let row_len = c * p * p;
        let img = images.cpu_f32(OP, "images")?; // (B, C, H, W)
        let mut out = vec![0.0f32; b * hp * wp * row_len]; // (B, HP*WP, C*P*P)
        if !out.is_empty() {
            // One output row (one patch) per task unit: a gather of C*P rows of P pixels.
            out.par_chunks_mut(row_len)
                .with_min_len((PAR_MIN_ELEMS / row_len).max(1))
                .enumerate()
                .for_each(|(r, prow)| {
                    let (bi, n) = (r / (hp * wp), r % (hp * wp));
                    let (ph, pw) = (n / wp, n % wp);
                    for (q, dst) in prow.chunks_mut(p).enumerate() {
                        let (ci, i) = (q / p, q % p);
                        let src = ((bi * c + ci) * h + ph * p + i) * w + pw * p;
                        dst.copy_from_slice(&img[src..src + p]);
                    }
                });
        }
        Tensor::cpu_from_f32(out, [b, hp * wp, row_len])
    }

    fn unpatchify(&self, dpatches: &Tensor, image_shape: &Shape, patch: usize) -> Result<Tensor> {
        if super::bf16::any(&[dpatches]) {
            return super::bf16::unpatchify(self, dpatches, image_shape, patch);
        }
        const OP: &str = "unpatchify";
        let [b, c, h, w] = image_shape.dims_n::<4>(OP, "image_shape")?;
        let p = patch_size(OP, h, w, patch)?;
        let (hp, wp) = (h / p, w / p);
        let row_len = c * p * p;
        let dp = dpatches.cpu_f32(OP, "dpatches")?; // (B, HP*WP, C*P*P)
        if dp.len() != b * hp * wp * row_len {
            return Err(Error::shape(
                OP,
                format!(
                    "dpatches {} does not fit images {image_shape} with patch {p}",
                    dpatches.shape()
                ),
            ));
        }
        let mut img = vec![0.0f32; b * c * h * w]; // (B, C, H, W)
        if !img.is_empty() {
            // patchify is a permutation, so its adjoint is a scatter with no overlaps:
            // one image row per task unit, filled with W/P copies of P pixels.
            img.par_chunks_mut(w)
                .with_min_len((PAR_MIN_ELEMS / w).max(1))
                .enumerate()
                .for_each(|(r, irow)| {
                    let (bc, y) = (r / h, r % h);
                    let (bi, ci) = (bc / c, bc % c);
                    let (ph, i) = (y / p, y % p);
                    for (pw, dst) in irow.chunks_mut(p).enumerate() {
                        let n = ph * wp + pw;
                        let src = (bi * hp * wp + n) * row_len + (ci * p + i) * p;
                        dst.copy_from_slice(&dp[src..src + p]);
                    }
                });
        }
        Tensor::cpu_from_f32(img, image_shape.clone())
    }
}
