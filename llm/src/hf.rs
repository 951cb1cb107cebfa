//! Hugging Face checkpoints of `LlamaForCausalLM` / `Qwen2ForCausalLM`: import (one
//! tensor at a time into the parameters) and export (`config.json` +
//! `model.safetensors` that `from_pretrained` loads).

use std::collections::BTreeSet;
use std::path::Path;

use braid_kernels::Device;
use braid_nn::hf::{WeightFiles, save_safetensors, write_json};
use braid_nn::{Error, Module, Result};

use crate::config::LlmConfig;
use crate::{Llm, LlmStage};

/// Braid parameter name -> Hugging Face state-dict key, for import and export alike
/// (Llama and Qwen2 share it): everything but `lm_head` lives under `model.`
/// (`layers.3.self_attn.q_proj.weight` -> `model.layers.3.self_attn.q_proj.weight`).
/// With tied embeddings there is no `lm_head.weight` parameter, so none is written —
/// as Hugging Face's `save_pretrained` does.
pub fn hf_name(braid: &str) -> String {
    if braid.starts_with("lm_head.") {
        braid.to_string()
    } else {
        format!("model.{braid}")
    }
}

/// What an import read, and what in the files it did not use.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HfLoadReport {
    /// Hugging Face names of the tensors loaded into parameters, in parameter order.
    pub loaded: Vec<String>,
    /// Tensors present in the files that no parameter uses (rotary `inv_freq` buffers,
    /// an `lm_head.weight` next to tied embeddings, other stages' layers), sorted.
    pub unused: Vec<String>,
}

impl LlmStage {
    /// Replaces every parameter of this stage with the checkpoint's tensor of the same
    /// (mapped) name, one tensor at a time; a tensor-parallel shard reads only its slice. A missing tensor or a shape mismatch is an
    /// error naming the file, the tensor and both shapes. Returns the names loaded.
    pub fn load_hf(&mut self, files: &WeightFiles) -> Result<Vec<String>> {
        let mut loaded = Vec::new();
        let mut first_err = None;
        self.visit_params_mut(&mut |p| {
            if first_err.is_some() {
                return;
            }
            let name = hf_name(&p.name);
            let device = p.value.device();
            // A tensor-parallel shard reads only its slice of the stored full tensor.
            let full = p.shard.full_dims(&p.name, p.value.dims());
            match full.and_then(|full| files.load_shard(&name, &full, p.shard, device)) {
                Ok(t) => {
                    p.value = t;
                    loaded.push(name);
                }
                Err(e) => first_err = Some(e),
            }
        });
        match first_err {
            Some(e) => Err(e),
            None => Ok(loaded),
        }
    }
}

impl Llm {
    /// Builds the model a Hugging Face directory describes (`config.json`, then
    /// `model.safetensors` or a sharded index; f32/f16/bf16 on disk, f32 in memory) on
    /// `device`. The parameters are first created (initialized, then overwritten one
    /// tensor at a time as it is read from the memory-mapped files).
    pub fn from_hf_dir(dir: &Path, device: Device) -> Result<(Self, HfLoadReport)> {
        let config = LlmConfig::from_hf_config(dir)?;
        let files = WeightFiles::open_dir(dir)?;
        // std 0: no weight is used before it is overwritten.
        let mut llm = Llm::new(&config, &braid_nn::Init::for_loading(device))?;
        let loaded = llm.stage.load_hf(&files)?;
        let used: BTreeSet<&str> = loaded.iter().map(String::as_str).collect();
        let unused = files
            .names()
            .filter(|n| !used.contains(n))
            .map(str::to_string)
            .collect();
        Ok((llm, HfLoadReport { loaded, unused }))
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (f32, Hugging Face names)
    /// so that `AutoModelForCausalLM.from_pretrained(dir)` loads this model. Both files
    /// are written atomically. Needs the whole, unsharded model (tensor-parallel group
    /// of one).
    pub fn export_hf(&self, dir: &Path) -> Result<()> {
        if let Some(b) = self.stage.blocks.first()
            && b.self_attn.group.size() != 1
        {
            return Err(Error::config(
                "export_hf",
                format!(
                    "the model is split over a tensor-parallel group of {}; export needs the full weights",
                    b.self_attn.group.size()
                ),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create directory", e))?;
        let mut tensors = Vec::new();
        self.visit_params(&mut |p| tensors.push((hf_name(&p.name), &p.value)));
        save_safetensors(&dir.join("model.safetensors"), &tensors)?;
        write_json(&dir.join("config.json"), &self.config().to_hf_json())
    }
}
