//! Matrix products: batched GEMM with transposes, and the linear layer's forward and
//! backward built on it.

use super::{accumulator_dtype, expect_shape, same_device, same_float_dtype};
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// A batched GEMM: for each `i < batch`,
/// `C_i (M, N) = alpha * op(A_i) @ op(B_i) + beta * C_i`.
///
/// `A_i` is stored `(M, K)` (or `(K, M)` when `trans_a`), `B_i` is `(K, N)` (or
/// `(N, K)` when `trans_b`), all row-major and contiguous. `stride_a`/`stride_b` are
/// the element offsets between consecutive batch items; 0 broadcasts one matrix to
/// every item (a weight shared by a batch of inputs). `C` is always `(batch, M, N)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmSpec {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub stride_a: usize,
    pub stride_b: usize,
    pub alpha: f32,
    pub beta: f32,
}

/// Reads `t` as `(batch, rows, cols)`: rank 2 is one matrix, rank 3 a batch.
fn as_batched(op: &'static str, name: &str, t: &Tensor) -> Result<(usize, usize, usize)> {
    match *t.dims() {
        [r, c] => Ok((1, r, c)),
        [b, r, c] => Ok((b, r, c)),
        _ => Err(Error::shape(
            op,
            format!("`{name}` must have rank 2 or 3, got shape {}", t.shape()),
        )),
    }
}

/// Works out the GEMM for `op(a) @ op(b)` and the shape of the result.
fn plan(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
) -> Result<(GemmSpec, Shape)> {
    let (ba, ra, ca) = as_batched(op, "a", a)?;
    let (bb, rb, cb) = as_batched(op, "b", b)?;
    let (m, k) = if trans_a { (ca, ra) } else { (ra, ca) };
    let (kb, n) = if trans_b { (cb, rb) } else { (rb, cb) };
    if k != kb {
        return Err(Error::shape(
            op,
            format!(
                "inner dimensions differ: a {}{} and b {}{} give K = {k} vs {kb}",
                a.shape(),
                if trans_a { "ᵀ" } else { "" },
                b.shape(),
                if trans_b { "ᵀ" } else { "" },
            ),
        ));
    }
    let batch = ba.max(bb);
    if (ba != batch && ba != 1) || (bb != batch && bb != 1) {
        return Err(Error::shape(
            op,
            format!(
                "batch sizes {ba} and {bb} of a {} and b {} do not broadcast",
                a.shape(),
                b.shape()
            ),
        ));
    }
    let out = if a.rank() == 3 || b.rank() == 3 {
        Shape::new([batch, m, n])
    } else {
        Shape::new([m, n])
    };
    let spec = GemmSpec {
        batch,
        m,
        n,
        k,
        trans_a,
        trans_b,
        stride_a: if ba == 1 { 0 } else { m * k },
        stride_b: if bb == 1 { 0 } else { k * n },
        alpha: 1.0,
        beta: 0.0,
    };
    Ok((spec, out))
}

/// `op(a) @ op(b)` for rank-2 or rank-3 operands (a rank-2 operand is broadcast over
/// the other's batch).
pub fn matmul(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
    const OP: &str = "matmul";
    let dev = same_device(OP, &[("a", a), ("b", b)])?;
    let dtype = same_float_dtype(OP, &[("a", a), ("b", b)])?;
    let (spec, out_shape) = plan(OP, a, b, trans_a, trans_b)?;
    let backend = dev.backend()?;
    let mut c = backend.zeros(&out_shape, dtype)?;
    backend.gemm(a, b, &mut c, &spec)?;
    Ok(c)
}

/// `c = alpha * op(a) @ op(b) + beta * c` into an existing `c`
/// (`beta = 1` accumulates: how weight grads are summed over microbatches).
pub fn matmul_into(
    a: &Tensor,
    b: &Tensor,
    c: &mut Tensor,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    const OP: &str = "matmul_into";
    let dev = same_device(OP, &[("a", a), ("b", b), ("c", c)])?;
    let dtype = same_float_dtype(OP, &[("a", a), ("b", b)])?;
    accumulator_dtype(OP, ("c", c), dtype)?;
    let (mut spec, out_shape) = plan(OP, a, b, trans_a, trans_b)?;
    expect_shape(OP, "c", c, &out_shape)?;
    spec.alpha = alpha;
    spec.beta = beta;
    dev.backend()?.gemm(a, b, c, &spec)
}

/// Splits `x (..., K)` into `(rows, K)` for a linear layer.
fn rows_and_features(op: &'static str, name: &str, x: &Tensor) -> Result<(usize, usize)> {
    if x.rank() == 0 {
        return Err(Error::shape(
            op,
            format!("`{name}` must have rank >= 1, got a scalar"),
        ));
    }
    Ok((x.shape().rows(), x.shape().last_dim(op)?))
}

/// `y = x @ wᵀ + b`: x (..., K), w (N, K) — PyTorch's `nn.Linear` layout, so Hugging
/// Face weights load as they are — b (N) -> y (..., N).
pub fn linear_fwd(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "linear_fwd";
    let mut args = vec![("x", x), ("w", w)];
    if let Some(b) = b {
        args.push(("b", b));
    }
    let dev = same_device(OP, &args)?;
    let dtype = same_float_dtype(OP, &args)?;
    let (rows, k) = rows_and_features(OP, "x", x)?;
    let [n, kw] = w.shape().dims_n::<2>(OP, "w")?;
    if kw != k {
        return Err(Error::shape(
            OP,
            format!(
                "x {} has {k} features but w {} expects {kw}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    if let Some(b) = b {
        expect_shape(OP, "b", b, &Shape::new([n]))?;
    }
    let spec = GemmSpec {
        batch: 1,
        m: rows,
        n,
        k,
        trans_a: false,
        trans_b: true,
        stride_a: 0,
        stride_b: 0,
        alpha: 1.0,
        beta: 0.0,
    };
    let backend = dev.backend()?;
    let mut y = backend.zeros(&Shape::new([rows, n]), dtype)?;
    backend.gemm(x, w, &mut y, &spec)?;
    if let Some(b) = b {
        backend.add_bias(&mut y, b)?;
    }
    let mut out_dims = x.dims().to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = n;
    }
    y.reshape(out_dims)
}

/// Backward of [`linear_fwd`]: returns `dx = dy @ w` and adds `dyᵀ @ x` into `dw` and
/// the row sum of `dy` into `db` (skipped when `None`: a frozen weight).
pub fn linear_bwd(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    dw: Option<&mut Tensor>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    const OP: &str = "linear_bwd";
    let dev = same_device(OP, &[("dy", dy), ("x", x), ("w", w)])?;
    let dtype = same_float_dtype(OP, &[("dy", dy), ("x", x), ("w", w)])?;
    let (rows, k) = rows_and_features(OP, "x", x)?;
    let [n, kw] = w.shape().dims_n::<2>(OP, "w")?;
    let (_, dy_n) = rows_and_features(OP, "dy", dy)?;
    let lead = |t: &Tensor| t.dims()[..t.rank() - 1].to_vec();
    if kw != k || dy_n != n || lead(dy) != lead(x) {
        return Err(Error::shape(
            OP,
            format!(
                "dy {}, x {}, w {} do not fit y = x @ wᵀ",
                dy.shape(),
                x.shape(),
                w.shape()
            ),
        ));
    }
    let backend = dev.backend()?;
    // dx (rows, K) = dy (rows, N) @ w (N, K)
    let mut dx = backend.zeros(&Shape::new([rows, k]), dtype)?;
    let dx_spec = GemmSpec {
        batch: 1,
        m: rows,
        n: k,
        k: n,
        trans_a: false,
        trans_b: false,
        stride_a: 0,
        stride_b: 0,
        alpha: 1.0,
        beta: 0.0,
    };
    backend.gemm(dy, w, &mut dx, &dx_spec)?;
    if let Some(dw) = dw {
        expect_shape(OP, "dw", dw, w.shape())?;
        linear_wgrad(dy, x, dw)?;
    }
    if let Some(db) = db {
        same_device(OP, &[("dy", dy), ("db", db)])?;
        accumulator_dtype(OP, ("db", db), dtype)?;
        expect_shape(OP, "db", db, &Shape::new([n]))?;
        backend.bias_grad(dy, db)?;
    }
    dx.reshape(x.dims().to_vec())
}

/// The weight gradient of [`linear_fwd`] alone: adds `dyᵀ @ x` into `dw` (N, K), for
/// dy (..., N) and x (..., K). [`linear_bwd`] runs it after the input gradient unless it
/// is given no `dw`; zero-bubble pipelining runs it later, as a pass of its own.
pub fn linear_wgrad(dy: &Tensor, x: &Tensor, dw: &mut Tensor) -> Result<()> {
    const OP: &str = "linear_wgrad";
    let dev = same_device(OP, &[("dy", dy), ("x", x), ("dw", dw)])?;
    let dtype = same_float_dtype(OP, &[("dy", dy), ("x", x)])?;
    accumulator_dtype(OP, ("dw", dw), dtype)?;
    let (rows, k) = rows_and_features(OP, "x", x)?;
    let (dy_rows, n) = rows_and_features(OP, "dy", dy)?;
    if dy_rows != rows {
        return Err(Error::shape(
            OP,
            format!("dy {} and x {} have different rows", dy.shape(), x.shape()),
        ));
    }
    expect_shape(OP, "dw", dw, &Shape::new([n, k]))?;
    // dw (N, K) += dyᵀ (N, rows) @ x (rows, K)
    let spec = GemmSpec {
        batch: 1,
        m: n,
        n: k,
        k: rows,
        trans_a: true,
        trans_b: false,
        stride_a: 0,
        stride_b: 0,
        alpha: 1.0,
        beta: 1.0,
    };
    dev.backend()?.gemm(dy, x, dw, &spec)
}

/// `y[n, :] += b` for every row of y (..., C), b (C): a bias added apart from a
/// product (after a tensor-parallel reduction, say). Its backward is the row sum of
/// the output grad, as in [`linear_bwd`].
pub fn add_bias(y: &mut Tensor, b: &Tensor) -> Result<()> {
    const OP: &str = "add_bias";
    let dev = same_device(OP, &[("y", y), ("b", b)])?;
    same_float_dtype(OP, &[("y", y), ("b", b)])?;
    let (_, c) = rows_and_features(OP, "y", y)?;
    expect_shape(OP, "b", b, &Shape::new([c]))?;
    dev.backend()?.add_bias(y, b)
}
