//! CPU elementwise arithmetic and reductions.

use rayon::prelude::*;

use super::CpuBackend;
use crate::backend::ElementwiseKernels;
use crate::error::Result;
use crate::tensor::Tensor;

/// Chunk size for parallel reductions: fixed, so the f64 partial sums (and therefore
/// the result) do not depend on the number of threads.
const REDUCE_CHUNK: usize = 1 << 14;

impl ElementwiseKernels for CpuBackend {
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (av, bv) = (a.cpu_f32("add", "a")?, b.cpu_f32("add", "b")?);
        let out: Vec<f32> = av
            .par_iter()
            .zip(bv.par_iter())
            .map(|(x, y)| x + y)
            .collect();
        Tensor::cpu_from_f32(out, a.shape().clone())
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        let xv = x.cpu_f32("add_assign", "x")?;
        let av = acc.cpu_f32_mut("add_assign", "acc")?;
        av.par_iter_mut()
            .zip(xv.par_iter())
            .for_each(|(a, x)| *a += x);
        Ok(())
    }

    fn scale_assign(&self, x: &mut Tensor, s: f32) -> Result<()> {
        x.cpu_f32_mut("scale_assign", "x")?
            .par_iter_mut()
            .for_each(|v| *v *= s);
        Ok(())
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        let xv = x.cpu_f32("sum_squares", "x")?;
        let partials: Vec<f64> = xv
            .par_chunks(REDUCE_CHUNK)
            .map(|c| c.iter().map(|&v| f64::from(v) * f64::from(v)).sum())
            .collect();
        Ok(partials.iter().sum())
    }
}
