//! CLIP/SigLIP vision towers <-> Hugging Face checkpoints: the one name table, import
//! (`from_hf_dir`) and export (`export_hf`).
//!
//! Import reads CLIPVisionModel, CLIPModel, SiglipVisionModel and SiglipModel
//! directories; the tower's tensors are bare (`embeddings.*`, as transformers 5.x
//! saves a *VisionModel) or under `vision_model.` (hub checkpoints and the two-tower
//! models). Export writes a CLIPVisionModel / SiglipVisionModel directory with bare
//! names, which `from_pretrained` of that class loads.

use std::path::Path;
use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::Device;
use braid_nn::hf::{WeightFiles, read_json, write_json};
use braid_nn::{Error, Init, Result};
use serde_json::{Value, json};

use crate::config::{VisionConfig, VisionFamily};
use crate::vision::VisionEncoder;
use crate::weights::{Layout, NameMap, find_prefix, load_params_sharded, save_params};

/// A model read from a Hugging Face directory, with what the checkpoint held beyond it.
#[derive(Debug)]
pub struct HfImport<M> {
    pub model: M,
    /// `architectures[0]` of config.json.
    pub architecture: String,
    /// Where the module's tensors live in the checkpoint (`""`, `"vision_model."`, ...).
    pub prefix: String,
    /// Checkpoint tensors the model did not use (a two-tower model's text side, a
    /// Whisper decoder), sorted.
    pub unused: Vec<String>,
}

/// The name table of a vision tower (HF names without the checkpoint prefix).
pub fn vision_name_map(cfg: &VisionConfig) -> NameMap {
    let (d, c, p) = (cfg.hidden_size, cfg.num_channels, cfg.patch_size);
    let clip = cfg.family == VisionFamily::Clip;
    let mut m = NameMap::default();
    let pe = "embeddings.patch_embedding";
    m.push(
        format!("{pe}.weight"),
        format!("{pe}.weight"),
        Layout::Reshape(vec![d, c, p, p]),
    );
    if !clip {
        m.push(format!("{pe}.bias"), format!("{pe}.bias"), Layout::Same);
    }
    if clip {
        let ce = "embeddings.class_embedding";
        m.push(ce, ce, Layout::Reshape(vec![d]));
    }
    let pos = "embeddings.position_embedding.weight";
    m.push(pos, pos, Layout::Same);
    if clip {
        m.push_wb("pre_layrnorm", "pre_layrnorm", true);
    }
    for i in 0..cfg.num_layers {
        let l = format!("encoder.layers.{i}");
        m.push_wb(
            &format!("{l}.input_layernorm"),
            &format!("{l}.layer_norm1"),
            true,
        );
        for proj in ["q_proj", "k_proj", "v_proj"] {
            let n = format!("{l}.self_attn.{proj}");
            m.push_wb(&n, &n, true);
        }
        m.push_wb(
            &format!("{l}.self_attn.o_proj"),
            &format!("{l}.self_attn.out_proj"),
            true,
        );
        m.push_wb(
            &format!("{l}.post_attention_layernorm"),
            &format!("{l}.layer_norm2"),
            true,
        );
        for fc in ["fc1", "fc2"] {
            let n = format!("{l}.mlp.{fc}");
            m.push_wb(&n, &n, true);
        }
    }
    m.push_wb("post_layernorm", "post_layernorm", true);
    if cfg.use_head {
        m.push("head.probe", "head.probe", Layout::Reshape(vec![1, 1, d]));
        for (index, proj) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
            let layout = Layout::Chunk { index, count: 3 };
            let b = format!("head.attention.{proj}");
            m.push(
                format!("{b}.weight"),
                "head.attention.in_proj_weight",
                layout.clone(),
            );
            m.push(format!("{b}.bias"), "head.attention.in_proj_bias", layout);
        }
        m.push_wb("head.attention.o_proj", "head.attention.out_proj", true);
        m.push_wb("head.layernorm", "head.layernorm", true);
        m.push_wb("head.mlp.fc1", "head.mlp.fc1", true);
        m.push_wb("head.mlp.fc2", "head.mlp.fc2", true);
    }
    m
}

impl VisionEncoder {
    /// Builds the encoder from an HF directory (config.json + safetensors, single or
    /// sharded), loading tensors one at a time onto `device`.
    pub fn from_hf_dir(dir: &Path, device: Device) -> Result<HfImport<VisionEncoder>> {
        Self::from_hf_dir_with_group(dir, device, Arc::new(SingleRank))
    }

    /// [`Self::from_hf_dir`] for this rank's shard over the tensor-parallel group `tp`:
    /// each split parameter is cut from the checkpoint's full tensor on the host.
    pub fn from_hf_dir_with_group(
        dir: &Path,
        device: Device,
        tp: Arc<dyn Comm>,
    ) -> Result<HfImport<VisionEncoder>> {
        let cfg: Value = read_json(&dir.join("config.json"))?;
        let hf = VisionConfig::from_hf_config(&cfg)?;
        let mut model = VisionEncoder::with_group(&Init::for_loading(device), hf.config, tp)?;
        let (prefix, unused) = model.load_hf_files(dir, &hf.architecture, device)?;
        Ok(HfImport {
            model,
            architecture: hf.architecture,
            prefix,
            unused,
        })
    }

    /// Overwrites this encoder (the whole tower, a pipeline stage of it or a
    /// tensor-parallel shard) from an HF directory of the same config: each split
    /// parameter is cut from the checkpoint's tensor on the host, one tensor at a time.
    /// Returns the tensors of the files it did not use (other stages' layers among them).
    pub fn load_hf_dir(&mut self, dir: &Path, device: Device) -> Result<Vec<String>> {
        let cfg: Value = read_json(&dir.join("config.json"))?;
        let hf = VisionConfig::from_hf_config(&cfg)?;
        if hf.config != self.config {
            return Err(Error::config(
                "vision encoder",
                format!(
                    "{}: the checkpoint's config differs from this encoder's",
                    dir.display()
                ),
            ));
        }
        Ok(self.load_hf_files(dir, &hf.architecture, device)?.1)
    }

    /// Every parameter of this encoder from the weights of `dir` (written by a model of
    /// `architecture`): the tower's prefix in the files, and the tensors left unused.
    fn load_hf_files(
        &mut self,
        dir: &Path,
        architecture: &str,
        device: Device,
    ) -> Result<(String, Vec<String>)> {
        let files = WeightFiles::open_dir(dir)?;
        let candidates: &[&str] = match architecture {
            "CLIPModel" | "SiglipModel" => &["vision_model."],
            _ => &["", "vision_model."],
        };
        let prefix = find_prefix(&files, dir, "embeddings.patch_embedding.weight", candidates)?;
        let map = vision_name_map(&self.config);
        let shards = self.tp_shards();
        let unused = load_params_sharded(self, &map, &files, &prefix, device, &shards)?;
        Ok((prefix, unused))
    }

    /// The HF `config.json` of this tower as a single-tower model.
    pub fn hf_config(&self) -> Value {
        let c = &self.config;
        let (arch, model_type) = match c.family {
            VisionFamily::Clip => ("CLIPVisionModel", "clip_vision_model"),
            VisionFamily::Siglip => ("SiglipVisionModel", "siglip_vision_model"),
        };
        let mut v = json!({
            "architectures": [arch],
            "model_type": model_type,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_channels": c.num_channels,
            "image_size": c.image_size,
            "patch_size": c.patch_size,
            "hidden_act": c.act.hf_name(),
            "layer_norm_eps": c.layer_norm_eps,
            "attention_dropout": 0.0,
            "dtype": "float32",
        });
        if c.family == VisionFamily::Siglip
            && let Some(o) = v.as_object_mut()
        {
            o.insert("vision_use_head".into(), json!(c.use_head));
        }
        v
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (f32, bare HF names) that
    /// `CLIPVisionModel` / `SiglipVisionModel.from_pretrained(dir)` loads.
    pub fn export_hf(&self, dir: &Path) -> Result<()> {
        if self.tp_size() != 1 {
            return Err(Error::config(
                "export_hf",
                format!(
                    "the vision encoder is split over a tensor-parallel group of {}; export needs the full weights",
                    self.tp_size()
                ),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create directory", e))?;
        let map = vision_name_map(&self.config);
        save_params(self, &map, "", &dir.join("model.safetensors"))?;
        write_json(&dir.join("config.json"), &self.hf_config())
    }
}
