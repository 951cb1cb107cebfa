//! `CudaStorage`: a tensor's buffer in the memory of one GPU.

use cudarc::driver::CudaSlice;

use crate::dtype::DType;

/// A device buffer, one variant per dtype. bf16 is stored as its raw bits (`u16`): the
/// kernels read and write bf16 as bit patterns (no CUDA headers needed at run time), and
/// host copies reinterpret `half::bf16` slices as `u16` without converting.
#[derive(Debug)]
pub enum CudaStorage {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<u16>),
    U32(CudaSlice<u32>),
}

impl CudaStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CudaStorage::F32(_) => DType::F32,
            CudaStorage::BF16(_) => DType::BF16,
            CudaStorage::U32(_) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CudaStorage::F32(s) => s.len(),
            CudaStorage::BF16(s) => s.len(),
            CudaStorage::U32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ordinal of the GPU that holds the buffer.
    pub fn ordinal(&self) -> usize {
        match self {
            CudaStorage::F32(s) => s.ordinal(),
            CudaStorage::BF16(s) => s.ordinal(),
            CudaStorage::U32(s) => s.ordinal(),
        }
    }

    /// Bytes on the device.
    pub fn num_bytes(&self) -> usize {
        match self {
            CudaStorage::F32(s) => s.num_bytes(),
            CudaStorage::BF16(s) => s.num_bytes(),
            CudaStorage::U32(s) => s.num_bytes(),
        }
    }
}
