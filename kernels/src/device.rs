//! Where a tensor's buffer lives, and which backend computes on it.

use std::fmt;

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::error::Result;

/// A compute device. `Cuda(ordinal)` is a GPU; on a machine without a driver or without
/// that GPU, placing data on it is an [`crate::Error::DeviceUnavailable`] that says
/// what is missing (never a panic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

static CPU_BACKEND: CpuBackend = CpuBackend;

impl Device {
    /// The backend that runs kernels on this device.
    ///
    /// This is the one place a new device plugs in: return its `impl Backend` here.
    pub fn backend(self) -> Result<&'static dyn Backend> {
        match self {
            Device::Cpu => Ok(&CPU_BACKEND),
            Device::Cuda(ordinal) => Ok(crate::cuda::backend(ordinal)?),
        }
    }

    /// True if data can be placed on this device here.
    pub fn is_available(self) -> bool {
        self.backend().is_ok()
    }

    /// Why this device cannot be used here (no driver, no such GPU), or `None`. Cheap
    /// and side-effect free: creates no CUDA context.
    pub fn unavailable_reason(self) -> Option<String> {
        match self {
            Device::Cpu => None,
            Device::Cuda(ordinal) => crate::cuda::unavailable_reason(ordinal),
        }
    }
}

impl Device {
    /// The most memory this device's allocator has held since the last
    /// [`Device::reset_peak_memory`], in bytes; `None` on the CPU (not tracked).
    pub fn peak_memory_bytes(self) -> Result<Option<u64>> {
        match self {
            Device::Cpu => Ok(None),
            Device::Cuda(ordinal) => Ok(Some(crate::cuda::backend(ordinal)?.peak_memory_bytes()?)),
        }
    }

    /// Waits until every kernel issued on this device has finished (a no-op on the CPU,
    /// where every op returns when it is done). For timing, not for correctness: host
    /// copies already wait for the work they read.
    pub fn synchronize(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(ordinal) => crate::cuda::backend(ordinal)?.synchronize(),
        }
    }

    /// Starts a new peak-memory window (a no-op on the CPU).
    pub fn reset_peak_memory(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(ordinal) => crate::cuda::backend(ordinal)?.reset_peak_memory(),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
