//! Elementwise math of the attention kernels: a vectorizable dot, exp and max.

/// `a · b` with 8 independent partial sums (vectorizable; fixed order -> deterministic).
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `a * b + c`, fused (one rounding) when `FMA`. Only code built with FMA (AVX2+FMA,
/// or AVX-512, whose `avx512f` implies it) uses `FMA = true`; elsewhere `mul_add` is
/// a libm call.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `e^x` for the `x <= 0` of a softmax (`score - max`, `score - lse`), -inf -> 0.
///
/// Cephes' `expf` (range reduction by ln 2, degree-6 polynomial, ~1 ulp) written
/// branch-free so loops over it vectorize; libm's scalar `expf` took ~23 % of the
/// attention time. Results below e^-87 (subnormal) are flushed to 0.
#[inline(always)]
pub(super) fn exp_softmax<const FMA: bool>(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds an |f32| < 2^22 to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let n = madd::<FMA>(xc, std::f32::consts::LOG2_E, ROUND) - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, xc));
    let mut p = 1.987_569_1e-4;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = madd::<FMA>(p, r, c);
    }
    let er = madd::<FMA>(p, r * r, r) + 1.0;
    // 2^n: n + 127 lands in the low mantissa bits of (n + 127 + ROUND); shifting them
    // into the exponent field (the high bits fall off) builds the power of two.
    let two_n = f32::from_bits((n + (ROUND + 127.0)).to_bits() << 23);
    if x < -87.0 { 0.0 } else { er * two_n }
}

/// Largest element (-inf for an empty slice), in 16 independent lanes. NaN-blind
/// (plain compares vectorize to one max instruction; `f32::max` needs blends).
#[inline(always)]
pub(super) fn max16(x: &[f32]) -> f32 {
    let max = |a: f32, b: f32| if b > a { b } else { a };
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| max(a, b));
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = max(*a, v);
        }
    }
    acc.iter().fold(tail, |a, &b| max(a, b))
}
