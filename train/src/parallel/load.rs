//! A rank's shard made without the full model (one process per rank): random weights
//! drawn by name exactly as the full model draws them, modules started from Hugging Face
//! read slice by slice from the memory-mapped files, and a checkpoint of any layout read
//! slice by slice on resume. No process ever holds more than its share plus one tensor.

use std::collections::HashMap;
use std::path::Path;

use braid_comm::Comm;
use braid_kernels::Device;
use braid_nn::hf::WeightFiles;
use braid_nn::{Init, Module, Shard};

use super::ckpt::SliceReader;
use super::engine::Engine;
use super::layout::Layouts;
use super::model::{ModuleInits, RankModel};
use crate::assemble::ModelCounts;
use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::mllm::{Freeze, MllmConfig, module_init};

/// This rank's shards of `config` under `cfg`, as [`crate::assemble::build_model`] would
/// make the full model and [`RankModel::build`] would cut it: the same per-name draws
/// from the same per-module seeds, the same Hugging Face tensors, the same freezing.
pub fn build_direct(
    config: &MllmConfig,
    cfg: &RunConfig,
    world: &dyn Comm,
    layouts: &Layouts,
    rank: usize,
) -> Result<RankModel> {
    let device = cfg.parallel.kernel_device();
    let init = Init::new(cfg.run.seed, device).with_std(cfg.model.init_std);
    let zeros = Init::for_loading(device);
    let m = &cfg.model;
    let llm_hf = m.llm.hf_path();
    let vision_hf = m.vision.as_ref().and_then(|v| v.hf_path());
    let audio_hf = m.audio.as_ref().and_then(|a| a.hf_path());
    // `Mllm::new_except`'s seeds: the LLM draws from the run's init, every other module
    // from its own; a module read from Hugging Face draws nothing.
    let inits = ModuleInits {
        vision: if vision_hf.is_some() {
            zeros
        } else {
            module_init(&init, "vision")
        },
        vision_projector: module_init(&init, "vision_projector"),
        audio: if audio_hf.is_some() {
            zeros
        } else {
            module_init(&init, "audio")
        },
        audio_projector: module_init(&init, "audio_projector"),
        llm: if llm_hf.is_some() { zeros } else { init },
    };
    let mut model = RankModel::shells(config, &inits, world, layouts, rank)?;
    // Hugging Face files name the modules' tensors without Braid's module prefixes.
    if let (Some(dir), Some(v)) = (vision_hf, model.vision.as_mut()) {
        v.encoder.load_hf_dir(dir, device)?;
    }
    if let (Some(dir), Some(a)) = (audio_hf, model.audio.as_mut()) {
        a.encoder.load_hf_dir(dir, device)?;
    }
    if let (Some(dir), Some(l)) = (llm_hf, model.llm.as_mut()) {
        let files = WeightFiles::open_dir(dir)?;
        for c in &mut l.chunks {
            c.load_hf(&files)?;
        }
    }
    model.add_prefixes();
    apply_freeze(&mut model, config, Freeze::from_names(&cfg.train.freeze)?)?;
    Ok(model)
}

/// `train.freeze` on a rank's shards (`Mllm::apply_freeze`'s rules: freezing a module
/// the model lacks is an error, whether or not this rank holds it).
fn apply_freeze(model: &mut RankModel, config: &MllmConfig, f: Freeze) -> Result<()> {
    let has = [
        (f.vision, config.vision.is_some(), "vision"),
        (
            f.vision_projector,
            config.vision_projector.is_some(),
            "vision_projector",
        ),
        (f.audio, config.audio.is_some(), "audio"),
        (
            f.audio_projector,
            config.audio_projector.is_some(),
            "audio_projector",
        ),
    ];
    for (flag, present, name) in has {
        if flag && !present {
            return Err(crate::config::invalid(
                "train.freeze",
                format!("`{name}` is frozen but the model has no {name}"),
            )
            .into());
        }
    }
    if let Some(v) = &mut model.vision {
        if f.vision {
            v.encoder.freeze();
        }
        if let (true, Some(p)) = (f.vision_projector, v.projector.as_mut()) {
            p.freeze();
        }
    }
    if let Some(a) = &mut model.audio {
        if f.audio {
            a.encoder.freeze();
        }
        if let (true, Some(p)) = (f.audio_projector, a.projector.as_mut()) {
            p.freeze();
        }
    }
    if let (true, Some(l)) = (f.llm, model.llm.as_mut()) {
        for c in &mut l.chunks {
            c.freeze();
        }
    }
    Ok(())
}

/// Restores this rank's weights and AdamW moments from checkpoint `dir`, written under
/// any layout: each tensor is read as this rank's slice (a slice stored as such is read
/// as is; otherwise one full tensor at a time is joined and cut). The checkpoint must hold
/// exactly the model's tensors (`counts`, of the whole model: every rank checks alike),
/// as a one-rank load requires.
pub fn load_rank_checkpoint(
    dir: &Path,
    engine: &mut Engine,
    optimizer_step: u64,
    device: Device,
    counts: ModelCounts,
) -> Result<()> {
    let weights = SliceReader::open(dir, "model")?;
    let moments = SliceReader::open(dir, "optim")?;
    let mismatch = |reason: String| TrainError::Checkpoint {
        path: dir.to_path_buf(),
        reason,
    };
    if weights.len() != counts.tensors {
        return Err(mismatch(format!(
            "{} tensors stored but the model has {} parameters: the checkpoint is of another model",
            weights.len(),
            counts.tensors
        )));
    }
    if moments.len() != 2 * counts.trainable_tensors {
        return Err(mismatch(format!(
            "{} tensors stored for {} trainable parameters (2 each): were other modules frozen?",
            moments.len(),
            counts.trainable_tensors
        )));
    }
    let mut shards: HashMap<String, Shard> = HashMap::new();
    let mut res: Result<()> = Ok(());
    engine.model.visit_params_mut(&mut |p| {
        if res.is_err() {
            return;
        }
        shards.insert(p.name.clone(), p.shard);
        res = weights
            .tensor(&p.name, p.shard, p.value.dims(), device)
            .and_then(|t| {
                p.value = t;
                // A loaded master re-derives its compute copy (mixed precision).
                Ok(p.refresh_compute()?)
            });
    });
    res?;
    for m in &mut engine.optim.moments {
        let shard = shards.get(&m.name).copied().ok_or_else(|| {
            TrainError::Other(format!("optimizer state for `{}`, not a parameter", m.name))
        })?;
        for (suffix, t) in [
            ("exp_avg", &mut m.exp_avg),
            ("exp_avg_sq", &mut m.exp_avg_sq),
        ] {
            let name = format!("{}.{suffix}", m.name);
            *t = moments.tensor(&name, shard, t.dims(), device)?;
        }
    }
    engine.optim.step = optimizer_step;
    Ok(())
}
