//! The CUDA backend: one [`CudaBackend`] per GPU, kernels from `kernels/cuda/*.cu`
//! compiled at run time by NVRTC, GEMMs through cuBLASLt.
//!
//! Built into every binary (cudarc loads libcuda, cuBLASLt and NVRTC at run time), so a
//! machine without CUDA builds and runs everything on the CPU, and `Device::Cuda(n)`
//! there is an [`crate::Error::DeviceUnavailable`] naming what is missing.
//!
//! One file per kernel family, each holding `impl <Family>Kernels for CudaBackend`, with
//! its kernels in `kernels/cuda/<family>.cu`. Conventions of the kernels:
//! - names `braid_<op>_<dtype>` (`braid_rms_norm_fwd_bf16`), `extern "C"`;
//! - bf16 as raw bits (`bf16_t`, `unsigned short`), math in f32, sums of many terms in
//!   f32 with a fixed reduction tree (or f64 where the CPU backend uses f64);
//! - element counts that can pass 2^31 (logits are N x V) as `u64`;
//! - no float atomics in any reduction: the same inputs give the same bits, run to run;
//! - outputs a kernel overwrites in full are allocated uninitialized
//!   ([`CudaBackend::alloc`]); only accumulators are zeroed.

/// Launches kernel `$f` on backend `$be` with launch config `$cfg`, pushing `$arg`s in
/// order (each a reference to a live value: bind scalars to locals first). Evaluates to
/// `Result<()>`. Must be used inside `unsafe`: the arguments must match the kernel's C
/// signature in number, order and type, and every buffer must hold as many elements as
/// the kernel touches under `$cfg` (each call site states the signature).
macro_rules! launch {
    ($be:expr, $op:expr, $f:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let mut builder = $be.stream.launch_builder(&$f);
        $( cudarc::driver::PushKernelArg::arg(&mut builder, $arg); )*
        builder.launch($cfg).map(|_| ()).map_err(|e| $be.driver_err($op, e))
    }};
}

pub mod compile;
mod context;
mod storage;

mod activation;
mod attention;
mod conv;
mod elementwise;
mod embedding;
mod layout;
mod loss;
mod matmul;
mod memory;
mod norm;
mod optim;
mod rope;
mod vocab_loss;

pub use context::{CudaBackend, backend, unavailable_reason};
pub(crate) use memory::{clone_storage, zero_storage};
pub use storage::CudaStorage;

use cudarc::driver::LaunchConfig;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
}

/// Threads per block of the simple grid-stride kernels.
pub(crate) const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements: enough blocks to fill the GPU several times
/// over, never more than the work needs.
pub(crate) fn grid_for(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 132 * 32) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A `usize` that a kernel takes as `int`/`u32` (rows, channels, heads), or an error
/// naming it when it does not fit.
pub(crate) fn to_u32(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::invalid(
            op,
            format!("{what} = {v} does not fit the kernel's 32-bit index"),
        )
    })
}

/// Shorthand used by every family: the backend's error for a CUDA tensor of the wrong
/// storage (ops validate dtypes first, so this only fires on an internal mistake).
pub(crate) fn storage_err(op: &'static str, arg: &'static str, t: &Tensor) -> Error {
    Error::invalid(
        op,
        format!("`{arg}` {t:?} is not a CUDA tensor of the expected dtype"),
    )
}
