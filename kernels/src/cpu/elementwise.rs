//! CPU elementwise arithmetic and reductions. Tensors of at most [`PAR_MIN_ELEMS`]
//! values run on the calling thread: handing them to rayon's pool (a wake-up and a
//! wait per call) costs more than the arithmetic.

use rayon::prelude::*;

use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::ElementwiseKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// Chunk size for parallel reductions: fixed, so the f64 partial sums (and therefore
/// the result) do not depend on the number of threads.
const REDUCE_CHUNK: usize = 1 << 14;

impl ElementwiseKernels for CpuBackend {
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if super::bf16::any(&[a, b]) {
            return super::bf16::add(self, a, b);
        }
        let (av, bv) = (a.cpu_f32("add", "a")?, b.cpu_f32("add", "b")?);
        let out: Vec<f32> = if av.len() <= PAR_MIN_ELEMS {
            av.iter().zip(bv).map(|(x, y)| x + y).collect()
        } else {
            av.par_iter()
                .zip(bv.par_iter())
                .with_min_len(PAR_MIN_ELEMS)
                .map(|(x, y)| x + y)
                .collect()
        };
        Tensor::cpu_from_f32(out, a.shape().clone())
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        if super::bf16::any(&[acc, x]) {
            return super::bf16::add_assign(self, acc, x);
        }
        let xv = x.cpu_f32("add_assign", "x")?;
        let av = acc.cpu_f32_mut("add_assign", "acc")?;
        if av.len() <= PAR_MIN_ELEMS {
            av.iter_mut().zip(xv).for_each(|(a, x)| *a += x);
        } else {
            av.par_iter_mut()
                .zip(xv.par_iter())
                .with_min_len(PAR_MIN_ELEMS)
                .for_each(|(a, x)| *a += x);
        }
        Ok(())
    }

    fn scale_assign(&self, x: &mut Tensor, s: f32) -> Result<()> {
        if super::bf16::any(&[x]) {
            return super::bf16::scale_assign(self, x, s);
        }
        let xv = x.cpu_f32_mut("scale_assign", "x")?;
        if xv.len() <= PAR_MIN_ELEMS {
            xv.iter_mut().for_each(|v| *v *= s);
        } else {
            xv.par_iter_mut()
                .with_min_len(PAR_MIN_ELEMS)
                .for_each(|v| *v *= s);
        }
        Ok(())
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        if super::bf16::any(&[x]) {
            return super::bf16::sum_squares(self, x);
        }
        let xv = x.cpu_f32("sum_squares", "x")?;
        let square = |c: &[f32]| -> f64 { c.iter().map(|&v| f64::from(v) * f64::from(v)).sum() };
        if xv.len() <= REDUCE_CHUNK {
            // One chunk: the same sum, in the same order, as the parallel path.
            return Ok(square(xv));
        }
        let partials: Vec<f64> = xv.par_chunks(REDUCE_CHUNK).map(square).collect();
        Ok(partials.iter().sum())
    }
}
