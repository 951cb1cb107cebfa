//! Building the model a run config describes: each module from its sizes (random init from
//! the run's seed) or from a Hugging Face folder, checked against the dataset it will read
//! (vocabulary, image geometry, mel bins, audio pooling) before any step runs.

use braid_dataloader::dataset::DatasetInfo;
use braid_encoders::{
    VisionConfig, VisionEncoder, VisionFamily, WhisperEncoder, WhisperEncoderConfig,
};
use braid_kernels::Device;
use braid_llm::{Llm, LlmConfig};
use braid_nn::hf::read_json;
use braid_nn::{Init, Module};

use crate::config::{ModuleSpec, RunConfig, invalid};
use crate::error::Result;
use crate::mllm::{Freeze, Loaded, Mllm, MllmConfig, MllmParts};

/// The module configs, reading `config.json` of the modules started from Hugging Face.
pub fn model_config(cfg: &RunConfig) -> Result<MllmConfig> {
    let m = &cfg.model;
    let llm = match &m.llm {
        ModuleSpec::Sizes(c) => c.clone(),
        ModuleSpec::Hf(p) => LlmConfig::from_hf_config(p)?,
    };
    let vision = match &m.vision {
        None => None,
        Some(ModuleSpec::Sizes(c)) => Some(c.clone()),
        Some(ModuleSpec::Hf(p)) => {
            Some(VisionConfig::from_hf_config(&read_json(&p.join("config.json"))?)?.config)
        }
    };
    let audio = match &m.audio {
        None => None,
        Some(ModuleSpec::Sizes(c)) => Some(c.clone()),
        Some(ModuleSpec::Hf(p)) => {
            Some(WhisperEncoderConfig::from_hf_config(&read_json(&p.join("config.json"))?)?.0)
        }
    };
    let config = MllmConfig {
        llm,
        vision,
        vision_projector: m.projector.vision.clone(),
        audio,
        audio_projector: m.projector.audio.clone(),
    };
    config
        .validate()
        .map_err(|e| invalid("model", e.to_string()))?;
    Ok(config)
}

/// A warning where the data's rows are longer than the LLM's positions. Not an error:
/// RoPE has no table to run past, and a run may mean to extend the context; but the
/// export's config and tokenizer keep the old length.
pub fn past_max_position(
    config: &MllmConfig,
    data: &DatasetInfo,
    path: &std::path::Path,
) -> Option<String> {
    let positions = config.llm.max_position_embeddings as u64;
    (data.max_seq_len > positions).then(|| {
        format!(
            "warning: {} packs rows of up to {} tokens, past model.llm.max_position_embeddings = {positions}: positions beyond it were never trained in the base model, and the exported config.json and tokenizer still say {positions} (raise it, with rope.scaling if the model needs one, to train a longer context)",
            path.display(),
            data.max_seq_len
        )
    })
}

/// Checks that the model reads what the dataset holds; each message names both sides.
pub fn check_against_dataset(
    config: &MllmConfig,
    data: &DatasetInfo,
    data_key: &str,
) -> Result<()> {
    let vocab = data.tokenizer.vocab_size;
    if vocab > config.llm.vocab {
        return Err(invalid(
            "model.llm.vocab",
            format!(
                "{} is smaller than the vocabulary of the tokenizer {data_key} was packed with ({vocab})",
                config.llm.vocab
            ),
        )
        .into());
    }
    let s = &data.settings;
    match (&config.vision, &config.vision_projector) {
        (Some(v), Some(p))
            if v.image_size != s.image.size
                || v.patch_size != s.image.patch
                || p.spatial_merge != s.image.merge =>
        {
            return Err(invalid(
                "model.vision",
                format!(
                    "image_size {} / patch_size {} / spatial_merge {} differ from the data's [image] size {} / patch {} / merge {} ({data_key}): pack the data for this encoder or change the model",
                    v.image_size, v.patch_size, p.spatial_merge, s.image.size, s.image.patch, s.image.merge
                ),
            )
            .into());
        }
        (Some(v), Some(_)) => check_image_preset(v, &s.image, data_key)?,
        _ if data.images > 0 => {
            return Err(invalid(
                "model.vision",
                format!(
                    "{data_key} holds {} images but the model has no vision encoder",
                    data.images
                ),
            )
            .into());
        }
        _ => {}
    }
    match (&config.audio, &config.audio_projector) {
        (Some(a), Some(p)) => {
            if a.num_mel_bins != s.audio.decode.n_mels {
                return Err(invalid(
                    "model.audio.num_mel_bins",
                    format!(
                        "{} differs from the data's [audio.decode] n_mels = {} ({data_key})",
                        a.num_mel_bins, s.audio.decode.n_mels
                    ),
                )
                .into());
            }
            if p.stride != s.audio.pool_stride || s.audio.conv_stride != 2 {
                return Err(invalid(
                    "model.projector.audio.stride",
                    format!(
                        "{} (after the encoder's stride-2 conv) differs from the data's [audio] pool_stride = {} / conv_stride = {} ({data_key})",
                        p.stride, s.audio.pool_stride, s.audio.conv_stride
                    ),
                )
                .into());
            }
        }
        _ if data.audio_clips > 0 => {
            return Err(invalid(
                "model.audio",
                format!(
                    "{data_key} holds {} audio clips but the model has no audio encoder",
                    data.audio_clips
                ),
            )
            .into());
        }
        _ => {}
    }
    Ok(())
}

/// Checks that the data's pixels were made the way the model's vision family expects:
/// CLIP's processor (shortest-edge resize + centre crop, OpenAI CLIP mean/std) or
/// SigLIP's (exact resize, mean = std = 0.5). Size and patch are checked by the caller.
fn check_image_preset(
    model: &VisionConfig,
    data: &braid_dataloader::config::VisionSpec,
    data_key: &str,
) -> Result<()> {
    use braid_dataloader::media::image::ImageConfig;
    let (family, want) = match model.family {
        VisionFamily::Clip => ("clip", ImageConfig::clip(data.size)),
        VisionFamily::Siglip => ("siglip", ImageConfig::siglip(data.size)),
    };
    let got = data.image_config();
    if got.resize == want.resize && got.mean == want.mean && got.std == want.std {
        return Ok(());
    }
    let preset = match data.preset {
        braid_dataloader::config::ImagePreset::Clip => "clip",
        braid_dataloader::config::ImagePreset::Siglip => "siglip",
    };
    let describe =
        |c: &ImageConfig| format!("resize {:?}, mean {:?}, std {:?}", c.resize, c.mean, c.std);
    Err(invalid(
        "model.vision.family",
        format!(
            "\"{family}\" expects pixels made by its processor ({}), but the data's [image] preset = \"{preset}\" ({data_key}) made them with {}: pack the data with image.preset = \"{family}\" or set model.vision.family = \"{preset}\"",
            describe(&want),
            describe(&got)
        ),
    )
    .into())
}

/// Refuses a model whose f32 weights alone exceed this machine's memory (`MemTotal`;
/// skipped where it cannot be read): a size typo (`layers = 320` for 32) would otherwise
/// allocate layer after layer until the kernel kills the process. Grads and AdamW state
/// (3x more) are left to the allocator, so no CPU run that could fit is refused (a GPU
/// run's weights live in device memory: the caller checks only CPU runs).
pub fn check_host_memory(config: &MllmConfig) -> Result<()> {
    let Some(total) = mem_total_bytes() else {
        return Ok(());
    };
    let dims = crate::planning::model_dims(config);
    let params: u64 = dims
        .modules()
        .iter()
        .filter_map(|&m| dims.module(m))
        .map(|d| d.params())
        .fold(0u64, u64::saturating_add);
    let weights = params.saturating_mul(4);
    if weights > total {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        return Err(invalid(
            "model",
            format!(
                "{params} parameters: {:.0} GiB of f32 weights alone, more than this machine's {:.0} GiB of memory; check the model sizes (model.llm.layers, hidden, intermediate, vocab, ...)",
                gib(weights),
                gib(total)
            ),
        )
        .into());
    }
    Ok(())
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
pub fn mem_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The model: random init from `seed` for modules given by sizes, Hugging Face weights
/// for the others; then the config's freezing.
pub fn build_model(cfg: &RunConfig, config: MllmConfig, seed: u64, device: Device) -> Result<Mllm> {
    let init = Init::new(seed, device).with_std(cfg.model.init_std);
    let m = &cfg.model;
    let (llm_hf, vision_hf, audio_hf) = (
        m.llm.hf_path(),
        m.vision.as_ref().and_then(|v| v.hf_path()),
        m.audio.as_ref().and_then(|a| a.hf_path()),
    );
    // Modules read from Hugging Face are not randomly initialized first (for a 7B LLM the
    // draws would cost more than the load).
    let loaded = Loaded {
        llm: llm_hf.is_some(),
        vision: vision_hf.is_some(),
        audio: audio_hf.is_some(),
    };
    let mut model = Mllm::new_except(config.clone(), &init, loaded)?;
    if loaded != Loaded::default() {
        let mut parts: MllmParts = model.into_parts();
        if let Some(p) = llm_hf {
            parts.llm = Llm::from_hf_dir(p, device)?.0;
        }
        if let Some(p) = vision_hf {
            parts.vision = Some(VisionEncoder::from_hf_dir(p, device)?.model);
        }
        if let Some(p) = audio_hf {
            parts.audio = Some(WhisperEncoder::from_hf_dir(p, device)?.model);
        }
        model = Mllm::from_parts(config, parts)?;
    }
    let freeze = Freeze::from_names(&cfg.train.freeze)?;
    model.apply_freeze(freeze)?;
    // `parallel.<module>.recompute` for the one-rank run (a parallel rank's shard gets
    // it in `Engine::new`).
    let p = &cfg.parallel;
    model.set_recompute(p.llm.recompute, p.vision.recompute, p.audio.recompute);
    Ok(model)
}

/// What the model a config describes holds: parameter elements and tensors, in all and
/// trainable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelCounts {
    pub params: usize,
    pub trainable: usize,
    pub tensors: usize,
    pub trainable_tensors: usize,
}

/// What the model `config` describes holds under `freeze`, without building it: each
/// module is laid out one layer at a time (weights only, zero, on the host), its distinct
/// parameter names counted and the layer dropped, so counting holds at most one layer (or
/// the embedding table), never the model.
pub fn model_counts(config: &MllmConfig, freeze: Freeze) -> Result<ModelCounts> {
    use std::collections::HashMap;
    use std::sync::Arc;

    use braid_comm::SingleRank;
    use braid_encoders::{AudioProjector, MlpProjector};
    use braid_llm::LlmStage;

    let init = Init::for_loading(Device::Cpu).frozen();
    // name -> elements, per module (a tied embedding's copy on a last stage shares the
    // first stage's name and is counted once).
    fn add<M: Module>(m: &M, seen: &mut HashMap<String, usize>) {
        m.visit_params(&mut |p| {
            seen.insert(p.name.clone(), p.value.elem_count());
        });
    }
    let one = || Arc::new(SingleRank) as Arc<dyn braid_comm::Comm>;
    // (elements, tensors, frozen) per module.
    let mut modules: Vec<(usize, usize, bool)> = Vec::new();
    let mut push = |seen: HashMap<String, usize>, frozen: bool| {
        modules.push((seen.values().sum(), seen.len(), frozen));
    };
    let mut llm = HashMap::new();
    for i in 0..config.llm.layers {
        add(
            &LlmStage::new(&config.llm, i..i + 1, &init, one())?,
            &mut llm,
        );
    }
    push(llm, freeze.llm);
    if let Some(v) = &config.vision {
        let mut seen = HashMap::new();
        for i in 0..v.num_layers {
            add(
                &VisionEncoder::stage(&init, v.clone(), i..i + 1, one())?,
                &mut seen,
            );
        }
        push(seen, freeze.vision);
    }
    if let Some(p) = &config.vision_projector {
        let mut seen = HashMap::new();
        add(
            &MlpProjector::new(&init, "vision_projector", p.projector())?,
            &mut seen,
        );
        push(seen, freeze.vision_projector);
    }
    if let Some(a) = &config.audio {
        let mut seen = HashMap::new();
        for i in 0..a.encoder_layers {
            add(
                &WhisperEncoder::stage(&init, a.clone(), i..i + 1, one())?,
                &mut seen,
            );
        }
        push(seen, freeze.audio);
    }
    if let Some(p) = &config.audio_projector {
        let mut seen = HashMap::new();
        let proj = AudioProjector::new(
            &init,
            "audio_projector",
            p.in_dim,
            p.out_dim,
            p.stride,
            p.activation(),
        )?;
        add(&proj, &mut seen);
        push(seen, freeze.audio_projector);
    }
    // The layers are gone: their pages should not add to the next phase's peak.
    crate::metrics::return_freed_memory();
    let trainable = modules.iter().filter(|m| !m.2);
    Ok(ModelCounts {
        params: modules.iter().map(|m| m.0).sum(),
        tensors: modules.iter().map(|m| m.1).sum(),
        trainable: trainable.clone().map(|m| m.0).sum(),
        trainable_tensors: trainable.map(|m| m.1).sum(),
    })
}

/// Parameters in total and trainable.
pub fn param_counts(model: &Mllm) -> (usize, usize) {
    let mut total = 0;
    let mut trainable = 0;
    model.visit_params(&mut |p| {
        total += p.value.elem_count();
        if p.is_trainable() {
            trainable += p.value.elem_count();
        }
    });
    (total, trainable)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Counting layer by layer gives exactly what the built model holds, for a tied and
    /// an untied LLM, CLIP and SigLIP towers, and frozen modules.
    #[test]
    fn counts_without_building_match_the_built_model() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.toml");
        let variants: [&[&str]; 4] = [
            &[],
            &["model.llm.tie_embeddings=false", "model.llm.layers=3"],
            &[
                r#"model.vision.family="clip""#,
                r#"train.freeze=["vision", "audio_projector"]"#,
            ],
            &["model.vision.use_head=true", r#"train.freeze=["llm"]"#],
        ];
        for sets in variants {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let cfg = RunConfig::from_file(&path, &sets).unwrap();
            let config = model_config(&cfg).unwrap();
            let freeze = Freeze::from_names(&cfg.train.freeze).unwrap();
            let model = build_model(&cfg, config.clone(), 1, Device::Cpu).unwrap();
            let want = param_counts(&model);
            assert!(want.0 > 0 && want.1 > 0, "{sets:?}");
            let got = model_counts(&config, freeze).unwrap();
            assert_eq!((got.params, got.trainable), want, "{sets:?}");
            let (mut tensors, mut trainable) = (0, 0);
            model.visit_params(&mut |p| {
                tensors += 1;
                trainable += usize::from(p.is_trainable());
            });
            assert_eq!(
                (got.tensors, got.trainable_tensors),
                (tensors, trainable),
                "{sets:?}"
            );
        }
    }
}
