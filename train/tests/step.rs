//! The pieces of the training step, on a tiny model: loader rows -> model batch, gradient
//! accumulation over microbatches equal to the full batch, AdamW state only for trainable
//! modules, and checkpoints that restore weights and moments exactly.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use braid_dataloader::loader::{AudioItem, ImageItem, Row};
use braid_kernels::Device;
use braid_kernels::rng::Rng;
use braid_llm::IGNORE_INDEX;
use braid_nn::{Init, Module};
use braid_train::assemble::{build_model, model_config};
use braid_train::checkpoint::{self, TrainState};
use braid_train::data::{rows_to_batch, split_even};
use braid_train::optim::AdamW;
use braid_train::{Mllm, RunConfig};

const CONFIG: &str = r#"
[run]
name = "t"
dir = "unused"
seed = 3
[data]
path = "unused"
[model.llm]
family = "qwen2"
vocab = 40
hidden = 16
intermediate = 24
layers = 1
heads = 2
kv_heads = 1
head_dim = 8
rms_norm_eps = 1e-5
max_position_embeddings = 64
rope = { theta = 10000.0 }
tie_embeddings = false
qkv_bias = true
[model.vision]
family = "siglip"
hidden_size = 8
intermediate_size = 16
num_layers = 1
num_heads = 2
num_channels = 3
image_size = 8
patch_size = 4
act = "gelu_pytorch_tanh"
layer_norm_eps = 1e-6
[model.audio]
num_mel_bins = 4
d_model = 8
encoder_layers = 1
encoder_attention_heads = 2
encoder_ffn_dim = 16
max_source_positions = 64
act = "gelu"
layer_norm_eps = 1e-5
[model.projector.vision]
in_dim = 8
out_dim = 16
act = "gelu"
[model.projector.audio]
in_dim = 8
out_dim = 16
stride = 2
act = "gelu"
[train]
steps = 4
batch_rows = 2
"#;

fn config(sets: &[&str]) -> RunConfig {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::from_toml(CONFIG, "step.rs", &sets).unwrap()
}

fn model(cfg: &RunConfig) -> Mllm {
    build_model(cfg, model_config(cfg).unwrap(), cfg.run.seed, Device::Cpu).unwrap()
}

/// A packed row of two samples: one with an image (4 tokens), one with a 6-frame clip
/// (2 tokens), loss on the last few tokens of each.
fn row(seed: u64) -> Row {
    let mut rng = Rng::new(seed);
    let ids: Vec<u32> = rng.index_vec(20, 40); // (T)
    let offsets = vec![0u32, 11, 20];
    let mut positions = Vec::new();
    for w in offsets.windows(2) {
        positions.extend(0..w[1] - w[0]);
    }
    let mut loss_mask = vec![0u8; 20];
    for t in [8, 9, 10, 17, 18, 19] {
        loss_mask[t] = 1;
    }
    Row {
        pack: seed as usize,
        ids,
        positions,
        loss_mask,
        sample_offsets: offsets,
        sample_ids: vec!["a".into(), "b".into()],
        costs: vec![Default::default(); 2],
        images: vec![ImageItem {
            pixels: rng.normal_vec(3 * 8 * 8, 1.0), // (3, H, W)
            height: 8,
            width: 8,
            patches: 4,
            start: 2,
            len: 4,
        }],
        audio: vec![AudioItem {
            mel: rng.normal_vec(4 * 6, 1.0), // (n_mels, F)
            n_mels: 4,
            frames: 6,
            start: 13,
            len: 2,
        }],
    }
}

fn grads(m: &Mllm) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| {
        if let Some(g) = &p.grad {
            out.push((p.name.clone(), g.to_vec_f32().unwrap()));
        }
    });
    out
}

#[test]
fn rows_become_one_packed_batch_with_shifted_positions_and_targets() {
    let (a, b) = (row(1), row(2));
    let batch = rows_to_batch(&[&a, &b], Device::Cpu).unwrap();
    assert_eq!(batch.num_tokens(), 40);
    assert_eq!(batch.seq.cu_seqlens, [0, 11, 20, 31, 40]);
    assert_eq!(batch.image_positions[1], [22, 23, 24, 25]);
    assert_eq!(batch.clip_positions[1], [33, 34]);
    assert_eq!(batch.images.as_ref().unwrap().dims(), [2, 3, 8, 8]);
    // Target t is id t+1 where the mask of t+1 is set, within the sample.
    assert_eq!(batch.targets[7], a.ids[8]);
    assert_eq!(batch.targets[10], IGNORE_INDEX); // last token of sample a
    assert_eq!(batch.targets[20 + 16], b.ids[17]);
    let valid = batch.targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    assert_eq!(valid, 2 * 6 - 2 + 2); // the first loss token of each sample has a predecessor: 12
    assert_eq!(split_even(5, 2), [0..2, 2..5]);
    assert_eq!(split_even(2, 4), [0..1, 1..2]);
}

#[test]
fn microbatches_with_the_global_normalizer_give_the_full_batch_gradient() {
    let cfg = config(&[]);
    let rows = [row(1), row(2), row(3)];
    let refs: Vec<&Row> = rows.iter().collect();

    let mut full = model(&cfg);
    let whole = rows_to_batch(&refs, Device::Cpu).unwrap();
    let (loss, cache) = full.forward(&whole).unwrap();
    full.backward(cache).unwrap();

    let mut acc = model(&cfg);
    let parts: Vec<_> = split_even(3, 2)
        .into_iter()
        .map(|r| rows_to_batch(&refs[r], Device::Cpu).unwrap())
        .collect();
    let n: usize = parts
        .iter()
        .map(|b| b.targets.iter().filter(|&&t| t != IGNORE_INDEX).count())
        .sum();
    assert_eq!(n, loss.n_valid);
    let mut sum = 0.0;
    for b in &parts {
        let (l, cache) = acc.forward_normalized(b, Some(n)).unwrap();
        sum += l.loss_sum;
        acc.backward(cache).unwrap();
    }
    assert!((sum / n as f64 - f64::from(loss.loss)).abs() < 1e-5);
    let (gf, ga) = (grads(&full), grads(&acc));
    assert_eq!(gf.len(), ga.len());
    for ((name, x), (_, y)) in gf.iter().zip(&ga) {
        let scale = x.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        for (u, v) in x.iter().zip(y) {
            assert!((u - v).abs() <= 1e-4 * scale, "{name}: {u} vs {v}");
        }
    }
}

#[test]
fn frozen_modules_get_no_optimizer_state_and_do_not_move() {
    let cfg = config(&["train.freeze=[\"vision\", \"audio\"]"]);
    let mut m = model(&cfg);
    let opt = AdamW::new(cfg.optim.clone(), &m).unwrap();
    assert!(!opt.moments.is_empty());
    assert!(
        opt.moments
            .iter()
            .all(|s| !s.name.starts_with("vision.") && !s.name.starts_with("audio."))
    );
    let before: Vec<Vec<f32>> = {
        let mut v = Vec::new();
        m.visit_params(&mut |p| {
            if p.name.starts_with("vision.") {
                v.push(p.value.to_vec_f32().unwrap())
            }
        });
        v
    };
    let r = row(4);
    let batch = rows_to_batch(&[&r], Device::Cpu).unwrap();
    let (_, cache) = m.forward(&batch).unwrap();
    m.backward(cache).unwrap();
    let mut opt = opt;
    opt.update(&mut m, 1e-2).unwrap();
    let mut after = Vec::new();
    m.visit_params(&mut |p| {
        if p.name.starts_with("vision.") {
            after.push(p.value.to_vec_f32().unwrap())
        }
    });
    assert_eq!(before, after);
}

#[test]
fn checkpoints_restore_weights_and_moments_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&[]);
    let mut m = model(&cfg);
    let mut opt = AdamW::new(cfg.optim.clone(), &m).unwrap();
    let r = row(5);
    let batch = rows_to_batch(&[&r], Device::Cpu).unwrap();
    let (_, cache) = m.forward(&batch).unwrap();
    m.backward(cache).unwrap();
    opt.update(&mut m, 1e-2).unwrap();
    let loader = braid_dataloader::loader::LoaderState {
        epoch: 0,
        batch: 1,
        seed: 3,
        batch_rows: 2,
        packs: 10,
        shuffle: true,
    };
    let state = TrainState {
        step: 1,
        optimizer_step: 1,
        tokens_seen: 20,
        elapsed_s: 0.5,
        ..TrainState::fresh(loader, 3)
    };
    let root = dir.path().join("checkpoints");
    let saved =
        checkpoint::save(&root, &m, &opt, &state, &[("config.toml", b"x")], 2, false).unwrap();
    assert_eq!(checkpoint::latest(&root).unwrap().unwrap().1, saved);
    assert_eq!(checkpoint::read_state(&saved).unwrap(), state);
    // An edited or damaged state.json: a step that is not the folder's, counters past it.
    let text = std::fs::read_to_string(saved.join("state.json")).unwrap();
    for (from, to, says) in [
        ("\"step\": 1,", "\"step\": 0,", "the folder holds step 1"),
        (
            "\"step\": 1,",
            "\"step\": 18446744073709551615,",
            "the folder holds step 1",
        ),
        (
            "\"optimizer_step\": 1,",
            "\"optimizer_step\": 7,",
            "cannot exceed step 1",
        ),
        // A loader further on than the steps taken (u64::MAX used to overflow the loader's
        // epoch count and panic).
        (
            "\"epoch\": 0,",
            "\"epoch\": 18446744073709551615,",
            "lie beyond step 1",
        ),
        ("\"batch\": 1,", "\"batch\": 5,", "lie beyond step 1"),
        // A run of skipped steps longer than all skipped steps (u64::MAX used to wrap
        // round the stop guard on the next skip).
        (
            "\"nonfinite_in_a_row\": 0",
            "\"nonfinite_in_a_row\": 18446744073709551615",
            "nor nonfinite_in_a_row",
        ),
    ] {
        assert!(text.contains(from), "{text}");
        std::fs::write(saved.join("state.json"), text.replace(from, to)).unwrap();
        let e = checkpoint::read_state(&saved).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains("damaged"), "{to}: {e}");
    }
    std::fs::write(saved.join("state.json"), &text).unwrap();

    let mut fresh =
        Mllm::new(model_config(&cfg).unwrap(), &Init::for_loading(Device::Cpu)).unwrap();
    let mut fresh_opt = AdamW::new(cfg.optim.clone(), &fresh).unwrap();
    checkpoint::load_weights(&saved, &mut fresh, Device::Cpu).unwrap();
    checkpoint::load_optim(&saved, &mut fresh_opt, 1, Device::Cpu).unwrap();
    let bits = |m: &Mllm| {
        let mut v = Vec::new();
        m.visit_params(&mut |p| {
            v.extend(p.value.to_vec_f32().unwrap().iter().map(|x| x.to_bits()))
        });
        v
    };
    assert_eq!(bits(&m), bits(&fresh));
    for (a, b) in opt.moments.iter().zip(&fresh_opt.moments) {
        assert_eq!(
            a.exp_avg.to_vec_f32().unwrap(),
            b.exp_avg.to_vec_f32().unwrap()
        );
        assert_eq!(
            a.exp_avg_sq.to_vec_f32().unwrap(),
            b.exp_avg_sq.to_vec_f32().unwrap()
        );
    }
    assert_eq!(fresh_opt.step, 1);

    // Another model's checkpoint is refused with the tensor named.
    let other = config(&[
        "model.llm.hidden=24",
        "model.projector.vision.out_dim=24",
        "model.projector.audio.out_dim=24",
    ]);
    let mut wrong = Mllm::new(
        model_config(&other).unwrap(),
        &Init::for_loading(Device::Cpu),
    )
    .unwrap();
    let e = checkpoint::load_weights(&saved, &mut wrong, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("expects [24") && e.contains("model.safetensors"),
        "{e}"
    );

    // keep = 2: a third checkpoint removes the first.
    for step in [2, 3] {
        let s = TrainState {
            step,
            ..state.clone()
        };
        checkpoint::save(&root, &m, &opt, &s, &[], 2, false).unwrap();
    }
    let steps: Vec<u64> = checkpoint::list(&root)
        .unwrap()
        .into_iter()
        .map(|x| x.0)
        .collect();
    assert_eq!(steps, [2, 3]);
}

#[test]
fn the_shipped_configs_parse_and_build() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let cfg = RunConfig::from_file(&dir.join("demo.toml"), &[]).unwrap();
    let mc = model_config(&cfg).unwrap();
    assert_eq!(mc.tokens_per_image(), Some(16));
    assert_eq!(mc.tokens_per_clip(100), Some(13));
    let data =
        braid_dataloader::config::DataConfig::from_file(&dir.join("data-demo.toml")).unwrap();
    assert_eq!((data.image.size, data.image.patch), (32, 8));
    assert_eq!(data.audio.pool_stride, 4);
}
