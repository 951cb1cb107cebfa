//! CPU allocation, host copies and f32 <-> bf16 casts.

use half::bf16;
use rayon::prelude::*;

use super::CpuBackend;
use crate::backend::MemoryKernels;
use crate::dtype::DType;
use crate::error::Result;
use crate::shape::Shape;
use crate::tensor::{CpuStorage, Storage, Tensor};

impl MemoryKernels for CpuBackend {
    fn zeros(&self, shape: &Shape, dtype: DType) -> Result<Tensor> {
        let n = shape.elem_count();
        let storage = match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::U32 => CpuStorage::U32(vec![0; n]),
        };
        Tensor::from_storage(Storage::Cpu(storage), shape.clone())
    }

    fn copy_from_host(&self, data: CpuStorage, shape: Shape) -> Result<Tensor> {
        Tensor::from_storage(Storage::Cpu(data), shape)
    }

    fn copy_to_host(&self, t: &Tensor) -> Result<CpuStorage> {
        Ok(t.cpu_storage("to_host", "t")?.clone())
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let out = match (x.cpu_storage("cast", "x")?, dtype) {
            (CpuStorage::F32(v), DType::BF16) => {
                CpuStorage::BF16(v.par_iter().map(|&f| bf16::from_f32(f)).collect())
            }
            (CpuStorage::BF16(v), DType::F32) => {
                CpuStorage::F32(v.par_iter().map(|h| h.to_f32()).collect())
            }
            (same, _) => same.clone(),
        };
        Tensor::from_storage(Storage::Cpu(out), x.shape().clone())
    }
}
