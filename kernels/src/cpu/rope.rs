//! CPU rotary position embedding: one task per group of tokens, every head of a token
//! rotated by that token's cos/sin row.

use rayon::prelude::*;

use super::CpuBackend;
use super::norm::min_rows;
use crate::backend::RopeKernels;
use crate::error::Result;
use crate::tensor::Tensor;

impl RopeKernels for CpuBackend {
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
        if super::bf16::any(&[x, cos, sin]) {
            return super::bf16::rope(self, x, cos, sin, inverse);
        }
        const OP: &str = "rope";
        let xv = x.cpu_f32(OP, "x")?; // (T, NH, HS)
        let cv = cos.cpu_f32(OP, "cos")?; // (T, R/2)
        let sv = sin.cpu_f32(OP, "sin")?; // (T, R/2)
        let [_, nh, hs] = x.shape().dims_n::<3>(OP, "x")?;
        let [_, half] = cos.shape().dims_n::<2>(OP, "cos")?;
        let mut y = xv.to_vec(); // (T, NH, HS): channels >= R pass through as copied
        let (row, half, hs) = ((nh * hs).max(1), half.max(1), hs.max(1));
        // The backward rotates by -theta: cos is even, sin odd.
        let sign = if inverse { -1.0f32 } else { 1.0 };
        y.par_chunks_mut(row)
            .zip(cv.par_chunks(half).zip(sv.par_chunks(half)))
            .with_min_len(min_rows(row))
            .for_each(|(yt, (ct, st))| {
                for head in yt.chunks_mut(hs) {
                    let (lo, hi) = head.split_at_mut(half);
                    // lo: channels [0, R/2), hi: [R/2, HS); pairs are (i, i + R/2).
                    for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(ct).zip(st) {
                        let s = sign * s;
                        let (x1, x2) = (*a, *b);
                        *a = x1 * c - x2 * s;
                        *b = x2 * c + x1 * s;
                    }
                }
            });
        Tensor::cpu_from_f32(y, x.shape().clone())
    }
}
