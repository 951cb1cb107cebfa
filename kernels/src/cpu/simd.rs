//! Instruction-set dispatch for the CPU kernels' elementwise loops, and the
//! branch-free math they vectorize with (`exp`, `max16`, fused multiply-add).
//!
//! A loop written as an `#[inline(always)] fn imp<const FMA: bool>(..)` and wrapped by
//! [`simd_fn!`] is compiled three times — for AVX-512, for AVX2+FMA and for the
//! baseline target — and the wrapper picks one at run time. The compiler vectorizes
//! such loops only if every call in them inlines: libm's scalar `expf` or `tanhf` does
//! not, so the math here is plain arithmetic.

/// The instruction set a kernel runs with, chosen once per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    /// `gemm` for products, compiler-vectorized loops for the baseline target.
    Portable,
    /// Hand-written AVX-512 kernels where there are some, and loops compiled for it.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// Hand-written AVX2+FMA kernels where there are some, and loops compiled for it.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Simd {
    /// The best level this machine supports, probed once (kernels ask on every call).
    pub(crate) fn detect() -> Self {
        static BEST: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Self::available()[0])
    }

    /// Every level this machine supports, best first.
    pub(crate) fn available() -> Vec<Self> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") {
                out.push(Simd::Avx512);
            }
            if has!("avx2") && has!("fma") {
                out.push(Simd::Avx2);
            }
        }
        out.push(Simd::Portable);
        out
    }
}

/// `fn $name(simd: Simd, args..)` running the `#[inline(always)]` loop function
/// `$imp::<true>(args..)` compiled for AVX-512 or AVX2+FMA when `simd` says so (loops
/// vectorize 16 or 8 lanes wide; `true`: fused multiply-adds, one instruction there),
/// and `$imp::<false>` for the baseline target otherwise.
macro_rules! simd_fn {
    ($name:ident => $imp:ident ( $($arg:ident : $ty:ty),* $(,)? )) => {
        fn $name(simd: $crate::cpu::simd::Simd, $($arg: $ty),*) {
            // `avx512f` as a target feature: Rust >= 1.89 (the workspace MSRV).
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512($($arg: $ty),*) {
                $imp::<true>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) {
                $imp::<true>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::is_x86_feature_detected as has;
                use $crate::cpu::simd::Simd;
                if simd == Simd::Avx512 && has!("avx512f") {
                    // SAFETY: the CPU supports avx512f (checked just above).
                    unsafe { avx512($($arg),*) };
                    return;
                }
                if simd == Simd::Avx2 && has!("avx2") && has!("fma") {
                    // SAFETY: the CPU supports avx2 and fma (checked just above).
                    unsafe { avx2($($arg),*) };
                    return;
                }
            }
            let _ = simd;
            $imp::<false>($($arg),*)
        }
    };
}

/// `a * b + c`, fused (one rounding) when `FMA`. Only code built with FMA (AVX2+FMA,
/// or AVX-512, whose `avx512f` implies it) uses `FMA = true`; elsewhere `mul_add` is
/// a libm call.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// `e^x`, ~1 ulp, for x <= 88 (above, e^88 ~ 1.65e38: the f32 range ends at 88.72);
/// results below e^-87 (subnormal) and -inf are flushed to 0.
///
/// Cephes' `expf` (range reduction by ln 2, degree-6 polynomial) written branch-free
/// so loops over it vectorize; libm's scalar `expf` took ~23 % of the attention time.
/// Callers never need the overflow: softmax feeds it `score - max <= 0`, a sigmoid
/// `1 / (1 + e^-x)` is 1 / 1.65e38 ~ 0 either way.
#[inline(always)]
pub(crate) fn exp<const FMA: bool>(x: f32) -> f32 {
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
pub(crate) fn max16(x: &[f32]) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::exp;

    /// The vectorizable exp agrees with f64 exp to a few ulp over [-87, 88], flushes
    /// -inf and deep negatives to exactly 0, and stops at e^88 above.
    #[test]
    fn exp_is_accurate() {
        fn check<const FMA: bool>() {
            let mut worst = 0.0f64;
            for i in 0..=350_000 {
                let x = -87.0 + 175.0 * i as f32 / 350_000.0;
                let want = f64::from(x).exp();
                let rel = (f64::from(exp::<FMA>(x)) - want).abs() / want;
                worst = worst.max(rel);
            }
            assert!(worst < 2e-7, "FMA {FMA}: max relative error {worst}");
            assert_eq!(exp::<FMA>(0.0), 1.0);
            assert_eq!(exp::<FMA>(f32::NEG_INFINITY), 0.0);
            assert_eq!(exp::<FMA>(-1e30), 0.0);
            let top = f64::from(exp::<FMA>(1e30));
            assert!((top / 88f64.exp() - 1.0).abs() < 2e-7, "e^(1e30) -> {top}");
        }
        check::<false>();
        check::<true>();
    }
}
