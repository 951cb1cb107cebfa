//! The error type of every op: it names the op, the argument and the offending shapes.

use crate::device::Device;
use crate::dtype::DType;
use crate::shape::Shape;

/// Result of a kernel-crate call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, with enough context to find it without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit together. `msg` says how, with the shapes.
    #[error("{op}: shape mismatch: {msg}")]
    Shape { op: &'static str, msg: String },

    /// An argument of the wrong element type.
    #[error("{op}: `{arg}` has dtype {got}, expected {expected}")]
    DType {
        op: &'static str,
        arg: &'static str,
        got: DType,
        expected: DType,
    },

    /// Arguments on different devices, or on a device the op does not support.
    #[error("{op}: `{arg}` is on {got}, expected {expected}")]
    Device {
        op: &'static str,
        arg: &'static str,
        got: Device,
        expected: Device,
    },

    /// A device this build cannot use.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable { device: Device, reason: String },

    /// An argument whose value (not shape) is out of range: an index past the table,
    /// a zero stride, unsorted sequence offsets.
    #[error("{op}: invalid argument: {msg}")]
    Invalid { op: &'static str, msg: String },

    /// A CUDA driver, cuBLASLt or NVRTC call that failed (not out-of-memory, which is
    /// [`Error::OutOfMemory`]).
    #[error("{op} on {device}: {msg}")]
    Cuda {
        op: &'static str,
        device: Device,
        msg: String,
    },

    /// A device allocation that did not fit. The trainer adds the module it was running;
    /// the message says what to change.
    #[error(
        "{device} is out of memory: {op} needs {} for {what} ({} free of {}); \
         use more microbatches per step (train.microbatches), turn on activation \
         recomputation (parallel.<module>.recompute), or a smaller batch_rows",
        gib(*bytes), gib(*free_bytes), gib(*total_bytes)
    )]
    OutOfMemory {
        device: Device,
        op: &'static str,
        what: String,
        bytes: usize,
        free_bytes: usize,
        total_bytes: usize,
    },

    /// A buffer whose length does not match the shape it is given.
    #[error("buffer of {len} elements does not fit shape {shape} ({} elements)", shape.elem_count())]
    BufferLen { len: usize, shape: Shape },
}

/// Bytes as GiB for messages ("1.50 GiB").
fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl Error {
    /// Shorthand for [`Error::Shape`].
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            msg: msg.into(),
        }
    }
}
