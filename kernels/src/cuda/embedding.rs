//! Token-embedding lookup and its deterministic scatter-add backward on CUDA
//! (`kernels/cuda/embedding.cu`).
//!
//! Ids live on the device, so their range is checked by a kernel (`braid_check_ids`)
//! whose one verdict word is copied back: an id >= V is the CPU backend's
//! [`Error::Invalid`], naming the first bad id, its position and V. The backward sorts
//! `(id, position)` pairs (a bitonic sort, one launch per stage) and sums each id's rows
//! in position order, so repeated ids never race and the bits never change run to run.
//! The table may be f32 or bf16 in the forward; the backward's accumulator `dtable`
//! must be f32 (a bf16 `dtable` is an [`Error::DType`]), `dy` f32 or bf16.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::compile::EMBEDDING;
use super::{CudaBackend, CudaStorage, THREADS, grid_for, storage_err, to_u32};
use crate::backend::EmbeddingKernels;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Most blocks along the sorted positions in the backward (each walks a grid-stride
/// subset of them; blocks inside a run skip it at once).
const BWD_POSITION_BLOCKS: usize = 4096;

fn ids_slice<'a>(op: &'static str, ids: &'a Tensor) -> Result<&'a CudaSlice<u32>> {
    match ids.cuda_storage(op, "ids")? {
        CudaStorage::U32(v) => Ok(v),
        _ => Err(storage_err(op, "ids", ids)),
    }
}

impl CudaBackend {
    /// Launches the range check of `ids` (N) against V; the returned verdict word is read
    /// by [`CudaBackend::ids_error`] after whatever else the caller issues meanwhile.
    fn check_ids(
        &self,
        op: &'static str,
        ids: &CudaSlice<u32>,
        n: u32,
        v: u32,
    ) -> Result<CudaSlice<u64>> {
        let mut verdict = self.verdicts(op, 1)?;
        let f = self.function(&EMBEDDING, "braid_check_ids")?;
        // braid_check_ids(u64* verdict, const u32* ids, u32 n, u32 v): reads ids[0..N),
        // lowers verdict[0].
        // SAFETY: signature above; `ids` holds N elements, `verdict` 1.
        unsafe { launch!(self, op, f, grid_for(n as usize); &mut verdict, ids, &n, &v)? };
        Ok(verdict)
    }

    /// Waits for the check and turns a bad id into the CPU backend's error.
    fn ids_error(&self, op: &'static str, verdict: &CudaSlice<u64>, v: usize) -> Result<()> {
        match self.read_verdicts(op, verdict)?.first() {
            Some(Some((pos, id))) => Err(Error::invalid(
                op,
                format!("id {id} at position {pos} is out of range for a table of V = {v} rows"),
            )),
            _ => Ok(()),
        }
    }

    /// Sorts `(id << 32 | position)` for the N ids into a buffer of P = N rounded up to
    /// a power of two (the padding, all ones, sorts last); keys[0..N) are the real ones.
    fn sorted_keys(
        &self,
        op: &'static str,
        ids: &CudaSlice<u32>,
        n: u32,
    ) -> Result<CudaSlice<u64>> {
        let p = to_u32(
            op,
            "N rounded up to a power of two",
            (n as usize).next_power_of_two(),
        )?;
        let mut keys = self.alloc::<u64>(op, p as usize, || format!("the sort keys of {n} ids"))?; // (P)
        let f = self.function(&EMBEDDING, "braid_embedding_keys")?;
        let cfg = grid_for(p as usize);
        // braid_embedding_keys(u64* keys, const u32* ids, u32 n, u32 p): writes keys[0..P),
        // reads ids[0..N).
        // SAFETY: signature above; `keys` holds P elements, `ids` N.
        unsafe { launch!(self, op, f, cfg; &mut keys, ids, &n, &p)? };
        let step = self.function(&EMBEDDING, "braid_bitonic_step")?;
        // Stage sizes k = 2, 4, .., P (u64: doubling P = 2^31 must not overflow).
        let mut k = 2u64;
        while k <= u64::from(p) {
            let k32 = k as u32; // <= P, which is a u32
            let mut j = k32 / 2;
            while j > 0 {
                // braid_bitonic_step(u64* keys, u32 p, u32 j, u32 k): touches keys[0..P).
                // SAFETY: signature above; `keys` holds P elements.
                unsafe { launch!(self, op, step, cfg; &mut keys, &p, &j, &k32)? };
                j /= 2;
            }
            k *= 2;
        }
        Ok(keys)
    }
}

impl EmbeddingKernels for CudaBackend {
    fn embedding_fwd(&self, ids: &Tensor, table: &Tensor) -> Result<Tensor> {
        const OP: &str = "embedding_fwd";
        let [v, c] = table.shape().dims_n::<2>(OP, "table")?;
        let idv = ids_slice(OP, ids)?; // (N)
        let n = ids.elem_count();
        let (n32, v32) = (to_u32(OP, "N", n)?, to_u32(OP, "V", v)?);
        let verdict = self.check_ids(OP, idv, n32, v32)?;
        let total = n * c;
        let (n64, c64) = (n as u64, c as u64);
        let what = || format!("the embeddings of {n} ids from {table:?}");
        // braid_embedding_fwd_T(T* y, const T* table, const u32* ids, u64 n, u32 v, u64 c):
        // writes all N*C of y; reads table rows ids[r] < V only.
        let y = match table.cuda_storage(OP, "table")? {
            CudaStorage::F32(tv) => {
                let mut y = self.alloc::<f32>(OP, total, what)?; // (N, C)
                let f = self.function(&EMBEDDING, "braid_embedding_fwd_f32")?;
                // SAFETY: signature above; `y` holds N*C, `tv` V*C, `idv` N elements.
                unsafe {
                    launch!(self, OP, f, grid_for(total); &mut y, tv, idv, &n64, &v32, &c64)?
                };
                CudaStorage::F32(y)
            }
            CudaStorage::BF16(tv) => {
                let mut y = self.alloc::<u16>(OP, total, what)?; // (N, C)
                let f = self.function(&EMBEDDING, "braid_embedding_fwd_bf16")?;
                // SAFETY: as above.
                unsafe {
                    launch!(self, OP, f, grid_for(total); &mut y, tv, idv, &n64, &v32, &c64)?
                };
                CudaStorage::BF16(y)
            }
            CudaStorage::U32(_) => return Err(storage_err(OP, "table", table)),
        };
        // The lookup ran with the check, so this one wait covers both.
        self.ids_error(OP, &verdict, v)?;
        Tensor::from_cuda(y, [n, c])
    }

    fn embedding_bwd(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()> {
        const OP: &str = "embedding_bwd";
        let [v, c] = dtable.shape().dims_n::<2>(OP, "dtable")?;
        if dtable.dtype() != DType::F32 {
            // A bf16 accumulator would round every add; grads accumulate in f32.
            return Err(Error::DType {
                op: OP,
                arg: "dtable",
                got: dtable.dtype(),
                expected: DType::F32,
            });
        }
        let idv = ids_slice(OP, ids)?; // (N)
        let n = ids.elem_count();
        let (n32, v32) = (to_u32(OP, "N", n)?, to_u32(OP, "V", v)?);
        let verdict = self.check_ids(OP, idv, n32, v32)?;
        // The sort touches only its own buffer, so it may run before the verdict is read.
        let keys = if n > 0 && c > 0 {
            Some(self.sorted_keys(OP, idv, n32)?)
        } else {
            None
        };
        // dtable is untouched until every id is known to be in range.
        self.ids_error(OP, &verdict, v)?;
        let Some(keys) = keys else { return Ok(()) };

        let cfg = LaunchConfig {
            grid_dim: (
                n.min(BWD_POSITION_BLOCKS) as u32,
                to_u32(OP, "C / 256", c.div_ceil(THREADS as usize))?,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let c64 = c as u64;
        let kernel = match dy.cuda_storage(OP, "dy")? {
            CudaStorage::F32(_) => "braid_embedding_bwd_f32",
            CudaStorage::BF16(_) => "braid_embedding_bwd_bf16",
            CudaStorage::U32(_) => return Err(storage_err(OP, "dy", dy)),
        };
        let f = self.function(&EMBEDDING, kernel)?;
        let dt = match dtable.cuda_storage_mut(OP, "dtable")? {
            CudaStorage::F32(dt) => dt,
            _ => {
                return Err(Error::invalid(
                    OP,
                    "`dtable` is not an f32 CUDA tensor".to_string(),
                ));
            }
        };
        // braid_embedding_bwd_T(float* dtable, const T* dy, const u64* keys, u32 n, u64 c):
        // reads keys[0..N) and dy rows (positions < N), writes dtable rows (ids < V,
        // checked above), channels < C; grid.y * THREADS >= C.
        match dy.cuda_storage(OP, "dy")? {
            // SAFETY: signature above; `dt` holds V*C, `g` N*C, `keys` P >= N elements.
            CudaStorage::F32(g) => unsafe { launch!(self, OP, f, cfg; dt, g, &keys, &n32, &c64) },
            // SAFETY: as above.
            CudaStorage::BF16(g) => unsafe { launch!(self, OP, f, cfg; dt, g, &keys, &n32, &c64) },
            CudaStorage::U32(_) => Err(storage_err(OP, "dy", dy)),
        }
    }
}
