//! Image test helpers: patterned RGB images, encoders, HF's normalize written out, and PNGs built by
//! hand (palette, tRNS, stored zlib) for the decoders' edge cases.

use std::io::Cursor;

use braid_dataloader::media::image::{ImageConfig, Pixels, Resize};
use image::{DynamicImage, ImageBuffer, ImageFormat, Rgb};

/// A 0..255 pattern with distinct values per channel and position (exercises all channels, no symmetry).
pub fn pattern_rgb(w: u32, h: u32) -> ImageBuffer<Rgb<u8>, Vec<u8>> {
    ImageBuffer::from_fn(w, h, |x, y| {
        Rgb([
            (x * 7 + y * 3) as u8,
            (x * 2 + y * 11 + 40) as u8,
            (x * y + 90) as u8,
        ])
    })
}

pub fn encode(img: &DynamicImage, fmt: ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, fmt).unwrap();
    out.into_inner()
}

/// HF's rescale + normalize of one 8-bit value, written out directly.
pub fn norm(v: u8, c: usize, cfg: &ImageConfig) -> f32 {
    ((f64::from(v) * (1.0 / 255.0)) as f32 - cfg.mean[c]) / cfg.std[c]
}

/// Config whose resize is the identity on a `w x w` input (Exact to the same size): output = normalize(input).
pub fn identity_cfg(w: usize) -> ImageConfig {
    ImageConfig {
        size: w,
        resize: Resize::Exact,
        ..ImageConfig::clip(w)
    }
}

pub fn px(p: &Pixels, c: usize, y: usize, x: usize) -> f32 {
    p.data[(c * p.h + y) * p.w + x]
}

/// Asserts `p` is exactly normalize(expected RGB8 (h, w, 3)).
pub fn assert_normalized(p: &Pixels, expected: &[u8], cfg: &ImageConfig) {
    assert_eq!((p.c, p.h, p.w), (3, cfg.size, cfg.size));
    assert_eq!(p.data.len(), 3 * cfg.size * cfg.size);
    for y in 0..p.h {
        for x in 0..p.w {
            for c in 0..3 {
                let want = norm(expected[(y * p.w + x) * 3 + c], c, cfg);
                assert_eq!(px(p, c, y, x), want, "pixel (c={c}, y={y}, x={x})");
            }
        }
    }
}

pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// zlib stream of stored (uncompressed) deflate blocks.
pub fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let chunks: Vec<&[u8]> = if data.is_empty() {
        vec![&[]]
    } else {
        data.chunks(65535).collect()
    };
    for (i, chunk) in chunks.iter().enumerate() {
        out.push(u8::from(i + 1 == chunks.len()));
        let n = chunk.len() as u16;
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(!n).to_le_bytes());
        out.extend_from_slice(chunk);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65521;
        b = (b + a) % 65521;
    }
    out.extend_from_slice(&((b << 16) | a).to_be_bytes());
    out
}

pub fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32(&body).to_be_bytes());
}

/// A PNG written by hand (the image crate's encoder writes no palette images): `rows` are unfiltered scanlines.
pub fn png_by_hand(
    w: u32,
    h: u32,
    depth: u8,
    color: u8,
    plte: Option<&[u8]>,
    trns: Option<&[u8]>,
    rows: &[u8],
) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[depth, color, 0, 0, 0]);
    png_chunk(&mut out, b"IHDR", &ihdr);
    if let Some(p) = plte {
        png_chunk(&mut out, b"PLTE", p);
    }
    if let Some(t) = trns {
        png_chunk(&mut out, b"tRNS", t);
    }
    png_chunk(&mut out, b"IDAT", &zlib_stored(rows));
    png_chunk(&mut out, b"IEND", &[]);
    out
}

pub fn small_png() -> Vec<u8> {
    encode(
        &DynamicImage::ImageRgb8(pattern_rgb(12, 9)),
        ImageFormat::Png,
    )
}

pub fn small_jpeg() -> Vec<u8> {
    encode(
        &DynamicImage::ImageRgb8(pattern_rgb(12, 9)),
        ImageFormat::Jpeg,
    )
}
