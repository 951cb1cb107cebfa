//! What the parallel and mixed-precision tests share: a packed demo dataset and a tiny
//! three-module run config (made once per test binary), and running it.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use braid_dataloader::demo::{DemoConfig, write_demo};
use braid_train::data::ensure_dataset;
use braid_train::metrics::read_metrics;
use braid_train::trainer::train;
use braid_train::{Quiet, RunConfig};

pub mod layouts;

/// A folder with a packed demo dataset and a tiny run config, made once per binary.
pub fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("braid-parallel-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let demo = DemoConfig {
            train: 48,
            heldout: 4,
            ..DemoConfig::default()
        };
        write_demo(&dir.join("demo"), &demo).unwrap();
        std::fs::write(
            dir.join("data.toml"),
            "[input]\npath = \"demo/train.jsonl\"\nformat = \"jsonl\"\n[image]\npreset = \"siglip\"\nsize = 32\npatch = 8\n[audio]\npool_stride = 4\n[pack]\nmax_seq_len = 160\n",
        )
        .unwrap();
        ensure_dataset(
            &dir.join("packed"),
            Some(&dir.join("data.toml")),
            None,
            None,
            &mut |_| {},
        )
        .unwrap();
        std::fs::write(dir.join("run.toml"), RUN.replace("{dir}", &dir.display().to_string()))
            .unwrap();
        dir
    })
}

/// LLM: 4 layers, 4 heads, 2 KV heads, vocab 264 (divisible by 2, 4, 8); encoders with
/// 2 heads and 2 layers each, so every module takes TP 2 and PP 2.
pub const RUN: &str = r#"
[run]
name = "par"
dir = "{dir}/runs/unused"
seed = 11
[data]
path = "{dir}/packed"
workers = 1
[model.llm]
family = "llama"
vocab = 264
hidden = 32
intermediate = 64
layers = 4
heads = 4
kv_heads = 2
head_dim = 8
rms_norm_eps = 1e-5
max_position_embeddings = 256
rope = { theta = 10000.0 }
tie_embeddings = true
qkv_bias = false
[model.vision]
family = "siglip"
hidden_size = 16
intermediate_size = 32
num_layers = 2
num_heads = 2
num_channels = 3
image_size = 32
patch_size = 8
act = "gelu_pytorch_tanh"
layer_norm_eps = 1e-6
[model.audio]
num_mel_bins = 80
d_model = 16
encoder_layers = 2
encoder_attention_heads = 2
encoder_ffn_dim = 32
max_source_positions = 1500
act = "gelu"
layer_norm_eps = 1e-5
[model.projector.vision]
in_dim = 16
out_dim = 32
act = "gelu"
[model.projector.audio]
in_dim = 16
out_dim = 32
stride = 4
act = "gelu"
[train]
steps = 20
batch_rows = 6
microbatches = 2
[optim]
lr = 3e-3
warmup_steps = 2
[checkpoint]
interval = 0
keep = 2
[parallel]
timeout_s = 60
"#;

pub fn config(run_dir: &Path, sets: &[&str]) -> RunConfig {
    let mut all: Vec<String> = vec![format!("run.dir={}", run_dir.display())];
    all.extend(sets.iter().map(|s| s.to_string()));
    RunConfig::from_file(&fixture().join("run.toml"), &all).unwrap()
}

pub fn run_dir(name: &str) -> PathBuf {
    fixture().join("runs").join(name)
}

/// (loss, grad norm) of every step of a run of `sets` in a fresh folder.
pub fn losses(name: &str, sets: &[&str]) -> Vec<(f64, f64)> {
    let dir = run_dir(name);
    let _ = std::fs::remove_dir_all(&dir);
    train(config(&dir, sets), false, &mut Quiet).unwrap();
    read_metrics(&dir.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m| (m.loss, m.grad_norm))
        .collect()
}

/// A global batch of 6 rows of `cfg`'s data, every item decoded.
pub fn first_batch(cfg: &RunConfig) -> Vec<braid_dataloader::loader::Row> {
    let loader_cfg = braid_dataloader::loader::LoaderConfig {
        seed: 3,
        batch_rows: 6,
        workers: 1,
        prefetch: 1,
        shuffle: true,
    };
    let mut loader =
        braid_dataloader::loader::Loader::open(&cfg.data.path, &loader_cfg, 0, 1, None).unwrap();
    loader.next_batch().unwrap().rows
}
