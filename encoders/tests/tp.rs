//! Tensor parallelism of the encoders: a CLIP ViT, a SigLIP ViT with its pooling head
//! and a Whisper encoder on tp ranks equal the single-rank model on the same Init —
//! outputs, input grads, and every parameter grad (split ones concatenated along their
//! split dim, replicated ones equal on every rank) — for tp = 2 and 4; a Hugging Face
//! checkpoint loads into shards; sizes that do not split are errors naming the module.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use braid_comm::local::run_local;
use braid_comm::testing::run_on_ranks;
use braid_comm::{Comm, SingleRank};
use braid_encoders::{
    Act, VisionConfig, VisionEncoder, VisionFamily, WhisperEncoder, WhisperEncoderConfig,
};
use braid_kernels::{Device, Tensor};
use braid_nn::{Init, Module};
use common::{TestResult, check, fixture, randn};

const TOL: f32 = 1e-5;
/// A collective that waits longer fails the test (naming the ranks) instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(30);
const DEV: Device = Device::Cpu;

fn init() -> Init {
    Init::new(21, DEV).with_std(0.2)
}

fn vision_config(family: VisionFamily) -> VisionConfig {
    VisionConfig {
        family,
        hidden_size: 16,
        intermediate_size: 32,
        num_layers: 2,
        num_heads: 4,
        num_channels: 3,
        image_size: 8,
        patch_size: 4,
        act: match family {
            VisionFamily::Clip => Act::QuickGelu,
            VisionFamily::Siglip => Act::GeluPytorchTanh,
        },
        layer_norm_eps: 1e-5,
        use_head: family == VisionFamily::Siglip,
    }
}

fn whisper_config() -> WhisperEncoderConfig {
    WhisperEncoderConfig {
        num_mel_bins: 6,
        d_model: 16,
        encoder_layers: 2,
        encoder_attention_heads: 4,
        encoder_ffn_dim: 32,
        max_source_positions: 10,
        act: Act::Gelu,
        layer_norm_eps: 1e-5,
    }
}

/// name -> (dims, value, grad) on the host.
type HostParams = BTreeMap<String, (Vec<usize>, Vec<f32>, Vec<f32>)>;

fn params(m: &dyn Module) -> HostParams {
    let mut out = HostParams::new();
    m.visit_params(&mut |p| {
        let v = p.value.to_vec_f32().unwrap();
        let g = p.grad.as_ref().unwrap().to_vec_f32().unwrap();
        out.insert(p.name.clone(), (p.value.dims().to_vec(), v, g));
    });
    out
}

/// What one rank computed: outputs and input grads (flattened, in order) and params.
struct Run {
    outputs: Vec<(String, Vec<f32>)>,
    params: HostParams,
}

/// Concatenates the ranks' shards (each `dims`) along the one dim where they differ
/// from `full`; `None` when they are full (replicated).
fn concat(full: &[usize], shards: &[(&[usize], &[f32])]) -> Option<Vec<f32>> {
    let dims = shards[0].0;
    let d = (0..full.len()).find(|&i| dims[i] != full[i])?;
    assert_eq!(
        dims[d] * shards.len(),
        full[d],
        "shard dims {dims:?} of {full:?}"
    );
    let outer: usize = full[..d].iter().product();
    let chunk = dims[d] * full[d + 1..].iter().product::<usize>();
    let mut out = Vec::with_capacity(full.iter().product());
    for o in 0..outer {
        for (_, s) in shards {
            out.extend_from_slice(&s[o * chunk..(o + 1) * chunk]);
        }
    }
    Some(out)
}

/// `check` of a parameter grad, except a key bias: it adds the same score to every
/// key of a query and cancels in the softmax, so its true grad is 0 and both sides hold
/// round-off (~1e-7) that no relative measure can compare.
#[track_caller]
fn grad_close(what: &str, name: &str, got: &[f32], want: &[f32]) {
    if name.ends_with("k_proj.bias") {
        let max = got.iter().chain(want).fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(max < 1e-5, "{what}: should be ~0, got {max:e}");
    } else {
        check(what, got, want, TOL);
    }
}

fn compare(what: &str, tp: usize, reference: &Run, runs: &[Run]) {
    for (r, run) in runs.iter().enumerate() {
        for ((name, got), (_, want)) in run.outputs.iter().zip(&reference.outputs) {
            check(&format!("{what} tp {tp} rank {r}: {name}"), got, want, TOL);
        }
    }
    let mut split = 0;
    for (name, (dims, value, grad)) in &reference.params {
        let held: Vec<_> = runs
            .iter()
            .map(|r| r.params.get(name).unwrap_or_else(|| panic!("no {name}")))
            .collect();
        let vals: Vec<_> = held
            .iter()
            .map(|p| (p.0.as_slice(), p.1.as_slice()))
            .collect();
        let grads: Vec<_> = held
            .iter()
            .map(|p| (p.0.as_slice(), p.2.as_slice()))
            .collect();
        match (concat(dims, &vals), concat(dims, &grads)) {
            (Some(v), Some(g)) => {
                split += 1;
                assert_eq!(&v, value, "{what} tp {tp}: {name} shards");
                grad_close(
                    &format!("{what} tp {tp}: d {name} (gathered)"),
                    name,
                    &g,
                    grad,
                );
            }
            _ => {
                for (r, (v, g)) in vals.iter().zip(&grads).enumerate() {
                    assert_eq!(v.1, value.as_slice(), "{what} tp {tp} rank {r}: {name}");
                    grad_close(
                        &format!("{what} tp {tp} rank {r}: d {name}"),
                        name,
                        g.1,
                        grad,
                    );
                }
            }
        }
    }
    assert!(split > 0, "{what}: nothing was split");
    assert_eq!(runs[0].params.len(), reference.params.len());
}

/// Two images through the ViT, backward from random grads of both outputs.
fn run_vision(cfg: VisionConfig, group: Arc<dyn Comm>) -> TestResult<Run> {
    let mut model = VisionEncoder::with_group(&init(), cfg, group)?;
    let (b, c, side, d, s) = (2, 3, 8, 16, model.seq_len());
    let px = Tensor::from_vec(randn(1, b * c * side * side), [b, c, side, side], DEV)?;
    let (out, cache) = model.forward(&px)?;
    let pooled = out.pooler_output.ok_or("no pooler output")?;
    let dl = Tensor::from_vec(randn(2, b * s * d), [b, s, d], DEV)?;
    let dp = Tensor::from_vec(randn(3, b * d), [b, d], DEV)?;
    let dpx = model.backward(cache, &dl, Some(&dp))?;
    Ok(Run {
        outputs: vec![
            (
                "last_hidden_state".into(),
                out.last_hidden_state.to_vec_f32()?,
            ),
            ("pooler_output".into(), pooled.to_vec_f32()?),
            ("d pixel_values".into(), dpx.to_vec_f32()?),
        ],
        params: params(&model),
    })
}

/// Two clips of different lengths (7 and 10 frames) packed through the encoder.
fn run_whisper(cfg: WhisperEncoderConfig, group: Arc<dyn Comm>) -> TestResult<Run> {
    let mut model = WhisperEncoder::with_group(&init(), cfg, group)?;
    let clips = [7usize, 10]
        .iter()
        .enumerate()
        .map(|(i, &f)| Tensor::from_vec(randn(10 + i as u64, 6 * f), [6, f], DEV))
        .collect::<Result<Vec<_>, _>>()?;
    let (out, cache) = model.forward(&clips)?;
    let dy = Tensor::from_vec(randn(4, out.hidden.elem_count()), out.hidden.dims(), DEV)?;
    let dclips = model.backward(cache, &dy)?;
    let mut outputs = vec![("hidden".to_string(), out.hidden.to_vec_f32()?)];
    for (i, d) in dclips.iter().enumerate() {
        outputs.push((format!("d clip {i}"), d.to_vec_f32()?));
    }
    Ok(Run {
        outputs,
        params: params(&model),
    })
}

fn check_tp<C: Clone + Sync>(
    what: &str,
    cfg: C,
    run: fn(C, Arc<dyn Comm>) -> TestResult<Run>,
) -> TestResult {
    let reference = run(cfg.clone(), Arc::new(SingleRank))?;
    for tp in [2, 4] {
        let runs = run_local(tp, TIMEOUT, |r| {
            run(cfg.clone(), Arc::new(r)).map_err(|e| e.to_string())
        })?;
        compare(what, tp, &reference, &runs);
    }
    Ok(())
}

#[test]
fn clip_vit_on_tp_ranks_equals_one_rank() -> TestResult {
    check_tp("clip", vision_config(VisionFamily::Clip), run_vision)
}

/// SigLIP with the attention-pooling head (its MLP split, its attention replicated).
#[test]
fn siglip_vit_with_head_on_tp_ranks_equals_one_rank() -> TestResult {
    check_tp("siglip", vision_config(VisionFamily::Siglip), run_vision)
}

#[test]
fn whisper_encoder_on_tp_ranks_equals_one_rank() -> TestResult {
    check_tp("whisper", whisper_config(), run_whisper)
}

/// A Hugging Face CLIP tower (4 heads, MLP 56) loaded into 2 and 4 shards: the shards
/// concatenate to the single-rank import and the outputs match; export needs tp = 1.
#[test]
fn hf_checkpoint_loads_into_tp_shards() -> TestResult {
    let dir = fixture("clip_vision");
    let one = VisionEncoder::from_hf_dir(&dir, DEV)?.model;
    let (c, side) = (one.config.num_channels, one.config.image_size);
    let px = Tensor::from_vec(randn(7, 2 * c * side * side), [2, c, side, side], DEV)?;
    let want = one.forward(&px)?.0.last_hidden_state.to_vec_f32()?;
    let names: Vec<_> = one.param_shapes();
    let full = params_values(&one);
    for tp in [2, 4] {
        let runs = run_local(tp, TIMEOUT, |r| {
            let f = || -> TestResult<_> {
                let import = VisionEncoder::from_hf_dir_with_group(&dir, DEV, Arc::new(r))?;
                let m = import.model;
                let y = m.forward(&px)?.0.last_hidden_state.to_vec_f32()?;
                let tmp =
                    std::env::temp_dir().join(format!("braid-tp-export-{}", std::process::id()));
                let e = m.export_hf(&tmp).unwrap_err().to_string();
                assert!(e.contains("tensor-parallel group of"), "{e}");
                Ok((y, m.param_shapes(), params_values(&m)))
            };
            f().map_err(|e| e.to_string())
        })?;
        for (y, _, _) in &runs {
            check(&format!("hf tp {tp}: last_hidden_state"), y, &want, TOL);
        }
        let mut split = 0;
        for (i, (name, dims)) in names.iter().enumerate() {
            let shards: Vec<_> = runs
                .iter()
                .map(|r| (r.1[i].1.as_slice(), r.2[i].as_slice()))
                .collect();
            assert_eq!(&runs[0].1[i].0, name);
            match concat(dims, &shards) {
                Some(v) => {
                    split += 1;
                    assert_eq!(v, full[i], "hf tp {tp}: {name}");
                }
                None => shards
                    .iter()
                    .for_each(|s| assert_eq!(s.1, full[i].as_slice(), "hf tp {tp}: {name}")),
            }
        }
        assert!(split > 0);
    }
    Ok(())
}

fn params_values(m: &dyn Module) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| out.push(p.value.to_vec_f32().unwrap()));
    out
}

#[test]
fn heads_or_mlp_that_do_not_split_are_errors_naming_the_module() {
    let mut cfg = vision_config(VisionFamily::Siglip);
    cfg.hidden_size = 18;
    cfg.num_heads = 3;
    for e in run_on_ranks(2, |r| {
        VisionEncoder::with_group(&init(), cfg.clone(), Arc::new(r)).unwrap_err()
    }) {
        let e = e.to_string();
        assert!(
            e.contains("vision encoder: 3 attention heads are not divisible by tp = 2"),
            "{e}"
        );
    }
    let mut cfg = whisper_config();
    cfg.encoder_ffn_dim = 30;
    for e in run_on_ranks(4, |r| {
        WhisperEncoder::with_group(&init(), cfg.clone(), Arc::new(r)).unwrap_err()
    }) {
        let e = e.to_string();
        assert!(e.contains("audio encoder"), "{e}");
        assert!(e.contains("30 is not divisible by tp = 4"), "{e}");
    }
}
