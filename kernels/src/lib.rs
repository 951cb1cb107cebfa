//! braid-kernels: tensors, devices, and every compute op of Braid as a forward/backward pair.
//!
//! # Layout of the crate
//!
//! - [`Tensor`] is a device buffer + [`Shape`] + [`DType`]. Its data is reached on the
//!   host only through explicit copies ([`Tensor::from_vec`], [`Tensor::to_vec_f32`]).
//! - [`ops`] is the public op surface. Each op validates its inputs (shapes, dtypes,
//!   devices: a bad input is an [`Error`] naming them, never a panic) and then calls the
//!   [`Backend`] of the device its inputs live on.
//! - [`Backend`] is the list of kernels a device must provide. [`cpu::CpuBackend`] is the
//!   reference implementation (f32 compute, rayon + the `gemm` crate);
//!   [`cuda::CudaBackend`] runs the same contracts on an NVIDIA GPU (NVRTC-compiled
//!   kernels from `kernels/cuda/`, cuBLASLt GEMMs). Layers in `braid-nn` call [`ops`]
//!   only, so they run on either.
//! - [`testing`] holds the finite-difference checker and comparison helpers that every
//!   test of this crate and of the layers above uses.

pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod ops;
pub mod rng;
pub mod shape;
pub mod tensor;
pub mod testing;

pub use backend::Backend;
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use shape::Shape;
pub use tensor::Tensor;
