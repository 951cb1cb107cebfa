//! The CPU backend: the f32 reference every other backend is tested against.
//!
//! One file per kernel family, each holding `impl <Family>Kernels for CpuBackend`.
//! Heavy loops run on rayon; matrix products go through the `gemm` crate
//! ([`matmul::sgemm`]). bf16 tensors are widened to f32, computed by the same f32
//! kernels and their outputs rounded once ([`bf16`]): the reference for mixed precision.

#[macro_use]
mod simd;
mod activation;
mod attention;
mod bf16;
mod conv;
mod elementwise;
mod embedding;
mod layout;
mod loss;
pub(crate) mod matmul;
mod memory;
mod norm;
mod optim;
mod rope;
mod vocab_loss;

use crate::backend::Backend;

/// The CPU backend (stateless; threads come from rayon's global pool).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
}

/// Rows below which splitting work across threads costs more than it saves.
pub(crate) const PAR_MIN_ELEMS: usize = 1 << 14;
