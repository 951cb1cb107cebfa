//! CPU layout ops: row copies, any dtype.

use super::CpuBackend;
use crate::backend::LayoutKernels;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::{CpuStorage, Storage, Tensor};

/// Builds an output of the same dtype as `s` by copying, for each output row `r`,
/// `row_len` elements starting at `src_start(r)`.
fn copy_rows(
    s: &CpuStorage,
    rows: usize,
    row_len: usize,
    src_start: impl Fn(usize) -> usize,
) -> CpuStorage {
    fn go<T: Copy>(v: &[T], rows: usize, row_len: usize, f: &dyn Fn(usize) -> usize) -> Vec<T> {
        let mut out = Vec::with_capacity(rows * row_len);
        for r in 0..rows {
            let s = f(r);
            out.extend_from_slice(&v[s..s + row_len]);
        }
        out
    }
    match s {
        CpuStorage::F32(v) => CpuStorage::F32(go(v, rows, row_len, &src_start)),
        CpuStorage::BF16(v) => CpuStorage::BF16(go(v, rows, row_len, &src_start)),
        CpuStorage::U32(v) => CpuStorage::U32(go(v, rows, row_len, &src_start)),
    }
}

impl LayoutKernels for CpuBackend {
    fn transpose01(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "transpose01";
        let [a, b, c] = x.shape().dims_n::<3>(OP, "x")?;
        let s = x.cpu_storage(OP, "x")?; // (A, B, C)
        // Output row r = (j, i) of (B, A) reads input row (i, j).
        let out = copy_rows(s, a * b, c, |r| ((r % a) * b + r / a) * c); // (B, A, C)
        Tensor::from_storage(Storage::Cpu(out), Shape::new([b, a, c]))
    }

    fn narrow_last(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let s = x.cpu_storage("narrow_last", "x")?; // (N, C)
        let c = x.shape().last_dim("narrow_last")?;
        let n = x.shape().rows();
        let out = copy_rows(s, n, len, |r| r * c + start); // (N, len)
        Tensor::from_storage(Storage::Cpu(out), Shape::new([n, len]))
    }

    fn gather_rows(&self, x: &Tensor, idx: &Tensor) -> Result<Tensor> {
        const OP: &str = "gather_rows";
        let s = x.cpu_storage(OP, "x")?; // (N, C)
        let [n, c] = x.shape().dims_n::<2>(OP, "x")?;
        let iv = idx.cpu_u32(OP, "idx")?; // (M)
        check_rows(OP, iv, n)?;
        let out = copy_rows(s, iv.len(), c, |m| iv[m] as usize * c); // (M, C)
        Tensor::from_storage(Storage::Cpu(out), Shape::new([iv.len(), c]))
    }

    fn copy_range(
        &self,
        src: &Tensor,
        src_start: usize,
        dst: &mut Tensor,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        // Ranges checked by `ops::copy_range`.
        const OP: &str = "copy_range";
        let (s, d) = (src_start..src_start + n, dst_start..dst_start + n);
        let (src_dtype, dst_dtype) = (src.dtype(), dst.dtype());
        match (src.cpu_storage(OP, "src")?, dst.cpu_storage_mut(OP, "dst")?) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => b[d].copy_from_slice(&a[s]),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => b[d].copy_from_slice(&a[s]),
            (CpuStorage::U32(a), CpuStorage::U32(b)) => b[d].copy_from_slice(&a[s]),
            _ => {
                return Err(Error::DType {
                    op: OP,
                    arg: "dst",
                    got: dst_dtype,
                    expected: src_dtype,
                });
            }
        }
        Ok(())
    }

    fn scatter_rows(&self, dst: &mut Tensor, idx: &Tensor, src: &Tensor) -> Result<()> {
        const OP: &str = "scatter_rows";
        let [n, c] = dst.shape().dims_n::<2>(OP, "dst")?;
        let iv = idx.cpu_u32(OP, "idx")?; // (M)
        check_rows(OP, iv, n)?;
        let mut seen = vec![false; n];
        for (m, &i) in iv.iter().enumerate() {
            if std::mem::replace(&mut seen[i as usize], true) {
                return Err(Error::invalid(
                    OP,
                    format!("idx[{m}] = {i} repeats an earlier index: rows must be distinct"),
                ));
            }
        }
        fn copy<T: Copy>(dv: &mut [T], sv: &[T], iv: &[u32], c: usize) {
            for (m, &i) in iv.iter().enumerate() {
                let i = i as usize;
                dv[i * c..(i + 1) * c].copy_from_slice(&sv[m * c..(m + 1) * c]);
            }
        }
        let (src_dtype, dst_dtype) = (src.dtype(), dst.dtype());
        let sv = src.cpu_storage(OP, "src")?; // (M, C)
        match (dst.cpu_storage_mut(OP, "dst")?, sv) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => copy(d, s, iv, c),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => copy(d, s, iv, c),
            (CpuStorage::U32(d), CpuStorage::U32(s)) => copy(d, s, iv, c),
            _ => {
                return Err(Error::DType {
                    op: OP,
                    arg: "src",
                    got: src_dtype,
                    expected: dst_dtype,
                });
            }
        }
        Ok(())
    }
}

/// Every index must name a row of a tensor with `n` rows.
fn check_rows(op: &'static str, idx: &[u32], n: usize) -> Result<()> {
    match idx.iter().enumerate().find(|&(_, &i)| i as usize >= n) {
        Some((m, &i)) => Err(Error::invalid(
            op,
            format!("idx[{m}] = {i} is out of range for {n} rows"),
        )),
        None => Ok(()),
    }
}
