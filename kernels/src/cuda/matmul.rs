//! GEMMs through cuBLASLt (row-major via operand swap, batched and strided), and the
//! linear layer's bias add and deterministic bias grad (`kernels/cuda/elementwise.cu`).
//!
//! Types: f32 x f32 -> f32 computes in true f32 (`CUBLAS_COMPUTE_32F`, never TF32, so
//! the f32 path matches the CPU within 1e-5); bf16 x bf16 -> bf16 or -> f32 (weight grads
//! accumulated into f32) computes in f32 on the tensor cores. The scale type is f32.
//! The bias grad takes a bf16 `dy` into an f32 `dbias` (mixed precision) as well as
//! equal dtypes: its f64 partial sums (the CPU backend's) do not depend on either.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::compile::ELEMENTWISE;
use super::context::lock;
use super::{CudaBackend, CudaStorage, grid_for, storage_err};
use crate::backend::MatmulKernels;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::matmul::GemmSpec;
use crate::tensor::Tensor;

/// cuBLASLt's handle, its workspace and the algorithm chosen per problem. Used only under
/// the backend's lock.
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: HashMap<GemmKey, sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the handle is only used while the backend's `Mutex<Blas>` is held, so no two
// threads use it at once (cuBLASLt handles may move between threads).
unsafe impl Send for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blas({} cached algorithms)", self.algos.len())
    }
}

impl Blas {
    /// Hopper wants a 32 MiB workspace, older GPUs 4 MiB (NVIDIA's recommendation).
    pub(crate) fn new(
        be_stream: &std::sync::Arc<cudarc::driver::CudaStream>,
        major: i32,
    ) -> std::result::Result<Self, String> {
        let handle = lt::create_handle().map_err(|e| format!("cublasLtCreate: {e:?}"))?;
        let size = if major >= 9 { 32 << 20 } else { 4 << 20 };
        // SAFETY: a workspace is scratch that cuBLASLt writes before it reads.
        let workspace = unsafe { be_stream.alloc::<u8>(size) }
            .map_err(|e| format!("allocating the cuBLASLt workspace: {e}"))?;
        Ok(Blas {
            handle,
            workspace,
            algos: HashMap::new(),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by cublasLtCreate and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Everything that decides cuBLASLt's algorithm choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GemmKey {
    types: (u8, u8),
    m: u64,
    n: u64,
    k: u64,
    trans: (bool, bool),
    batch: usize,
    strides: (usize, usize),
}

/// RAII owners of cuBLASLt descriptors.
struct Layout(sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatrixLayoutCreate, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
struct Desc(sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulDescCreate, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

fn blas_err(op: &'static str, be: &CudaBackend, what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda {
        op,
        device: be.device(),
        msg: format!("{what}: {e:?}"),
    }
}

/// A column-major layout of `rows x cols` with leading dimension `ld`, batched.
fn layout(
    dtype: sys::cudaDataType,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: usize,
    stride: usize,
) -> std::result::Result<Layout, lt::CublasError> {
    let l = Layout(lt::create_matrix_layout(dtype, rows, cols, ld)?);
    if batch > 1 {
        let count = batch as i32;
        let stride = stride as i64;
        // SAFETY: both attributes take the value types given (int32, int64); the
        // pointers are to live locals for the duration of the calls.
        unsafe {
            lt::set_matrix_layout_attribute(
                l.0,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&count as *const i32).cast::<c_void>(),
                size_of::<i32>(),
            )?;
            lt::set_matrix_layout_attribute(
                l.0,
                sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                (&stride as *const i64).cast::<c_void>(),
                size_of::<i64>(),
            )?;
        }
    }
    Ok(l)
}

fn set_trans(
    desc: &Desc,
    attr: sys::cublasLtMatmulDescAttributes_t,
    t: bool,
) -> std::result::Result<(), lt::CublasError> {
    // cublasOperation_t as an int32: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    let op = i32::from(t);
    // SAFETY: TRANSA/TRANSB take a cublasOperation_t (an int32); `op` outlives the call.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc.0,
            attr,
            (&op as *const i32).cast::<c_void>(),
            size_of::<i32>(),
        )
    }
}

impl CudaBackend {
    /// Row-major `C (M, N) = alpha op(A) op(B) + beta C` as the column-major product
    /// `C^T (N, M) = op(B)^T op(A)^T`: cuBLAS's A is our B and its B our A, with the same
    /// transpose flags, and no data moves.
    #[allow(clippy::too_many_arguments)]
    fn lt_gemm(
        &self,
        spec: &GemmSpec,
        (a, a_type): (u64, sys::cudaDataType),
        (b, b_type): (u64, sys::cudaDataType),
        (c, c_type): (u64, sys::cudaDataType),
    ) -> Result<()> {
        const OP: &str = "gemm";
        // cuBLASLt launches on the context current on this thread (cudarc binds only for
        // its own calls): a rank thread whose last call went to another GPU, or a fresh
        // thread, would run this GEMM in the wrong context.
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.driver_err(OP, e))?;
        let (m, n, k) = (spec.m as u64, spec.n as u64, spec.k as u64);
        let e = |what: &str, err: lt::CublasError| blas_err(OP, self, what, err);
        // cuBLAS's A = our B: stored (K, N) row-major = col-major N x K, ld N; or, when
        // trans_b, (N, K) row-major = col-major K x N, ld K, used transposed.
        let (ar, ac, lda) = if spec.trans_b { (k, n, k) } else { (n, k, n) };
        // cuBLAS's B = our A: (M, K) row-major = col-major K x M, ld K; or (K, M) = M x K.
        let (br, bc, ldb) = if spec.trans_a { (m, k, m) } else { (k, m, k) };
        let la = layout(b_type, ar, ac, lda as i64, spec.batch, spec.stride_b)
            .map_err(|x| e("layout A", x))?;
        let lb = layout(a_type, br, bc, ldb as i64, spec.batch, spec.stride_a)
            .map_err(|x| e("layout B", x))?;
        let lc = layout(c_type, n, m, n as i64, spec.batch, spec.m * spec.n)
            .map_err(|x| e("layout C", x))?;
        let desc = Desc(
            lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(|x| e("matmul desc", x))?,
        );
        set_trans(
            &desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            spec.trans_b,
        )
        .map_err(|x| e("TRANSA", x))?;
        set_trans(
            &desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            spec.trans_a,
        )
        .map_err(|x| e("TRANSB", x))?;

        let mut blas = lock(&self.blas);
        let key = GemmKey {
            types: (a_type as u8, c_type as u8),
            m,
            n,
            k,
            trans: (spec.trans_a, spec.trans_b),
            batch: spec.batch,
            strides: (spec.stride_a, spec.stride_b),
        };
        let ws_size = blas.workspace.len();
        let algo = match blas.algos.get(&key) {
            Some(a) => *a,
            None => {
                let pref = Pref(lt::create_matmul_pref().map_err(|x| e("preference", x))?);
                let ws = ws_size as u64;
                // SAFETY: MAX_WORKSPACE_BYTES takes a u64; `ws` outlives the call.
                unsafe {
                    lt::set_matmul_pref_attribute(
                        pref.0,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        (&ws as *const u64).cast::<c_void>(),
                        size_of::<u64>(),
                    )
                }
                .map_err(|x| e("workspace preference", x))?;
                // SAFETY: every descriptor is live (owned above) and describes the call.
                let h = unsafe {
                    lt::get_matmul_algo_heuristic(
                        blas.handle,
                        desc.0,
                        la.0,
                        lb.0,
                        lc.0,
                        lc.0,
                        pref.0,
                    )
                }
                .map_err(|x| e(&format!("no cuBLASLt algorithm for {spec:?}"), x))?;
                blas.algos.insert(key, h.algo);
                h.algo
            }
        };
        let (alpha, beta) = (spec.alpha, spec.beta);
        let handle = blas.handle;
        let (ws_ptr, _sync) = blas.workspace.device_ptr_mut(&self.stream);
        // SAFETY: a, b, c are device pointers of buffers holding at least
        // batch x (the matrix sizes above) elements of the stated types (ops validated
        // the shapes); alpha/beta are f32 as the f32 scale type requires; the
        // workspace holds ws_size bytes; everything is on this backend's stream.
        unsafe {
            lt::matmul(
                handle,
                desc.0,
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
                b as *const c_void,
                la.0,
                a as *const c_void,
                lb.0,
                c as *const c_void,
                lc.0,
                c as *mut c_void,
                lc.0,
                &algo,
                ws_ptr as *mut c_void,
                ws_size,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|x| e(&format!("cublasLtMatmul {spec:?}"), x))
    }
}

const R_32F: sys::cudaDataType = sys::cudaDataType_t::CUDA_R_32F;
const R_16BF: sys::cudaDataType = sys::cudaDataType_t::CUDA_R_16BF;

impl MatmulKernels for CudaBackend {
    fn gemm(&self, a: &Tensor, b: &Tensor, c: &mut Tensor, spec: &GemmSpec) -> Result<()> {
        const OP: &str = "gemm";
        if spec.m == 0 || spec.n == 0 || spec.batch == 0 {
            return Ok(());
        }
        let (sa, sb) = (a.cuda_storage(OP, "a")?, b.cuda_storage(OP, "b")?);
        let (pa, ta) = match sa {
            CudaStorage::F32(s) => (s.device_ptr(&self.stream).0, R_32F),
            CudaStorage::BF16(s) => (s.device_ptr(&self.stream).0, R_16BF),
            CudaStorage::U32(_) => return Err(storage_err(OP, "a", a)),
        };
        let (pb, tb) = match sb {
            CudaStorage::F32(s) => (s.device_ptr(&self.stream).0, R_32F),
            CudaStorage::BF16(s) => (s.device_ptr(&self.stream).0, R_16BF),
            CudaStorage::U32(_) => return Err(storage_err(OP, "b", b)),
        };
        if ta != tb {
            return Err(Error::invalid(
                OP,
                format!("`a` {a:?} and `b` {b:?} differ in dtype"),
            ));
        }
        let c_dbg = format!("{c:?}");
        let (pc, tc) = match c.cuda_storage_mut(OP, "c")? {
            CudaStorage::F32(s) => (s.device_ptr_mut(&self.stream).0, R_32F),
            CudaStorage::BF16(s) => (s.device_ptr_mut(&self.stream).0, R_16BF),
            CudaStorage::U32(_) => {
                return Err(Error::invalid(
                    OP,
                    format!("`c` {c_dbg} is not a float tensor"),
                ));
            }
        };
        if ta == R_32F && tc != R_32F {
            return Err(Error::invalid(
                OP,
                format!("f32 inputs need an f32 `c`, got {c_dbg}"),
            ));
        }
        if spec.k == 0 {
            // op(A) op(B) is all zeros: C = beta C (cuBLASLt rejects K = 0). With
            // beta = 0, C may be uninitialized memory: zero it rather than scale NaNs.
            if spec.beta == 0.0 {
                return c.zero_();
            }
            return crate::backend::ElementwiseKernels::scale_assign(self, c, spec.beta);
        }
        self.lt_gemm(spec, (pa, ta), (pb, tb), (pc, tc))
    }

    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()> {
        const OP: &str = "add_bias";
        let c = bias.elem_count();
        let rows = y.elem_count().checked_div(c).unwrap_or(0);
        let (rows64, c32) = (rows as u64, super::to_u32(OP, "channels", c)?);
        let cfg = grid_for(y.elem_count());
        let y_dbg = format!("{y:?}");
        match (y.cuda_storage_mut(OP, "y")?, bias.cuda_storage(OP, "bias")?) {
            // braid_add_bias_T(T* y, const T* bias, u64 n, u32 c): y (n, c).
            (CudaStorage::F32(ys), CudaStorage::F32(bs)) => {
                let f = self.function(&ELEMENTWISE, "braid_add_bias_f32")?;
                // SAFETY: signature above; ys holds rows * c, bs holds c elements.
                unsafe { launch!(self, OP, f, cfg; ys, bs, &rows64, &c32) }
            }
            (CudaStorage::BF16(ys), CudaStorage::BF16(bs)) => {
                let f = self.function(&ELEMENTWISE, "braid_add_bias_bf16")?;
                // SAFETY: as above.
                unsafe { launch!(self, OP, f, cfg; ys, bs, &rows64, &c32) }
            }
            _ => Err(Error::invalid(
                OP,
                format!("`y` {y_dbg} and `bias` {bias:?} differ in dtype"),
            )),
        }
    }

    fn bias_grad(&self, dy: &Tensor, dbias: &mut Tensor) -> Result<()> {
        const OP: &str = "bias_grad";
        let c = dbias.elem_count();
        if c == 0 {
            return Ok(());
        }
        if dy.dtype() == DType::U32 || dbias.dtype() == DType::U32 {
            // Checked before any launch, so nothing runs on an integer tensor.
            return Err(Error::invalid(
                OP,
                format!("`dy` {dy:?} and `dbias` {dbias:?} must both be float tensors"),
            ));
        }
        let rows = dy.elem_count() / c;
        // Groups of rows summed separately, then in order: a function of N only, so the
        // bits do not depend on the GPU.
        let groups = rows.div_ceil(64).clamp(1, 256);
        let (rows64, c32, g32) = (
            rows as u64,
            super::to_u32(OP, "channels", c)?,
            groups as u32,
        );
        let mut partial = self.alloc::<f64>(OP, groups * c, || {
            format!("bias-grad partial sums ({groups}, {c})")
        })?;
        let col_blocks = c.div_ceil(256) as u32;
        let cfg1 = LaunchConfig {
            grid_dim: (col_blocks, g32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let cfg2 = LaunchConfig {
            grid_dim: (col_blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Stage 1 by dy's dtype into f64 partials, stage 2 by dbias's dtype: the two need
        // not match (under mixed precision a bf16 dy adds into the f32 grad of an f32
        // master bias).
        let db_dbg = format!("{dbias:?}");
        // braid_bias_grad_partial_T(double* p, const T* dy, u64 n, u32 c) writes p[g, col]
        // for every g < G, col < c (the grid covers both); reads dy (n x c).
        match dy.cuda_storage(OP, "dy")? {
            CudaStorage::F32(d) => {
                let f1 = self.function(&ELEMENTWISE, "braid_bias_grad_partial_f32")?;
                // SAFETY: signature above; `partial` holds G x c, `d` rows x c elements.
                unsafe { launch!(self, OP, f1, cfg1; &mut partial, d, &rows64, &c32)? };
            }
            CudaStorage::BF16(d) => {
                let f1 = self.function(&ELEMENTWISE, "braid_bias_grad_partial_bf16")?;
                // SAFETY: as above.
                unsafe { launch!(self, OP, f1, cfg1; &mut partial, d, &rows64, &c32)? };
            }
            CudaStorage::U32(_) => return Err(storage_err(OP, "dy", dy)),
        }
        // braid_bias_grad_finish_G(G* db, const double* p, u32 g, u32 c): db[col] +=
        // sum_g p[g, col] for col < c; G is dbias's dtype.
        match dbias.cuda_storage_mut(OP, "dbias")? {
            CudaStorage::F32(db) => {
                let f2 = self.function(&ELEMENTWISE, "braid_bias_grad_finish_f32")?;
                // SAFETY: signature above; `db` holds c elements, `partial` G x c.
                unsafe { launch!(self, OP, f2, cfg2; db, &partial, &g32, &c32) }
            }
            CudaStorage::BF16(db) => {
                let f2 = self.function(&ELEMENTWISE, "braid_bias_grad_finish_bf16")?;
                // SAFETY: as above.
                unsafe { launch!(self, OP, f2, cfg2; db, &partial, &g32, &c32) }
            }
            CudaStorage::U32(_) => Err(Error::invalid(
                OP,
                format!("`dbias` {db_dbg} is not a CUDA tensor of the expected dtype"),
            )),
        }
    }
}
