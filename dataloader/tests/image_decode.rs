//! Image decoding: every format, colour layouts (grey, alpha, 16-bit, palette), resize/crop
//! geometry, config validation and determinism.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_dataloader::media::image::{
    CLIP_STD, Filter, ImageConfig, ImageError, Resize, decode_image, image_dims, preprocess_rgb8,
    shortest_edge_dims,
};
use image::{DynamicImage, ImageBuffer, ImageFormat, Luma, LumaA, Rgb, Rgba};

use common::image_util::*;

// ---------------------------------------------------------------------------------------------------------------
// Formats.

#[test]
fn lossless_formats_round_trip_exactly() {
    let rgb = pattern_rgb(16, 16);
    let img = DynamicImage::ImageRgb8(rgb.clone());
    let cfg = identity_cfg(16);
    for fmt in [ImageFormat::Png, ImageFormat::Bmp, ImageFormat::WebP] {
        let bytes = encode(&img, fmt);
        assert_eq!(image_dims(&bytes, "t", &cfg).unwrap(), (16, 16), "{fmt:?}");
        let p = decode_image(&bytes, "t", &cfg).unwrap();
        assert_normalized(&p, rgb.as_raw(), &cfg);
    }
}

#[test]
fn gif_decodes_first_frame() {
    // <= 256 colours so the GIF encoder keeps them exactly; two frames of different content.
    let f0 = ImageBuffer::from_fn(8, 8, |x, y| {
        Rgba([(x * 32) as u8, (y * 32) as u8, 200, 255])
    });
    let f1 = ImageBuffer::from_fn(8, 8, |_, _| Rgba([10, 20, 30, 255]));
    let mut bytes = Vec::new();
    {
        let mut enc = image::codecs::gif::GifEncoder::new(&mut bytes);
        enc.encode_frames([image::Frame::new(f0.clone()), image::Frame::new(f1)])
            .unwrap();
    }
    let cfg = identity_cfg(8);
    let p = decode_image(&bytes, "anim.gif", &cfg).unwrap();
    let want: Vec<u8> = f0.pixels().flat_map(|p| [p[0], p[1], p[2]]).collect();
    assert_normalized(&p, &want, &cfg);
}

#[test]
fn jpeg_round_trip_within_codec_error() {
    // Smooth content at quality 100: the codec's own error is a few levels.
    let rgb: ImageBuffer<Rgb<u8>, _> = ImageBuffer::from_fn(32, 32, |x, y| {
        Rgb([
            (x * 4 + 60) as u8,
            (y * 4 + 30) as u8,
            ((x + y) * 2 + 50) as u8,
        ])
    });
    let mut bytes = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 100)
        .encode_image(&rgb)
        .unwrap();
    let cfg = identity_cfg(32);
    let p = decode_image(&bytes, "t.jpg", &cfg).unwrap();
    let lsb = 1.0 / (255.0 * CLIP_STD[1]);
    let mut max = 0f32;
    for (i, v) in rgb.as_raw().iter().enumerate() {
        let (y, x, c) = (i / 96, i / 3 % 32, i % 3);
        max = max.max((px(&p, c, y, x) - norm(*v, c, &cfg)).abs());
    }
    assert!(max <= 4.0 * lsb, "JPEG q100 error {} levels", max / lsb);
}

#[test]
fn format_comes_from_bytes_not_name() {
    let cfg = ImageConfig::clip(8);
    let jpeg = small_jpeg();
    assert!(decode_image(&jpeg, "really_a_jpeg.png", &cfg).is_ok());
    assert_eq!(image_dims(&small_png(), "x.jpg", &cfg).unwrap(), (12, 9));
}

// ---------------------------------------------------------------------------------------------------------------
// Colour layouts.

#[test]
fn grayscale_is_replicated() {
    let g = ImageBuffer::from_fn(10, 10, |x, y| Luma([(x * 20 + y) as u8]));
    let cfg = identity_cfg(10);
    let p = decode_image(
        &encode(&DynamicImage::ImageLuma8(g.clone()), ImageFormat::Png),
        "g",
        &cfg,
    )
    .unwrap();
    let want: Vec<u8> = g.as_raw().iter().flat_map(|&v| [v, v, v]).collect();
    assert_normalized(&p, &want, &cfg);
}

/// PIL's alpha_composite onto opaque white, written from its definition: round(v * a / 255 + 255 * (1 - a / 255)).
fn on_white(v: u8, a: u8) -> u8 {
    let (v, a) = (f64::from(v), f64::from(a));
    (v * a / 255.0 + 255.0 * (1.0 - a / 255.0)).round() as u8
}

#[test]
fn alpha_is_composited_onto_white() {
    // Every alpha value 0..=255 against several colours.
    let rgba = ImageBuffer::from_fn(16, 16, |x, y| {
        let a = (y * 16 + x) as u8;
        Rgba([a.wrapping_mul(37), 255 - a, 0, a])
    });
    let cfg = identity_cfg(16);
    let p = decode_image(
        &encode(&DynamicImage::ImageRgba8(rgba.clone()), ImageFormat::Png),
        "a",
        &cfg,
    )
    .unwrap();
    let want: Vec<u8> = rgba
        .pixels()
        .flat_map(|p| {
            [
                on_white(p[0], p[3]),
                on_white(p[1], p[3]),
                on_white(p[2], p[3]),
            ]
        })
        .collect();
    // PIL's fixed-point division by 255 can differ from exact rounding by one level on ties; allow exactly that.
    let lsb = 1.0 / (255.0 * CLIP_STD[1]);
    for (i, &v) in want.iter().enumerate() {
        let (y, x, c) = (i / 48, i / 3 % 16, i % 3);
        let d = (px(&p, c, y, x) - norm(v, c, &cfg)).abs();
        assert!(d <= 1.01 * lsb, "pixel {i}: {d}");
    }
    // Fully transparent -> white, opaque -> unchanged.
    assert_eq!(px(&p, 0, 0, 0), norm(255, 0, &cfg));
    assert_eq!(px(&p, 1, 15, 15), norm(0, 1, &cfg));

    // Gray + alpha takes the same path.
    let la = ImageBuffer::from_fn(4, 4, |x, _| LumaA([100, (x * 85) as u8]));
    let cfg4 = identity_cfg(4);
    let p = decode_image(
        &encode(&DynamicImage::ImageLumaA8(la), ImageFormat::Png),
        "la",
        &cfg4,
    )
    .unwrap();
    assert_eq!(px(&p, 2, 1, 0), norm(255, 2, &cfg4));
    assert_eq!(px(&p, 2, 1, 3), norm(100, 2, &cfg4));
}

#[test]
fn sixteen_bit_rounds_to_eight() {
    let to8 = |v: u16| ((f64::from(v) * 255.0 / 65535.0).round()) as u8;
    let rgb16: ImageBuffer<Rgb<u16>, _> = ImageBuffer::from_fn(8, 8, |x, y| {
        Rgb([(x * 8000 + y) as u16, (y * 9000 + 77) as u16, 65535])
    });
    let cfg = identity_cfg(8);
    let p = decode_image(
        &encode(&DynamicImage::ImageRgb16(rgb16.clone()), ImageFormat::Png),
        "16",
        &cfg,
    )
    .unwrap();
    let want: Vec<u8> = rgb16.as_raw().iter().map(|&v| to8(v)).collect();
    assert_normalized(&p, &want, &cfg);

    let g16 = ImageBuffer::from_fn(8, 8, |x, y| Luma([(x * 8191 + y * 3) as u16]));
    let p = decode_image(
        &encode(&DynamicImage::ImageLuma16(g16.clone()), ImageFormat::Png),
        "g16",
        &cfg,
    )
    .unwrap();
    let want: Vec<u8> = g16.as_raw().iter().flat_map(|&v| [to8(v); 3]).collect();
    assert_normalized(&p, &want, &cfg);
}

#[test]
fn palette_png_with_transparency() {
    // 4x2, 8-bit indices into a 3-colour palette; index 2 is fully transparent (-> white).
    let plte = [255, 0, 0, 0, 128, 0, 1, 2, 3];
    let rows = [0u8, 0, 1, 2, 1, /* row 2 */ 0, 2, 2, 0, 1];
    let bytes = png_by_hand(4, 2, 8, 3, Some(&plte), Some(&[255, 255, 0]), &rows);
    let cfg = identity_cfg(4);
    let cfg = ImageConfig {
        resize: Resize::Exact,
        ..cfg
    };
    // Exact 4x2 -> 4x4 is a resize; check the colours on a 4x4 palette image instead for exactness.
    assert_eq!(image_dims(&bytes, "pal", &cfg).unwrap(), (4, 2));
    let rows4 = [0u8, 0, 1, 2, 1, 0, 2, 2, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1];
    let bytes = png_by_hand(4, 4, 8, 3, Some(&plte), Some(&[255, 255, 0]), &rows4);
    let p = decode_image(&bytes, "pal", &cfg).unwrap();
    let idx: Vec<usize> = rows4
        .chunks(5)
        .flat_map(|r| r[1..].iter().map(|&i| usize::from(i)))
        .collect();
    let colours = [[255u8, 0, 0], [0, 128, 0], [255, 255, 255]];
    let want: Vec<u8> = idx.iter().flat_map(|&i| colours[i]).collect();
    assert_normalized(&p, &want, &cfg);
}

// ---------------------------------------------------------------------------------------------------------------
// Geometry.

#[test]
fn shortest_edge_dims_match_hf() {
    // transformers: short -> size, long -> int(size * long / short).
    assert_eq!(shortest_edge_dims(640, 480, 224), (298, 224));
    assert_eq!(shortest_edge_dims(480, 640, 224), (224, 298));
    assert_eq!(shortest_edge_dims(100, 100, 224), (224, 224));
    assert_eq!(shortest_edge_dims(50, 30, 336), (560, 336));
    assert_eq!(shortest_edge_dims(1, 65535, 384), (384, 384 * 65535));
}

#[test]
fn center_crop_takes_the_middle_window() {
    // Short side == size, so the resize is the identity and the crop is visible exactly.
    let crop = |img: &ImageBuffer<Rgb<u8>, Vec<u8>>, x0: u32, y0: u32| -> Vec<u8> {
        (y0..y0 + 8)
            .flat_map(|y| (x0..x0 + 8).flat_map(move |x| img.get_pixel(x, y).0))
            .collect()
    };
    let cfg = ImageConfig::clip(8);
    // Landscape 21x8 -> columns 6..14 ((21 - 8) / 2 = 6, floored as HF's center_crop).
    let img = pattern_rgb(21, 8);
    let p = decode_image(
        &encode(&DynamicImage::ImageRgb8(img.clone()), ImageFormat::Png),
        "l",
        &cfg,
    )
    .unwrap();
    assert_normalized(&p, &crop(&img, 6, 0), &cfg);
    // Portrait 8x19 -> rows 5..13.
    let img = pattern_rgb(8, 19);
    let p = decode_image(
        &encode(&DynamicImage::ImageRgb8(img.clone()), ImageFormat::Png),
        "p",
        &cfg,
    )
    .unwrap();
    assert_normalized(&p, &crop(&img, 0, 5), &cfg);
}

#[test]
fn resizing_preserves_constant_and_separable_structure() {
    // A uniform image stays uniform (filters sum to one), for down- and upscaling, both filters, both modes,
    // non-square inputs; a vertical gradient stays constant along rows.
    for (w, h) in [(640u32, 480u32), (17, 40), (5, 3), (1, 1), (300, 7)] {
        for filter in [Filter::Bicubic, Filter::Bilinear] {
            for resize in [Resize::ShortestEdgeCrop, Resize::Exact] {
                let cfg = ImageConfig {
                    filter,
                    resize,
                    ..ImageConfig::clip(24)
                };
                let flat = ImageBuffer::from_pixel(w, h, Rgb([200u8, 13, 77]));
                let p = preprocess_rgb8(flat.into_raw(), w, h, "flat", &cfg).unwrap();
                assert_eq!((p.c, p.h, p.w, p.data.len()), (3, 24, 24, 3 * 24 * 24));
                for (c, v) in [200u8, 13, 77].into_iter().enumerate() {
                    assert!(
                        p.data[c * 576..(c + 1) * 576]
                            .iter()
                            .all(|&x| x == norm(v, c, &cfg)),
                        "{w}x{h} {cfg:?}"
                    );
                }
                let grad = ImageBuffer::from_fn(w, h, |_, y| Rgb([(y * 255 / h.max(2)) as u8; 3]));
                let p = preprocess_rgb8(grad.into_raw(), w, h, "grad", &cfg).unwrap();
                for y in 0..24 {
                    assert!(
                        (0..24).all(|x| px(&p, 0, y, x) == px(&p, 0, y, 0)),
                        "{w}x{h} {cfg:?} row {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn upscaling_small_images_interpolates() {
    // 2x1 black|white upscaled to 8 (shortest edge 1 -> 8, long 16, crop the middle 8 columns: 4..12):
    // monotone non-decreasing left to right, symmetric around the middle.
    let img = ImageBuffer::from_fn(2, 1, |x, _| Rgb([(x * 255) as u8; 3]));
    let cfg = ImageConfig {
        filter: Filter::Bilinear,
        ..ImageConfig::clip(8)
    };
    let p = preprocess_rgb8(img.into_raw(), 2, 1, "tiny", &cfg).unwrap();
    let row: Vec<f32> = (0..8).map(|x| px(&p, 0, 3, x)).collect();
    assert!(row.windows(2).all(|w| w[0] <= w[1]), "{row:?}");
    assert!(row[0] > norm(0, 0, &cfg) - 1e-6 && row[7] < norm(255, 0, &cfg) + 1e-6);
    let lo = norm(0, 0, &cfg);
    let hi = norm(255, 0, &cfg);
    for x in 0..4 {
        assert!(
            ((row[x] - lo) - (hi - row[7 - x])).abs() < 2.0 / (255.0 * CLIP_STD[0]),
            "{row:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Config.

#[test]
fn config_serde_and_validation() {
    let cfg: ImageConfig = serde_json::from_str(
        r#"{"size": 384, "resize": "exact", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}"#,
    )
    .unwrap();
    assert_eq!(cfg, ImageConfig::siglip(384));
    let clip = ImageConfig::clip(336);
    assert_eq!(
        serde_json::from_str::<ImageConfig>(&serde_json::to_string(&clip).unwrap()).unwrap(),
        clip
    );
    let unknown =
        r#"{"size": 224, "resize": "exact", "mean": [0,0,0], "std": [1,1,1], "interp": "x"}"#;
    assert!(serde_json::from_str::<ImageConfig>(unknown).is_err());

    let png = small_png();
    for (bad, key) in [
        (
            ImageConfig {
                size: 0,
                ..clip.clone()
            },
            "size",
        ),
        (
            ImageConfig {
                std: [0.5, 0.0, 0.5],
                ..clip.clone()
            },
            "std",
        ),
        (
            ImageConfig {
                mean: [f32::NAN, 0.0, 0.0],
                ..clip.clone()
            },
            "mean",
        ),
        (
            ImageConfig {
                max_pixels: 0,
                ..clip.clone()
            },
            "max_pixels",
        ),
    ] {
        let err = decode_image(&png, "x", &bad).unwrap_err();
        assert!(
            matches!(&err, ImageError::Config(m) if m.starts_with(key)),
            "{err}"
        );
    }
}

#[test]
fn decoding_is_deterministic() {
    let bytes = encode(
        &DynamicImage::ImageRgb8(pattern_rgb(97, 61)),
        ImageFormat::Jpeg,
    );
    let cfg = ImageConfig::clip(32);
    let a = decode_image(&bytes, "d", &cfg).unwrap();
    let b = decode_image(&bytes, "d", &cfg).unwrap();
    assert!(
        a.data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );
}
