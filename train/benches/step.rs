//! Step time of a whole MLLM training step on CPU (encoders, projectors, LLM, loss,
//! backward, clipping, AdamW), side by side with the same step in PyTorch eager
//! (tools/bench_train_step.py) when BRAID_BENCH_PYTHON is set.
//!
//! cargo bench -p braid-train --bench step
//! BRAID_BENCH_PYTHON=/path/to/python cargo bench -p braid-train --bench step
//!   env BRAID_BENCH_THREADS (default 2: rayon's global pool here, torch.set_num_threads there),
//!       BRAID_BENCH_CONFIG (default configs/demo.toml: its [model.*] sections),
//!       BRAID_BENCH_SET (`;`-separated `--set` overrides, e.g. "model.llm.layers=8"),
//!       BRAID_BENCH_SIZE=big (a larger tiny MLLM: LLM C=512 x 8 layers, vocab 8192, encoders
//!       D=192 x 4 layers; applied before BRAID_BENCH_SET),
//!       BRAID_BENCH_ROWS (8), _SEQ (512), _SAMPLES (5 per row), _IMAGES (20), _CLIPS (20),
//!       _FRAMES (100 mel frames per clip), _MICROBATCHES (2), _STEPS (20), _WARMUP (3),
//!       BRAID_BENCH_TEXT_ONLY=1 (no images or clips: the LLM alone),
//!       BRAID_BENCH_PARTS (10: repetitions of the per-module timing after the steps; 0 = off),
//!       BRAID_BENCH_DEVICE (cpu; `cuda` runs Braid's side on GPU 0, each phase timed to
//!       the end of its kernels; tools/gpu/check.sh runs it for the 1B LLM).
//!
//! The batch: ROWS rows of SAMPLES samples of L = SEQ / SAMPLES tokens (510 tokens a row for
//! 512 / 5); media item k (the images, then the clips) goes to sample k % (ROWS * SAMPLES)
//! and fills consecutive placeholder tokens from the sample's second token on. The rows are
//! split into MICROBATCHES groups as the demo's trainer does (8 rows = 2 x 4), each one
//! packed `MllmBatch` (its rows back to back, `SeqInfo::packed` of the samples). The Python
//! side lays out the same tokens as (ROWS * SAMPLES, L) causal sequences.
//!
//! One timed step mirrors `Trainer::step` (train/src/trainer.rs) minus the data loading:
//! zero_grads, forward_normalized + backward per microbatch (loss / the step's target
//! count), grad_norm + clip_factor/scale_grads (max 1.0), AdamW (lr 1e-3, wd 0.05 on
//! matrices, betas 0.9/0.95). Medians and minimums over the timed steps. Then, to show where
//! the time goes, each big module's forward and backward alone (`time_parts`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The allocator the `braid` binary uses (see cli/src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use braid_kernels::rng::Rng;
use braid_kernels::{Device, Tensor};
use braid_llm::{IGNORE_INDEX, cross_entropy_loss, next_token_targets};
use braid_nn::{Init, Module, SeqInfo};
use braid_train::data::split_even;
use braid_train::optim::{AdamW, OptimConfig, clip_factor, grad_norm, scale_grads};
use braid_train::{Mllm, MllmBatch, MllmConfig, RunConfig};

/// `--set` overrides of BRAID_BENCH_SIZE=big. Vocabulary 8192 so that the output layer
/// weighs what it does in a real model (the byte vocabulary of the demo makes it free).
const BIG: &[&str] = &[
    "model.llm.vocab=8192",
    "model.llm.hidden=512",
    "model.llm.intermediate=1408",
    "model.llm.layers=8",
    "model.llm.heads=8",
    "model.llm.kv_heads=4",
    "model.llm.head_dim=64",
    "model.llm.max_position_embeddings=1024",
    "model.vision.hidden_size=192",
    "model.vision.intermediate_size=768",
    "model.vision.num_layers=4",
    "model.vision.num_heads=4",
    "model.audio.d_model=192",
    "model.audio.encoder_layers=4",
    "model.audio.encoder_ffn_dim=768",
    "model.projector.vision.in_dim=192",
    "model.projector.vision.out_dim=512",
    "model.projector.audio.in_dim=192",
    "model.projector.audio.out_dim=512",
];

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The step's shapes; the same flags go to the Python side.
#[derive(Debug)]
struct Shape {
    rows: usize,
    seq: usize,
    samples: usize,
    images: usize,
    clips: usize,
    frames: usize,
    microbatches: usize,
    steps: usize,
    warmup: usize,
    text_only: bool,
    /// Repetitions of the per-module timing (0: none).
    parts: usize,
}

impl Shape {
    fn from_env() -> Self {
        Shape {
            rows: env_usize("BRAID_BENCH_ROWS", 8),
            seq: env_usize("BRAID_BENCH_SEQ", 512),
            samples: env_usize("BRAID_BENCH_SAMPLES", 5),
            images: env_usize("BRAID_BENCH_IMAGES", 20),
            clips: env_usize("BRAID_BENCH_CLIPS", 20),
            frames: env_usize("BRAID_BENCH_FRAMES", 100),
            microbatches: env_usize("BRAID_BENCH_MICROBATCHES", 2),
            steps: env_usize("BRAID_BENCH_STEPS", 20).max(1),
            warmup: env_usize("BRAID_BENCH_WARMUP", 3),
            text_only: env_usize("BRAID_BENCH_TEXT_ONLY", 0) != 0,
            parts: env_usize("BRAID_BENCH_PARTS", 10),
        }
    }

    /// Tokens per sample.
    fn sample_len(&self) -> usize {
        self.seq / self.samples
    }

    fn python_args(&self) -> Vec<String> {
        let mut a: Vec<String> = [
            ("--rows", self.rows),
            ("--seq", self.seq),
            ("--samples-per-row", self.samples),
            ("--images", self.images),
            ("--clips", self.clips),
            ("--frames", self.frames),
            ("--microbatches", self.microbatches),
            ("--steps", self.steps),
            ("--warmup", self.warmup),
            ("--parts", self.parts),
        ]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect();
        if self.text_only {
            a.push("--text-only".into());
        }
        a
    }
}

/// Placeholder positions of every image and clip as (sample, global token positions):
/// item k goes to sample k % samples, after the items already there (tools/bench_train_step.py
/// `layout` is the same rule).
type Placed = Vec<(usize, Vec<u32>)>;

fn layout(sh: &Shape, tok_img: usize, tok_clip: usize) -> (Placed, Placed) {
    let n_samples = sh.rows * sh.samples;
    let l = sh.sample_len();
    let mut fill = vec![1usize; n_samples]; // token 0 of each sample stays text
    let (mut img, mut clip) = (Vec::new(), Vec::new());
    for k in 0..sh.images + sh.clips {
        let s = k % n_samples;
        let n = if k < sh.images { tok_img } else { tok_clip };
        assert!(
            fill[s] + n <= l,
            "sample {s} of {l} tokens cannot hold its media ({} tokens)",
            fill[s] + n
        );
        let start = s * l + fill[s];
        let pos: Vec<u32> = (start..start + n).map(|p| p as u32).collect();
        fill[s] += n;
        if k < sh.images {
            img.push((s, pos));
        } else {
            clip.push((s, pos));
        }
    }
    (img, clip)
}

/// The device Braid's side runs on: BRAID_BENCH_DEVICE = cpu (default) or cuda.
fn bench_device() -> Device {
    match std::env::var("BRAID_BENCH_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(0),
        Ok("cpu") | Err(_) => Device::Cpu,
        Ok(other) => panic!("BRAID_BENCH_DEVICE={other}: expected cpu or cuda"),
    }
}

/// One packed `MllmBatch` per microbatch, laid out as the module doc says.
fn make_batches(config: &MllmConfig, sh: &Shape, seed: u64) -> Vec<MllmBatch> {
    let dev = bench_device();
    let mut rng = Rng::new(seed);
    let l = sh.sample_len();
    let n_samples = sh.rows * sh.samples;
    let vocab = config.llm.vocab;
    let tok_img = config.tokens_per_image().unwrap_or(0);
    let tok_clip = config.tokens_per_clip(sh.frames).unwrap_or(0);
    let (img, clip) = if sh.text_only {
        (Vec::new(), Vec::new())
    } else {
        layout(sh, tok_img, tok_clip)
    };
    let mut ids = rng.index_vec(n_samples * l, vocab.min(256) as u32); // (N*L)
    for (_, pos) in img.iter().chain(&clip) {
        for &p in pos {
            ids[p as usize] = (vocab - 1) as u32; // placeholder: its embedding is replaced
        }
    }
    let (c, hw, n_mels) = match (&config.vision, &config.audio) {
        (Some(v), Some(a)) => (v.num_channels, v.image_size, a.num_mel_bins),
        _ => panic!("the bench needs a vision and an audio encoder in the config"),
    };
    split_even(sh.rows, sh.microbatches)
        .into_iter()
        .map(|r| {
            let (s0, s1) = (r.start * sh.samples, r.end * sh.samples);
            let base = (s0 * l) as u32;
            let mine = |items: &Placed| -> Vec<Vec<u32>> {
                items
                    .iter()
                    .filter(|(s, _)| (s0..s1).contains(s))
                    .map(|(_, p)| p.iter().map(|&q| q - base).collect())
                    .collect()
            };
            let (image_positions, clip_positions) = (mine(&img), mine(&clip));
            let mb_ids = ids[s0 * l..s1 * l].to_vec();
            let seq = SeqInfo::packed(&vec![l; s1 - s0]);
            let targets = next_token_targets(&mb_ids, &seq, None).unwrap();
            let b_img = image_positions.len();
            let images = (b_img > 0).then(|| {
                let px = rng.normal_vec(b_img * c * hw * hw, 1.0);
                Tensor::from_vec(px, [b_img, c, hw, hw], dev).unwrap()
            });
            let clips = (0..clip_positions.len())
                .map(|_| {
                    let mel = rng.normal_vec(n_mels * sh.frames, 1.0);
                    Tensor::from_vec(mel, [n_mels, sh.frames], dev).unwrap() // (n_mels, F)
                })
                .collect();
            let n = mb_ids.len();
            MllmBatch {
                ids: Tensor::from_vec_u32(mb_ids, [n], dev).unwrap(),
                seq,
                targets,
                images,
                image_positions,
                clips,
                clip_positions,
            }
        })
        .collect()
}

/// What tools/bench_train_step.py reported.
struct Torch {
    median: f64,
    min: f64,
    phases: Vec<f64>,
    /// (module, fwd s, bwd s)
    parts: Vec<(String, f64, f64)>,
}

/// Per-step seconds of each phase: zero_grads, forward, backward, clip, AdamW.
type Phases = [f64; 5];

fn step(
    model: &mut Mllm,
    optim: &mut AdamW,
    batches: &[MllmBatch],
    targets: usize,
) -> (Phases, f64, f64) {
    // On a GPU each phase is timed to the end of its kernels.
    let sync = || bench_device().synchronize().unwrap();
    let t0 = Instant::now();
    model.zero_grads().unwrap();
    sync();
    let t1 = Instant::now();
    let (mut fwd, mut bwd, mut loss_sum) = (0.0, 0.0, 0.0);
    for mb in batches {
        let f0 = Instant::now();
        let (loss, cache) = model.forward_normalized(mb, Some(targets)).unwrap();
        let f1 = Instant::now();
        model.backward(cache).unwrap();
        sync();
        fwd += (f1 - f0).as_secs_f64();
        bwd += f1.elapsed().as_secs_f64();
        loss_sum += loss.loss_sum;
    }
    let t2 = Instant::now();
    let norm = grad_norm(model).unwrap();
    if let Some(f) = clip_factor(norm, optim.config.clip_grad) {
        scale_grads(model, f).unwrap();
    }
    let t3 = Instant::now();
    let lr = optim.config.lr;
    optim.update(model, lr).unwrap();
    sync();
    let t4 = Instant::now();
    let ph = [
        (t1 - t0).as_secs_f64(),
        fwd,
        bwd,
        (t3 - t2).as_secs_f64(),
        (t4 - t3).as_secs_f64(),
    ];
    (ph, loss_sum / targets as f64, norm)
}

/// Forward and backward seconds of each big module alone, summed over the microbatches
/// (median of `reps` after one warm-up; `zero_grads` before each, untimed): the vision and
/// audio encoders (backward from a random output grad, generated untimed) and the LLM on
/// the token ids with its loss. tools/bench_train_step.py `time_parts` does the same.
fn time_parts(
    model: &mut Mllm,
    batches: &[MllmBatch],
    targets: usize,
    reps: usize,
) -> Vec<(&'static str, f64, f64)> {
    let mut rng = Rng::new(7);
    let mut out = Vec::new();
    for name in ["vision", "audio", "llm"] {
        let (mut fw, mut bw) = (Vec::new(), Vec::new());
        for _ in 0..=reps {
            model.zero_grads().unwrap();
            let (mut f, mut b) = (0.0, 0.0);
            for mb in batches {
                let t0 = Instant::now();
                match name {
                    "vision" => {
                        let (Some(px), Some(enc)) = (&mb.images, model.vision.as_mut()) else {
                            continue;
                        };
                        let (y, cache) = enc.forward(px).unwrap();
                        f += t0.elapsed().as_secs_f64();
                        let y = y.last_hidden_state; // (B, S, D)
                        let dy = Tensor::from_vec(
                            rng.normal_vec(y.elem_count(), 1.0),
                            y.shape().clone(),
                            bench_device(),
                        )
                        .unwrap();
                        let t1 = Instant::now();
                        enc.backward(cache, &dy, None).unwrap();
                        b += t1.elapsed().as_secs_f64();
                    }
                    "audio" => {
                        let Some(enc) = model.audio.as_mut() else {
                            continue;
                        };
                        if mb.clips.is_empty() {
                            continue;
                        }
                        let (y, cache) = enc.forward(&mb.clips).unwrap();
                        f += t0.elapsed().as_secs_f64();
                        let y = y.hidden; // (T_a, D)
                        let dy = Tensor::from_vec(
                            rng.normal_vec(y.elem_count(), 1.0),
                            y.shape().clone(),
                            bench_device(),
                        )
                        .unwrap();
                        let t1 = Instant::now();
                        enc.backward(cache, &dy).unwrap();
                        b += t1.elapsed().as_secs_f64();
                    }
                    _ => {
                        let (logits, cache) = model.llm.forward(&mb.ids, &mb.seq, None).unwrap(); // (T, V)
                        let loss = cross_entropy_loss(&logits, &mb.targets, Some(targets)).unwrap();
                        drop(logits);
                        f += t0.elapsed().as_secs_f64();
                        let t1 = Instant::now();
                        model.llm.backward(cache, &loss.dlogits).unwrap();
                        b += t1.elapsed().as_secs_f64();
                    }
                }
            }
            fw.push(f);
            bw.push(b);
        }
        out.push((name, median(fw[1..].to_vec()), median(bw[1..].to_vec())));
    }
    model.zero_grads().unwrap();
    out
}

/// Runs tools/bench_train_step.py on the same shapes; None when it failed (its output is
/// printed).
fn run_python(
    python: &str,
    config: &PathBuf,
    sets: &[String],
    sh: &Shape,
    threads: usize,
) -> Option<Torch> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/bench_train_step.py");
    let mut cmd = Command::new(python);
    cmd.arg(&script).arg("--config").arg(config);
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.args(sh.python_args())
        .arg("--threads")
        .arg(threads.to_string());
    let out = cmd.output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        println!(
            "python bench failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let (mut result, mut phases, mut parts) = (None, Vec::new(), Vec::new());
    for line in stdout.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| {
            f.get(i)
                .and_then(|x| x.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        match f.first().copied() {
            // RESULT torch <median_s> <min_s>
            Some("RESULT") => result = Some((num(2), num(3))),
            // PHASES torch <zero> <fwd> <bwd> <clip> <optim>
            Some("PHASES") => phases = (2..f.len()).map(num).collect(),
            // PART torch <module> <fwd_s> <bwd_s>
            Some("PART") => parts.push((f.get(2).unwrap_or(&"?").to_string(), num(3), num(4))),
            _ => println!("  {line}"),
        }
    }
    result.map(|(median, min)| Torch {
        median,
        min,
        phases,
        parts,
    })
}

fn main() {
    // Before anything touches rayon: every Braid kernel splits its work over this pool.
    let threads = env_usize("BRAID_BENCH_THREADS", 2).max(1);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();

    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let config_path = std::env::var("BRAID_BENCH_CONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("configs/demo.toml"));
    let mut sets: Vec<String> = Vec::new();
    if std::env::var("BRAID_BENCH_SIZE").as_deref() == Ok("big") {
        sets.extend(BIG.iter().map(|s| s.to_string()));
    }
    if let Ok(extra) = std::env::var("BRAID_BENCH_SET") {
        sets.extend(
            extra
                .split(';')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
    }
    let sh = Shape::from_env();

    let cfg = RunConfig::from_file(&config_path, &sets).unwrap();
    let config = braid_train::assemble::model_config(&cfg).unwrap();
    let init = Init::new(cfg.run.seed, bench_device()).with_std(cfg.model.init_std);
    let mut model = Mllm::new(config, &init).unwrap();
    // `train.precision` as the trainer resolves it, for the bench's device: bf16 mixed
    // precision on CUDA unless the config says otherwise.
    let precision = cfg.train.precision.unwrap_or(match bench_device() {
        Device::Cuda(_) => braid_train::config::Precision::Bf16,
        Device::Cpu => braid_train::config::Precision::F32,
    });
    model.set_compute_dtype(precision.compute_dtype()).unwrap();
    println!("precision {}", precision.name());
    let batches = make_batches(&model.config, &sh, cfg.run.seed);
    let targets: usize = batches
        .iter()
        .map(|b| b.targets.iter().filter(|&&t| t != IGNORE_INDEX).count())
        .sum();
    let mut optim = AdamW::new(
        OptimConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.05,
            clip_grad: 1.0,
            ..OptimConfig::default()
        },
        &model,
    )
    .unwrap();
    let (params, trainable) = braid_train::assemble::param_counts(&model);

    println!(
        "config {} {:?}\nshape {sh:?}\nbraid: threads {threads}, {params} params ({trainable} trainable), {} microbatches, {} x {} tokens, {} images, {} clips, {targets} targets",
        config_path.display(),
        sets,
        batches.len(),
        sh.rows * sh.samples,
        sh.sample_len(),
        batches.iter().map(MllmBatch::num_images).sum::<usize>(),
        batches.iter().map(|b| b.clips.len()).sum::<usize>(),
    );
    let mut phases: Vec<Phases> = Vec::new();
    for i in 0..sh.warmup + sh.steps {
        let (ph, loss, norm) = step(&mut model, &mut optim, &batches, targets.max(1));
        let tag = if i < sh.warmup { "warmup" } else { "step" };
        println!(
            "{tag} {i:3}: {:.4} s (fwd {:.4} bwd {:.4} clip {:.4} optim {:.4})  loss {loss:.4} grad_norm {norm:.3}",
            ph.iter().sum::<f64>(),
            ph[1],
            ph[2],
            ph[3],
            ph[4]
        );
        if i >= sh.warmup {
            phases.push(ph);
        }
    }
    let totals: Vec<f64> = phases.iter().map(|p| p.iter().sum()).collect();
    let ours = median(totals.clone());
    let ours_min = min(&totals);
    let ours_ph: Vec<f64> = (0..5)
        .map(|k| median(phases.iter().map(|p| p[k]).collect()))
        .collect();
    let ours_parts = if sh.parts > 0 {
        time_parts(&mut model, &batches, targets.max(1), sh.parts)
    } else {
        Vec::new()
    };

    let theirs = match std::env::var("BRAID_BENCH_PYTHON") {
        Ok(python) => {
            println!("--- PyTorch eager (tools/bench_train_step.py) ---");
            run_python(&python, &config_path, &sets, &sh, threads)
        }
        Err(_) => {
            println!(
                "(set BRAID_BENCH_PYTHON=/path/to/python to run tools/bench_train_step.py alongside)"
            );
            None
        }
    };

    println!(
        "\n{:<8} {:>10} {:>10}   median per phase (s): zero / fwd / bwd / clip / optim",
        "", "median s", "min s"
    );
    let fmt_ph = |p: &[f64]| {
        p.iter()
            .map(|x| format!("{x:.4}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "{:<8} {ours:>10.4} {ours_min:>10.4}   {}",
        "braid",
        fmt_ph(&ours_ph)
    );
    if let Some(t) = &theirs {
        println!(
            "{:<8} {:>10.4} {:>10.4}   {}",
            "torch",
            t.median,
            t.min,
            fmt_ph(&t.phases)
        );
        println!(
            "ratio torch / braid: median step {:.2}x, min step {:.2}x  (> 1: Braid is faster)",
            t.median / ours,
            t.min / ours_min
        );
    }
    if !ours_parts.is_empty() {
        println!(
            "\nmodule alone, summed over microbatches (median s): braid fwd / bwd | torch fwd / bwd"
        );
        for (name, f, b) in &ours_parts {
            let tp = theirs
                .as_ref()
                .and_then(|t| t.parts.iter().find(|p| p.0 == *name));
            let tcol = tp.map_or(String::new(), |(_, tf, tb)| format!(" | {tf:.4} / {tb:.4}"));
            println!("{name:<8} {f:.4} / {b:.4}{tcol}");
        }
    }
}
