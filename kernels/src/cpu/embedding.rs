//! CPU embedding lookup and scatter-add backward. The backward is a counting sort of
//! positions by id, then one task per table row: each row's grad is summed in position
//! order by a single task, so repeated ids never race and the result is bitwise the
//! same for any number of threads.

use rayon::prelude::*;

use super::CpuBackend;
use super::norm::min_rows;
use crate::backend::EmbeddingKernels;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Every id must index a row of the table: the first one that does not is an
/// [`Error::Invalid`] naming it, its position and V.
fn check_ids(op: &'static str, ids: &[u32], v: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= v) {
        None => Ok(()),
        Some(n) => Err(Error::invalid(
            op,
            format!(
                "id {} at position {n} is out of range for a table of V = {v} rows",
                ids[n]
            ),
        )),
    }
}

impl EmbeddingKernels for CpuBackend {
    fn embedding_fwd(&self, ids: &Tensor, table: &Tensor) -> Result<Tensor> {
        if super::bf16::any(&[table]) {
            return super::bf16::embedding_fwd(self, ids, table);
        }
        const OP: &str = "embedding_fwd";
        let idv = ids.cpu_u32(OP, "ids")?; // (N)
        let tv = table.cpu_f32(OP, "table")?; // (V, C)
        let [v, c] = table.shape().dims_n::<2>(OP, "table")?;
        check_ids(OP, idv, v)?;
        let n = idv.len();
        let mut y = vec![0.0f32; n * c]; // (N, C)
        if c > 0 {
            y.par_chunks_mut(c)
                .zip(idv.par_iter())
                .with_min_len(min_rows(c))
                .for_each(|(yr, &id)| {
                    let row = id as usize * c;
                    yr.copy_from_slice(&tv[row..row + c]);
                });
        }
        Tensor::cpu_from_f32(y, [n, c])
    }

    fn embedding_bwd(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
        if super::bf16::any(&[dy, dtable]) {
            return super::bf16::embedding_bwd(self, dy, ids, dtable);
        }
        const OP: &str = "embedding_bwd";
        let idv = ids.cpu_u32(OP, "ids")?; // (N)
        let dyv = dy.cpu_f32(OP, "dy")?; // (N, C)
        let [v, c] = dtable.shape().dims_n::<2>(OP, "dtable")?;
        check_ids(OP, idv, v)?;
        if c == 0 {
            return Ok(());
        }
        // Counting sort: the positions holding id r are order[start[r]..start[r + 1]],
        // in increasing position order (the sort is stable).
        let mut start = vec![0usize; v + 1]; // (V + 1)
        for &id in idv {
            start[id as usize + 1] += 1;
        }
        for r in 0..v {
            start[r + 1] += start[r];
        }
        let mut fill = start.clone(); // (V + 1) next free slot per id
        let mut order = vec![0usize; idv.len()]; // (N)
        for (n, &id) in idv.iter().enumerate() {
            order[fill[id as usize]] = n;
            fill[id as usize] += 1;
        }
        let dtv = dtable.cpu_f32_mut(OP, "dtable")?; // (V, C)
        dtv.par_chunks_mut(c)
            .enumerate()
            .with_min_len(min_rows(c))
            .for_each_init(
                || vec![0.0f64; c],
                |acc, (r, row)| {
                    let positions = &order[start[r]..start[r + 1]];
                    match positions {
                        [] => {}
                        // One occurrence: a plain f32 add, the same as an unsorted scatter.
                        [p] => {
                            let src = &dyv[p * c..p * c + c];
                            row.iter_mut().zip(src).for_each(|(o, &d)| *o += d);
                        }
                        // Several (a frequent token, padding): sum in f64, add once.
                        _ => {
                            acc.iter_mut().for_each(|a| *a = 0.0);
                            for &p in positions {
                                let src = &dyv[p * c..p * c + c];
                                acc.iter_mut()
                                    .zip(src)
                                    .for_each(|(a, &d)| *a += f64::from(d));
                            }
                            row.iter_mut()
                                .zip(acc.iter())
                                .for_each(|(o, &a)| *o += a as f32);
                        }
                    }
                },
            );
        Ok(())
    }
}
