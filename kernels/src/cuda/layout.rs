//! The layout ops on CUDA (`kernels/cuda/layout.cu`): row copies of any dtype, with
//! gather/scatter indices checked on the device, and the "verdict" words that the
//! index checks of this file, `embedding.rs` and `loss.rs` copy back to the host.
//!
//! An index is a value in device memory, so its range (and, for a scatter, its
//! distinctness) is checked by a kernel that lowers one u64 word per check with an
//! integer `atomicMin` of `position << 32 | value`: the word ends as the first bad
//! position, whatever the schedule, which is what the CPU backend reports. The host then
//! copies those few words back (one small synchronous copy per call).

use cudarc::driver::CudaSlice;

use super::compile::LAYOUT;
use super::{CudaBackend, CudaStorage, grid_for, storage_err, to_u32};
use crate::backend::LayoutKernels;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

impl CudaBackend {
    /// One device-to-device copy on the backend's stream (stream-ordered: no host wait),
    /// `b[dst_start..][..n] = a[src_start..][..n]`; ranges out of bounds are an error,
    /// never cudarc's panic.
    fn copy_slices<T: cudarc::driver::DeviceRepr>(
        &self,
        a: &CudaSlice<T>,
        src_start: usize,
        b: &mut CudaSlice<T>,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "copy_range";
        let (a_len, b_len) = (a.len(), b.len());
        let bad = || {
            Error::shape(
                OP,
                format!(
                    "{n} elements from {src_start} of {a_len} into {dst_start} of {b_len} do not fit"
                ),
            )
        };
        let from = a.try_slice(src_start..src_start + n).ok_or_else(bad)?;
        let mut to = b.try_slice_mut(dst_start..dst_start + n).ok_or_else(bad)?;
        self.stream
            .memcpy_dtod(&from, &mut to)
            .map_err(|e| self.driver_err(OP, e))
    }
}

/// The kernel `$name` for the dtype of storage `$s`: `$name` + `_f32` / `_bf16` / `_u32`.
macro_rules! by_dtype {
    ($s:expr, $name:literal) => {
        match $s {
            CudaStorage::F32(_) => concat!($name, "_f32"),
            CudaStorage::BF16(_) => concat!($name, "_bf16"),
            CudaStorage::U32(_) => concat!($name, "_u32"),
        }
    };
}

/// A new storage of the same dtype as `$s`: `$body` run with `$v` bound to `$s`'s
/// typed slice (each arm is type-checked on its own, so `$body` may be generic).
macro_rules! map_storage {
    ($s:expr, |$v:ident| $body:expr) => {
        match $s {
            CudaStorage::F32($v) => CudaStorage::F32($body),
            CudaStorage::BF16($v) => CudaStorage::BF16($body),
            CudaStorage::U32($v) => CudaStorage::U32($body),
        }
    };
}

/// The u32 buffer of an index tensor (ops checked its dtype).
fn index_slice<'a>(
    op: &'static str,
    arg: &'static str,
    idx: &'a Tensor,
) -> Result<&'a CudaSlice<u32>> {
    match idx.cuda_storage(op, arg)? {
        CudaStorage::U32(v) => Ok(v),
        _ => Err(storage_err(op, arg, idx)),
    }
}

fn out_of_range(op: &'static str, pos: u64, value: u32, rows: usize) -> Error {
    Error::invalid(
        op,
        format!("idx[{pos}] = {value} is out of range for {rows} rows"),
    )
}

impl LayoutKernels for CudaBackend {
    fn transpose01(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "transpose01";
        let [a, b, c] = x.shape().dims_n::<3>(OP, "x")?;
        let s = x.cuda_storage(OP, "x")?; // (A, B, C)
        let f = self.function(&LAYOUT, by_dtype!(s, "braid_transpose01"))?;
        let n = a * b * c;
        let (a64, b64, c64) = (a as u64, b as u64, c as u64);
        let what = || format!("the transpose of {x:?}");
        let out = map_storage!(s, |v| {
            let mut out = self.alloc(OP, n, what)?; // (B, A, C)
            // braid_transpose01_T(T* out, const T* x, u64 a, u64 b, u64 c): writes all
            // A*B*C elements of out, reads x at indices < A*B*C.
            // SAFETY: signature above; `out` and `v` both hold A*B*C elements.
            unsafe { launch!(self, OP, f, grid_for(n); &mut out, v, &a64, &b64, &c64)? };
            out
        });
        Tensor::from_cuda(out, Shape::new([b, a, c]))
    }

    fn narrow_last(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        const OP: &str = "narrow_last";
        let c = x.shape().last_dim(OP)?;
        let rows = x.shape().rows();
        let s = x.cuda_storage(OP, "x")?; // (N, C)
        let f = self.function(&LAYOUT, by_dtype!(s, "braid_narrow_last"))?;
        let n = rows * len;
        let (rows64, c64, start64, len64) = (rows as u64, c as u64, start as u64, len as u64);
        let what = || format!("columns {start}..{} of {x:?}", start + len);
        let out = map_storage!(s, |v| {
            let mut out = self.alloc(OP, n, what)?; // (N, len)
            // braid_narrow_last_T(T* out, const T* x, u64 rows, u64 c, u64 start, u64 len):
            // writes all N*len of out, reads x at r*C + start + k < N*C.
            // SAFETY: signature above; ops checked start + len <= C, so every read is
            // inside x's N*C elements, and `out` holds N*len.
            unsafe {
                launch!(self, OP, f, grid_for(n); &mut out, v, &rows64, &c64, &start64, &len64)?
            };
            out
        });
        Tensor::from_cuda(out, Shape::new([rows, len]))
    }

    fn gather_rows(&self, x: &Tensor, idx: &Tensor) -> Result<Tensor> {
        const OP: &str = "gather_rows";
        let [rows, c] = x.shape().dims_n::<2>(OP, "x")?;
        let ids = index_slice(OP, "idx", idx)?; // (M)
        let m = idx.elem_count();
        let (m32, rows32) = (to_u32(OP, "M", m)?, to_u32(OP, "N", rows)?);
        let mut verdict = self.verdicts(OP, 1)?;
        let check = self.function(&LAYOUT, "braid_check_rows")?;
        // braid_check_rows(u64* verdict, const u32* idx, u32 m, u32 rows): reads idx[0..M),
        // lowers verdict[0].
        // SAFETY: signature above; `ids` holds M elements, `verdict` 1.
        unsafe { launch!(self, OP, check, grid_for(m); &mut verdict, ids, &m32, &rows32)? };

        let s = x.cuda_storage(OP, "x")?; // (N, C)
        let f = self.function(&LAYOUT, by_dtype!(s, "braid_gather_rows"))?;
        let n = m * c;
        let (m64, c64) = (m as u64, c as u64);
        let what = || format!("{m} rows gathered from {x:?}");
        let out = map_storage!(s, |v| {
            let mut out = self.alloc(OP, n, what)?; // (M, C)
            // braid_gather_rows_T(T* out, const T* x, const u32* idx, u64 m, u32 rows, u64 c):
            // writes all M*C of out; reads x only at rows idx[r] < N (others are zeroed).
            // SAFETY: signature above; `out` holds M*C, `v` N*C, `ids` M elements.
            unsafe { launch!(self, OP, f, grid_for(n); &mut out, v, ids, &m64, &rows32, &c64)? };
            out
        });
        // The gather ran with the check, so this one wait covers both.
        if let Some(Some((pos, value))) = self.read_verdicts(OP, &verdict)?.first() {
            return Err(out_of_range(OP, *pos, *value, rows));
        }
        Tensor::from_cuda(out, Shape::new([m, c]))
    }

    fn copy_range(
        &self,
        src: &Tensor,
        src_start: usize,
        dst: &mut Tensor,
        dst_start: usize,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "copy_range";
        let dst_dbg = format!("{dst:?}");
        match (
            src.cuda_storage(OP, "src")?,
            dst.cuda_storage_mut(OP, "dst")?,
        ) {
            (CudaStorage::F32(a), CudaStorage::F32(b)) => {
                self.copy_slices(a, src_start, b, dst_start, n)
            }
            (CudaStorage::BF16(a), CudaStorage::BF16(b)) => {
                self.copy_slices(a, src_start, b, dst_start, n)
            }
            (CudaStorage::U32(a), CudaStorage::U32(b)) => {
                self.copy_slices(a, src_start, b, dst_start, n)
            }
            _ => Err(Error::invalid(
                OP,
                format!("`src` {src:?} and `dst` {dst_dbg} differ in dtype"),
            )),
        }
    }

    fn scatter_rows(&self, dst: &mut Tensor, idx: &Tensor, src: &Tensor) -> Result<()> {
        const OP: &str = "scatter_rows";
        let [rows, c] = dst.shape().dims_n::<2>(OP, "dst")?;
        let ids = index_slice(OP, "idx", idx)?; // (M)
        let m = idx.elem_count();
        let (m32, rows32) = (to_u32(OP, "M", m)?, to_u32(OP, "N", rows)?);

        // Check every index before dst is touched: in range, then distinct.
        let mut first = self.alloc::<u32>(OP, rows, || {
            format!("the scatter's row flags ({rows} rows)")
        })?; // (N)
        let mut verdict = self.verdicts(OP, 2)?; // [out of range, repeat]
        let fill = self.function(&LAYOUT, "braid_fill_u32")?;
        let (rows64, none) = (rows as u64, u32::MAX);
        // braid_fill_u32(u32* p, u32 v, u64 n): writes p[0..n).
        // SAFETY: signature above; `first` holds N elements.
        unsafe { launch!(self, OP, fill, grid_for(rows); &mut first, &none, &rows64)? };
        let pass1 = self.function(&LAYOUT, "braid_scatter_first")?;
        // braid_scatter_first(u32* first, u64* verdict, const u32* idx, u32 m, u32 rows):
        // reads idx[0..M), lowers first[idx[p]] only where idx[p] < N, and verdict[0].
        // SAFETY: signature above; `first` holds N, `verdict` 2, `ids` M elements.
        unsafe {
            launch!(self, OP, pass1, grid_for(m); &mut first, &mut verdict, ids, &m32, &rows32)?
        };
        let pass2 = self.function(&LAYOUT, "braid_scatter_repeats")?;
        // braid_scatter_repeats(u64* verdict, const u32* first, const u32* idx, u32 m, u32 rows):
        // reads idx[0..M) and first[idx[p]] where idx[p] < N, lowers verdict[1].
        // SAFETY: signature above; sizes as for pass 1.
        unsafe { launch!(self, OP, pass2, grid_for(m); &mut verdict, &first, ids, &m32, &rows32)? };
        let found = self.read_verdicts(OP, &verdict)?;
        // The CPU checks ranges over all of idx first, then repeats: the same precedence.
        if let Some(Some((pos, value))) = found.first() {
            return Err(out_of_range(OP, *pos, *value, rows));
        }
        if let Some(Some((pos, value))) = found.get(1) {
            return Err(Error::invalid(
                OP,
                format!("idx[{pos}] = {value} repeats an earlier index: rows must be distinct"),
            ));
        }

        let n = m * c;
        let (m64, c64) = (m as u64, c as u64);
        let kernel = by_dtype!(src.cuda_storage(OP, "src")?, "braid_scatter_rows");
        let f = self.function(&LAYOUT, kernel)?;
        let dst_dbg = format!("{dst:?}");
        // braid_scatter_rows_T(T* dst, const T* src, const u32* idx, u64 m, u64 c): reads
        // src[0..M*C), writes dst rows idx[r] (all < N and distinct: checked above).
        match (
            dst.cuda_storage_mut(OP, "dst")?,
            src.cuda_storage(OP, "src")?,
        ) {
            // SAFETY: signature above; `d` holds N*C, `s` M*C, `ids` M elements.
            (CudaStorage::F32(d), CudaStorage::F32(s)) => unsafe {
                launch!(self, OP, f, grid_for(n); d, s, ids, &m64, &c64)
            },
            // SAFETY: as above.
            (CudaStorage::BF16(d), CudaStorage::BF16(s)) => unsafe {
                launch!(self, OP, f, grid_for(n); d, s, ids, &m64, &c64)
            },
            // SAFETY: as above.
            (CudaStorage::U32(d), CudaStorage::U32(s)) => unsafe {
                launch!(self, OP, f, grid_for(n); d, s, ids, &m64, &c64)
            },
            _ => Err(Error::invalid(
                OP,
                format!("`dst` {dst_dbg} and `src` {src:?} differ in dtype"),
            )),
        }
    }
}
