//! Image decoding for the vision encoders: bytes -> RGB8 -> resize (+ center crop) -> normalized (C, H, W) f32.
//!
//! Reproduces Hugging Face's PIL-backed processors (`CLIPImageProcessor`, `SiglipImageProcessor`):
//! convert to RGB (transparency composited onto white, exactly as `transformers.image_transforms.convert_to_rgb`),
//! resize in 8 bits with PIL's convolution filters (fast_image_resize implements the same kernels and the same
//! support scaling when downsampling), center crop, rescale by 1/255 and normalize, with the same f32 arithmetic,
//! so the output differs from Python only where the two 8-bit resamplers round differently (see tests/image_reference.rs).
//!
//! Hostile input: the encoded size is bounded (`max_bytes`), the format is guessed from the bytes (never the file
//! name), and the header's dimensions are checked against `max_pixels` BEFORE any pixel buffer is allocated.
//! EXIF orientation is not applied (neither PIL's `Image.open` nor the HF processors apply it).

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};
use serde::{Deserialize, Serialize};

use super::resize::{SourceBox, resize_box_rgb8};

/// OpenAI CLIP normalization (`OPENAI_CLIP_MEAN` / `OPENAI_CLIP_STD` in transformers).
// The digits as transformers publishes them (more than f32 holds; the nearest f32 is what both sides use).
#[allow(clippy::excessive_precision)]
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_58, 0.275_777_11];
/// SigLIP normalization (`IMAGENET_STANDARD_MEAN` / `_STD`): maps [0, 1] to [-1, 1].
pub const SIGLIP_MEAN: [f32; 3] = [0.5, 0.5, 0.5];
pub const SIGLIP_STD: [f32; 3] = [0.5, 0.5, 0.5];

/// Default decompression-bomb limit: 64 Mpx (an 8192x8192 photo fits; a 100000x100000 header does not).
pub const DEFAULT_MAX_PIXELS: u64 = 64 * 1024 * 1024;
/// Default limit on the encoded size.
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Largest accepted `size` (a 4096^2 target is far beyond any ViT in use).
pub const MAX_SIZE: usize = 4096;

/// How the decoded image is brought to `size x size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resize {
    /// CLIP: resize so the shorter edge is `size` (longer edge `floor(size * long / short)`, aspect kept), then
    /// take the centered `size x size` window (`top = (new_h - size) / 2`, `left = (new_w - size) / 2`).
    ShortestEdgeCrop,
    /// SigLIP: resize to exactly `size x size`, aspect ratio not kept.
    Exact,
}

/// Resampling filter, named as PIL names it; both run as a convolution whose support widens when downsampling
/// (PIL's `Image.resize` semantics, which the HF processors call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Filter {
    /// PIL `BICUBIC` (cubic convolution, a = -0.5) = fast_image_resize `CatmullRom`. CLIP and SigLIP use it.
    #[default]
    Bicubic,
    /// PIL `BILINEAR` (triangle) = fast_image_resize `Bilinear`.
    Bilinear,
}

/// Preprocessing of one vision encoder. Owned by the dataloader's `[data]` config section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    /// Square output side in pixels (224, 336, 384, ...).
    pub size: usize,
    pub resize: Resize,
    #[serde(default)]
    pub filter: Filter,
    /// Per-channel (R, G, B) mean and std applied after scaling to [0, 1].
    pub mean: [f32; 3],
    pub std: [f32; 3],
    /// Largest accepted `width * height` from the header; checked before decoding.
    #[serde(default = "default_max_pixels")]
    pub max_pixels: u64,
    /// Largest accepted encoded size in bytes.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
}

fn default_max_pixels() -> u64 {
    DEFAULT_MAX_PIXELS
}

fn default_max_bytes() -> u64 {
    DEFAULT_MAX_BYTES
}

impl ImageConfig {
    /// OpenAI CLIP (`CLIPImageProcessor`): bicubic shortest-edge resize to `size`, center crop `size x size`.
    pub fn clip(size: usize) -> Self {
        Self {
            size,
            resize: Resize::ShortestEdgeCrop,
            filter: Filter::Bicubic,
            mean: CLIP_MEAN,
            std: CLIP_STD,
            max_pixels: DEFAULT_MAX_PIXELS,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// SigLIP (`SiglipImageProcessor`): bicubic resize to exactly `size x size`, mean = std = 0.5.
    pub fn siglip(size: usize) -> Self {
        Self {
            size,
            resize: Resize::Exact,
            filter: Filter::Bicubic,
            mean: SIGLIP_MEAN,
            std: SIGLIP_STD,
            max_pixels: DEFAULT_MAX_PIXELS,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// Checks every field; the error names the key.
    pub fn validate(&self) -> Result<(), ImageError> {
        let bad = |key: &str, why: String| Err(ImageError::Config(format!("{key}: {why}")));
        if self.size == 0 || self.size > MAX_SIZE {
            return bad("size", format!("{} is outside 1..={MAX_SIZE}", self.size));
        }
        for c in 0..3 {
            if !self.mean[c].is_finite() {
                return bad(
                    "mean",
                    format!("channel {c} is {} (must be finite)", self.mean[c]),
                );
            }
            if !(self.std[c].is_finite() && self.std[c] > 0.0) {
                return bad(
                    "std",
                    format!("channel {c} is {} (must be finite and > 0)", self.std[c]),
                );
            }
        }
        if self.max_pixels == 0 {
            return bad("max_pixels", "must be >= 1".into());
        }
        if self.max_bytes == 0 {
            return bad("max_bytes", "must be >= 1".into());
        }
        Ok(())
    }
}

/// A preprocessed image: `data` is (C, H, W) row-major, normalized. `c` is always 3 (R, G, B).
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    pub c: usize,
    pub h: usize,
    pub w: usize,
    // (C, H, W)
    pub data: Vec<f32>,
}

/// Why an image was rejected. Every variant names the input.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{name}: empty image file (0 bytes)")]
    Empty { name: String },
    #[error("{name}: {len} bytes exceeds the limit of {max} bytes per image (max_bytes)")]
    TooManyBytes { name: String, len: u64, max: u64 },
    #[error(
        "{name}: not a recognised image (first bytes {head}); accepted formats: JPEG, PNG, WebP, GIF, BMP"
    )]
    UnknownFormat { name: String, head: String },
    #[error(
        "{name}: {format} images are not accepted; accepted formats: JPEG, PNG, WebP, GIF, BMP"
    )]
    UnsupportedFormat { name: String, format: String },
    #[error("{name}: {format} header says {w}x{h}, an empty image")]
    ZeroSize {
        name: String,
        format: &'static str,
        w: u32,
        h: u32,
    },
    #[error(
        "{name}: {format} header says {w}x{h} = {pixels} pixels, over the limit of {max} (max_pixels; decompression-bomb guard), not decoded"
    )]
    TooManyPixels {
        name: String,
        format: &'static str,
        w: u32,
        h: u32,
        pixels: u64,
        max: u64,
    },
    #[error("{name}: corrupt or truncated {format} data: {source}")]
    Decode {
        name: String,
        format: &'static str,
        #[source]
        source: image::ImageError,
    },
    #[error("{name}: truncated {format}: {what}")]
    Truncated {
        name: String,
        format: &'static str,
        what: &'static str,
    },
    #[error(
        "{name}: {format} header says {w}x{h}, a side over {MAX_SIDE} pixels (JPEG's own limit); not decoded (resizing needs memory in proportion to the long side)"
    )]
    SideTooLong {
        name: String,
        format: &'static str,
        w: u32,
        h: u32,
    },
    #[error("{name}: resizing {w}x{h} to {size}x{size} failed: {reason}")]
    Resize {
        name: String,
        w: u32,
        h: u32,
        size: usize,
        reason: String,
    },
    #[error("image config: {0}")]
    Config(String),
}

impl ImageError {
    /// Short name of the reason, for reject counts.
    pub fn kind(&self) -> &'static str {
        match self {
            ImageError::Empty { .. } => "empty",
            ImageError::TooManyBytes { .. } => "too_many_bytes",
            ImageError::UnknownFormat { .. } => "unknown_format",
            ImageError::UnsupportedFormat { .. } => "unsupported_format",
            ImageError::ZeroSize { .. } => "zero_size",
            ImageError::TooManyPixels { .. } => "too_many_pixels",
            ImageError::SideTooLong { .. } => "side_too_long",
            ImageError::Decode { .. } => "corrupt",
            ImageError::Truncated { .. } => "truncated",
            ImageError::Resize { .. } => "resize",
            ImageError::Config(_) => "config",
        }
    }
}

/// The formats we decode; anything else `image::guess_format` recognises is rejected by name.
fn accepted_format(f: ImageFormat) -> Option<&'static str> {
    match f {
        ImageFormat::Jpeg => Some("JPEG"),
        ImageFormat::Png => Some("PNG"),
        ImageFormat::WebP => Some("WebP"),
        ImageFormat::Gif => Some("GIF"),
        ImageFormat::Bmp => Some("BMP"),
        _ => None,
    }
}

/// Header probe: size and format checks, then the decoder, constructed with allocation limits, positioned after the
/// header. Nothing proportional to the pixel count has been allocated when this returns.
fn open_decoder<'a>(
    bytes: &'a [u8],
    name: &str,
    max_pixels: u64,
    max_bytes: u64,
) -> Result<(impl ImageDecoder + 'a, &'static str, u32, u32), ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty { name: name.into() });
    }
    let len = bytes.len() as u64;
    if len > max_bytes {
        return Err(ImageError::TooManyBytes {
            name: name.into(),
            len,
            max: max_bytes,
        });
    }
    let guessed = image::guess_format(bytes).map_err(|_| ImageError::UnknownFormat {
        name: name.into(),
        head: hex_head(bytes),
    })?;
    let format = accepted_format(guessed).ok_or_else(|| ImageError::UnsupportedFormat {
        name: name.into(),
        format: format!("{guessed:?}"),
    })?;
    if guessed == ImageFormat::Jpeg && !jpeg_has_eoi(bytes) {
        // zune-jpeg pads a truncated scan with grey and reports success; PIL raises "image file is truncated".
        return Err(ImageError::Truncated {
            name: name.into(),
            format,
            what: "no end-of-image marker after the scan",
        });
    }
    let mut reader = ImageReader::with_format(Cursor::new(bytes), guessed);
    // Decoders that honour Limits refuse oversized headers and big side allocations (metadata chunks) themselves;
    // 8 bytes/pixel covers the widest buffer our formats decode to (16-bit RGBA PNG).
    let mut limits = Limits::default();
    limits.max_alloc = Some(max_pixels.saturating_mul(8).max(1 << 20));
    reader.limits(limits);
    let decoder = reader
        .into_decoder()
        .map_err(|source| decode_err(name, format, source))?;
    let (w, h) = decoder.dimensions();
    if w == 0 || h == 0 {
        return Err(ImageError::ZeroSize {
            name: name.into(),
            format,
            w,
            h,
        });
    }
    let pixels = u64::from(w) * u64::from(h);
    if pixels > max_pixels {
        return Err(ImageError::TooManyPixels {
            name: name.into(),
            format,
            w,
            h,
            pixels,
            max: max_pixels,
        });
    }
    if w.max(h) > MAX_SIDE {
        return Err(ImageError::SideTooLong {
            name: name.into(),
            format,
            w,
            h,
        });
    }
    Ok((decoder, format, w, h))
}

/// The longest side an image may have (JPEG's own limit): the resize's first pass keeps
/// every row of the long side, so a 1 x 60M strip under `max_pixels` needed 8 GB; at
/// most 65,535 rows it stays under `size x 65,535 x 3` bytes.
pub const MAX_SIDE: u32 = 65_535;

fn decode_err(name: &str, format: &'static str, source: image::ImageError) -> ImageError {
    ImageError::Decode {
        name: name.into(),
        format,
        source,
    }
}

/// Whether a JPEG has an EOI marker (FF D9) after its first SOS. Walks the marker segments up to the first scan (so
/// an EXIF thumbnail's own EOI does not count), then looks for FF D9, which entropy-coded data cannot contain (an
/// 0xFF there is always followed by 0x00 or a restart marker). Trailing bytes after the EOI are tolerated.
fn jpeg_has_eoi(bytes: &[u8]) -> bool {
    let mut i = 2; // after SOI
    loop {
        // Optional 0xFF fill bytes, then the marker code.
        while bytes.get(i) == Some(&0xFF) && bytes.get(i + 1) == Some(&0xFF) {
            i += 1;
        }
        let (Some(&0xFF), Some(&marker)) = (bytes.get(i), bytes.get(i + 1)) else {
            return false;
        };
        i += 2;
        match marker {
            0xDA => {
                return bytes
                    .get(i..)
                    .is_some_and(|scan| scan.windows(2).rev().any(|w| w == [0xFF, 0xD9]));
            }
            0xD9 => return false,    // EOI before any scan
            0x01 | 0xD0..=0xD7 => {} // standalone markers
            _ => {
                let Some(len) = bytes
                    .get(i..i + 2)
                    .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
                else {
                    return false;
                };
                i += len;
            }
        }
    }
}

fn hex_head(bytes: &[u8]) -> String {
    bytes
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Width and height from the header alone (pack time: token counts without decoding), with the same format, size
/// and decompression-bomb checks as `decode_image`.
pub fn image_dims(bytes: &[u8], name: &str, cfg: &ImageConfig) -> Result<(u32, u32), ImageError> {
    let (_, _, w, h) = open_decoder(bytes, name, cfg.max_pixels, cfg.max_bytes)?;
    Ok((w, h))
}

/// Decodes an encoded image (JPEG, PNG, WebP, GIF first frame, BMP; format from the bytes) into normalized
/// (3, size, size) pixels per `cfg`. `name` (file, tar member, row id) only labels errors.
pub fn decode_image(bytes: &[u8], name: &str, cfg: &ImageConfig) -> Result<Pixels, ImageError> {
    let rgb = decode_resized_rgb8(bytes, name, cfg)?;
    Ok(normalize(&rgb, cfg))
}

/// Decodes and resizes (+ crops) like [`decode_image`] but stops before normalizing: packed RGB8
/// (size, size, 3). `braid pack` stores this, so the loader only normalizes ([`normalize_rgb8`]).
pub fn decode_resized_rgb8(
    bytes: &[u8],
    name: &str,
    cfg: &ImageConfig,
) -> Result<Vec<u8>, ImageError> {
    cfg.validate()?;
    let (decoder, format, w, h) = open_decoder(bytes, name, cfg.max_pixels, cfg.max_bytes)?;
    let img =
        DynamicImage::from_decoder(decoder).map_err(|source| decode_err(name, format, source))?;
    // `open_decoder` refused zero-sized images.
    resize_rgb8(to_rgb8(img), w, h, cfg).map_err(|reason| ImageError::Resize {
        name: name.into(),
        w,
        h,
        size: cfg.size,
        reason,
    })
}

/// Normalizes packed RGB8 (size, size, 3), as [`decode_resized_rgb8`] returns, into (3, size, size).
pub fn normalize_rgb8(rgb: &[u8], name: &str, cfg: &ImageConfig) -> Result<Pixels, ImageError> {
    let n = cfg.size * cfg.size * 3;
    if rgb.len() != n {
        return Err(ImageError::Resize {
            name: name.into(),
            w: cfg.size as u32,
            h: cfg.size as u32,
            size: cfg.size,
            reason: format!(
                "stored RGB8 buffer holds {} bytes, {s}x{s}x3 needs {n}",
                rgb.len(),
                s = cfg.size
            ),
        });
    }
    Ok(normalize(rgb, cfg))
}

/// Resize (+ crop) and normalize an already decoded packed RGB8 image (h, w, 3) per `cfg`.
pub fn preprocess_rgb8(
    rgb: Vec<u8>,
    w: u32,
    h: u32,
    name: &str,
    cfg: &ImageConfig,
) -> Result<Pixels, ImageError> {
    // (size, size, 3) u8
    let resized = resize_rgb8_to_config(rgb, w, h, name, cfg)?;
    Ok(normalize(&resized, cfg))
}

/// Resize (+ crop) an already decoded packed RGB8 image (h, w, 3) per `cfg`, stopping before normalization:
/// packed RGB8 (size, size, 3), what `braid pack` stores.
pub fn resize_rgb8_to_config(
    rgb: Vec<u8>,
    w: u32,
    h: u32,
    name: &str,
    cfg: &ImageConfig,
) -> Result<Vec<u8>, ImageError> {
    cfg.validate()?;
    let resize_err = |reason: String| ImageError::Resize {
        name: name.into(),
        w,
        h,
        size: cfg.size,
        reason,
    };
    if w == 0 || h == 0 {
        return Err(ImageError::ZeroSize {
            name: name.into(),
            format: "RGB8",
            w,
            h,
        });
    }
    let expected = u64::from(w) * u64::from(h) * 3;
    if rgb.len() as u64 != expected {
        return Err(resize_err(format!(
            "buffer holds {} bytes, {w}x{h} RGB8 needs {expected}",
            rgb.len()
        )));
    }
    resize_rgb8(rgb, w, h, cfg).map_err(resize_err)
}

/// Any decoded layout (gray, gray+alpha, RGB, RGBA, 8 or 16 bits, palette already expanded by the decoders) to
/// packed RGB8. Alpha is composited onto white with PIL's integer `alpha_composite` arithmetic, as transformers'
/// `convert_to_rgb` does; 16-bit samples round to 8 bits (x * 255 / 65535).
pub fn to_rgb8(img: DynamicImage) -> Vec<u8> {
    if !img.color().has_alpha() {
        return img.into_rgb8().into_raw();
    }
    // (h, w, 4) u8
    let rgba = img.into_rgba8().into_raw();
    let mut out = Vec::with_capacity(rgba.len() / 4 * 3);
    for px in rgba.chunks_exact(4) {
        let a = u32::from(px[3]);
        for &v in &px[..3] {
            out.push(composite_on_white(u32::from(v), a));
        }
    }
    out
}

/// PIL `ImagingAlphaComposite` with an opaque white destination (dst.a = 255, dst.rgb = 255), PRECISION_BITS = 7.
#[inline]
fn composite_on_white(src: u32, a: u32) -> u8 {
    const P: u32 = 7;
    // outa255 = a * 255 + 255 * (255 - a) = 255 * 255, so coef1 = a * 255 * 255 * 2^P / (255 * 255) = a << P.
    let coef1 = a << P;
    let coef2 = (255 << P) - coef1;
    let tmp = src * coef1 + 255 * coef2 + (0x80 << P);
    // SHIFTFORDIV255(x) = ((x >> 8) + x) >> 8, then drop the precision bits.
    let div = ((tmp >> 8) + tmp) >> 8;
    (div >> P).min(255) as u8
}

/// Output size of the shortest-edge resize, as transformers' `get_resize_output_image_size(default_to_square=False)`
/// computes it: the short side becomes `size`, the long side `int(size * long / short)` (floor).
pub fn shortest_edge_dims(w: u32, h: u32, size: usize) -> (u64, u64) {
    let (w, h, s) = (u64::from(w), u64::from(h), size as u64);
    if w <= h {
        (s, s * h / w)
    } else {
        (s * w / h, s)
    }
}

/// Resizes packed RGB8 (h, w, 3) to (size, size, 3). For `ShortestEdgeCrop`, the centre crop is expressed as a source
/// box of the full-image resize: output pixel i sits at source coordinate `left + (i + 0.5) * scale` with the taps
/// outside the box kept (PIL's `box`), so only the kept `size x size` pixels are computed and they equal
/// resize-then-crop. The passes themselves: `resize::resize_box_rgb8`.
fn resize_rgb8(rgb: Vec<u8>, w: u32, h: u32, cfg: &ImageConfig) -> Result<Vec<u8>, String> {
    let size = u32::try_from(cfg.size).map_err(|e| e.to_string())?;
    let bx = match cfg.resize {
        Resize::Exact => SourceBox {
            x0: 0.0,
            y0: 0.0,
            w: f64::from(w),
            h: f64::from(h),
        },
        Resize::ShortestEdgeCrop => {
            let (new_w, new_h) = shortest_edge_dims(w, h, cfg.size);
            let s = u64::from(size);
            let (left, top) = ((new_w - s) / 2, (new_h - s) / 2);
            let (sx, sy) = (f64::from(w) / new_w as f64, f64::from(h) / new_h as f64);
            let (x0, y0) = (left as f64 * sx, top as f64 * sy);
            // Clamp against f64 rounding pushing the box a hair past the edge.
            SourceBox {
                x0,
                y0,
                w: (s as f64 * sx).min(f64::from(w) - x0),
                h: (s as f64 * sy).min(f64::from(h) - y0),
            }
        }
    };
    resize_box_rgb8(rgb, w, h, bx, size, cfg.filter)
}

/// Packed RGB8 (size, size, 3) -> normalized (3, size, size): HF's `rescale` (`u8 as f64 * (1/255)`, cast to f32)
/// then `normalize` (`(x - mean) / std` in f32), tabulated per channel since the input has 256 values.
fn normalize(rgb: &[u8], cfg: &ImageConfig) -> Pixels {
    let n = cfg.size * cfg.size;
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, out) in table.iter_mut().enumerate() {
            let x = (v as f64 * (1.0 / 255.0)) as f32;
            *out = (x - cfg.mean[c]) / cfg.std[c];
        }
    }
    // (C, H, W)
    let mut data = vec![0f32; 3 * n];
    let (r, gb) = data.split_at_mut(n);
    let (g, b) = gb.split_at_mut(n);
    for (i, px) in rgb.chunks_exact(3).take(n).enumerate() {
        r[i] = lut[0][usize::from(px[0])];
        g[i] = lut[1][usize::from(px[1])];
        b[i] = lut[2][usize::from(px[2])];
    }
    Pixels {
        c: 3,
        h: cfg.size,
        w: cfg.size,
        data,
    }
}
