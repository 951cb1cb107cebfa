//! `CudaStorage`: a tensor's buffer in the memory of one GPU.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use super::storage_err;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

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

/// An element type of a float device buffer: `f32`, or bf16 as its raw `u16` bits.
/// Lets one generic function serve both dtypes; `pick` chooses the kernel's name.
pub(crate) trait DeviceFloat:
    DeviceRepr + ValidAsZeroBits + Unpin + Sized + 'static
{
    const IS_BF16: bool;
    fn of(s: &CudaStorage) -> Option<&CudaSlice<Self>>;
    fn of_mut(s: &mut CudaStorage) -> Option<&mut CudaSlice<Self>>;
    fn wrap(s: CudaSlice<Self>) -> CudaStorage;
    /// The kernel of this dtype: `f32` or `bf16` of a `braid_<op>_<dtype>` pair.
    fn pick(f32_name: &'static str, bf16_name: &'static str) -> &'static str {
        if Self::IS_BF16 { bf16_name } else { f32_name }
    }
}

impl DeviceFloat for f32 {
    const IS_BF16: bool = false;
    fn of(s: &CudaStorage) -> Option<&CudaSlice<f32>> {
        match s {
            CudaStorage::F32(v) => Some(v),
            _ => None,
        }
    }
    fn of_mut(s: &mut CudaStorage) -> Option<&mut CudaSlice<f32>> {
        match s {
            CudaStorage::F32(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(s: CudaSlice<f32>) -> CudaStorage {
        CudaStorage::F32(s)
    }
}

impl DeviceFloat for u16 {
    const IS_BF16: bool = true;
    fn of(s: &CudaStorage) -> Option<&CudaSlice<u16>> {
        match s {
            CudaStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
    fn of_mut(s: &mut CudaStorage) -> Option<&mut CudaSlice<u16>> {
        match s {
            CudaStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
    fn wrap(s: CudaSlice<u16>) -> CudaStorage {
        CudaStorage::BF16(s)
    }
}

/// The `T` buffer of a CUDA tensor, or the backend's dtype error.
pub(crate) fn slice<'a, T: DeviceFloat>(
    op: &'static str,
    arg: &'static str,
    t: &'a Tensor,
) -> Result<&'a CudaSlice<T>> {
    T::of(t.cuda_storage(op, arg)?).ok_or_else(|| storage_err(op, arg, t))
}

/// The `T` buffer of a CUDA tensor, mutably.
pub(crate) fn slice_mut<'a, T: DeviceFloat>(
    op: &'static str,
    arg: &'static str,
    t: &'a mut Tensor,
) -> Result<&'a mut CudaSlice<T>> {
    let dbg = format!("{t:?}");
    match T::of_mut(t.cuda_storage_mut(op, arg)?) {
        Some(s) => Ok(s),
        None => Err(crate::Error::invalid(
            op,
            format!("`{arg}` {dbg} is not a CUDA tensor of the expected dtype"),
        )),
    }
}
