//! CPU activations, SwiGLU and softmax: elementwise maps and per-row reductions,
//! parallel over fixed-size pieces so results do not depend on the thread count.
//!
//! The maps are written on [`simd::exp`] (no libm call, so the loops vectorize) and
//! compiled per instruction set ([`simd_fn!`]): exact GELU through libm's f64 `exp` cost
//! ~25 ns a value and was most of a small Whisper encoder's time on CPU. Every
//! activation is a sigmoid or an `erfc` in disguise: `gelu_pytorch_tanh(x) = x
//! sigmoid(2u)` since `1 + tanh(u) = 2 sigmoid(2u)`, and `1 - sigmoid(x)` is computed as
//! `e^-x sigmoid(x)`, never by a subtraction that cancels. Tensors of at most
//! [`PAR_MIN_ELEMS`] values run on the calling thread: handing a few thousand values to
//! rayon's pool costs more than computing them.

use rayon::prelude::*;

use super::norm::min_rows;
use super::simd::{Simd, exp, madd};
use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::ActivationKernels;
use crate::error::Result;
use crate::ops::activation::Activation;
use crate::tensor::Tensor;

/// sqrt(2 / pi), the scale inside `gelu_pytorch_tanh`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of `gelu_pytorch_tanh`.
const GELU_CUBIC: f32 = 0.044_715;
/// CLIP's `quick_gelu` slope.
const QUICK_GELU_SLOPE: f32 = 1.702;

/// `(sigmoid(x), 1 - sigmoid(x))`. For x << 0, e^-x stops at e^88 and sigmoid is
/// ~6e-39 (the true value is smaller still; both are 0 to f32 work), never NaN.
#[inline(always)]
fn sigmoid<const FMA: bool>(x: f32) -> (f32, f32) {
    let e = exp::<FMA>(-x);
    let s = 1.0 / (1.0 + e);
    (s, e * s)
}

/// `erfc(x)` in f32: the Chebyshev fit of [`crate::ops::activation::erfc`] (fractional
/// error 1.2e-7 in f64) on the vectorizable exp, `-z^2` fused into its argument.
#[inline(always)]
fn erfc<const FMA: bool>(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / madd::<FMA>(0.5, z, 1.0);
    let mut poly = 0.170_872_77;
    for c in [
        -0.822_152_23,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ] {
        poly = madd::<FMA>(poly, t, c);
    }
    let r = t * exp::<FMA>(madd::<FMA>(-z, z, poly));
    if x >= 0.0 { r } else { 2.0 - r }
}

/// `u` of `gelu_pytorch_tanh`: sqrt(2/pi) (x + 0.044715 x^3).
#[inline(always)]
fn gelu_u<const FMA: bool>(x: f32) -> f32 {
    SQRT_2_OVER_PI * madd::<FMA>(GELU_CUBIC * x * x, x, x)
}

/// `act(x)`.
#[inline(always)]
fn act_fwd<const FMA: bool>(act: Activation, x: f32) -> f32 {
    match act {
        Activation::GeluTanh => x * sigmoid::<FMA>(2.0 * gelu_u::<FMA>(x)).0,
        // 0.5 x erfc(-x / sqrt 2): no cancellation in the negative tail.
        Activation::GeluErf => 0.5 * x * erfc::<FMA>(-x * std::f32::consts::FRAC_1_SQRT_2),
        Activation::QuickGelu => x * sigmoid::<FMA>(QUICK_GELU_SLOPE * x).0,
        Activation::Silu => x * sigmoid::<FMA>(x).0,
    }
}

/// `act'(x)`.
#[inline(always)]
fn act_grad<const FMA: bool>(act: Activation, x: f32) -> f32 {
    match act {
        Activation::GeluTanh => {
            // d/dx x s(2u) = s + 2 x s (1 - s) u'.
            let (s, s1) = sigmoid::<FMA>(2.0 * gelu_u::<FMA>(x));
            let du = SQRT_2_OVER_PI * madd::<FMA>(3.0 * GELU_CUBIC * x, x, 1.0);
            madd::<FMA>(2.0 * x * s * s1, du, s)
        }
        Activation::GeluErf => {
            // Phi(x) + x phi(x), phi the standard normal density.
            const INV_SQRT_2PI: f32 = 0.398_942_3;
            let cdf = 0.5 * erfc::<FMA>(-x * std::f32::consts::FRAC_1_SQRT_2);
            let pdf = INV_SQRT_2PI * exp::<FMA>(-0.5 * x * x);
            madd::<FMA>(x, pdf, cdf)
        }
        Activation::QuickGelu => {
            let (s, s1) = sigmoid::<FMA>(QUICK_GELU_SLOPE * x);
            madd::<FMA>(QUICK_GELU_SLOPE * x * s, s1, s)
        }
        Activation::Silu => silu_grad::<FMA>(x),
    }
}

/// d/dx [x sigmoid(x)] = s + x s (1 - s).
#[inline(always)]
fn silu_grad<const FMA: bool>(x: f32) -> f32 {
    let (s, s1) = sigmoid::<FMA>(x);
    madd::<FMA>(x * s, s1, s)
}

simd_fn!(fwd_piece => fwd_imp(act: Activation, x: &[f32], y: &mut [f32]));
simd_fn!(bwd_piece => bwd_imp(act: Activation, dy: &[f32], x: &[f32], dx: &mut [f32]));
simd_fn!(swiglu_fwd_piece => swiglu_fwd_imp(g: &[f32], u: &[f32], y: &mut [f32]));
simd_fn!(swiglu_bwd_piece => swiglu_bwd_imp(
    dy: &[f32],
    g: &[f32],
    u: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
));

/// One loop per activation: the `match` is outside, so each loop body is straight-line
/// arithmetic that vectorizes.
#[inline(always)]
fn fwd_imp<const FMA: bool>(act: Activation, x: &[f32], y: &mut [f32]) {
    #[inline(always)]
    fn each(x: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32) {
        for (o, &v) in y.iter_mut().zip(x) {
            *o = f(v);
        }
    }
    match act {
        Activation::GeluTanh => each(x, y, |v| act_fwd::<FMA>(Activation::GeluTanh, v)),
        Activation::GeluErf => each(x, y, |v| act_fwd::<FMA>(Activation::GeluErf, v)),
        Activation::QuickGelu => each(x, y, |v| act_fwd::<FMA>(Activation::QuickGelu, v)),
        Activation::Silu => each(x, y, |v| act_fwd::<FMA>(Activation::Silu, v)),
    }
}

#[inline(always)]
fn bwd_imp<const FMA: bool>(act: Activation, dy: &[f32], x: &[f32], dx: &mut [f32]) {
    #[inline(always)]
    fn each(dy: &[f32], x: &[f32], dx: &mut [f32], f: impl Fn(f32) -> f32) {
        for ((o, &d), &v) in dx.iter_mut().zip(dy).zip(x) {
            *o = d * f(v);
        }
    }
    match act {
        Activation::GeluTanh => each(dy, x, dx, |v| act_grad::<FMA>(Activation::GeluTanh, v)),
        Activation::GeluErf => each(dy, x, dx, |v| act_grad::<FMA>(Activation::GeluErf, v)),
        Activation::QuickGelu => each(dy, x, dx, |v| act_grad::<FMA>(Activation::QuickGelu, v)),
        Activation::Silu => each(dy, x, dx, |v| act_grad::<FMA>(Activation::Silu, v)),
    }
}

#[inline(always)]
fn swiglu_fwd_imp<const FMA: bool>(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((o, &g), &u) in y.iter_mut().zip(g).zip(u) {
        *o = g * sigmoid::<FMA>(g).0 * u;
    }
}

#[inline(always)]
fn swiglu_bwd_imp<const FMA: bool>(
    dy: &[f32],
    g: &[f32],
    u: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
) {
    for (((og, ou), &d), (&g, &u)) in dg
        .iter_mut()
        .zip(du.iter_mut())
        .zip(dy)
        .zip(g.iter().zip(u))
    {
        *og = d * u * silu_grad::<FMA>(g);
        *ou = d * g * sigmoid::<FMA>(g).0;
    }
}

/// Pieces of [`PAR_MIN_ELEMS`] values: several go to rayon's pool, one runs on the
/// calling thread.
const PIECE: usize = PAR_MIN_ELEMS;

/// A new `(n)` output, each piece written by `fill(offset, piece)`: on the calling
/// thread when it is one piece, else on rayon's pool.
fn fill_pieces(n: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0.0f32; n]; // (N)
    if n <= PIECE {
        fill(0, &mut out);
    } else {
        out.par_chunks_mut(PIECE)
            .enumerate()
            .for_each(|(i, piece)| fill(i * PIECE, piece));
    }
    out
}

impl ActivationKernels for CpuBackend {
    fn activation_fwd(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        if super::bf16::any(&[x]) {
            return super::bf16::activation_fwd(self, x, act);
        }
        let xv = x.cpu_f32("activation_fwd", "x")?; // (N)
        let simd = Simd::detect();
        let y = fill_pieces(xv.len(), |at, y| {
            fwd_piece(simd, act, &xv[at..at + y.len()], y)
        }); // (N)
        Tensor::cpu_from_f32(y, x.shape().clone())
    }

    fn activation_bwd(&self, dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
        if super::bf16::any(&[dy, x]) {
            return super::bf16::activation_bwd(self, dy, x, act);
        }
        let dyv = dy.cpu_f32("activation_bwd", "dy")?; // (N)
        let xv = x.cpu_f32("activation_bwd", "x")?; // (N)
        let simd = Simd::detect();
        let dx = fill_pieces(xv.len(), |at, dx| {
            let r = at..at + dx.len();
            bwd_piece(simd, act, &dyv[r.clone()], &xv[r], dx)
        }); // (N)
        Tensor::cpu_from_f32(dx, x.shape().clone())
    }

    fn swiglu_fwd(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        if super::bf16::any(&[gate, up]) {
            return super::bf16::swiglu_fwd(self, gate, up);
        }
        let gv = gate.cpu_f32("swiglu_fwd", "gate")?; // (N)
        let uv = up.cpu_f32("swiglu_fwd", "up")?; // (N)
        let simd = Simd::detect();
        let y = fill_pieces(gv.len(), |at, y| {
            let r = at..at + y.len();
            swiglu_fwd_piece(simd, &gv[r.clone()], &uv[r], y)
        }); // (N)
        Tensor::cpu_from_f32(y, gate.shape().clone())
    }

    fn swiglu_bwd(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        if super::bf16::any(&[dy, gate, up]) {
            return super::bf16::swiglu_bwd(self, dy, gate, up);
        }
        let dyv = dy.cpu_f32("swiglu_bwd", "dy")?; // (N)
        let gv = gate.cpu_f32("swiglu_bwd", "gate")?; // (N)
        let uv = up.cpu_f32("swiglu_bwd", "up")?; // (N)
        let simd = Simd::detect();
        let (mut dgate, mut dup) = (vec![0.0f32; gv.len()], vec![0.0f32; gv.len()]); // (N), (N)
        if gv.len() <= PIECE {
            swiglu_bwd_piece(simd, dyv, gv, uv, &mut dgate, &mut dup);
        } else {
            dgate
                .par_chunks_mut(PIECE)
                .zip(dup.par_chunks_mut(PIECE))
                .zip(dyv.par_chunks(PIECE))
                .zip(gv.par_chunks(PIECE).zip(uv.par_chunks(PIECE)))
                .for_each(|(((dg, du), dy), (g, u))| swiglu_bwd_piece(simd, dy, g, u, dg, du));
        }
        Ok((
            Tensor::cpu_from_f32(dgate, gate.shape().clone())?,
            Tensor::cpu_from_f32(dup, up.shape().clone())?,
        ))
    }

    fn softmax_fwd(&self, x: &Tensor) -> Result<Tensor> {
        if super::bf16::any(&[x]) {
            return super::bf16::softmax_fwd(self, x);
        }
        let xv = x.cpu_f32("softmax_fwd", "x")?; // (N, C)
        let c = x.dims().last().copied().unwrap_or(1).max(1);
        let mut y = vec![0.0f32; xv.len()]; // (N, C)
        y.par_chunks_mut(c)
            .zip(xv.par_chunks(c))
            .with_min_len(min_rows(c))
            .for_each(|(yr, xr)| {
                // Subtracting the row max keeps every exp <= 1: no overflow for any
                // finite logits, and the largest term is exactly 1 so the sum is >= 1.
                let m = xr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f64;
                for (o, &v) in yr.iter_mut().zip(xr) {
                    *o = (v - m).exp();
                    sum += f64::from(*o);
                }
                let inv = (1.0 / sum) as f32;
                yr.iter_mut().for_each(|o| *o *= inv);
            });
        Tensor::cpu_from_f32(y, x.shape().clone())
    }

    fn softmax_bwd(&self, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
        if super::bf16::any(&[dy, y]) {
            return super::bf16::softmax_bwd(self, dy, y);
        }
        let dyv = dy.cpu_f32("softmax_bwd", "dy")?; // (N, C)
        let yv = y.cpu_f32("softmax_bwd", "y")?; // (N, C)
        let c = y.dims().last().copied().unwrap_or(1).max(1);
        let mut dx = vec![0.0f32; yv.len()]; // (N, C)
        dx.par_chunks_mut(c)
            .zip(dyv.par_chunks(c).zip(yv.par_chunks(c)))
            .with_min_len(min_rows(c))
            .for_each(|(dxr, (dyr, yr))| {
                let dot: f64 = dyr
                    .iter()
                    .zip(yr)
                    .map(|(&d, &p)| f64::from(d) * f64::from(p))
                    .sum();
                let dot = dot as f32;
                for ((o, &d), &p) in dxr.iter_mut().zip(dyr).zip(yr) {
                    *o = p * (d - dot);
                }
            });
        Tensor::cpu_from_f32(dx, y.shape().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::activation::erfc as erfc_f64;

    const ALL: [Activation; 4] = [
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::QuickGelu,
        Activation::Silu,
    ];

    /// f64 references: the activation and its analytic derivative.
    fn reference(act: Activation, x: f64) -> (f64, f64) {
        let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
        match act {
            Activation::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                let t = (k * (x + 0.044715 * x.powi(3))).tanh();
                let du = k * (1.0 + 3.0 * 0.044715 * x * x);
                (
                    0.5 * x * (1.0 + t),
                    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
                )
            }
            Activation::GeluErf => {
                let cdf = 0.5 * erfc_f64(-x / std::f64::consts::SQRT_2);
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (x * cdf, cdf + x * pdf)
            }
            Activation::QuickGelu => {
                let s = sig(1.702 * x);
                (x * s, s + 1.702 * x * s * (1.0 - s))
            }
            Activation::Silu => {
                let s = sig(x);
                (x * s, s * (1.0 + x * (1.0 - s)))
            }
        }
    }

    /// The largest `|got - want| / (floor + |want|)`.
    fn worst(got: &[f32], want: &[f64], floor: f64) -> f64 {
        got.iter()
            .zip(want)
            .map(|(&g, &w)| (f64::from(g) - w).abs() / (floor + w.abs()))
            .fold(0.0, f64::max)
    }

    /// Every instruction-set level (AVX-512, AVX2+FMA, portable: the public op runs
    /// only the best) against f64 on [-12, 12] and far out: values within a few f32
    /// ulps of |want| + 1e-6, derivatives of |want| + 0.01 (a derivative is a sum of
    /// O(1) terms: where it crosses 0, as GELU's does at x = -0.75, its f32 error is
    /// ~1e-8 absolute), SwiGLU likewise.
    #[test]
    fn every_level_matches_f64() {
        let mut x: Vec<f32> = (0..=24_000).map(|i| -12.0 + i as f32 * 0.001).collect();
        x.extend([
            0.0, -0.0, 1e-6, -1e-6, 30.0, -30.0, 100.0, -100.0, 1e4, -1e4,
        ]);
        let n = x.len();
        let dy: Vec<f32> = (0..n).map(|i| 1.0 - (i % 7) as f32 * 0.25).collect();
        let up: Vec<f32> = (0..n).map(|i| 0.5 + (i % 5) as f32 * 0.5).collect();
        for simd in Simd::available() {
            for act in ALL {
                let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
                fwd_piece(simd, act, &x, &mut y);
                bwd_piece(simd, act, &dy, &x, &mut dx);
                let want: Vec<(f64, f64)> =
                    x.iter().map(|&v| reference(act, f64::from(v))).collect();
                let wy: Vec<f64> = want.iter().map(|w| w.0).collect();
                let wdx: Vec<f64> = want
                    .iter()
                    .zip(&dy)
                    .map(|(w, &d)| w.1 * f64::from(d))
                    .collect();
                let (ey, edx) = (worst(&y, &wy, 1e-6), worst(&dx, &wdx, 1e-2));
                assert!(ey < 2e-6, "{simd:?} {act:?}: forward error {ey:e}");
                assert!(edx < 4e-6, "{simd:?} {act:?}': backward error {edx:e}");
                assert!(y.iter().chain(&dx).all(|v| v.is_finite()));
            }
            let (mut y, mut dg, mut du) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            swiglu_fwd_piece(simd, &x, &up, &mut y);
            swiglu_bwd_piece(simd, &dy, &x, &up, &mut dg, &mut du);
            let silu: Vec<(f64, f64)> = x
                .iter()
                .map(|&v| reference(Activation::Silu, f64::from(v)))
                .collect();
            let at = |i: usize| (f64::from(dy[i]), f64::from(up[i]), silu[i]);
            let wy: Vec<f64> = (0..n).map(|i| at(i).2.0 * at(i).1).collect();
            let wdg: Vec<f64> = (0..n).map(|i| at(i).0 * at(i).1 * at(i).2.1).collect();
            let wdu: Vec<f64> = (0..n).map(|i| at(i).0 * at(i).2.0).collect();
            for (what, got, want) in [("y", &y, &wy), ("dgate", &dg, &wdg), ("dup", &du, &wdu)] {
                let e = worst(got, want, if what == "y" { 1e-6 } else { 1e-2 });
                assert!(e < 4e-6, "{simd:?} swiglu {what}: error {e:e}");
            }
        }
    }
}
