//! Image preprocessing throughput on one core: decode + CLIP resize/crop + normalize of 640x480 JPEGs to 224x224.
//!
//! `cargo bench -p braid-dataloader --bench image -- [--dir DIR] [--n N] [--reps R]`
//! Writes N photo-like 640x480 JPEGs (quality 90, deterministic) to DIR (default: target/bench-images), prints the
//! path, then times `decode_image` over the in-memory bytes, R passes, median. Single-threaded by construction
//! (image is built without rayon, fast_image_resize without its rayon feature). tools/bench_image_py.py runs this
//! and the same pipeline in PIL + numpy on the same files and prints the ratio.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Instant;

use braid_dataloader::media::image::{ImageConfig, decode_image, preprocess_rgb8, to_rgb8};
mod support;

use support::photo;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = arg(&args, "--n").map_or(200, |s| s.parse().unwrap());
    let reps: usize = arg(&args, "--reps").map_or(5, |s| s.parse().unwrap());
    let dir = arg(&args, "--dir").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-images"),
        PathBuf::from,
    );
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::with_capacity(n);
    for i in 0..n {
        let path = dir.join(format!("img{i:04}.jpg"));
        if !path.exists() {
            let mut bytes = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
                .encode_image(&photo(i as u64 + 1, 640, 480))
                .unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        files.push(std::fs::read(&path).unwrap());
    }
    let mb = files.iter().map(Vec::len).sum::<usize>() as f64 / 1e6;
    println!(
        "images: {} ({n} x 640x480 JPEG q90, {mb:.1} MB)",
        dir.display()
    );

    let cfg = ImageConfig::clip(224);
    let mut checksum = 0f64;
    // Warm-up pass, then timed passes.
    for (i, b) in files.iter().enumerate() {
        checksum += f64::from(decode_image(b, &format!("img{i}"), &cfg).unwrap().data[0]);
    }
    let mut total = Vec::new();
    let mut decode = Vec::new();
    let mut resize = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        for b in &files {
            let p = decode_image(b, "img", &cfg).unwrap();
            checksum += f64::from(p.data[p.data.len() / 2]);
        }
        total.push(n as f64 / t.elapsed().as_secs_f64());
        // Split: decode to RGB8, then resize + crop + normalize.
        let (mut td, mut tr) = (0f64, 0f64);
        for b in &files {
            let t = Instant::now();
            let img = image::load_from_memory(b).unwrap();
            let (w, h) = (img.width(), img.height());
            let rgb = to_rgb8(img);
            td += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let p = preprocess_rgb8(rgb, w, h, "img", &cfg).unwrap();
            tr += t.elapsed().as_secs_f64();
            checksum += f64::from(p.data[0]);
        }
        decode.push(td * 1e3 / n as f64);
        resize.push(tr * 1e3 / n as f64);
    }
    let ips = median(total);
    println!(
        "braid decode+resize+normalize: {ips:.1} images/s/core ({:.3} ms/image)",
        1e3 / ips
    );
    println!(
        "  split: decode {:.3} ms/image, resize+crop+normalize {:.3} ms/image (medians of {reps} passes; checksum {checksum:.3})",
        median(decode),
        median(resize)
    );
    // Machine-readable line for tools/bench_image_py.py.
    println!("BRAID_IMAGES_PER_S {ips:.3}");
}
