//! Attention on CUDA (`kernels/cuda/attention.cu`): FlashAttention-2-style kernels driven
//! by a segment table, so varlen self-attention (`cu_seqlens`) and context-parallel
//! ranges ([`QkSegment`]) are one code path (and bitwise the same for equal segments).
//!
//! The host cuts every segment into tiles of 32 query rows (forward, dQ) and 32 key rows
//! (dK/dV), each tile starting at a multiple of 32 from its segment's first row, so a
//! packed batch computes every sample exactly as it would alone. Tables (4 u32 per
//! segment, 2 per tile) are uploaded once and reused by every later call with the same
//! table (every layer of a microbatch): see `CudaBackend::table`.
//!
//! Backward, all deterministic, no atomics: D = rowsum(dO * O) (one kernel), dQ over
//! query tiles (one kernel), dK/dV over key tiles, each block looping over its group's
//! query heads, then the segment's query tiles. dK/dV are f32 and zeroed; a dK/dV launch
//! ADDS its tiles' sums, and consecutive segments go to one launch only while their key
//! ranges are disjoint: a key row shared by segments gets their grads added in segment
//! order. bf16 dK/dV are cast from those f32 sums at the end.
//!
//! Data paths: f32 inputs run SIMT kernels with exact f32 math (tiles of 32 x 32,
//! 128 threads); bf16 inputs with HS = 64, 80, 96 or 128 run a tensor-core forward
//! (`mma.sync` m16n8k16 bf16 -> f32, tiles of 64 x 64) and the SIMT backward; other bf16
//! head sizes run the SIMT kernels throughout. HS up to 128 (larger is an error).

use std::collections::BTreeMap;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

use super::compile::ATTENTION;
use super::{CudaBackend, CudaStorage, storage_err};
use crate::backend::{AttentionKernels, MemoryKernels};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::attention::{AttentionDims, AttentionSpec, QkSegment, check_qk_ranges, check_qkv};
use crate::tensor::Tensor;

/// Query rows per tile (forward, dQ); `ATT_BR` in the .cu.
const BR: usize = 32;
/// Query rows per tile of the tensor-core forward; `TC_BR` in the .cu.
const TC_BR: usize = 64;
/// Key rows per tile (dK/dV); `ATT_BC` in the .cu.
const BC: usize = 32;
/// Threads per block of the tile kernels; `ATT_THREADS` in the .cu.
const THREADS: u32 = 128;
/// Shared memory a kernel gets without opting in.
const DEFAULT_SMEM: usize = 48 * 1024;

/// Kernel names by [dtype (f32, bf16)][head-size variant (see [`variant`])].
macro_rules! kernel_table {
    ($op:literal) => {
        [
            kernel_table!(@dt $op, "f32"),
            kernel_table!(@dt $op, "bf16"),
        ]
    };
    (@dt $op:literal, $dt:literal) => {
        [
            concat!("braid_attention_", $op, "_hs64_", $dt),
            concat!("braid_attention_", $op, "_hs80_", $dt),
            concat!("braid_attention_", $op, "_hs96_", $dt),
            concat!("braid_attention_", $op, "_hs128_", $dt),
            concat!("braid_attention_", $op, "_le32_", $dt),
            concat!("braid_attention_", $op, "_le64_", $dt),
            concat!("braid_attention_", $op, "_le128_", $dt),
        ]
    };
}
static FWD: [[&str; 7]; 2] = kernel_table!("fwd");
static BWD_DQ: [[&str; 7]; 2] = kernel_table!("bwd_dq");
static BWD_DKV: [[&str; 7]; 2] = kernel_table!("bwd_dkv");
/// The tensor-core bf16 forwards, HS = 64, 80, 96, 128.
static FWD_TC: [&str; 4] = [
    "braid_attention_fwd_tc_hs64_bf16",
    "braid_attention_fwd_tc_hs80_bf16",
    "braid_attention_fwd_tc_hs96_bf16",
    "braid_attention_fwd_tc_hs128_bf16",
];
static DSUM: [&str; 2] = ["braid_attention_dsum_f32", "braid_attention_dsum_bf16"];

/// The kernel variant for head size `hs` -> (index into the tables, HSMAX of the kernel).
/// Exact variants for the usual sizes, else the smallest generic one that holds `hs`.
fn variant(op: &'static str, hs: usize) -> Result<(usize, usize)> {
    Ok(match hs {
        64 => (0, 64),
        80 => (1, 80),
        96 => (2, 96),
        128 => (3, 128),
        0..=32 => (4, 32),
        33..=64 => (5, 64),
        65..=128 => (6, 128),
        _ => {
            return Err(Error::invalid(
                op,
                format!("head size HS = {hs}: the CUDA attention kernels support HS <= 128"),
            ));
        }
    })
}

/// Dynamic shared memory of each kernel for HSMAX `hsmax`, in bytes: tiles of 32 rows
/// with an odd row stride `hsmax | 1` (see the layouts in the .cu).
fn smem_bytes(tiles: usize, extra_floats: usize, hsmax: usize) -> usize {
    (tiles * 32 * (hsmax | 1) + extra_floats) * size_of::<f32>()
}

/// A dtype the kernels take: f32 or bf16 bits.
trait Elem: DeviceRepr + Sized {
    /// Index into the kernel tables.
    const DT: usize;
    fn slice(s: &CudaStorage) -> Option<&CudaSlice<Self>>;
    fn wrap(s: CudaSlice<Self>) -> CudaStorage;
}

impl Elem for f32 {
    const DT: usize = 0;
    fn slice(s: &CudaStorage) -> Option<&CudaSlice<f32>> {
        match s {
            CudaStorage::F32(x) => Some(x),
            _ => None,
        }
    }
    fn wrap(s: CudaSlice<f32>) -> CudaStorage {
        CudaStorage::F32(s)
    }
}

impl Elem for u16 {
    const DT: usize = 1;
    fn slice(s: &CudaStorage) -> Option<&CudaSlice<u16>> {
        match s {
            CudaStorage::BF16(x) => Some(x),
            _ => None,
        }
    }
    fn wrap(s: CudaSlice<u16>) -> CudaStorage {
        CudaStorage::BF16(s)
    }
}

/// The device buffer of `t` as a `T` slice.
fn get<'a, T: Elem>(
    op: &'static str,
    arg: &'static str,
    t: &'a Tensor,
) -> Result<&'a CudaSlice<T>> {
    T::slice(t.cuda_storage(op, arg)?).ok_or_else(|| storage_err(op, arg, t))
}

/// A size the kernels take as `int`.
fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid(
            op,
            format!("{what} = {v} does not fit the kernel's 32-bit index"),
        )
    })
}

/// The host-built work tables of one call.
struct Plan {
    /// 4 per segment: q_start, q_len, k_start, k_len.
    segs: Vec<u32>,
    /// 2 per query tile: segment, first query row relative to the segment.
    qtiles: Vec<u32>,
    /// 2 per key tile: segment, first key row relative to the segment.
    ktiles: Vec<u32>,
    /// dK/dV launches as (first key tile, tile count): within one launch the segments'
    /// key ranges are disjoint; launches follow segment order.
    launches: Vec<(u32, u32)>,
}

impl Plan {
    /// `segs` are validated (`check_qk_ranges`); sizes are checked to fit the kernels.
    /// Query tiles have `bq` rows (32, or 64 for the tensor-core forward).
    fn new(op: &'static str, segs: &[QkSegment], dims: &AttentionDims, bq: usize) -> Result<Plan> {
        to_i32(op, "Tq", dims.t)?;
        to_i32(op, "Tk", dims.tk)?;
        let u = |v: usize| v as u32; // every value is <= Tq or Tk, checked just above
        let mut plan = Plan {
            segs: Vec::new(),
            qtiles: Vec::new(),
            ktiles: Vec::new(),
            launches: Vec::new(),
        };
        // Key ranges (start -> end) of the open dK/dV launch.
        let mut open: BTreeMap<usize, usize> = BTreeMap::new();
        let mut first = 0u32;
        for (i, s) in segs.iter().enumerate() {
            plan.segs
                .extend([u(s.q_start), u(s.q_len), u(s.k_start), u(s.k_len)]);
            // No queries: no output rows and no grads (a segment with queries has keys).
            if s.q_len == 0 || s.k_len == 0 {
                continue;
            }
            let si = to_i32(op, "segment count", i)? as u32;
            for q0 in (0..s.q_len).step_by(bq) {
                plan.qtiles.extend([si, u(q0)]);
            }
            let (a, b) = (s.k_start, s.k_start + s.k_len);
            let before = open
                .range(..=a)
                .next_back()
                .is_some_and(|(_, &end)| end > a);
            let after = open.range(a..).next().is_some_and(|(&start, _)| start < b);
            if before || after {
                let now = (plan.ktiles.len() / 2) as u32;
                plan.launches.push((first, now - first));
                first = now;
                open.clear();
            }
            open.insert(a, b);
            for k0 in (0..s.k_len).step_by(BC) {
                plan.ktiles.extend([si, u(k0)]);
            }
        }
        let now = (plan.ktiles.len() / 2) as u32;
        if now > first {
            plan.launches.push((first, now - first));
        }
        Ok(plan)
    }
}

/// The scalars every tile kernel takes.
#[derive(Clone, Copy)]
struct Scalars {
    nh: i32,
    nkv: i32,
    tq: i32,
    hs: i32,
    scale: f32,
    causal: i32,
}

impl Scalars {
    fn new(op: &'static str, dims: &AttentionDims, spec: &AttentionSpec) -> Result<Scalars> {
        if dims.nh > 65535 {
            return Err(Error::invalid(
                op,
                format!(
                    "NH = {} query heads: the CUDA kernels take at most 65535",
                    dims.nh
                ),
            ));
        }
        Ok(Scalars {
            nh: to_i32(op, "NH", dims.nh)?,
            nkv: to_i32(op, "NKV", dims.nkv)?,
            tq: to_i32(op, "Tq", dims.t)?,
            hs: to_i32(op, "HS", dims.hs)?,
            scale: spec.scale,
            causal: i32::from(spec.causal),
        })
    }
}

impl CudaBackend {
    /// A tile launch of `blocks` x `heads` blocks with `smem` bytes of dynamic shared
    /// memory, opting the kernel in to more than the default where needed.
    fn tile_config(
        &self,
        op: &'static str,
        f: &cudarc::driver::CudaFunction,
        blocks: u32,
        heads: usize,
        smem: usize,
    ) -> Result<LaunchConfig> {
        if smem > DEFAULT_SMEM {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| self.driver_err(op, e))?;
        }
        Ok(LaunchConfig {
            grid_dim: (blocks, heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        })
    }

    /// -> (out (Tq, NH, HS), lse (NH, Tq)).
    fn forward<T: Elem>(
        &self,
        op: &'static str,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        dims: &AttentionDims,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        let AttentionDims { t, nh, hs, .. } = *dims;
        let (vi, hsmax) = variant(op, hs)?;
        let sc = Scalars::new(op, dims, spec)?;
        // bf16 with HS 64, 80, 96, 128: the tensor-core forward (64-row tiles).
        let tc = match (T::DT, hs) {
            (1, 64) => Some(FWD_TC[0]),
            (1, 80) => Some(FWD_TC[1]),
            (1, 96) => Some(FWD_TC[2]),
            (1, 128) => Some(FWD_TC[3]),
            _ => None,
        };
        let plan = Plan::new(op, segs, dims, if tc.is_some() { TC_BR } else { BR })?;
        let (qs, ks, vs) = (
            get::<T>(op, "q", q)?,
            get::<T>(op, "k", k)?,
            get::<T>(op, "v", v)?,
        );
        let mut out =
            self.alloc::<T>(op, t * nh * hs, || format!("the attention output of {q:?}"))?;
        let mut lse = self.alloc::<f32>(op, nh * t, || format!("the attention lse of {q:?}"))?;
        let ntiles = plan.qtiles.len() / 2;
        if let (true, Some(name)) = (ntiles > 0, tc) {
            let segs_d = self.table(op, &plan.segs)?;
            let tiles_d = self.table(op, &plan.qtiles)?;
            let f = self.function(&ATTENTION, name)?;
            let cfg = LaunchConfig {
                grid_dim: (ntiles as u32, nh as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // braid_attention_fwd_tc_hs<D>_bf16(bf16* out, float* lse, const bf16* q, const bf16* k,
            //   const bf16* v, const u32* segs, const u32* tiles, int nh, int nkv, int tq, float scale, int causal)
            // SAFETY: signature above; T is bf16 here (T::DT == 1) and HS == D. Sizes and
            // tables as in the SIMT forward below, with 64-row tiles (the plan's); the
            // kernel's shared memory is static; its 16-byte row loads need each buffer
            // 16-byte aligned, which device allocations are (256 bytes).
            unsafe {
                launch!(self, op, f, cfg; &mut out, &mut lse, qs, ks, vs, &*segs_d, &*tiles_d,
                    &sc.nh, &sc.nkv, &sc.tq, &sc.scale, &sc.causal)?;
            }
        } else if ntiles > 0 {
            let segs_d = self.table(op, &plan.segs)?;
            let tiles_d = self.table(op, &plan.qtiles)?;
            let f = self.function(&ATTENTION, FWD[T::DT][vi])?;
            let cfg = self.tile_config(op, &f, ntiles as u32, nh, smem_bytes(3, 0, hsmax))?;
            // braid_attention_fwd_<v>_<dt>(T* out, float* lse, const T* q, const T* k, const T* v,
            //   const u32* segs, const u32* tiles, int nh, int nkv, int tq, int hs, float scale, int causal)
            // SAFETY: signature above. out holds Tq*NH*HS and lse NH*Tq elements, and every
            // query row lies in exactly one tile (segments cover 0..Tq), so both are written
            // in full; q, k, v hold Tq*NH*HS / Tk*NKV*HS (validated shapes) and the tables
            // only name rows inside them (validated segments); the tables hold 4 per segment
            // and 2 per tile of the grid; shared memory is the kernel's 3 tiles.
            unsafe {
                launch!(self, op, f, cfg; &mut out, &mut lse, qs, ks, vs, &*segs_d, &*tiles_d,
                    &sc.nh, &sc.nkv, &sc.tq, &sc.hs, &sc.scale, &sc.causal)?;
            }
        }
        Ok((
            Tensor::from_cuda(T::wrap(out), q.shape().clone())?,
            Tensor::from_cuda(CudaStorage::F32(lse), [nh, t])?,
        ))
    }

    /// -> (dq, dk, dv) shaped like q, k, v.
    #[allow(clippy::too_many_arguments)]
    fn backward<T: Elem>(
        &self,
        op: &'static str,
        (dout, q, k, v, out, lse): (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
        dims: &AttentionDims,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let AttentionDims { t, tk, nh, nkv, hs } = *dims;
        let (vi, hsmax) = variant(op, hs)?;
        let sc = Scalars::new(op, dims, spec)?;
        let plan = Plan::new(op, segs, dims, BR)?;
        let (qs, ks, vs) = (
            get::<T>(op, "q", q)?,
            get::<T>(op, "k", k)?,
            get::<T>(op, "v", v)?,
        );
        let (dos, os) = (get::<T>(op, "dout", dout)?, get::<T>(op, "out", out)?);
        let lses = match lse.cuda_storage(op, "lse")? {
            CudaStorage::F32(x) => x,
            _ => return Err(storage_err(op, "lse", lse)),
        };
        let mut dq = self.alloc::<T>(op, t * nh * hs, || format!("dq of {q:?}"))?;
        let mut dk =
            self.alloc_zeros::<f32>(op, tk * nkv * hs, || format!("the f32 dk of {k:?}"))?;
        let mut dv =
            self.alloc_zeros::<f32>(op, tk * nkv * hs, || format!("the f32 dv of {v:?}"))?;
        let nq = plan.qtiles.len() / 2;
        if nq > 0 {
            let segs_d = self.table(op, &plan.segs)?;
            let qtiles_d = self.table(op, &plan.qtiles)?;
            let ktiles_d = self.table(op, &plan.ktiles)?;
            // D (NH, Tq); every row written (one warp per (t, h), 8 warps a block).
            let rows = t * nh;
            let mut dsum = self.alloc::<f32>(op, rows, || "D = rowsum(dout * out)".into())?;
            let f = self.function(&ATTENTION, DSUM[T::DT])?;
            let blocks = u32::try_from(rows.div_ceil(8))
                .map_err(|_| Error::invalid(op, format!("Tq * NH = {rows} rows is too many")))?;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // braid_attention_dsum_<dt>(float* dsum, const T* dout, const T* out, int tq, int nh, int hs)
            // SAFETY: signature above; dsum holds Tq*NH, dout and out Tq*NH*HS elements;
            // the grid covers the Tq*NH rows, warps past them return.
            unsafe { launch!(self, op, f, cfg; &mut dsum, dos, os, &sc.tq, &sc.nh, &sc.hs)? };

            let f = self.function(&ATTENTION, BWD_DQ[T::DT][vi])?;
            let cfg = self.tile_config(op, &f, nq as u32, nh, smem_bytes(4, 0, hsmax))?;
            // braid_attention_bwd_dq_<v>_<dt>(T* dq, const T* dout, const T* q, const T* k, const T* v,
            //   const float* lse, const float* dsum, const u32* segs, const u32* tiles,
            //   int nh, int nkv, int tq, int hs, float scale, int causal)
            // SAFETY: signature above; dq is written in full (every query row is in one
            // tile); sizes as in the forward, lse and dsum hold NH*Tq.
            unsafe {
                launch!(self, op, f, cfg; &mut dq, dos, qs, ks, vs, lses, &dsum, &*segs_d, &*qtiles_d,
                    &sc.nh, &sc.nkv, &sc.tq, &sc.hs, &sc.scale, &sc.causal)?;
            }

            let f = self.function(&ATTENTION, BWD_DKV[T::DT][vi])?;
            for &(base, count) in &plan.launches {
                let cfg = self.tile_config(op, &f, count, nkv, smem_bytes(4, 2 * BR, hsmax))?;
                let base = base as i32; // < Tk / 32 * segments... always < 2^31 tiles of 2 u32
                // braid_attention_bwd_dkv_<v>_<dt>(float* dk, float* dv, const T* dout, const T* q,
                //   const T* k, const T* v, const float* lse, const float* dsum, const u32* segs,
                //   const u32* tiles, int tile_base, int nh, int nkv, int tq, int hs, float scale, int causal)
                // SAFETY: signature above; dk, dv hold Tk*NKV*HS f32 (zeroed) and each block
                // adds into the rows of its key tile only, which no other block of this
                // launch touches (disjoint key ranges per launch); tiles base..base+count
                // exist in the table; other sizes as above.
                unsafe {
                    launch!(self, op, f, cfg; &mut dk, &mut dv, dos, qs, ks, vs, lses, &dsum, &*segs_d, &*ktiles_d,
                        &base, &sc.nh, &sc.nkv, &sc.tq, &sc.hs, &sc.scale, &sc.causal)?;
                }
            }
        }
        let dk = Tensor::from_cuda(CudaStorage::F32(dk), k.shape().clone())?;
        let dv = Tensor::from_cuda(CudaStorage::F32(dv), v.shape().clone())?;
        let (dk, dv) = if T::DT == 1 {
            (self.cast(&dk, DType::BF16)?, self.cast(&dv, DType::BF16)?)
        } else {
            (dk, dv)
        };
        Ok((Tensor::from_cuda(T::wrap(dq), q.shape().clone())?, dk, dv))
    }

    fn forward_any(
        &self,
        op: &'static str,
        qkv: (&Tensor, &Tensor, &Tensor),
        dims: &AttentionDims,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        match qkv.0.dtype() {
            DType::F32 => self.forward::<f32>(op, qkv, dims, segs, spec),
            DType::BF16 => self.forward::<u16>(op, qkv, dims, segs, spec),
            DType::U32 => Err(storage_err(op, "q", qkv.0)),
        }
    }

    #[allow(clippy::type_complexity)]
    fn backward_any(
        &self,
        op: &'static str,
        args: (&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Tensor),
        dims: &AttentionDims,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match args.1.dtype() {
            DType::F32 => self.backward::<f32>(op, args, dims, segs, spec),
            DType::BF16 => self.backward::<u16>(op, args, dims, segs, spec),
            DType::U32 => Err(storage_err(op, "q", args.1)),
        }
    }
}

impl AttentionKernels for CudaBackend {
    fn attention_fwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "attention_fwd";
        let dims = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
        self.forward_any(
            OP,
            (q, k, v),
            &dims,
            &QkSegment::from_cu_seqlens(cu_seqlens),
            spec,
        )
    }

    fn attention_bwd(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "attention_bwd";
        let dims = check_qkv(OP, q, k, v, cu_seqlens, spec)?;
        let segs = QkSegment::from_cu_seqlens(cu_seqlens);
        self.backward_any(OP, (dout, q, k, v, out, lse), &dims, &segs, spec)
    }

    fn attention_fwd_ranges(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "attention_fwd_ranges";
        let dims = check_qk_ranges(OP, q, k, v, segs, spec)?;
        self.forward_any(OP, (q, k, v), &dims, segs, spec)
    }

    fn attention_bwd_ranges(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "attention_bwd_ranges";
        let dims = check_qk_ranges(OP, q, k, v, segs, spec)?;
        self.backward_any(OP, (dout, q, k, v, out, lse), &dims, segs, spec)
    }
}
