//! Braid's own, validated encoder configs (`[model.vision]`, `[model.audio]` in a run
//! TOML) and their construction from a Hugging Face `config.json`.
//!
//! HF files are parsed permissively (they carry many keys Braid ignores); missing
//! size keys take the defaults of the transformers config classes, as
//! `from_pretrained` would. Braid's own TOML-facing structs deny unknown fields.

use braid_kernels::ops::Activation;
use braid_nn::error::{MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_TABLE, MAX_WIDTH};
use braid_nn::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The MLP nonlinearity, by its Hugging Face `hidden_act` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    /// `gelu`: exact erf GELU.
    Gelu,
    /// `gelu_pytorch_tanh` / `gelu_new`: the tanh approximation.
    GeluPytorchTanh,
    /// `quick_gelu`: x sigmoid(1.702 x) (CLIP).
    QuickGelu,
}

impl Act {
    /// The kernel activation.
    pub fn kernel(self) -> Activation {
        match self {
            Act::Gelu => Activation::GeluErf,
            Act::GeluPytorchTanh => Activation::GeluTanh,
            Act::QuickGelu => Activation::QuickGelu,
        }
    }

    /// Parses a Hugging Face `hidden_act` / `activation_function` value.
    pub fn from_hf(key: &str, name: &str) -> Result<Self> {
        match name {
            "gelu" => Ok(Act::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Ok(Act::GeluPytorchTanh),
            "quick_gelu" => Ok(Act::QuickGelu),
            other => Err(Error::config(
                "HF config",
                format!(
                    "{key} = {other:?} is not supported; allowed: \"gelu\", \"gelu_pytorch_tanh\", \"gelu_new\", \"quick_gelu\""
                ),
            )),
        }
    }

    /// The Hugging Face name written on export.
    pub fn hf_name(self) -> &'static str {
        match self {
            Act::Gelu => "gelu",
            Act::GeluPytorchTanh => "gelu_pytorch_tanh",
            Act::QuickGelu => "quick_gelu",
        }
    }
}

/// The two ViT families.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionFamily {
    /// CLIP: class token, `pre_layrnorm`, last_hidden_state not post-normed, pooler =
    /// post_layernorm(class token).
    Clip,
    /// SigLIP: no class token, patch-embedding bias, post_layernorm on every token,
    /// optional attention-pooling head.
    Siglip,
}

/// A ViT image encoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionConfig {
    pub family: VisionFamily,
    /// D
    pub hidden_size: usize,
    /// MLP width
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    /// C (3 for RGB)
    pub num_channels: usize,
    /// The square image side the position table was trained for (H = W).
    pub image_size: usize,
    /// P
    pub patch_size: usize,
    pub act: Act,
    pub layer_norm_eps: f32,
    /// SigLIP's attention-pooling head (`head.*`), the pooler_output.
    #[serde(default)]
    pub use_head: bool,
}

fn positive(what: &'static str, key: &str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(Error::config(what, format!("{key} = 0 must be > 0")));
    }
    Ok(())
}

fn check_eps(what: &'static str, eps: f32) -> Result<()> {
    if !(eps > 0.0 && eps.is_finite()) {
        return Err(Error::config(
            what,
            format!("layer_norm_eps = {eps} must be a positive number"),
        ));
    }
    Ok(())
}

impl VisionConfig {
    pub fn validate(&self) -> Result<()> {
        const W: &str = "VisionConfig";
        positive(W, "hidden_size", self.hidden_size)?;
        positive(W, "intermediate_size", self.intermediate_size)?;
        positive(W, "num_layers", self.num_layers)?;
        positive(W, "num_heads", self.num_heads)?;
        positive(W, "num_channels", self.num_channels)?;
        positive(W, "image_size", self.image_size)?;
        positive(W, "patch_size", self.patch_size)?;
        Error::check_sizes(
            W,
            &[
                ("hidden_size", self.hidden_size, MAX_WIDTH),
                ("intermediate_size", self.intermediate_size, MAX_FFN),
                ("num_layers", self.num_layers, MAX_LAYERS),
                ("num_heads", self.num_heads, MAX_HEADS),
                ("num_channels", self.num_channels, MAX_HEADS),
                // 65,536 pixels a side: 4 gigapixels an image.
                ("image_size", self.image_size, 1 << 16),
            ],
        )?;
        check_eps(W, self.layer_norm_eps)?;
        if !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(Error::config(
                W,
                format!(
                    "hidden_size = {} is not a multiple of num_heads = {}",
                    self.hidden_size, self.num_heads
                ),
            ));
        }
        if !self.image_size.is_multiple_of(self.patch_size) {
            return Err(Error::config(
                W,
                format!(
                    "image_size = {} is not a multiple of patch_size = {}",
                    self.image_size, self.patch_size
                ),
            ));
        }
        if self.use_head && self.family == VisionFamily::Clip {
            return Err(Error::config(
                W,
                "use_head = true is a SigLIP option; CLIP pools its class token",
            ));
        }
        Ok(())
    }

    /// N = (image_size / P)^2 patches per image.
    pub fn num_patches(&self) -> usize {
        let g = self.image_size / self.patch_size;
        g * g
    }

    /// Rows of the position table: N, plus one for CLIP's class token.
    pub fn num_positions(&self) -> usize {
        self.num_patches() + usize::from(self.family == VisionFamily::Clip)
    }

    /// Head size HS = D / NH.
    pub fn head_size(&self) -> usize {
        self.hidden_size / self.num_heads
    }
}

/// A Whisper-style audio encoder: conv stem, learned positions, pre-norm blocks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WhisperEncoderConfig {
    /// Mel channels of the input features.
    pub num_mel_bins: usize,
    /// D
    pub d_model: usize,
    pub encoder_layers: usize,
    pub encoder_attention_heads: usize,
    pub encoder_ffn_dim: usize,
    /// Rows of the position table: the longest clip after the stride-2 conv (1500 for
    /// 30 s of Whisper audio).
    pub max_source_positions: usize,
    pub act: Act,
    /// LayerNorm eps (PyTorch's default 1e-5 in Whisper).
    pub layer_norm_eps: f32,
}

impl WhisperEncoderConfig {
    pub fn validate(&self) -> Result<()> {
        const W: &str = "WhisperEncoderConfig";
        positive(W, "num_mel_bins", self.num_mel_bins)?;
        positive(W, "d_model", self.d_model)?;
        positive(W, "encoder_layers", self.encoder_layers)?;
        positive(W, "encoder_attention_heads", self.encoder_attention_heads)?;
        positive(W, "encoder_ffn_dim", self.encoder_ffn_dim)?;
        positive(W, "max_source_positions", self.max_source_positions)?;
        Error::check_sizes(
            W,
            &[
                ("num_mel_bins", self.num_mel_bins, MAX_HEADS),
                ("d_model", self.d_model, MAX_WIDTH),
                ("encoder_layers", self.encoder_layers, MAX_LAYERS),
                (
                    "encoder_attention_heads",
                    self.encoder_attention_heads,
                    MAX_HEADS,
                ),
                ("encoder_ffn_dim", self.encoder_ffn_dim, MAX_FFN),
                ("max_source_positions", self.max_source_positions, MAX_TABLE),
            ],
        )?;
        check_eps(W, self.layer_norm_eps)?;
        if !self.d_model.is_multiple_of(self.encoder_attention_heads) {
            return Err(Error::config(
                W,
                format!(
                    "d_model = {} is not a multiple of encoder_attention_heads = {}",
                    self.d_model, self.encoder_attention_heads
                ),
            ));
        }
        Ok(())
    }

    /// Output frames of a clip of `frames` input frames (the stride-2 conv2 with
    /// padding 1 and kernel 3): ceil(frames / 2).
    pub fn out_frames(frames: usize) -> usize {
        frames.div_ceil(2)
    }
}

/// The architectures Braid reads, as named in `config.json`'s `architectures`.
pub const VISION_ARCHITECTURES: [&str; 4] = [
    "CLIPVisionModel",
    "CLIPModel",
    "SiglipVisionModel",
    "SiglipModel",
];
pub const AUDIO_ARCHITECTURES: [&str; 2] = ["WhisperModel", "WhisperForConditionalGeneration"];

/// The single `architectures` entry of an HF config.
pub(crate) fn architecture(cfg: &Value) -> Result<String> {
    match cfg.get("architectures").and_then(Value::as_array) {
        Some(a) if a.len() == 1 => a[0]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Error::config("HF config", "architectures[0] is not a string")),
        _ => Err(Error::config(
            "HF config",
            "`architectures` must be a list of exactly one class name",
        )),
    }
}

fn unknown_arch(arch: &str, supported: &[&str]) -> Error {
    Error::config(
        "HF config",
        format!(
            "architecture {arch:?} is not supported here; supported: {}",
            supported.join(", ")
        ),
    )
}

/// `key` of `cfg` as usize, or `default` when absent.
fn get_usize(cfg: &Value, key: &str, default: usize) -> Result<usize> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| {
                Error::config(
                    "HF config",
                    format!("{key} = {v} must be a non-negative integer"),
                )
            }),
    }
}

fn get_f32(cfg: &Value, key: &str, default: f32) -> Result<f32> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| Error::config("HF config", format!("{key} = {v} must be a number"))),
    }
}

fn get_str<'a>(cfg: &'a Value, key: &str, default: &'a str) -> Result<&'a str> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_str()
            .ok_or_else(|| Error::config("HF config", format!("{key} = {v} must be a string"))),
    }
}

/// How an HF vision checkpoint is laid out: the config and the weight-name prefix
/// (`""` or `"vision_model."`; resolved against the weights on load).
#[derive(Clone, Debug, PartialEq)]
pub struct HfVision {
    pub config: VisionConfig,
    pub architecture: String,
}

impl VisionConfig {
    /// Reads CLIPVisionModel / CLIPModel / SiglipVisionModel / SiglipModel configs
    /// (the tower's keys are under `vision_config` for the two-tower models).
    pub fn from_hf_config(cfg: &Value) -> Result<HfVision> {
        let arch = architecture(cfg)?;
        let (family, v) = match arch.as_str() {
            "CLIPVisionModel" => (VisionFamily::Clip, cfg),
            "SiglipVisionModel" => (VisionFamily::Siglip, cfg),
            "CLIPModel" | "SiglipModel" => {
                let v = cfg.get("vision_config").ok_or_else(|| {
                    Error::config("HF config", format!("{arch} config has no `vision_config`"))
                })?;
                let fam = if arch == "CLIPModel" {
                    VisionFamily::Clip
                } else {
                    VisionFamily::Siglip
                };
                (fam, v)
            }
            other => return Err(unknown_arch(other, &VISION_ARCHITECTURES)),
        };
        // transformers' CLIPVisionConfig / SiglipVisionConfig defaults.
        let (patch, act, eps) = match family {
            VisionFamily::Clip => (32, "quick_gelu", 1e-5),
            VisionFamily::Siglip => (16, "gelu_pytorch_tanh", 1e-6),
        };
        let config = VisionConfig {
            family,
            hidden_size: get_usize(v, "hidden_size", 768)?,
            intermediate_size: get_usize(v, "intermediate_size", 3072)?,
            num_layers: get_usize(v, "num_hidden_layers", 12)?,
            num_heads: get_usize(v, "num_attention_heads", 12)?,
            num_channels: get_usize(v, "num_channels", 3)?,
            image_size: get_usize(v, "image_size", 224)?,
            patch_size: get_usize(v, "patch_size", patch)?,
            act: Act::from_hf("hidden_act", get_str(v, "hidden_act", act)?)?,
            layer_norm_eps: get_f32(v, "layer_norm_eps", eps)?,
            use_head: family == VisionFamily::Siglip
                && v.get("vision_use_head")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
        };
        config.validate()?;
        Ok(HfVision {
            config,
            architecture: arch,
        })
    }
}

impl WhisperEncoderConfig {
    /// Reads a WhisperModel / WhisperForConditionalGeneration config (encoder keys).
    pub fn from_hf_config(cfg: &Value) -> Result<(Self, String)> {
        let arch = architecture(cfg)?;
        if !AUDIO_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(unknown_arch(&arch, &AUDIO_ARCHITECTURES));
        }
        // transformers' WhisperConfig defaults (whisper-tiny sizes).
        let config = WhisperEncoderConfig {
            num_mel_bins: get_usize(cfg, "num_mel_bins", 80)?,
            d_model: get_usize(cfg, "d_model", 384)?,
            encoder_layers: get_usize(cfg, "encoder_layers", 4)?,
            encoder_attention_heads: get_usize(cfg, "encoder_attention_heads", 6)?,
            encoder_ffn_dim: get_usize(cfg, "encoder_ffn_dim", 1536)?,
            max_source_positions: get_usize(cfg, "max_source_positions", 1500)?,
            act: Act::from_hf(
                "activation_function",
                get_str(cfg, "activation_function", "gelu")?,
            )?,
            layer_norm_eps: 1e-5,
        };
        config.validate()?;
        Ok((config, arch))
    }
}
