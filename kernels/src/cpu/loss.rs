//! CPU fused softmax cross-entropy. The exponentials (one per logit: N x V of them,
//! the LLM head's vocabulary on every token) run on the vectorizable
//! [`super::simd::exp`], compiled per instruction set.

use rayon::prelude::*;

use super::simd::{Simd, exp, max16};
use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::LossKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

simd_fn!(exp_shifted => exp_shifted_imp(x: &[f32], m: f32, out: &mut [f32]));

/// `out = e^(x - m)`.
#[inline(always)]
fn exp_shifted_imp<const FMA: bool>(x: &[f32], m: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp::<FMA>(v - m);
    }
}

impl LossKernels for CpuBackend {
    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: u32,
        grad_scale: f32,
    ) -> Result<(Tensor, Tensor)> {
        if super::bf16::any(&[logits]) {
            return super::bf16::cross_entropy(self, logits, targets, ignore_index, grad_scale);
        }
        const OP: &str = "cross_entropy";
        let [n, v] = logits.shape().dims_n::<2>(OP, "logits")?;
        let x = logits.cpu_f32(OP, "logits")?; // (N, V)
        let t = targets.cpu_u32(OP, "targets")?; // (N)
        if t.len() != n {
            return Err(Error::shape(
                OP,
                format!(
                    "targets {} do not match logits {}",
                    targets.shape(),
                    logits.shape()
                ),
            ));
        }
        // Checked up front, in row order, so a batch with several bad targets always
        // reports the first one whatever the thread schedule (O(N), next to O(N V)).
        if let Some((row, &bad)) = t
            .iter()
            .enumerate()
            .find(|&(_, &tg)| tg != ignore_index && tg as usize >= v)
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "targets[{row}] = {bad} is out of range for a vocabulary of {v} (ignore_index = {ignore_index})"
                ),
            ));
        }
        let mut losses = vec![0.0f32; n]; // (N)
        let mut dlogits = vec![0.0f32; n * v]; // (N, V)
        let simd = Simd::detect();
        if !dlogits.is_empty() {
            dlogits
                .par_chunks_mut(v)
                .zip(losses.par_iter_mut())
                .with_min_len((PAR_MIN_ELEMS / v).max(1))
                .enumerate()
                .for_each(|(row, (drow, loss))| {
                    let tg = t[row];
                    if tg == ignore_index {
                        return; // loss 0, grad 0 (already zero)
                    }
                    let xrow = &x[row * v..(row + 1) * v];
                    // Max-subtracted log-sum-exp: exp never overflows, the largest term is 1.
                    let mx = max16(xrow);
                    // drow holds exp(x - max) until it is normalized; the sum is in f64
                    // so a 150k-entry vocabulary loses no precision.
                    exp_shifted(simd, xrow, mx, drow);
                    let sum: f64 = drow.iter().map(|&e| f64::from(e)).sum();
                    let tg = tg as usize;
                    let lse = f64::from(mx) + sum.ln();
                    *loss = (lse - f64::from(xrow[tg])) as f32;
                    // dlogits = grad_scale * (softmax - onehot(target))
                    let scale = (f64::from(grad_scale) / sum) as f32;
                    drow.iter_mut().for_each(|d| *d *= scale);
                    drow[tg] -= grad_scale;
                });
        }
        Ok((
            Tensor::cpu_from_f32(losses, [n])?,
            Tensor::cpu_from_f32(dlogits, [n, v])?,
        ))
    }
}
