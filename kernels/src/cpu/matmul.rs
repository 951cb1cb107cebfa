//! CPU matrix products through the `gemm` crate, plus bias add/grad.

use rayon::prelude::*;

use super::CpuBackend;
use crate::backend::MatmulKernels;
use crate::error::{Error, Result};
use crate::ops::matmul::GemmSpec;
use crate::tensor::Tensor;

/// A row-major matrix view into a slice: element (i, j) is at `i * rs + j * cs`.
/// A transposed operand is the same slice with the strides swapped.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A contiguous `(rows, cols)` matrix, read transposed when `trans`.
    pub fn new(data: &'a [f32], cols: usize, trans: bool) -> Self {
        if trans {
            MatRef {
                data,
                rs: 1,
                cs: cols,
            }
        } else {
            MatRef {
                data,
                rs: cols,
                cs: 1,
            }
        }
    }
}

/// Checks that an (rows, cols) view with strides (rs, cs) stays inside `len`.
fn fits(
    op: &'static str,
    name: &str,
    len: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let last = (rows - 1) * rs + (cols - 1) * cs;
    if last >= len {
        return Err(Error::invalid(
            op,
            format!(
                "{name}: a ({rows}, {cols}) view with strides ({rs}, {cs}) needs {} elements, buffer has {len}",
                last + 1
            ),
        ));
    }
    Ok(())
}

/// `c (m, n, row stride c_rs) = alpha * a (m, k) @ b (k, n) + beta * c`, single matrix.
///
/// `threads` > 1 lets `gemm` split the product across rayon's pool; pass 1 when the
/// caller already runs several products in parallel.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    c_rs: usize,
    alpha: f32,
    beta: f32,
    threads: usize,
) -> Result<()> {
    const OP: &str = "sgemm";
    fits(OP, "a", a.data.len(), m, k, a.rs, a.cs)?;
    fits(OP, "b", b.data.len(), k, n, b.rs, b.cs)?;
    fits(OP, "c", c.len(), m, n, c_rs, 1)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // The product is empty: c = beta * c.
        for i in 0..m {
            for v in &mut c[i * c_rs..i * c_rs + n] {
                *v = if beta == 0.0 { 0.0 } else { beta * *v };
            }
        }
        return Ok(());
    }
    let parallelism = if threads > 1 && m * n * k >= 1 << 15 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // gemm computes dst = alpha_g * dst + beta_g * lhs @ rhs, reading dst only if asked.
    let read_dst = beta != 0.0;
    // SAFETY: `fits` checked above that every (i, j) index the strides can form for
    // a (m x k), b (k x n) and c (m x n) lies inside its slice; strides fit in isize
    // because they index allocated slices; `c` is borrowed mutably and cannot alias
    // `a` or `b`, which are shared borrows.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_rs as isize,
            read_dst,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            beta,
            alpha,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

impl MatmulKernels for CpuBackend {
    fn gemm(&self, a: &Tensor, b: &Tensor, c: &mut Tensor, spec: &GemmSpec) -> Result<()> {
        if super::bf16::any(&[a, b, c]) {
            return super::bf16::gemm(self, a, b, c, spec);
        }
        const OP: &str = "gemm";
        let GemmSpec {
            batch,
            m,
            n,
            k,
            trans_a,
            trans_b,
            stride_a,
            stride_b,
            alpha,
            beta,
        } = *spec;
        let av = a.cpu_f32(OP, "a")?;
        let bv = b.cpu_f32(OP, "b")?;
        let cv = c.cpu_f32_mut(OP, "c")?;
        let (a_cols, b_cols) = (if trans_a { m } else { k }, if trans_b { k } else { n });
        let a_item = |i: usize| -> Result<&[f32]> {
            av.get(i * stride_a..i * stride_a + m * k)
                .ok_or_else(|| Error::invalid(OP, format!("a has no batch item {i}")))
        };
        let b_item = |i: usize| -> Result<&[f32]> {
            bv.get(i * stride_b..i * stride_b + k * n)
                .ok_or_else(|| Error::invalid(OP, format!("b has no batch item {i}")))
        };
        if cv.len() < batch * m * n {
            return Err(Error::invalid(
                OP,
                format!("c holds {} elements, needs {}", cv.len(), batch * m * n),
            ));
        }
        let c_items = cv[..batch * m * n].chunks_mut((m * n).max(1));
        let threads = rayon::current_num_threads();
        if batch > 1 && m * n * k < 1 << 18 {
            // Many small products (attention heads): one per task, each single-threaded.
            c_items
                .enumerate()
                .collect::<Vec<_>>()
                .into_par_iter()
                .try_for_each(|(i, ci)| {
                    let (ai, bi) = (a_item(i)?, b_item(i)?);
                    sgemm(
                        m,
                        n,
                        k,
                        MatRef::new(ai, a_cols, trans_a),
                        MatRef::new(bi, b_cols, trans_b),
                        ci,
                        n,
                        alpha,
                        beta,
                        1,
                    )
                })
        } else {
            for (i, ci) in c_items.enumerate() {
                let (ai, bi) = (a_item(i)?, b_item(i)?);
                sgemm(
                    m,
                    n,
                    k,
                    MatRef::new(ai, a_cols, trans_a),
                    MatRef::new(bi, b_cols, trans_b),
                    ci,
                    n,
                    alpha,
                    beta,
                    threads,
                )?;
            }
            Ok(())
        }
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        if super::bf16::any(&[y, bias]) {
            return super::bf16::add_bias(self, y, bias);
        }
        let bv = bias.cpu_f32("add_bias", "bias")?;
        let c = bv.len().max(1);
        y.cpu_f32_mut("add_bias", "y")?
            .par_chunks_mut(c)
            .for_each(|row| row.iter_mut().zip(bv).for_each(|(v, b)| *v += b));
        Ok(())
    }

    fn bias_grad(&self, dy: &Tensor, dbias: &mut Tensor) -> Result<()> {
        if super::bf16::any(&[dy, dbias]) {
            return super::bf16::bias_grad(self, dy, dbias);
        }
        let dyv = dy.cpu_f32("bias_grad", "dy")?;
        let db = dbias.cpu_f32_mut("bias_grad", "dbias")?;
        let c = db.len().max(1);
        // Column sums in f64, parallel over column blocks so each output is summed in
        // row order by one thread: deterministic.
        db.par_chunks_mut(64).enumerate().for_each(|(blk, out)| {
            let j0 = blk * 64;
            let mut acc = vec![0.0f64; out.len()];
            for row in dyv.chunks(c) {
                for (a, &v) in acc.iter_mut().zip(&row[j0..j0 + out.len()]) {
                    *a += f64::from(v);
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o += a as f32;
            }
        });
        Ok(())
    }
}
