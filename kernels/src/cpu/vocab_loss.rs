//! CPU vocab-parallel cross-entropy: a shard's partials (max, sum of exp, target logit)
//! and, from every rank's, the loss and the shard's grad.

use rayon::prelude::*;

use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::VocabLossKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// The column of `target` in a shard starting at `start` of `vl` columns, if it has one.
fn local_column(target: u32, ignore_index: u32, start: usize, vl: usize) -> Option<usize> {
    (target != ignore_index)
        .then(|| (target as usize).checked_sub(start))
        .flatten()
        .filter(|&j| j < vl)
}

impl VocabLossKernels for CpuBackend {
    fn vocab_loss_partials(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        vocab_start: usize,
        ignore_index: u32,
    ) -> Result<Tensor> {
        if super::bf16::any(&[logits]) {
            return super::bf16::vocab_loss_partials(
                self,
                logits,
                targets,
                vocab_start,
                ignore_index,
            );
        }
        const OP: &str = "vocab_loss_partials";
        let [t, vl] = logits.shape().dims_n::<2>(OP, "logits")?;
        let x = logits.cpu_f32(OP, "logits")?; // (T, Vl)
        let tg = targets.cpu_u32(OP, "targets")?; // (T)
        let mut out = vec![0.0f32; 3 * t]; // (3, T): max, sum of exp, target logit
        let (maxes, rest) = out.split_at_mut(t);
        let (sums, target_logits) = rest.split_at_mut(t);
        maxes
            .par_iter_mut()
            .zip(sums.par_iter_mut())
            .zip(target_logits.par_iter_mut())
            .with_min_len((PAR_MIN_ELEMS / vl).max(1))
            .enumerate()
            .for_each(|(i, ((m, s), tl))| {
                let row = &x[i * vl..(i + 1) * vl];
                let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f64 = row.iter().map(|&v| f64::from((v - mx).exp())).sum();
                *m = mx;
                *s = sum as f32;
                if let Some(j) = local_column(tg[i], ignore_index, vocab_start, vl) {
                    *tl = row[j];
                }
            });
        Tensor::cpu_from_f32(out, [3, t])
    }

    fn vocab_loss_finish(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        gathered: &Tensor,
        vocab_start: usize,
        ignore_index: u32,
        grad_scale: f32,
    ) -> Result<(Tensor, Tensor)> {
        if super::bf16::any(&[logits, gathered]) {
            return super::bf16::vocab_loss_finish(
                self,
                logits,
                targets,
                gathered,
                vocab_start,
                ignore_index,
                grad_scale,
            );
        }
        const OP: &str = "vocab_loss_finish";
        let [t, vl] = logits.shape().dims_n::<2>(OP, "logits")?;
        let ranks = gathered.dims()[0];
        let x = logits.cpu_f32(OP, "logits")?; // (T, Vl)
        let tg = targets.cpu_u32(OP, "targets")?; // (T)
        let g = gathered.cpu_f32(OP, "gathered")?; // (R, 3, T)
        let mut losses = vec![0.0f32; t]; // (T)
        let mut dlogits = vec![0.0f32; t * vl]; // (T, Vl)
        if !dlogits.is_empty() {
            dlogits
                .par_chunks_mut(vl)
                .zip(losses.par_iter_mut())
                .with_min_len((PAR_MIN_ELEMS / vl).max(1))
                .enumerate()
                .for_each(|(i, (drow, loss))| {
                    if tg[i] == ignore_index {
                        return; // loss 0, grad 0
                    }
                    let part = |r: usize, k: usize| g[(r * 3 + k) * t + i];
                    let big_m = (0..ranks)
                        .map(|r| part(r, 0))
                        .fold(f32::NEG_INFINITY, f32::max);
                    let big_s: f64 = (0..ranks)
                        .map(|r| f64::from(part(r, 1)) * f64::from(part(r, 0) - big_m).exp())
                        .sum();
                    let target_logit: f64 = (0..ranks).map(|r| f64::from(part(r, 2))).sum();
                    *loss = (big_s.ln() + f64::from(big_m) - target_logit) as f32;
                    let scale = (f64::from(grad_scale) / big_s) as f32;
                    let row = &x[i * vl..(i + 1) * vl];
                    for (d, &v) in drow.iter_mut().zip(row) {
                        *d = (v - big_m).exp() * scale;
                    }
                    if let Some(j) = local_column(tg[i], ignore_index, vocab_start, vl) {
                        drow[j] -= grad_scale;
                    }
                });
        }
        Ok((
            Tensor::cpu_from_f32(losses, [t])?,
            Tensor::cpu_from_f32(dlogits, [t, vl])?,
        ))
    }
}
