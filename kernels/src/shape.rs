//! Tensor shapes: a list of dimensions, row-major (last dimension contiguous).

use std::fmt;

use crate::error::{Error, Result};

/// The dimensions of a tensor, outermost first. Tensors are always contiguous and
/// row-major, so a shape alone fixes the layout.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar of rank 0).
    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }

    /// Size of dimension `i`, or an error naming the op if the rank is too small.
    pub fn dim(&self, op: &'static str, i: usize) -> Result<usize> {
        self.0
            .get(i)
            .copied()
            .ok_or_else(|| Error::shape(op, format!("shape {self} has no dimension {i}")))
    }

    /// The last dimension (the contiguous one).
    pub fn last_dim(&self, op: &'static str) -> Result<usize> {
        self.0
            .last()
            .copied()
            .ok_or_else(|| Error::shape(op, "a scalar has no last dimension".to_string()))
    }

    /// Product of all dimensions but the last: the number of rows when the tensor is
    /// read as a matrix `(rows, last_dim)`.
    pub fn rows(&self) -> usize {
        match self.0.split_last() {
            Some((_, lead)) => lead.iter().product(),
            None => 1,
        }
    }

    /// Checks the rank and returns the dims as a fixed array.
    pub fn dims_n<const N: usize>(&self, op: &'static str, what: &str) -> Result<[usize; N]> {
        <[usize; N]>::try_from(self.0.as_slice())
            .map_err(|_| Error::shape(op, format!("`{what}` must have rank {N}, got shape {self}")))
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(Vec::new())
    }
}
