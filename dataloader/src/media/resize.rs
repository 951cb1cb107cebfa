//! The 8-bit resampler behind the image preprocessing: a source box of packed RGB8 to (size, size, 3), horizontal pass
//! then vertical pass as PIL does it, each pass one single-axis call of fast_image_resize.
//!
//! Why not one two-axis call: fast_image_resize 6.1.0 (the newest release) reads out of bounds in its two-axis u8 path
//! when a crop box puts the first output pixel's window on a zero of the filter, which is what a CLIP centre crop does
//! whenever the upscale factor is an odd whole number (a 95x32 image at CLIP 224: 7x). `precompute_coefficients` trims
//! that zero tap, so `bounds[0].start` is no longer the smallest start; `do_convolution` then shifts every bound by it
//! (`b.start -= x_first`), a later bound wraps around, and the horizontal pass reads far outside its temporary image
//! (SIGSEGV in every backend: AVX2, SSE4.1 and the scalar one). A single-axis call applies the bounds to the source
//! as they are, and every bound lies inside `[0, in_size]`, so it cannot go out of bounds.
//!
//! Running the two passes ourselves costs nothing: the vertical pass reads only the source rows the horizontal pass
//! produced, and the horizontal pass runs only on the rows the vertical one needs (PIL's `ImagingResample` does the
//! same), so the intermediate image is at most `size x (short side + filter margin)`, never the full resized image
//! (a 65536x1 banner resized whole for a 224 crop would need 10 GB). The pass order is PIL's, so the 8-bit rounding
//! between the passes happens where PIL's does.

use fast_image_resize as fr;

use super::image::Filter;

/// The part of the source that fills the output: left, top, width, height in source pixels (fractional, as PIL's
/// `box`). Output pixel i of an axis samples the source at `start + (i + 0.5) * extent / size`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SourceBox {
    pub x0: f64,
    pub y0: f64,
    pub w: f64,
    pub h: f64,
}

/// The filter's support at scale 1, as fast_image_resize (and PIL) define them; the window widens by the downscale
/// factor.
fn support(filter: Filter) -> f64 {
    match filter {
        Filter::Bicubic => 2.0,
        Filter::Bilinear => 1.0,
    }
}

fn fr_filter(filter: Filter) -> fr::FilterType {
    match filter {
        Filter::Bicubic => fr::FilterType::CatmullRom,
        Filter::Bilinear => fr::FilterType::Bilinear,
    }
}

/// Whether an axis needs no resampling: the box is a whole-pixel window exactly `size` wide (a plain copy). This is
/// fast_image_resize's own test for skipping a pass, so a single-axis call never meets a pass it would skip.
fn is_copy(start: f64, extent: f64, size: u32) -> bool {
    extent == f64::from(size) && start == start.round()
}

/// Resizes the `bx` part of packed RGB8 `rgb` (h, w, 3) to (size, size, 3) with `filter`. `bx` must lie inside the
/// image (the caller clamps it).
pub(crate) fn resize_box_rgb8(
    rgb: Vec<u8>,
    w: u32,
    h: u32,
    bx: SourceBox,
    size: u32,
    filter: Filter,
) -> Result<Vec<u8>, String> {
    let inside = bx.x0 >= 0.0
        && bx.y0 >= 0.0
        && bx.w > 0.0
        && bx.h > 0.0
        && bx.x0 + bx.w <= f64::from(w)
        && bx.y0 + bx.h <= f64::from(h);
    if !inside || size == 0 {
        return Err(format!(
            "source box {bx:?} of a {w}x{h} image to {size}x{size} is empty or outside the image"
        ));
    }
    let vertical_copy = is_copy(bx.y0, bx.h, size);
    // Source rows the vertical pass reads: the box, widened by the filter's window (one more row each side absorbs
    // f64 rounding of the window's ends). A superset changes nothing: no tap reaches past it, so clipping the
    // window at its edges never binds where it would not bind on the whole image.
    let (y_lo, y_hi) = if vertical_copy {
        (bx.y0 as u32, bx.y0 as u32 + size)
    } else {
        let radius = support(filter) * (bx.h / f64::from(size)).max(1.0);
        let lo = (bx.y0 - radius - 1.0).floor().max(0.0) as u32;
        let hi = (bx.y0 + bx.h + radius + 1.0).ceil().min(f64::from(h)) as u32;
        (lo, hi)
    };
    let rows = y_hi - y_lo;
    let src = fr::images::Image::from_vec_u8(w, h, rgb, fr::PixelType::U8x3)
        .map_err(|e| e.to_string())?;
    let mut resizer = fr::Resizer::new();
    let convolution = fr::ResizeOptions::new()
        .resize_alg(fr::ResizeAlg::Convolution(fr_filter(filter)))
        .use_alpha(false);

    // Pass 1, horizontal: rows [y_lo, y_hi) of the source, box columns -> (rows, size, 3).
    let mid = if is_copy(bx.x0, bx.w, size) {
        copy_window(src.buffer(), w, bx.x0 as u32, y_lo, size, rows)
    } else {
        let mut mid = fr::images::Image::new(size, rows, fr::PixelType::U8x3);
        let opts = convolution.crop(bx.x0, f64::from(y_lo), bx.w, f64::from(rows));
        resizer
            .resize(&src, &mut mid, &opts)
            .map_err(|e| e.to_string())?;
        mid.into_vec()
    };
    // Pass 2, vertical: (rows, size, 3) -> (size, size, 3). `bx.y0 - y_lo` is exact (an integer taken from a
    // smaller-or-equal f64).
    let top = bx.y0 - f64::from(y_lo);
    if vertical_copy {
        return Ok(copy_window(&mid, size, 0, top as u32, size, size));
    }
    let mid = fr::images::Image::from_vec_u8(size, rows, mid, fr::PixelType::U8x3)
        .map_err(|e| e.to_string())?;
    let mut dst = fr::images::Image::new(size, size, fr::PixelType::U8x3);
    let opts = convolution.crop(0.0, top, f64::from(size), bx.h);
    resizer
        .resize(&mid, &mut dst, &opts)
        .map_err(|e| e.to_string())?;
    Ok(dst.into_vec())
}

/// Copies the (rows, cols) window at (left, top) out of packed RGB8 (.., width, 3).
fn copy_window(rgb: &[u8], width: u32, left: u32, top: u32, cols: u32, rows: u32) -> Vec<u8> {
    let (width, left, top, cols, rows) = (
        width as usize,
        left as usize,
        top as usize,
        cols as usize,
        rows as usize,
    );
    let mut out = Vec::with_capacity(rows * cols * 3);
    for y in top..top + rows {
        let start = (y * width + left) * 3;
        out.extend_from_slice(&rgb[start..start + cols * 3]);
    }
    out
}
