//! Where a tensor's buffer lives, and which backend computes on it.

use std::fmt;

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::error::{Error, Result};

/// A compute device. `Cuda(ordinal)` is part of the type from day one so that configs,
/// layers and tests can name it; until the CUDA backend lands every attempt to place
/// data on it is an [`Error::DeviceUnavailable`].
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
            Device::Cuda(_) => Err(Error::DeviceUnavailable {
                device: self,
                reason: "the CUDA backend is not built yet; use device = \"cpu\"".into(),
            }),
        }
    }

    /// True if data can be placed on this device in this build.
    pub fn is_available(self) -> bool {
        self.backend().is_ok()
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
