//! Audio preprocessing throughput on ONE core: decode (WAV, 16-bit, 44.1 kHz stereo, 10 s) ->
//! mono -> resample to 16 kHz -> 80-bin Whisper log-mel, per clip, as the loader's workers do.
//!
//! cargo bench -p braid-dataloader --bench audio
//!   env BRAID_AUDIO_BENCH_CLIPS (default 16), BRAID_AUDIO_BENCH_REPEATS (default 5),
//!   BRAID_AUDIO_BENCH_DIR (default target/audio-bench: the generated WAVs, kept for Python),
//!   BRAID_BENCH_PYTHON (an interpreter with numpy, soundfile, librosa or scipy, transformers):
//!   when set, runs tools/bench_audio_py.py on the same files and prints the ratio.
//!
//! Everything runs on the calling thread (symphonia, rubato and realfft are single-threaded),
//! so the figures are per core. Reported: medians over the repeats, of wall time and of this
//! thread's CPU time (from /proc/thread-self/schedstat; Python reports its process CPU time):
//! on a machine shared with other jobs the CPU-time figures are the comparable ones.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use braid_dataloader::media::audio::{AudioConfig, AudioDecoder};
use braid_dataloader::media::mel::MelExtractor;

mod support;

use support::{RATE, SECONDS, make_wav};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This thread's CPU time in seconds (Linux schedstat, ns resolution); None elsewhere.
fn thread_cpu_s() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(ns as f64 * 1e-9)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes --bench; a plain `cargo test --benches` passes nothing useful either.
    let n_clips = env_usize("BRAID_AUDIO_BENCH_CLIPS", 16).max(1);
    let repeats = env_usize("BRAID_AUDIO_BENCH_REPEATS", 5).max(1);
    let dir = std::env::var("BRAID_AUDIO_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/audio-bench"));
    std::fs::create_dir_all(&dir)?;
    let mut files = Vec::new();
    for i in 0..n_clips {
        let path = dir.join(format!("clip_{i:03}.wav"));
        let bytes = make_wav(i as u64);
        if std::fs::read(&path).ok().as_deref() != Some(&bytes[..]) {
            std::fs::write(&path, &bytes)?;
        }
        files.push((path, bytes));
    }
    let audio_s = (n_clips * SECONDS) as f64;
    println!(
        "audio bench: {n_clips} clips x {SECONDS} s, {RATE} Hz stereo 16-bit WAV -> 16 kHz mono -> 80-bin log-mel, 1 thread, median of {repeats}"
    );

    let mut dec = AudioDecoder::new(AudioConfig::default())?;
    let mut mel = MelExtractor::new(80)?;
    let mut out = Vec::new();
    // Warm-up: plans, caches, page faults.
    for (path, bytes) in files.iter().take(2) {
        let pcm = dec.decode(bytes, &path.to_string_lossy())?;
        mel.compute_into(&pcm, &mut out)?;
    }
    let (mut t_total, mut t_decode, mut t_mel) = (Vec::new(), Vec::new(), Vec::new());
    let mut t_cpu = Vec::new();
    let mut checksum = 0.0f64;
    for _ in 0..repeats {
        let (mut d, mut m) = (0.0, 0.0);
        let start = Instant::now();
        let cpu0 = thread_cpu_s();
        for (path, bytes) in &files {
            let t0 = Instant::now();
            let pcm = dec.decode(bytes, &path.to_string_lossy())?;
            let t1 = Instant::now();
            let frames = mel.compute_into(&pcm, &mut out)?;
            let t2 = Instant::now();
            d += (t1 - t0).as_secs_f64();
            m += (t2 - t1).as_secs_f64();
            checksum += out.first().copied().unwrap_or(0.0) as f64 + frames as f64;
        }
        t_total.push(start.elapsed().as_secs_f64());
        if let (Some(a), Some(b)) = (cpu0, thread_cpu_s()) {
            t_cpu.push(b - a);
        }
        t_decode.push(d);
        t_mel.push(m);
    }
    let total = median(t_total);
    let rust_clips_s = n_clips as f64 / total;
    println!(
        "rust wall: {:8.1} clips/s  {:8.1} audio-s/s  ({:.2} ms/clip: decode+resample {:.2} ms, log-mel {:.2} ms)  [checksum {checksum:.1}]",
        rust_clips_s,
        audio_s / total,
        1e3 * total / n_clips as f64,
        1e3 * median(t_decode) / n_clips as f64,
        1e3 * median(t_mel) / n_clips as f64,
    );
    let rust_cpu_clips_s = if t_cpu.is_empty() {
        None
    } else {
        let cpu = median(t_cpu);
        println!(
            "rust cpu:  {:8.1} clips/s  {:8.1} audio-s/s  ({:.2} ms CPU/clip)",
            n_clips as f64 / cpu,
            audio_s / cpu,
            1e3 * cpu / n_clips as f64
        );
        Some(n_clips as f64 / cpu)
    };

    let Ok(python) = std::env::var("BRAID_BENCH_PYTHON") else {
        println!(
            "(set BRAID_BENCH_PYTHON=/path/to/python to run tools/bench_audio_py.py alongside)"
        );
        return Ok(());
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/bench_audio_py.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg(&dir)
        .arg("--clips")
        .arg(n_clips.to_string())
        .arg("--repeats")
        .arg(repeats.to_string())
        .env("OMP_NUM_THREADS", "1")
        .env("MKL_NUM_THREADS", "1")
        .env("OPENBLAS_NUM_THREADS", "1")
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        println!(
            "python bench failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        return Ok(());
    }
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("RESULT ") {
            // RESULT <pipeline> <wall clips/s> <cpu clips/s>
            let v: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| v.get(i).and_then(|x| x.parse::<f64>().ok());
            if let (Some(name), Some(wall), Some(cpu)) = (v.first(), num(1), num(2)) {
                let cpu_ratio =
                    rust_cpu_clips_s.map_or("n/a".to_string(), |r| format!("{:.1}x", r / cpu));
                println!(
                    "python {name:<26} wall {wall:7.1} clips/s, cpu {cpu:7.1} clips/s  -> rust is {:.1}x (wall), {cpu_ratio} (cpu)",
                    rust_clips_s / wall
                );
            }
        } else {
            println!("  {line}");
        }
    }
    Ok(())
}
