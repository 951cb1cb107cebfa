//! The hostile-corpus test's file makers: good images in every pixel format and container, header
//! bombs of each container, and a deterministic random stream.

use image::{DynamicImage, ImageBuffer, ImageFormat};

use super::crc32;
use super::image_util::{encode, png_by_hand};

/// A deterministic xorshift stream: the corpus is the same on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One good image of `w x h` in pixel format / container number `k` (cycled over).
pub fn good_image(w: u32, h: u32, k: usize) -> (Vec<u8>, &'static str) {
    let px = |x: u32, y: u32, c: u32| ((x * 37 + y * 11 + c * 71) % 251) as u8;
    let rgb8 = ImageBuffer::from_fn(w, h, |x, y| {
        image::Rgb([px(x, y, 0), px(x, y, 1), px(x, y, 2)])
    });
    let rgba8 = ImageBuffer::from_fn(w, h, |x, y| {
        image::Rgba([px(x, y, 0), px(x, y, 1), px(x, y, 2), px(x, y, 3)])
    });
    let l8 = ImageBuffer::from_fn(w, h, |x, y| image::Luma([px(x, y, 0)]));
    let la8 = ImageBuffer::from_fn(w, h, |x, y| image::LumaA([px(x, y, 0), px(x, y, 3)]));
    let wide = |v: u8| u16::from(v) * 257;
    match k % 11 {
        0 => (
            encode(&DynamicImage::ImageRgb8(rgb8), ImageFormat::Png),
            "png",
        ),
        1 => (
            encode(&DynamicImage::ImageRgba8(rgba8), ImageFormat::Png),
            "png",
        ),
        2 => (
            encode(&DynamicImage::ImageLuma8(l8), ImageFormat::Png),
            "png",
        ),
        3 => (
            encode(&DynamicImage::ImageLumaA8(la8), ImageFormat::Png),
            "png",
        ),
        4 => {
            let img = ImageBuffer::from_fn(w, h, |x, y| {
                image::Rgb([wide(px(x, y, 0)), wide(px(x, y, 1)), wide(px(x, y, 2))])
            });
            (
                encode(&DynamicImage::ImageRgb16(img), ImageFormat::Png),
                "png",
            )
        }
        5 => {
            let img = ImageBuffer::from_fn(w, h, |x, y| image::Luma([wide(px(x, y, 0))]));
            (
                encode(&DynamicImage::ImageLuma16(img), ImageFormat::Png),
                "png",
            )
        }
        6 => {
            // Palette PNG (the crate's encoder writes none): 8-bit indices into 256 colours.
            let plte: Vec<u8> = (0..256u32)
                .flat_map(|i| [i as u8, (255 - i) as u8, (i * 7) as u8])
                .collect();
            let mut rows = Vec::new();
            for y in 0..h {
                rows.push(0);
                rows.extend((0..w).map(|x| px(x, y, 0)));
            }
            (png_by_hand(w, h, 8, 3, Some(&plte), None, &rows), "png")
        }
        7 => (
            encode(&DynamicImage::ImageRgb8(rgb8), ImageFormat::Jpeg),
            "jpg",
        ),
        8 => (
            encode(&DynamicImage::ImageLuma8(l8), ImageFormat::Jpeg),
            "jpg",
        ),
        9 => (
            encode(&DynamicImage::ImageRgba8(rgba8), ImageFormat::Gif),
            "gif",
        ),
        _ => {
            if (w + h).is_multiple_of(2) {
                (
                    encode(&DynamicImage::ImageRgba8(rgba8), ImageFormat::WebP),
                    "webp",
                )
            } else {
                (
                    encode(&DynamicImage::ImageRgb8(rgb8), ImageFormat::Bmp),
                    "bmp",
                )
            }
        }
    }
}

/// A PNG/GIF/BMP/JPEG/WebP whose header claims far more than `max_pixels`.
pub fn bomb(kind: &str, good: &[u8]) -> Vec<u8> {
    let mut b = good.to_vec();
    match kind {
        "png" => {
            b[16..20].copy_from_slice(&100_000u32.to_be_bytes());
            b[20..24].copy_from_slice(&100_000u32.to_be_bytes());
            let crc = crc32(&b[12..29]);
            b[29..33].copy_from_slice(&crc.to_be_bytes());
        }
        "gif" => {
            b[6..8].copy_from_slice(&65_535u16.to_le_bytes());
            b[8..10].copy_from_slice(&65_535u16.to_le_bytes());
        }
        "bmp" => {
            b[18..22].copy_from_slice(&100_000i32.to_le_bytes());
            b[22..26].copy_from_slice(&100_000i32.to_le_bytes());
        }
        "jpg" => {
            let sof = b.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
            b[sof + 5..sof + 7].copy_from_slice(&65_500u16.to_be_bytes());
            b[sof + 7..sof + 9].copy_from_slice(&65_500u16.to_be_bytes());
        }
        "webp" => {
            assert_eq!(&b[12..16], b"VP8L", "lossless WebP expected");
            let old = u32::from_le_bytes(b[21..25].try_into().unwrap());
            let dims = 0x3FFF | (0x3FFF << 14) | (old & 0xF000_0000);
            b[21..25].copy_from_slice(&dims.to_le_bytes());
        }
        _ => unreachable!(),
    }
    b
}
