//! Element types a tensor can hold.

use std::fmt;

/// Element type of a [`crate::Tensor`].
///
/// `F32` is the compute type of the CPU backend and the master-weight / optimizer-state
/// type everywhere. `BF16` is a storage type (weights and activations on GPU); on CPU it
/// is converted to `F32` before any arithmetic. `U32` holds indices: token ids,
/// cross-entropy targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 => 2,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::U32 => "u32",
        })
    }
}
