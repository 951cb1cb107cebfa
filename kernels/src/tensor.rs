//! `Tensor`: a device buffer + shape + dtype. Host access only through explicit copies.

use std::fmt;

use half::bf16;

use crate::cuda::CudaStorage;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;

/// The buffer behind a tensor, one variant per device kind.
///
#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

/// A host buffer: the CPU backend's storage, and the unit of every host <-> device copy.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    U32(Vec<u32>),
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::U32(_) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::U32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense, contiguous, row-major n-dimensional array on one device.
///
/// There are no views and no strides: an op that needs a transpose says so in its
/// arguments (see [`crate::ops::matmul`]), which keeps every kernel's memory access
/// explicit and makes each op a single, checkable function.
pub struct Tensor {
    storage: Storage,
    shape: Shape,
}

impl Tensor {
    /// Builds a tensor from a storage; the length must match the shape.
    pub(crate) fn from_storage(storage: Storage, shape: Shape) -> Result<Self> {
        let len = match &storage {
            Storage::Cpu(s) => s.len(),
            Storage::Cuda(s) => s.len(),
        };
        if len != shape.elem_count() {
            return Err(Error::BufferLen { len, shape });
        }
        Ok(Tensor { storage, shape })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Self> {
        device.backend()?.zeros(&shape.into(), dtype)
    }

    /// Copies a host buffer to `device` (on CPU the buffer is moved, not copied).
    pub fn from_host(data: CpuStorage, shape: impl Into<Shape>, device: Device) -> Result<Self> {
        device.backend()?.copy_from_host(data, shape.into())
    }

    /// Copies f32 host data to `device`.
    pub fn from_vec(data: Vec<f32>, shape: impl Into<Shape>, device: Device) -> Result<Self> {
        Self::from_host(CpuStorage::F32(data), shape, device)
    }

    /// Copies u32 host data (token ids, targets) to `device`.
    pub fn from_vec_u32(data: Vec<u32>, shape: impl Into<Shape>, device: Device) -> Result<Self> {
        Self::from_host(CpuStorage::U32(data), shape, device)
    }

    /// A tensor filled with `value` (f32).
    pub fn full(value: f32, shape: impl Into<Shape>, device: Device) -> Result<Self> {
        let shape = shape.into();
        Self::from_vec(vec![value; shape.elem_count()], shape, device)
    }

    /// Normal(0, std) f32 values from `rng`, drawn on the host and copied to `device`.
    pub fn randn(
        shape: impl Into<Shape>,
        std: f32,
        rng: &mut crate::rng::Rng,
        device: Device,
    ) -> Result<Self> {
        let shape = shape.into();
        let data = rng.normal_vec(shape.elem_count(), std);
        Self::from_vec(data, shape, device)
    }

    /// Explicit copy to the host, as it is stored.
    pub fn to_host(&self) -> Result<CpuStorage> {
        self.device().backend()?.copy_to_host(self)
    }

    /// Explicit copy to the host as f32 (bf16 is widened; u32 is an error).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match self.to_host()? {
            CpuStorage::F32(v) => Ok(v),
            CpuStorage::BF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            CpuStorage::U32(_) => Err(Error::DType {
                op: "to_vec_f32",
                arg: "self",
                got: DType::U32,
                expected: DType::F32,
            }),
        }
    }

    /// Explicit copy to the host of a u32 tensor.
    pub fn to_vec_u32(&self) -> Result<Vec<u32>> {
        match self.to_host()? {
            CpuStorage::U32(v) => Ok(v),
            other => Err(Error::DType {
                op: "to_vec_u32",
                arg: "self",
                got: other.dtype(),
                expected: DType::U32,
            }),
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }

    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        }
    }

    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => Device::Cuda(s.ordinal()),
        }
    }

    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Same data, new shape with the same number of elements (free: no copy).
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        if shape.elem_count() != self.shape.elem_count() {
            return Err(Error::shape(
                "reshape",
                format!("cannot reshape {} into {}", self.shape, shape),
            ));
        }
        Ok(Tensor {
            storage: self.storage,
            shape,
        })
    }

    /// A deep copy on the same device.
    pub fn try_clone(&self) -> Result<Self> {
        let storage = match &self.storage {
            Storage::Cpu(s) => Storage::Cpu(s.clone()),
            Storage::Cuda(s) => Storage::Cuda(crate::cuda::clone_storage(s)?),
        };
        Ok(Tensor {
            storage,
            shape: self.shape.clone(),
        })
    }

    /// This tensor on `device`: itself when it is already there (no copy), else a copy.
    pub fn into_device(self, device: Device) -> Result<Self> {
        if device == self.device() {
            return Ok(self);
        }
        Tensor::from_host(self.to_host()?, self.shape.clone(), device)
    }

    /// Sets every element to zero, keeping shape, dtype and device (grad buffers).
    pub fn zero_(&mut self) -> Result<()> {
        match &mut self.storage {
            // In place on the GPU: a memset on the stream, no new allocation.
            Storage::Cuda(s) => crate::cuda::zero_storage(s),
            Storage::Cpu(_) => {
                *self = Tensor::zeros(self.shape.clone(), self.dtype(), self.device())?;
                Ok(())
            }
        }
    }

    // ---- backend access (crate-private: layers never touch buffers) ----

    /// The f32 host slice of a CPU tensor; names `op`/`arg` in the error otherwise.
    pub(crate) fn cpu_f32(&self, op: &'static str, arg: &'static str) -> Result<&[f32]> {
        match &self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
            Storage::Cpu(other) => Err(Error::DType {
                op,
                arg,
                got: other.dtype(),
                expected: DType::F32,
            }),
            Storage::Cuda(s) => Err(not_on_cpu(op, arg, s)),
        }
    }

    /// Mutable f32 host slice of a CPU tensor.
    pub(crate) fn cpu_f32_mut(
        &mut self,
        op: &'static str,
        arg: &'static str,
    ) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
            Storage::Cpu(other) => Err(Error::DType {
                op,
                arg,
                got: other.dtype(),
                expected: DType::F32,
            }),
            Storage::Cuda(s) => Err(not_on_cpu(op, arg, s)),
        }
    }

    /// Mutable bf16 host slice of a CPU tensor.
    pub(crate) fn cpu_bf16_mut(
        &mut self,
        op: &'static str,
        arg: &'static str,
    ) -> Result<&mut [half::bf16]> {
        match &mut self.storage {
            Storage::Cpu(CpuStorage::BF16(v)) => Ok(v),
            Storage::Cpu(other) => Err(Error::DType {
                op,
                arg,
                got: other.dtype(),
                expected: DType::BF16,
            }),
            Storage::Cuda(s) => Err(not_on_cpu(op, arg, s)),
        }
    }

    /// The u32 host slice of a CPU tensor.
    pub(crate) fn cpu_u32(&self, op: &'static str, arg: &'static str) -> Result<&[u32]> {
        match &self.storage {
            Storage::Cpu(CpuStorage::U32(v)) => Ok(v),
            Storage::Cpu(other) => Err(Error::DType {
                op,
                arg,
                got: other.dtype(),
                expected: DType::U32,
            }),
            Storage::Cuda(s) => Err(not_on_cpu(op, arg, s)),
        }
    }

    /// The CPU storage, whatever its dtype.
    pub(crate) fn cpu_storage(&self, op: &'static str, arg: &'static str) -> Result<&CpuStorage> {
        match &self.storage {
            Storage::Cpu(s) => Ok(s),
            Storage::Cuda(s) => Err(not_on_cpu(op, arg, s)),
        }
    }

    /// The CPU storage, mutably, whatever its dtype.
    pub(crate) fn cpu_storage_mut(
        &mut self,
        op: &'static str,
        arg: &'static str,
    ) -> Result<&mut CpuStorage> {
        match &mut self.storage {
            Storage::Cpu(s) => Ok(s),
            Storage::Cuda(s) => Err(not_on_cpu(op, arg, s)),
        }
    }

    /// The device buffer of a CUDA tensor.
    pub(crate) fn cuda_storage(&self, op: &'static str, arg: &'static str) -> Result<&CudaStorage> {
        match &self.storage {
            Storage::Cuda(s) => Ok(s),
            Storage::Cpu(_) => Err(Error::Device {
                op,
                arg,
                got: Device::Cpu,
                expected: Device::Cuda(0),
            }),
        }
    }

    /// The device buffer of a CUDA tensor, mutably.
    pub(crate) fn cuda_storage_mut(
        &mut self,
        op: &'static str,
        arg: &'static str,
    ) -> Result<&mut CudaStorage> {
        match &mut self.storage {
            Storage::Cuda(s) => Ok(s),
            Storage::Cpu(_) => Err(Error::Device {
                op,
                arg,
                got: Device::Cpu,
                expected: Device::Cuda(0),
            }),
        }
    }

    /// A new CUDA tensor (length checked against the shape).
    pub(crate) fn from_cuda(storage: CudaStorage, shape: impl Into<Shape>) -> Result<Self> {
        Self::from_storage(Storage::Cuda(storage), shape.into())
    }

    // ---- public device-buffer access, for transports (braid-comm's NcclComm) ----

    /// The device buffer of a CUDA tensor, `None` on the CPU. For code that hands device
    /// pointers to a library (NCCL); layers use [`crate::ops`] only.
    pub fn cuda_buffer(&self) -> Option<&CudaStorage> {
        match &self.storage {
            Storage::Cuda(s) => Some(s),
            Storage::Cpu(_) => None,
        }
    }

    /// The device buffer of a CUDA tensor, mutably (an in-place all-reduce writes into
    /// it), `None` on the CPU.
    pub fn cuda_buffer_mut(&mut self) -> Option<&mut CudaStorage> {
        match &mut self.storage {
            Storage::Cuda(s) => Some(s),
            Storage::Cpu(_) => None,
        }
    }

    /// A CUDA tensor around a device buffer filled elsewhere (a receive); the length
    /// must match the shape.
    pub fn from_cuda_buffer(storage: CudaStorage, shape: impl Into<Shape>) -> Result<Self> {
        Self::from_cuda(storage, shape)
    }

    /// A new CPU tensor from an f32 buffer (length checked).
    pub(crate) fn cpu_from_f32(data: Vec<f32>, shape: impl Into<Shape>) -> Result<Self> {
        Self::from_storage(Storage::Cpu(CpuStorage::F32(data)), shape.into())
    }
}

fn not_on_cpu(op: &'static str, arg: &'static str, s: &CudaStorage) -> Error {
    Error::Device {
        op,
        arg,
        got: Device::Cuda(s.ordinal()),
        expected: Device::Cpu,
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor({}, {}, {})",
            self.shape,
            self.dtype(),
            self.device()
        )
    }
}
