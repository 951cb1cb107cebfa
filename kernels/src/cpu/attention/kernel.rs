//! Block products for attention: AVX-512 and AVX2+FMA register-tiled kernels that
//! read their operands in place (no packing), and `gemm` ([`sgemm`]) elsewhere.
//!
//! Attention multiplies many small blocks (64 x 64 x HS). `gemm` packs both operands
//! on every call, which cost about as much as the multiply itself at these sizes
//! (28 % vs 35 % of the profile). Here `b` must have contiguous rows (callers keep Kᵀ
//! and Vᵀ pre-transposed) and `a` is read by broadcasts, so any strides work for it.
//!
//! Each output element is `alpha * fma-chain over k in order + beta * c`, the same
//! whatever the tile it falls in or the shape of the call: results depend only on
//! the values, never on blocking or threads.

use super::super::matmul::{MatRef, sgemm};
use crate::cpu::simd::Simd;
use crate::error::{Error, Result};

/// Checks that an (rows, cols) view with strides (rs, cs) stays inside `len`.
fn fits(name: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Result<()> {
    let last = (rows - 1) * rs + (cols - 1) * cs;
    if last >= len {
        return Err(Error::invalid(
            "attention",
            format!("{name}: a ({rows}, {cols}) view with strides ({rs}, {cs}) overruns {len}"),
        ));
    }
    Ok(())
}

/// `c (m, n, row stride c_rs) = alpha * a (m, k) @ b (k, n) + beta * c`; `c` is not
/// read when `beta == 0`.
#[allow(clippy::too_many_arguments)]
pub(super) fn mm(
    simd: Simd,
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    c_rs: usize,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if b.cs == 1 && m > 0 && n > 0 && k > 0 {
        use std::arch::is_x86_feature_detected as has;
        let avx512 = simd == Simd::Avx512 && has!("avx512f");
        let avx2 = simd == Simd::Avx2 && has!("avx2") && has!("fma");
        if avx512 || avx2 {
            fits("a", a.data.len(), m, k, a.rs, a.cs)?;
            fits("b", b.data.len(), k, n, b.rs, 1)?;
            fits("c", c.len(), m, n, c_rs, 1)?;
            let dims = (m, n, k);
            let a = (a.data.as_ptr(), a.rs, a.cs);
            let b = (b.data.as_ptr(), b.rs);
            let c = (c.as_mut_ptr(), c_rs);
            // SAFETY: the kernel's instruction set is available (checked above);
            // `fits` proved that every index the kernel forms for a, b and c lies
            // inside its slice; `c` is a unique borrow, so it aliases neither a nor b.
            unsafe {
                if avx512 {
                    avx512::gemm(dims, a, b, c, alpha, beta);
                } else {
                    avx2::gemm(dims, a, b, c, alpha, beta);
                }
            }
            return Ok(());
        }
    }
    let _ = simd;
    sgemm(m, n, k, a, b, c, c_rs, alpha, beta, 1)
}

// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust
// 1.89, the workspace's `rust-version`.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Rows per register tile: 6 rows x 4 zmm = 24 accumulators, + 4 b vectors and
    /// one broadcast fit the 32 zmm registers.
    const MR: usize = 6;
    /// Columns per panel (4 zmm of 16 lanes).
    const NC: usize = 64;

    /// The product of [`super::mm`], panel by panel of up to 64 columns.
    ///
    /// # Safety
    /// avx512f must be available; `a[i * ars + p * acs]`, `b[p * brs + j]` and
    /// `c[i * crs + j]` must be valid for i < m, p < k, j < n (c writable), m, n, k > 0.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemm(
        (m, n, k): (usize, usize, usize),
        (a, ars, acs): (*const f32, usize, usize),
        (b, brs): (*const f32, usize),
        (c, crs): (*mut f32, usize),
        alpha: f32,
        beta: f32,
    ) {
        let mut j0 = 0;
        while j0 < n {
            let w = NC.min(n - j0);
            let nv = w.div_ceil(16);
            let mut masks = [0u16; 4];
            for (v, mask) in masks.iter_mut().enumerate().take(nv) {
                let lanes = (w - 16 * v).min(16);
                *mask = if lanes == 16 {
                    u16::MAX
                } else {
                    (1u16 << lanes) - 1
                };
            }
            let t = Panel {
                k,
                a,
                ars,
                acs,
                b: b.wrapping_add(j0),
                brs,
                masks,
                c: c.wrapping_add(j0),
                crs,
                alpha,
                beta,
            };
            // SAFETY: same contract as this function, restricted to columns j0..j0 + w.
            unsafe {
                match nv {
                    1 => rows::<1>(&t, m),
                    2 => rows::<2>(&t, m),
                    3 => rows::<3>(&t, m),
                    _ => rows::<4>(&t, m),
                }
            }
            j0 += w;
        }
    }

    /// One column panel: `b` and `c` point at its first column, `masks` select its
    /// lanes (one per zmm, all nonzero for the V used).
    struct Panel {
        k: usize,
        a: *const f32,
        ars: usize,
        acs: usize,
        b: *const f32,
        brs: usize,
        masks: [u16; 4],
        c: *mut f32,
        crs: usize,
        alpha: f32,
        beta: f32,
    }

    /// All `m` rows of a panel of `V` zmm columns: full 6-row tiles, then the rest.
    ///
    /// # Safety
    /// As [`gemm`], for this panel.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const V: usize>(t: &Panel, m: usize) {
        let mut i0 = 0;
        // SAFETY: every tile covers rows i0..i0 + R < m of the panel.
        unsafe {
            while i0 + MR <= m {
                tile::<MR, V>(t, i0);
                i0 += MR;
            }
            match m - i0 {
                0 => {}
                1 => tile::<1, V>(t, i0),
                2 => tile::<2, V>(t, i0),
                3 => tile::<3, V>(t, i0),
                4 => tile::<4, V>(t, i0),
                _ => tile::<5, V>(t, i0),
            }
        }
    }

    /// Rows `i0..i0 + R` of a panel: R x V accumulators held in registers over k.
    ///
    /// # Safety
    /// As [`gemm`], for these rows of this panel.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile<const R: usize, const V: usize>(t: &Panel, i0: usize) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        let mut ap = t.a.wrapping_add(i0 * t.ars);
        let mut bp = t.b;
        for _ in 0..t.k {
            let mut bv = [_mm512_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: lanes outside the mask are neither read nor faulted on;
                // those inside are b[p, j] with j < n.
                *x = unsafe { _mm512_maskz_loadu_ps(t.masks[v], bp.wrapping_add(16 * v)) };
            }
            for row in acc.iter_mut() {
                // SAFETY: a[i, p] for a row i < m and p < k.
                let ai = _mm512_set1_ps(unsafe { *ap });
                for (x, &bx) in row.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(ai, bx, *x);
                }
                ap = ap.wrapping_add(t.ars);
            }
            ap = ap.wrapping_add(t.acs).wrapping_sub(R * t.ars);
            bp = bp.wrapping_add(t.brs);
        }
        let alpha = _mm512_set1_ps(t.alpha);
        let beta = _mm512_set1_ps(t.beta);
        for (i, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                let cp = t.c.wrapping_add((i0 + i) * t.crs + 16 * v);
                let mask = t.masks[v];
                // SAFETY: masked lanes are c[i, j] with i < m, j < n.
                unsafe {
                    let r = if t.beta == 0.0 {
                        _mm512_mul_ps(alpha, x)
                    } else {
                        let old = _mm512_maskz_loadu_ps(mask, cp);
                        _mm512_fmadd_ps(alpha, x, _mm512_mul_ps(beta, old))
                    };
                    _mm512_mask_storeu_ps(cp, mask, r);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Rows per register tile: 6 rows x 2 ymm = 12 accumulators, + 2 b vectors and
    /// one broadcast fit the 16 ymm registers.
    const MR: usize = 6;
    /// Columns per panel (2 ymm of 8 lanes).
    const NC: usize = 16;

    /// The product of [`super::mm`], panel by panel of up to 16 columns.
    ///
    /// # Safety
    /// avx2 and fma must be available; otherwise as [`super::avx512::gemm`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm(
        (m, n, k): (usize, usize, usize),
        (a, ars, acs): (*const f32, usize, usize),
        (b, brs): (*const f32, usize),
        (c, crs): (*mut f32, usize),
        alpha: f32,
        beta: f32,
    ) {
        let mut j0 = 0;
        while j0 < n {
            let w = NC.min(n - j0);
            // Lanes of the panel's last vector that are inside the matrix.
            let last = (w - 1) % 8 + 1;
            let t = Panel {
                k,
                a,
                ars,
                acs,
                b: b.wrapping_add(j0),
                brs,
                mask: _mm256_cmpgt_epi32(
                    _mm256_set1_epi32(last as i32),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                ),
                c: c.wrapping_add(j0),
                crs,
                alpha,
                beta,
            };
            // SAFETY: same contract as this function, restricted to columns j0..j0 + w;
            // a partial last vector goes through masked loads and stores.
            unsafe {
                match (w.div_ceil(8), last == 8) {
                    (1, true) => rows::<1, false>(&t, m),
                    (1, false) => rows::<1, true>(&t, m),
                    (_, true) => rows::<2, false>(&t, m),
                    (_, false) => rows::<2, true>(&t, m),
                }
            }
            j0 += w;
        }
    }

    /// One column panel of `V` ymm: `b` and `c` point at its first column; `mask`
    /// selects the lanes of the last vector when it is `PARTIAL`.
    struct Panel {
        k: usize,
        a: *const f32,
        ars: usize,
        acs: usize,
        b: *const f32,
        brs: usize,
        mask: __m256i,
        c: *mut f32,
        crs: usize,
        alpha: f32,
        beta: f32,
    }

    /// Vector `v` of `V` at `p`: masked if it is the partial last one.
    ///
    /// # Safety
    /// The (masked) lanes must be readable.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn load<const V: usize, const PARTIAL: bool>(
        p: *const f32,
        v: usize,
        mask: __m256i,
    ) -> __m256 {
        // SAFETY: per this function's contract.
        unsafe {
            if PARTIAL && v == V - 1 {
                _mm256_maskload_ps(p, mask)
            } else {
                _mm256_loadu_ps(p)
            }
        }
    }

    /// All `m` rows of a panel: full 6-row tiles, then the rest.
    ///
    /// # Safety
    /// As [`gemm`], for this panel.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const V: usize, const PARTIAL: bool>(t: &Panel, m: usize) {
        let mut i0 = 0;
        // SAFETY: every tile covers rows i0..i0 + R < m of the panel.
        unsafe {
            while i0 + MR <= m {
                tile::<MR, V, PARTIAL>(t, i0);
                i0 += MR;
            }
            match m - i0 {
                0 => {}
                1 => tile::<1, V, PARTIAL>(t, i0),
                2 => tile::<2, V, PARTIAL>(t, i0),
                3 => tile::<3, V, PARTIAL>(t, i0),
                4 => tile::<4, V, PARTIAL>(t, i0),
                _ => tile::<5, V, PARTIAL>(t, i0),
            }
        }
    }

    /// Rows `i0..i0 + R` of a panel: R x V accumulators held in registers over k.
    ///
    /// # Safety
    /// As [`gemm`], for these rows of this panel.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const V: usize, const PARTIAL: bool>(t: &Panel, i0: usize) {
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        let mut ap = t.a.wrapping_add(i0 * t.ars);
        let mut bp = t.b;
        for _ in 0..t.k {
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                // SAFETY: b[p, j] for j < n (the masked vector reads only those).
                *x = unsafe { load::<V, PARTIAL>(bp.wrapping_add(8 * v), v, t.mask) };
            }
            for row in acc.iter_mut() {
                // SAFETY: a[i, p] for a row i < m and p < k.
                let ai = _mm256_set1_ps(unsafe { *ap });
                for (x, &bx) in row.iter_mut().zip(&bv) {
                    *x = _mm256_fmadd_ps(ai, bx, *x);
                }
                ap = ap.wrapping_add(t.ars);
            }
            ap = ap.wrapping_add(t.acs).wrapping_sub(R * t.ars);
            bp = bp.wrapping_add(t.brs);
        }
        let alpha = _mm256_set1_ps(t.alpha);
        let beta = _mm256_set1_ps(t.beta);
        for (i, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                let cp = t.c.wrapping_add((i0 + i) * t.crs + 8 * v);
                // SAFETY: c[i, j] with i < m and j < n (masked for a partial vector).
                unsafe {
                    let r = if t.beta == 0.0 {
                        _mm256_mul_ps(alpha, x)
                    } else {
                        let old = load::<V, PARTIAL>(cp, v, t.mask);
                        _mm256_fmadd_ps(alpha, x, _mm256_mul_ps(beta, old))
                    };
                    if PARTIAL && v == V - 1 {
                        _mm256_maskstore_ps(cp, t.mask, r);
                    } else {
                        _mm256_storeu_ps(cp, r);
                    }
                }
            }
        }
    }
}
