//! Test support shared by every crate: finite-difference gradients, closeness checks,
//! and the macro that runs one test body on every device.
//!
//! Our kernels compute in f32, so gradients are checked with central differences in
//! f32 arithmetic and an f64 loss: `L(x) = sum_i y_i(x) * r_i` for a fixed random
//! `r`, step `eps` (default 1e-2 on O(1) inputs), and the tolerance stated per check
//! (default |analytic - numeric| <= 2e-3 + 2e-2 * |numeric|). Truncation error is
//! O(eps^2) and rounding error O(1e-7 * |L| / eps), both well inside that.

use crate::error::Result;

/// Step and tolerance of a finite-difference check.
#[derive(Clone, Copy, Debug)]
pub struct FdTolerance {
    pub eps: f32,
    pub atol: f32,
    pub rtol: f32,
}

impl Default for FdTolerance {
    fn default() -> Self {
        FdTolerance {
            eps: 1e-2,
            atol: 2e-3,
            rtol: 2e-2,
        }
    }
}

/// Central-difference gradient of `f` at `x`: `(f(x + eps e_i) - f(x - eps e_i)) / 2 eps`.
pub fn fd_grad(x: &[f32], eps: f32, mut f: impl FnMut(&[f32]) -> Result<f64>) -> Result<Vec<f32>> {
    let mut xp = x.to_vec();
    let mut g = Vec::with_capacity(x.len());
    for i in 0..x.len() {
        let orig = xp[i];
        xp[i] = orig + eps;
        let fp = f(&xp)?;
        xp[i] = orig - eps;
        let fm = f(&xp)?;
        xp[i] = orig;
        g.push(((fp - fm) / (2.0 * f64::from(eps))) as f32);
    }
    Ok(g)
}

/// `sum_i y_i * r_i` in f64: the scalar loss whose gradient w.r.t. `y` is `r`.
pub fn dot(y: &[f32], r: &[f32]) -> f64 {
    y.iter()
        .zip(r)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum()
}

/// Panics, naming `what` and the worst element, unless
/// `|got - want| <= atol + rtol * |want|` everywhere and the lengths agree.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: lengths differ ({} vs {})",
        got.len(),
        want.len()
    );
    let mut worst: Option<(usize, f32)> = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let excess = err - (atol + rtol * w.abs());
        // NaN anywhere is a failure, hence the explicit is_nan.
        let failed = excess > 0.0 || excess.is_nan();
        if failed && worst.is_none_or(|(_, e)| excess > e || e.is_nan()) {
            worst = Some((i, excess));
        }
    }
    if let Some((i, _)) = worst {
        panic!(
            "{what}: element {i} is {} but expected {} (atol {atol}, rtol {rtol}); max |diff| over all = {}",
            got[i],
            want[i],
            max_abs_diff(got, want)
        );
    }
}

/// Checks an analytic gradient against [`fd_grad`] of `f` at `x`.
#[track_caller]
pub fn check_grad(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    tol: FdTolerance,
    f: impl FnMut(&[f32]) -> Result<f64>,
) -> Result<()> {
    let numeric = fd_grad(x, tol.eps, f)?;
    assert_close(what, analytic, &numeric, tol.atol, tol.rtol);
    Ok(())
}

/// Largest `|a - b|` (NaN if any element is NaN).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m, d| {
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// Runs each named test body `fn(Device) -> braid_kernels::Result<()>` once per
/// device as its own `#[test]`: `<name>::cpu`, and `<name>::cuda` on GPU 0.
///
/// The CUDA tests are `#[ignore]`d, so a machine without a GPU (CI) counts them as
/// skipped in its summary; on a GPU machine run the test binary with `--ignored`
/// (`tools/gpu/check.sh` does). Run there without a usable GPU, they fail naming what
/// is missing — a CUDA test never passes without running.
#[macro_export]
macro_rules! test_on_devices {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn cpu() {
                    if let Err(e) = super::$name($crate::Device::Cpu) {
                        panic!("{} on cpu: {e}", stringify!($name));
                    }
                }

                #[test]
                #[ignore = "needs a CUDA GPU: run with --ignored on one (tools/gpu/check.sh)"]
                fn cuda() {
                    if let Err(e) = super::$name($crate::Device::Cuda(0)) {
                        panic!("{} on cuda:0: {e}", stringify!($name));
                    }
                }
            }
        )*
    };
}

/// A rayon pool of `threads` threads, to show a result does not depend on the count.
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| crate::Error::invalid("thread_pool", e.to_string()))
}

/// Runs `f` on a fresh rayon pool of `threads` threads.
pub fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    thread_pool(threads)?.install(f)
}

/// Asserts that an expression is `Err` matching a pattern, printing what it got.
#[macro_export]
macro_rules! assert_err {
    ($e:expr, $p:pat) => {{
        let r = $e;
        assert!(
            matches!(r, Err($p)),
            "expected Err({}), got {:?}",
            stringify!($p),
            r
        );
    }};
}
