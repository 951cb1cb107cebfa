//! Whisper encoder <-> Hugging Face checkpoints: the one name table, import and export.
//!
//! Import reads WhisperModel (`encoder.*`) and WhisperForConditionalGeneration
//! (`model.encoder.*`) directories; the decoder's tensors are reported as unused.
//!
//! Export writes an *encoder-only* WhisperModel directory: config.json (the encoder's
//! sizes; the decoder is declared with one layer of minimal width, as the config class
//! requires one) and `encoder.*` tensors. `WhisperModel.from_pretrained(dir)` loads
//! it, reporting the decoder weights as missing (randomly initialized): use its
//! `.encoder` (or `.get_encoder()`), which holds exactly the exported weights.

use std::path::Path;
use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::Device;
use braid_nn::hf::{WeightFiles, read_json, write_json};
use braid_nn::{Error, Init, Result};
use serde_json::{Value, json};

use crate::audio::WhisperEncoder;
use crate::config::WhisperEncoderConfig;
use crate::vision_hf::HfImport;
use crate::weights::{Layout, NameMap, find_prefix, load_params_sharded, save_params};

/// The name table of a Whisper encoder (HF names without `encoder.` / `model.encoder.`).
pub fn whisper_name_map(cfg: &WhisperEncoderConfig) -> NameMap {
    let mut m = NameMap::default();
    m.push_wb("conv1", "conv1", true);
    m.push_wb("conv2", "conv2", true);
    m.push(
        "embed_positions.weight",
        "embed_positions.weight",
        Layout::Same,
    );
    for i in 0..cfg.encoder_layers {
        let l = format!("layers.{i}");
        m.push_wb(
            &format!("{l}.input_layernorm"),
            &format!("{l}.self_attn_layer_norm"),
            true,
        );
        for (proj, bias) in [("q_proj", true), ("k_proj", false), ("v_proj", true)] {
            let n = format!("{l}.self_attn.{proj}");
            m.push_wb(&n, &n, bias);
        }
        m.push_wb(
            &format!("{l}.self_attn.o_proj"),
            &format!("{l}.self_attn.out_proj"),
            true,
        );
        m.push_wb(
            &format!("{l}.post_attention_layernorm"),
            &format!("{l}.final_layer_norm"),
            true,
        );
        m.push_wb(&format!("{l}.mlp.fc1"), &format!("{l}.fc1"), true);
        m.push_wb(&format!("{l}.mlp.fc2"), &format!("{l}.fc2"), true);
    }
    m.push_wb("layer_norm", "layer_norm", true);
    m
}

impl WhisperEncoder {
    /// Builds the encoder from an HF Whisper directory, loading tensors one at a time.
    pub fn from_hf_dir(dir: &Path, device: Device) -> Result<HfImport<WhisperEncoder>> {
        Self::from_hf_dir_with_group(dir, device, Arc::new(SingleRank))
    }

    /// [`Self::from_hf_dir`] for this rank's shard over the tensor-parallel group `tp`:
    /// each split parameter is cut from the checkpoint's full tensor on the host.
    pub fn from_hf_dir_with_group(
        dir: &Path,
        device: Device,
        tp: Arc<dyn Comm>,
    ) -> Result<HfImport<WhisperEncoder>> {
        let cfg: Value = read_json(&dir.join("config.json"))?;
        let (config, architecture) = WhisperEncoderConfig::from_hf_config(&cfg)?;
        let mut model = WhisperEncoder::with_group(&Init::for_loading(device), config, tp)?;
        let (prefix, unused) = model.load_hf_files(dir, device)?;
        Ok(HfImport {
            model,
            architecture,
            prefix,
            unused,
        })
    }

    /// Overwrites this encoder (the whole encoder, a pipeline stage of it or a
    /// tensor-parallel shard) from an HF Whisper directory of the same config, one tensor
    /// at a time. Returns the tensors of the files it did not use.
    pub fn load_hf_dir(&mut self, dir: &Path, device: Device) -> Result<Vec<String>> {
        let cfg: Value = read_json(&dir.join("config.json"))?;
        let (config, _) = WhisperEncoderConfig::from_hf_config(&cfg)?;
        if config != self.config {
            return Err(Error::config(
                "audio encoder",
                format!(
                    "{}: the checkpoint's config differs from this encoder's",
                    dir.display()
                ),
            ));
        }
        Ok(self.load_hf_files(dir, device)?.1)
    }

    /// Every parameter of this encoder from the weights of `dir`: the encoder's prefix in
    /// the files, and the tensors left unused.
    fn load_hf_files(&mut self, dir: &Path, device: Device) -> Result<(String, Vec<String>)> {
        let files = WeightFiles::open_dir(dir)?;
        let prefix = find_prefix(&files, dir, "conv1.weight", &["encoder.", "model.encoder."])?;
        let map = whisper_name_map(&self.config);
        let shards = self.tp_shards();
        let unused = load_params_sharded(self, &map, &files, &prefix, device, &shards)?;
        Ok((prefix, unused))
    }

    /// The WhisperModel `config.json` written on export.
    pub fn hf_config(&self) -> Value {
        let c = &self.config;
        json!({
            "architectures": ["WhisperModel"],
            "model_type": "whisper",
            "num_mel_bins": c.num_mel_bins,
            "d_model": c.d_model,
            "encoder_layers": c.encoder_layers,
            "encoder_attention_heads": c.encoder_attention_heads,
            "encoder_ffn_dim": c.encoder_ffn_dim,
            "max_source_positions": c.max_source_positions,
            "activation_function": c.act.hf_name(),
            // The decoder is not exported: the smallest one the config class accepts.
            "decoder_layers": 1,
            "decoder_attention_heads": c.encoder_attention_heads,
            "decoder_ffn_dim": 4,
            "max_target_positions": 8,
            "vocab_size": 8,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 3,
            "scale_embedding": false,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "dtype": "float32",
        })
    }

    /// Writes an encoder-only WhisperModel directory (see the module doc).
    pub fn export_hf(&self, dir: &Path) -> Result<()> {
        if self.tp_size() != 1 {
            return Err(Error::config(
                "export_hf",
                format!(
                    "the audio encoder is split over a tensor-parallel group of {}; export needs the full weights",
                    self.tp_size()
                ),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create directory", e))?;
        let map = whisper_name_map(&self.config);
        save_params(self, &map, "encoder.", &dir.join("model.safetensors"))?;
        write_json(&dir.join("config.json"), &self.hf_config())
    }
}
