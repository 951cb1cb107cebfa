//! Pack throughput and the loader's per-core decode + preprocess throughput, from packed shards,
//! side by side with Python pipelines on the same data (tools/bench_loader_py.py).
//!
//! cargo bench -p braid-dataloader --bench loader
//!   env BRAID_LOADER_BENCH_IMAGES (default 200: 640x480 JPEG q90, CLIP 224),
//!       BRAID_LOADER_BENCH_CLIPS (default 32: 10 s 44.1 kHz stereo WAV, 80-bin log-mel),
//!       BRAID_LOADER_BENCH_REPS (default 5), BRAID_LOADER_BENCH_DIR (default target/bench-loader),
//!       BRAID_BENCH_PYTHON (numpy, pillow, pyarrow, soundfile, librosa, transformers): runs the
//!       Python side on the same files and shards and prints the ratios.
//!
//! "Per core" = items per CPU-second of the whole process (/proc/self/stat utime + stime), with
//! one decode worker: the loader's producer and consumer threads are counted too. Medians over
//! the repetitions (each a full epoch of a fresh loader).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use braid_dataloader::config::DataConfig;
use braid_dataloader::job::{PackJob, run_pack};
use braid_dataloader::loader::{Loader, LoaderConfig};
use braid_dataloader::read::Format;
use support::{make_wav, photo};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds of this process (user + system), from /proc/self/stat.
fn process_cpu_s() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i)
            .and_then(|x| x.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A JSONL manifest of `n` samples, each one media file and a short caption.
fn manifest(dir: &Path, name: &str, files: &[String], kind: &str) -> PathBuf {
    let lines: Vec<String> = files
        .iter()
        .enumerate()
        .map(|(i, f)| {
            serde_json::json!({"id": format!("{name}{i}"), "messages": [
                {"role": "user", "content": [{"type": kind, "path": f}, {"type": "text", "text": "Describe it."}]},
                {"role": "assistant", "content": [{"type": "text", "text": format!("item number {i}")}]}
            ]})
            .to_string()
        })
        .collect();
    let path = dir.join(format!("{name}.jsonl"));
    std::fs::write(&path, lines.join("\n") + "\n").expect("write manifest");
    path
}

fn pack(input: &Path, out: &Path) -> (f64, f64) {
    let mut cfg = DataConfig::default();
    cfg.shards.threads = 1;
    let job = PackJob {
        input: input.to_path_buf(),
        format: Format::Jsonl,
        output: out.to_path_buf(),
        config: cfg,
        overwrite: true,
    };
    let (t, c) = (Instant::now(), process_cpu_s());
    let info = run_pack(&job, &mut |_| {}).expect("pack");
    let (wall, cpu) = (t.elapsed().as_secs_f64(), process_cpu_s() - c);
    assert_eq!(info.rejected, 0);
    (
        info.packed_samples as f64 / wall,
        info.packed_samples as f64 / cpu,
    )
}

/// (items per wall second, items per CPU second) of one epoch, median over `reps`.
fn load(dir: &Path, reps: usize, audio: bool) -> (f64, f64) {
    let cfg = LoaderConfig {
        workers: 1,
        batch_rows: 1,
        prefetch: 2,
        ..LoaderConfig::default()
    };
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let (t, c) = (Instant::now(), process_cpu_s());
        let mut l = Loader::open(dir, &cfg, 0, 1, None).expect("open loader");
        let mut items = 0usize;
        let mut checksum = 0f64;
        for _ in 0..l.batches_per_epoch() {
            let b = l.next_batch().expect("batch");
            for r in &b.rows {
                items += if audio { r.audio.len() } else { r.images.len() };
                checksum += r.images.iter().map(|i| f64::from(i.pixels[7])).sum::<f64>();
                checksum += r.audio.iter().map(|a| f64::from(a.mel[7])).sum::<f64>();
            }
        }
        drop(l);
        wall.push(items as f64 / t.elapsed().as_secs_f64());
        cpu.push(items as f64 / (process_cpu_s() - c));
        assert!(checksum.is_finite());
    }
    (median(wall), median(cpu))
}

fn main() {
    let n_img = env_usize("BRAID_LOADER_BENCH_IMAGES", 200);
    let n_clip = env_usize("BRAID_LOADER_BENCH_CLIPS", 32);
    let reps = env_usize("BRAID_LOADER_BENCH_REPS", 5);
    let dir = std::env::var("BRAID_LOADER_BENCH_DIR").map_or_else(
        |_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-loader"),
        PathBuf::from,
    );
    std::fs::create_dir_all(dir.join("media")).expect("bench dir");
    let mut images = Vec::new();
    for i in 0..n_img {
        let rel = format!("media/img{i:04}.jpg");
        let path = dir.join(&rel);
        if !path.exists() {
            let mut bytes = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
                .encode_image(&photo(i as u64 + 1, 640, 480))
                .expect("encode");
            std::fs::write(&path, bytes).expect("write jpeg");
        }
        images.push(rel);
    }
    let mut clips = Vec::new();
    for i in 0..n_clip {
        let rel = format!("media/clip{i:03}.wav");
        let path = dir.join(&rel);
        if !path.exists() {
            std::fs::write(&path, make_wav(i as u64)).expect("write wav");
        }
        clips.push(rel);
    }
    let img_manifest = manifest(&dir, "images", &images, "image");
    let clip_manifest = manifest(&dir, "audio", &clips, "audio");
    println!(
        "loader bench: {} ({n_img} JPEG 640x480 -> CLIP 224; {n_clip} x 10 s 44.1 kHz stereo WAV -> 80-bin log-mel)",
        dir.display()
    );

    let (pw, pc) = pack(&img_manifest, &dir.join("packed-images"));
    println!("braid pack (1 thread), images: {pw:8.1} samples/s wall, {pc:8.1} samples/CPU-s");
    let (aw, ac) = pack(&clip_manifest, &dir.join("packed-audio"));
    println!("braid pack (1 thread), audio:  {aw:8.1} samples/s wall, {ac:8.1} samples/CPU-s");

    let (iw, ic) = load(&dir.join("packed-images"), reps, false);
    println!("braid loader (1 worker), images: {iw:8.1} img/s wall, {ic:8.1} img/CPU-s");
    let (cw, cc) = load(&dir.join("packed-audio"), reps, true);
    println!("braid loader (1 worker), audio:  {cw:8.1} clips/s wall, {cc:8.1} clips/CPU-s");
    println!("BRAID_LOADER images {ic:.3} audio {cc:.3}");

    let Ok(python) = std::env::var("BRAID_BENCH_PYTHON") else {
        println!(
            "(set BRAID_BENCH_PYTHON=/path/to/python to run tools/bench_loader_py.py alongside)"
        );
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/bench_loader_py.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(&dir)
        .arg("--reps")
        .arg(reps.to_string())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        println!(
            "python bench failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    for line in stdout.lines() {
        // RESULT <pipeline> <images|audio> <items per wall s> <items per CPU s>
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() == 5 && f[0] == "RESULT" {
            let cpu: f64 = f[4].parse().unwrap_or(f64::NAN);
            let ours = if f[2] == "images" { ic } else { cc };
            println!(
                "python {:<28} {:<6} {:>8} /s wall, {cpu:8.1} /CPU-s  -> braid loader is {:.1}x per core",
                f[1],
                f[2],
                f[3],
                ours / cpu
            );
        } else {
            println!("  {line}");
        }
    }
}
