//! Image decoding of hostile input: truncations, garbage, byte and pixel limits, and decompression
//! bombs rejected before any pixel buffer is allocated (checked with a tracking allocator).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use braid_dataloader::media::image::{
    ImageConfig, ImageError, decode_image, image_dims, preprocess_rgb8,
};
use image::{DynamicImage, ImageFormat};

use common::image_util::*;

// ---------------------------------------------------------------------------------------------------------------
// Largest single allocation made by the current thread: proves bomb headers are rejected before pixel buffers.

struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; only records sizes in a const-initialised thread local
// (no allocation, no re-entrancy).
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(layout.size())));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|m| m.set(m.get().max(new_size)));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

fn largest_alloc_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|m| m.set(0));
    let out = f();
    (out, LARGEST.with(|m| m.get()))
}

// ---------------------------------------------------------------------------------------------------------------
// Hostile input.

#[test]
fn every_truncation_is_an_error() {
    let cfg = ImageConfig::clip(8);
    let files = [
        ("png", small_png()),
        ("jpeg", small_jpeg()),
        (
            "bmp",
            encode(
                &DynamicImage::ImageRgb8(pattern_rgb(12, 9)),
                ImageFormat::Bmp,
            ),
        ),
        (
            "webp",
            encode(
                &DynamicImage::ImageRgb8(pattern_rgb(12, 9)),
                ImageFormat::WebP,
            ),
        ),
        (
            "gif",
            encode(
                &DynamicImage::ImageRgba8(DynamicImage::ImageRgb8(pattern_rgb(12, 9)).to_rgba8()),
                ImageFormat::Gif,
            ),
        ),
    ];
    for (kind, bytes) in files {
        let full = decode_image(&bytes, kind, &cfg).unwrap();
        // A prefix either fails or, when only pixel-free trailing bytes are missing (PNG's IEND, the GIF trailer
        // and LZW end code, a RIFF pad byte), decodes to exactly the full image; never a grey-padded partial one.
        for n in 0..bytes.len() {
            match decode_image(&bytes[..n], kind, &cfg) {
                Err(_) => {}
                Ok(p) => {
                    assert!(
                        n + 16 > bytes.len(),
                        "{kind}: prefix of {n}/{} bytes decoded",
                        bytes.len()
                    );
                    assert_eq!(
                        p.data,
                        full.data,
                        "{kind}: prefix of {n}/{} bytes decoded differently",
                        bytes.len()
                    );
                }
            }
        }
    }
}

#[test]
fn garbage_and_empty_are_errors() {
    let cfg = ImageConfig::clip(8);
    assert!(matches!(
        decode_image(&[], "empty.jpg", &cfg),
        Err(ImageError::Empty { .. })
    ));
    assert!(matches!(
        image_dims(&[], "empty.jpg", &cfg),
        Err(ImageError::Empty { .. })
    ));
    let mut state = 12345u64;
    for len in [1usize, 7, 64, 1000] {
        let junk: Vec<u8> = (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 56) as u8
            })
            .collect();
        assert!(matches!(
            decode_image(&junk, "junk", &cfg),
            Err(ImageError::UnknownFormat { .. })
        ));
    }
    // Valid magic, garbage body: a decode error naming the format and the input.
    let mut fake = small_png()[..16].to_vec();
    fake.extend_from_slice(&[0xAB; 64]);
    let err = decode_image(&fake, "shard-3/img-17.png", &cfg).unwrap_err();
    assert!(
        matches!(err, ImageError::Decode { format: "PNG", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("shard-3/img-17.png"), "{err}");
}

#[test]
fn other_formats_are_rejected_by_name() {
    let cfg = ImageConfig::clip(8);
    let tiff = b"II*\x00\x08\x00\x00\x00 rest of a tiff".to_vec();
    let err = decode_image(&tiff, "scan.tif", &cfg).unwrap_err();
    assert!(
        matches!(&err, ImageError::UnsupportedFormat { format, .. } if format == "Tiff"),
        "{err}"
    );
    let pdf = b"%PDF-1.7\n".to_vec();
    assert!(matches!(
        decode_image(&pdf, "doc.pdf", &cfg),
        Err(ImageError::UnknownFormat { .. })
    ));
}

#[test]
fn byte_limit() {
    let png = small_png();
    let cfg = ImageConfig {
        max_bytes: png.len() as u64 - 1,
        ..ImageConfig::clip(8)
    };
    assert!(matches!(
        decode_image(&png, "big", &cfg),
        Err(ImageError::TooManyBytes { .. })
    ));
    let cfg = ImageConfig {
        max_bytes: png.len() as u64,
        ..cfg
    };
    assert!(decode_image(&png, "ok", &cfg).is_ok());
}

#[test]
fn pixel_limit_is_exact() {
    let png = encode(
        &DynamicImage::ImageRgb8(pattern_rgb(100, 100)),
        ImageFormat::Png,
    );
    let cfg = ImageConfig {
        max_pixels: 9_999,
        ..ImageConfig::clip(8)
    };
    let err = decode_image(&png, "p", &cfg).unwrap_err();
    assert!(
        matches!(
            err,
            ImageError::TooManyPixels {
                w: 100,
                h: 100,
                pixels: 10_000,
                ..
            }
        ),
        "{err}"
    );
    assert!(image_dims(&png, "p", &cfg).is_err());
    let cfg = ImageConfig {
        max_pixels: 10_000,
        ..cfg
    };
    assert!(decode_image(&png, "p", &cfg).is_ok());
}

fn set_png_dims(png: &mut [u8], w: u32, h: u32) {
    // IHDR data starts at 16; its CRC covers type + data (bytes 12..29) and sits at 29.
    png[16..20].copy_from_slice(&w.to_be_bytes());
    png[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
}

/// Small real files whose headers are patched to claim huge sizes, per format.
fn bombs() -> Vec<(&'static str, Vec<u8>)> {
    let img = DynamicImage::ImageRgb8(pattern_rgb(16, 16));
    let mut png = encode(&img, ImageFormat::Png);
    set_png_dims(&mut png, 100_000, 100_000);

    // BMP: 100000 is refused by the decoder's own header check (soft limit 65535); 60000 gets to ours.
    let mut bmp_huge = encode(&img, ImageFormat::Bmp);
    bmp_huge[18..22].copy_from_slice(&100_000i32.to_le_bytes());
    bmp_huge[22..26].copy_from_slice(&100_000i32.to_le_bytes());
    let mut bmp = bmp_huge.clone();
    bmp[18..22].copy_from_slice(&60_000i32.to_le_bytes());
    bmp[22..26].copy_from_slice(&60_000i32.to_le_bytes());

    let mut jpeg = encode(&img, ImageFormat::Jpeg);
    let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
    // SOF0: marker, length (2), precision (1), height (2), width (2).
    jpeg[sof + 5..sof + 9].copy_from_slice(&[0xFD, 0xE8, 0xFD, 0xE8]); // 65000 x 65000

    let mut gif = encode(&DynamicImage::ImageRgba8(img.to_rgba8()), ImageFormat::Gif);
    gif[6..10].copy_from_slice(&[0xFF; 4]); // logical screen 65535 x 65535

    let mut webp = encode(&img, ImageFormat::WebP);
    let vp8l = webp.windows(4).position(|w| w == b"VP8L").unwrap();
    // VP8L: chunk size (4), signature 0x2f, then 14 bits width-1, 14 bits height-1.
    let at = vp8l + 9;
    let bits = u32::from_le_bytes([webp[at], webp[at + 1], webp[at + 2], webp[at + 3]]);
    // 16383 x 16383 (image-webp 0.2.4 computes (1 + field) & 0x3FFF, so 16384 would read as 0 x 0).
    let bits = (bits & 0xF000_0000) | (0x3FFE << 14) | 0x3FFE;
    webp[at..at + 4].copy_from_slice(&bits.to_le_bytes());

    vec![
        ("png", png),
        ("bmp", bmp),
        ("bmp_huge", bmp_huge),
        ("jpeg", jpeg),
        ("gif", gif),
        ("webp", webp),
    ]
}

#[test]
fn decompression_bombs_rejected_before_allocation() {
    let cfg = ImageConfig::clip(224);
    for (kind, bytes) in bombs() {
        let (dims, _) = largest_alloc_during(|| image_dims(&bytes, kind, &cfg));
        let (res, largest) = largest_alloc_during(|| decode_image(&bytes, kind, &cfg));
        let err = res.unwrap_err();
        // Ours (header dims over max_pixels) or the decoder's own header check; both before any pixel buffer.
        if kind == "bmp_huge" {
            assert!(
                matches!(err, ImageError::Decode { format: "BMP", .. }),
                "{kind}: {err}"
            );
        } else {
            assert!(
                matches!(err, ImageError::TooManyPixels { .. }),
                "{kind}: {err}"
            );
        }
        assert!(dims.is_err(), "{kind}: image_dims accepted the bomb");
        assert!(
            largest < 1 << 20,
            "{kind}: allocated {largest} bytes at once"
        );
        if kind == "png" {
            assert!(
                matches!(
                    err,
                    ImageError::TooManyPixels {
                        w: 100_000,
                        h: 100_000,
                        ..
                    }
                ),
                "{kind}: {err}"
            );
        }
    }
}

#[test]
fn zero_size_is_rejected() {
    let cfg = ImageConfig::clip(8);
    let mut png = small_png();
    set_png_dims(&mut png, 0, 9);
    assert!(decode_image(&png, "z", &cfg).is_err());
    assert!(image_dims(&png, "z", &cfg).is_err());
    let mut bmp = encode(
        &DynamicImage::ImageRgb8(pattern_rgb(4, 4)),
        ImageFormat::Bmp,
    );
    bmp[18..22].copy_from_slice(&0i32.to_le_bytes());
    assert!(decode_image(&bmp, "z", &cfg).is_err());
    assert!(matches!(
        preprocess_rgb8(vec![], 0, 5, "z", &cfg),
        Err(ImageError::ZeroSize { .. })
    ));
    assert!(matches!(
        preprocess_rgb8(vec![0; 5], 2, 2, "short", &cfg),
        Err(ImageError::Resize { .. })
    ));
}

/// A strip under `max_pixels` with a side over 65,535 pixels (1 x 60,000,000 once took 8 GB
/// to resize, its first pass keeping every row) is refused from its header, before any
/// pixel buffer, naming its size; long thin strips within the limit pass the header.
#[test]
fn sides_over_65535_pixels_are_refused_from_the_header() {
    let cfg = ImageConfig::siglip(32);
    for (w, h, refused) in [
        (1, 60_000_000, true),
        (60_000_000, 1, true),
        (1, 65_536, true),
        (65_535, 1, false),
        (1, 512, false),
    ] {
        let img = DynamicImage::ImageRgb8(pattern_rgb(16, 16));
        let mut png = encode(&img, ImageFormat::Png);
        set_png_dims(&mut png, w, h);
        let (res, largest) = largest_alloc_during(|| decode_image(&png, "strip", &cfg));
        match res {
            Err(ImageError::SideTooLong { w: ew, h: eh, .. }) => {
                assert!(refused, "{w}x{h} was refused");
                assert_eq!((ew, eh), (w, h));
                assert!(
                    largest < 1 << 20,
                    "{w}x{h}: allocated {largest} bytes at once"
                );
            }
            // Within the limit the header passes; the patched file's pixels then fail to
            // decode (they were written for 16 x 16), which is not this check.
            Err(e) => assert!(!refused, "{w}x{h}: {e}"),
            Ok(_) => assert!(!refused, "{w}x{h} decoded"),
        }
    }
    let e = ImageError::SideTooLong {
        name: "a.png".into(),
        format: "PNG",
        w: 1,
        h: 60_000_000,
    };
    assert_eq!(e.kind(), "side_too_long");
    assert!(e.to_string().contains("1x60000000"), "{e}");
}
