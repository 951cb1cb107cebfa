//! The multimodal model end to end on a tiny configuration: finite differences of the
//! loss w.r.t. parameters of every module and the pixel / mel inputs with an image and
//! two clips in one packed row, freeze semantics (no grads, skipped branches, the rest
//! unchanged), text-only == the LLM alone, validation errors, determinism.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use braid_encoders::{Act, VisionConfig, VisionFamily, WhisperEncoderConfig};
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, in_pool};
use braid_kernels::{Device, Tensor};
use braid_llm::{Family, IGNORE_INDEX, Llm, LlmConfig, RopeScaling, RopeSpec, next_token_targets};
use braid_nn::{Error, Init, Module, SeqInfo};
use braid_train::{
    AudioProjectorConfig, Freeze, Mllm, MllmBatch, MllmConfig, MllmLoss, VisionProjectorConfig,
};

type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;
/// (name, grad) of every parameter, `None` when frozen.
type Grads = Vec<(String, Option<Vec<f32>>)>;

fn kerr(e: impl std::fmt::Display) -> braid_kernels::Error {
    braid_kernels::Error::invalid("fd", e.to_string())
}

/// LLM C = 16; CLIP ViT D = 8 on 8x8 images with 2x2 patches (4x4 grid), merged 2x2 by
/// the projector -> 4 tokens per image; Whisper D = 8 on 4 mel bins, stride-2 audio
/// projector -> ceil(ceil(F/2)/2) tokens per clip.
fn tiny_config() -> MllmConfig {
    MllmConfig {
        llm: LlmConfig {
            family: Family::Qwen2,
            vocab: 24,
            hidden: 16,
            intermediate: 24,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 64,
            rope: RopeSpec {
                theta: 10_000.0,
                scaling: RopeScaling::Default,
            },
            tie_embeddings: false,
            qkv_bias: true,
            o_bias: false,
            mlp_bias: false,
        },
        vision: Some(VisionConfig {
            family: VisionFamily::Clip,
            hidden_size: 8,
            intermediate_size: 16,
            num_layers: 1,
            num_heads: 2,
            num_channels: 3,
            image_size: 8,
            patch_size: 2,
            act: Act::QuickGelu,
            layer_norm_eps: 1e-5,
            use_head: false,
        }),
        vision_projector: Some(VisionProjectorConfig {
            in_dim: 8,
            out_dim: 16,
            spatial_merge: 2,
            act: Act::Gelu,
            ln_eps: 1e-6,
        }),
        audio: Some(WhisperEncoderConfig {
            num_mel_bins: 4,
            d_model: 8,
            encoder_layers: 1,
            encoder_attention_heads: 2,
            encoder_ffn_dim: 16,
            max_source_positions: 16,
            act: Act::Gelu,
            layer_norm_eps: 1e-5,
        }),
        audio_projector: Some(AudioProjectorConfig {
            in_dim: 8,
            out_dim: 16,
            stride: 2,
            act: Act::Gelu,
        }),
    }
}

/// std 0.3 so every path carries O(1) signal for finite differences.
fn init(dev: Device) -> Init {
    Init::new(11, dev).with_std(0.3)
}

const IMG: u32 = 2;
const AUD: u32 = 3;

/// Two samples in one row of T = 20:
/// sample A (12): `1 5 I I I I 6 A A 7 8 9` — the image (4 tokens) at 2..=5, clip 0
/// (7 frames -> 4 -> 2 tokens) at 7, 8;
/// sample B (8): `1 10 11 A A 12 13 14` — clip 1 (5 frames -> 3 -> 2 tokens) at 15, 16.
/// Placeholder tokens are not predicted (loss mask), so targets are text only.
struct Inputs {
    ids: Vec<u32>,
    lens: Vec<usize>,
    pixels: Vec<f32>,
    clips: Vec<Vec<f32>>,
    image_positions: Vec<Vec<u32>>,
    clip_positions: Vec<Vec<u32>>,
}

const CLIP_FRAMES: [usize; 2] = [7, 5];

fn inputs() -> Inputs {
    let ids = vec![
        1, 5, IMG, IMG, IMG, IMG, 6, AUD, AUD, 7, 8, 9, 1, 10, 11, AUD, AUD, 12, 13, 14,
    ];
    let mut rng = Rng::new(5);
    Inputs {
        ids,
        lens: vec![12, 8],
        pixels: rng.normal_vec(3 * 8 * 8, 1.0),
        clips: CLIP_FRAMES
            .iter()
            .map(|&f| rng.normal_vec(4 * f, 1.0))
            .collect(),
        image_positions: vec![vec![2, 3, 4, 5]],
        clip_positions: vec![vec![7, 8], vec![15, 16]],
    }
}

fn batch(x: &Inputs, dev: Device) -> TestResult<MllmBatch> {
    let seq = SeqInfo::packed(&x.lens);
    let mask: Vec<bool> = x.ids.iter().map(|&i| i != IMG && i != AUD).collect();
    let targets = next_token_targets(&x.ids, &seq, Some(&mask))?;
    Ok(MllmBatch {
        ids: Tensor::from_vec_u32(x.ids.clone(), [x.ids.len()], dev)?,
        seq,
        targets,
        images: Some(Tensor::from_vec(x.pixels.clone(), [1, 3, 8, 8], dev)?),
        image_positions: x.image_positions.clone(),
        clips: x
            .clips
            .iter()
            .zip(CLIP_FRAMES)
            .map(|(c, f)| Tensor::from_vec(c.clone(), [4, f], dev))
            .collect::<Result<_, _>>()?,
        clip_positions: x.clip_positions.clone(),
    })
}

/// (name, value, grad) of every parameter on the host.
fn params(m: &Mllm) -> Vec<(String, Vec<f32>, Option<Vec<f32>>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| {
        out.push((
            p.name.clone(),
            p.value.to_vec_f32().unwrap(),
            p.grad.as_ref().map(|g| g.to_vec_f32().unwrap()),
        ))
    });
    out
}

fn set_param(m: &mut Mllm, name: &str, data: &[f32]) {
    let mut found = false;
    m.visit_params_mut(&mut |p| {
        if p.name == name {
            p.value =
                Tensor::from_vec(data.to_vec(), p.value.shape().clone(), p.value.device()).unwrap();
            found = true;
        }
    });
    assert!(found, "no parameter {name}");
}

/// The loss as f64 (sum of per-token losses / valid count) for finite differences.
fn loss_of(m: &Mllm, b: &MllmBatch) -> braid_kernels::Result<f64> {
    let (l, _) = m.forward(b).map_err(kerr)?;
    Ok(l.loss_sum / l.n_valid as f64)
}

/// Element indices to check: `k` random ones plus the largest |grad|, deduplicated.
fn pick(rng: &mut Rng, grad: &[f32], k: usize) -> Vec<usize> {
    let mut idx = rng.index_vec(k, grad.len() as u32);
    let mut idx: Vec<usize> = idx.drain(..).map(|i| i as usize).collect();
    let big = (0..grad.len())
        .max_by(|&a, &b| grad[a].abs().total_cmp(&grad[b].abs()))
        .unwrap();
    idx.push(big);
    idx.sort_unstable();
    idx.dedup();
    idx
}

/// Central differences with eps 1e-2 on f32 (the loss accumulated in f64): the error is
/// truncation O(eps^2) plus f32 rounding of the forward ~1e-7 / eps; 1e-4 + 1e-2 |g|.
const TOL: FdTolerance = FdTolerance {
    eps: 1e-2,
    atol: 1e-4,
    rtol: 1e-2,
};

/// (1) d loss / d (a sample of every parameter of every module, the pixels, the mels)
/// by central finite differences, image and both clips in one packed row.
fn end_to_end_finite_differences(dev: Device) -> TestResult {
    let x = inputs();
    let b = batch(&x, dev)?;
    let mut m = Mllm::new(tiny_config(), &init(dev))?;
    let (_, cache) = m.forward(&b)?;
    assert!(cache.holds_vision_encoder() && cache.holds_audio_encoder());
    let dx = m.backward(cache)?;
    let dpix = dx.pixel_values.ok_or("no pixel grad")?.to_vec_f32()?;
    let dclips = dx.clips.ok_or("no clip grads")?;

    let mut rng = Rng::new(99);
    let mut modules_seen = std::collections::BTreeSet::new();
    for (name, value, grad) in params(&m) {
        let grad = grad.ok_or("trainable param without grad")?;
        modules_seen.insert(name.split('.').next().unwrap_or("").to_string());
        let idx = pick(&mut rng, &grad, 3);
        let x0: Vec<f32> = idx.iter().map(|&i| value[i]).collect();
        let g0: Vec<f32> = idx.iter().map(|&i| grad[i]).collect();
        check_grad(&format!("d {name} {idx:?}"), &x0, &g0, TOL, |xs| {
            let mut v = value.clone();
            for (&i, &xi) in idx.iter().zip(xs) {
                v[i] = xi;
            }
            set_param(&mut m, &name, &v);
            let l = loss_of(&m, &b);
            set_param(&mut m, &name, &value);
            l
        })?;
    }
    let want: Vec<String> = [
        "audio",
        "audio_projector",
        "llm",
        "vision",
        "vision_projector",
    ]
    .map(String::from)
    .into();
    assert_eq!(modules_seen.into_iter().collect::<Vec<_>>(), want);

    // Inputs: every pixel would be 192 forwards; a sample of each input suffices.
    let idx = pick(&mut rng, &dpix, 12);
    let x0: Vec<f32> = idx.iter().map(|&i| x.pixels[i]).collect();
    let g0: Vec<f32> = idx.iter().map(|&i| dpix[i]).collect();
    check_grad("d pixel_values", &x0, &g0, TOL, |xs| {
        let mut xi = inputs();
        for (&i, &v) in idx.iter().zip(xs) {
            xi.pixels[i] = v;
        }
        loss_of(&m, &batch(&xi, dev).map_err(kerr)?)
    })?;
    for (j, dc) in dclips.iter().enumerate() {
        let dc = dc.to_vec_f32()?;
        assert_eq!(dc.len(), 4 * CLIP_FRAMES[j]);
        let idx = pick(&mut rng, &dc, 8);
        let x0: Vec<f32> = idx.iter().map(|&i| x.clips[j][i]).collect();
        let g0: Vec<f32> = idx.iter().map(|&i| dc[i]).collect();
        check_grad(&format!("d clip {j}"), &x0, &g0, TOL, |xs| {
            let mut xi = inputs();
            for (&i, &v) in idx.iter().zip(xs) {
                xi.clips[j][i] = v;
            }
            loss_of(&m, &batch(&xi, dev).map_err(kerr)?)
        })?;
    }
    Ok(())
}

/// Loss and every (name, grad) after one forward/backward of a fresh model with `f`.
fn run(dev: Device, f: Freeze) -> TestResult<(MllmLoss, Grads, Mllm)> {
    let mut m = Mllm::new(tiny_config(), &init(dev))?;
    m.apply_freeze(f)?;
    let b = batch(&inputs(), dev)?;
    let (loss, cache) = m.forward(&b)?;
    let enc_v = cache.holds_vision_encoder();
    let enc_a = cache.holds_audio_encoder();
    assert_eq!(enc_v, !f.vision, "vision encoder cache kept iff it trains");
    assert_eq!(enc_a, !f.audio, "audio encoder cache kept iff it trains");
    let all = f.vision && f.audio && f.vision_projector && f.audio_projector && f.llm;
    assert_eq!(cache.runs_backward(), !all);
    let dx = m.backward(cache)?;
    assert_eq!(dx.pixel_values.is_some(), !f.vision);
    assert_eq!(dx.clips.is_some(), !f.audio);
    let g = params(&m).into_iter().map(|(n, _, g)| (n, g)).collect();
    Ok((loss, g, m))
}

fn frozen(name: &str, f: Freeze) -> bool {
    let module = name.split('.').next().unwrap_or("");
    match module {
        "vision" => f.vision,
        "audio" => f.audio,
        "vision_projector" => f.vision_projector,
        "audio_projector" => f.audio_projector,
        "llm" => f.llm,
        other => panic!("parameter {name} has no module prefix ({other})"),
    }
}

/// (2) Frozen modules get no grad buffer; everything else is bitwise what the unfrozen
/// run gives; an encoder frozen with its projector keeps no cache and runs no backward.
fn freeze_semantics(dev: Device) -> TestResult {
    let (loss0, g0, _) = run(dev, Freeze::default())?;
    let cases = [
        Freeze {
            vision: true,
            vision_projector: true,
            ..Freeze::default()
        },
        Freeze {
            audio: true,
            ..Freeze::default()
        },
        Freeze {
            vision: true,
            audio: true,
            audio_projector: true,
            ..Freeze::default()
        },
        Freeze {
            llm: true,
            ..Freeze::default()
        },
        Freeze::from_names(&[
            "vision",
            "audio",
            "vision_projector",
            "audio_projector",
            "llm",
        ])?,
    ];
    for f in cases {
        let (loss, g, _) = run(dev, f)?;
        assert_eq!(loss.loss.to_bits(), loss0.loss.to_bits(), "{f:?}: loss");
        for ((n, gf), (n0, gu)) in g.iter().zip(&g0) {
            assert_eq!(n, n0);
            if frozen(n, f) {
                assert!(gf.is_none(), "{f:?}: frozen {n} has a grad");
            } else {
                assert_eq!(gf, gu, "{f:?}: {n} differs from the unfrozen run");
            }
        }
    }
    // Freezing a module the model lacks is an error.
    let mut cfg = tiny_config();
    cfg.audio = None;
    cfg.audio_projector = None;
    let mut m = Mllm::new(cfg, &init(dev))?;
    let e = m.apply_freeze(Freeze::from_names(&["audio"])?).unwrap_err();
    assert!(e.to_string().contains("no audio"), "{e}");
    let e = Freeze::from_names(&["vison"]).unwrap_err();
    assert!(e.to_string().contains("\"vison\"") && e.to_string().contains("vision_projector"));
    Ok(())
}

/// (3) A batch of text only: the encoders do not run and loss and grads equal the LLM
/// built alone from the same init.
fn text_only_equals_llm(dev: Device) -> TestResult {
    let cfg = tiny_config();
    let x = inputs();
    let seq = SeqInfo::packed(&x.lens);
    let targets = next_token_targets(&x.ids, &seq, None)?;
    let ids = Tensor::from_vec_u32(x.ids.clone(), [x.ids.len()], dev)?;
    let b = MllmBatch {
        ids: ids.try_clone()?,
        seq: seq.clone(),
        targets: targets.clone(),
        images: None,
        image_positions: vec![],
        clips: vec![],
        clip_positions: vec![],
    };
    let mut m = Mllm::new(cfg.clone(), &init(dev))?;
    let (loss, cache) = m.forward(&b)?;
    let dx = m.backward(cache)?;
    assert!(dx.pixel_values.is_none() && dx.clips.is_none());

    let mut llm = Llm::new(&cfg.llm, &init(dev))?;
    let (out, cache) = llm.loss(&ids, &seq, None, &targets, None)?;
    llm.backward(cache, &out.dlogits)?;
    assert_eq!(loss.loss.to_bits(), out.loss.to_bits());
    assert_eq!(loss.n_valid, out.n_valid);
    let mut want = Vec::new();
    llm.visit_params(&mut |p| {
        want.push((
            format!("llm.{}", p.name),
            p.value.to_vec_f32().unwrap(),
            p.grad.as_ref().map(|g| g.to_vec_f32().unwrap()),
        ))
    });
    let got: Vec<_> = params(&m)
        .into_iter()
        .filter(|(n, ..)| n.starts_with("llm."))
        .collect();
    assert_eq!(got, want);
    // Encoder params received nothing.
    for (n, _, g) in params(&m) {
        if !n.starts_with("llm.") {
            assert!(g.unwrap().iter().all(|&v| v == 0.0), "{n} got a grad");
        }
    }
    Ok(())
}

fn input_err(r: braid_nn::Result<impl std::fmt::Debug>, needles: &[&str]) {
    match r {
        Err(Error::Input { msg, .. }) => {
            for n in needles {
                assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
            }
        }
        other => panic!("expected an input error with {needles:?}, got {other:?}"),
    }
}

fn config_err(r: braid_nn::Result<impl std::fmt::Debug>, needles: &[&str]) {
    match r {
        Err(Error::Config { msg, .. }) => {
            for n in needles {
                assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
            }
        }
        other => panic!("expected a config error with {needles:?}, got {other:?}"),
    }
}

/// (4) Batch and config validation: clear errors naming the image/clip, the counts,
/// the fields.
fn validation_errors(dev: Device) -> TestResult {
    let m = Mllm::new(tiny_config(), &init(dev))?;
    let fwd = |x: &Inputs| -> TestResult<braid_nn::Result<()>> {
        Ok(m.forward(&batch(x, dev)?).map(|_| ()))
    };
    let mut x = inputs();
    x.image_positions[0].pop();
    input_err(fwd(&x)?, &["image 0", "3 positions", "4 tokens"]);
    let mut x = inputs();
    x.clip_positions[1].push(17);
    input_err(fwd(&x)?, &["clip 1", "3 positions", "5 frames", "2 tokens"]);
    let mut x = inputs();
    x.clip_positions[0][1] = 4;
    input_err(fwd(&x)?, &["clip 0", "position[1] = 4", "image 0"]);
    let mut x = inputs();
    x.image_positions[0][3] = 2;
    input_err(fwd(&x)?, &["image 0", "position[3] = 2", "distinct"]);
    let mut x = inputs();
    x.clip_positions[1][0] = 20;
    input_err(fwd(&x)?, &["clip 1", "= 20", "T = 20"]);
    let mut x = inputs();
    x.clip_positions.pop();
    input_err(fwd(&x)?, &["2 clips", "1 clip_positions"]);
    // Wrong target, and images for a model without vision.
    let mut b = batch(&inputs(), dev)?;
    b.targets[0] = 24;
    input_err(m.forward(&b).map(|_| ()), &["targets[0] = 24"]);
    let mut cfg = tiny_config();
    cfg.vision = None;
    cfg.vision_projector = None;
    let no_vision = Mllm::new(cfg, &init(dev))?;
    input_err(
        no_vision.forward(&batch(&inputs(), dev)?).map(|_| ()),
        &["no vision encoder"],
    );

    // Config: widths chained, encoder and projector together.
    let mut cfg = tiny_config();
    cfg.vision_projector.as_mut().unwrap().in_dim = 12;
    config_err(
        Mllm::new(cfg, &init(dev)),
        &["vision_projector.in_dim = 12", "vision.hidden_size = 8"],
    );
    let mut cfg = tiny_config();
    cfg.audio_projector.as_mut().unwrap().out_dim = 8;
    config_err(
        cfg.validate(),
        &["audio_projector.out_dim = 8", "llm.hidden = 16"],
    );
    let mut cfg = tiny_config();
    cfg.vision_projector.as_mut().unwrap().spatial_merge = 3;
    config_err(cfg.validate(), &["spatial_merge = 3", "= 4"]);
    let mut cfg = tiny_config();
    cfg.audio_projector = None;
    config_err(cfg.validate(), &["`audio_projector` is not"]);
    Ok(())
}

/// (5) Same seed -> bitwise equal loss and grads, also on another thread count; the
/// config round-trips through serde; names are prefixed and unique, and `into_parts`
/// gives each part its own names back.
fn determinism_and_names(dev: Device) -> TestResult {
    let once = |threads: usize| -> TestResult<(u32, Grads)> {
        let r = in_pool(threads, || {
            run(dev, Freeze::default())
                .map(|(l, g, _)| (l.loss.to_bits(), g))
                .map_err(kerr)
        })?;
        Ok(r)
    };
    let a = once(1)?;
    let b = once(2)?;
    assert_eq!(a, b);
    // Twice on the same model (grads zeroed between) gives the same again.
    let (_, _, mut m) = run(dev, Freeze::default())?;
    m.zero_grads()?;
    let (l, cache) = m.forward(&batch(&inputs(), dev)?)?;
    m.backward(cache)?;
    assert_eq!(l.loss.to_bits(), a.0);
    let g: Vec<_> = params(&m).into_iter().map(|(n, _, g)| (n, g)).collect();
    assert_eq!(g, a.1);

    let names: Vec<String> = m.param_shapes().into_iter().map(|(n, _)| n).collect();
    let unique: std::collections::BTreeSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "duplicate parameter names");
    for n in &names {
        frozen(n, Freeze::default()); // panics without a module prefix
    }
    assert!(names.contains(&"vision.embeddings.patch_embedding.weight".to_string()));
    assert!(names.contains(&"vision_projector.mlp.0.weight".to_string()));
    assert!(names.contains(&"audio.conv1.weight".to_string()));
    assert!(names.contains(&"audio_projector.linear_1.weight".to_string()));
    assert!(names.contains(&"llm.embed_tokens.weight".to_string()));
    let parts = m.into_parts();
    let llm_alone = Llm::new(&tiny_config().llm, &init(dev))?;
    assert_eq!(parts.llm.param_shapes(), llm_alone.param_shapes());
    let ap = parts.audio_projector.as_ref().unwrap().param_shapes();
    assert_eq!(ap[0].0, "linear_1.weight");

    let cfg = tiny_config();
    let json = serde_json::to_string(&cfg)?;
    let back: MllmConfig = serde_json::from_str(&json)?;
    assert_eq!(back, cfg);
    Ok(())
}

/// The loss is the mean over valid targets only: placeholder and ignored positions add
/// nothing, and a normalizer divides the same sum.
fn loss_on_targets_only(dev: Device) -> TestResult {
    let m = Mllm::new(tiny_config(), &init(dev))?;
    let b = batch(&inputs(), dev)?;
    let (l, _) = m.forward(&b)?;
    let n_valid = b.targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    assert_eq!(l.n_valid, n_valid);
    assert_eq!(n_valid, 20 - 2 - 4 - 2 - 2); // last of each sample, 8 placeholders' predecessors
    assert_close(
        "mean",
        &[l.loss],
        &[(l.loss_sum / n_valid as f64) as f32],
        0.0,
        1e-6,
    );
    let (l2, _) = m.forward_normalized(&b, Some(2 * n_valid))?;
    assert_eq!(l2.loss_sum.to_bits(), l.loss_sum.to_bits());
    assert_close("half", &[l2.loss], &[l.loss / 2.0], 0.0, 1e-6);
    Ok(())
}

braid_kernels::test_on_devices!(
    end_to_end_finite_differences,
    freeze_semantics,
    text_only_equals_llm,
    validation_errors,
    determinism_and_names,
    loss_on_targets_only,
);
