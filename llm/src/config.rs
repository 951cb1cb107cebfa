//! `LlmConfig`: Braid's own, validated description of a Llama/Qwen2-family decoder, and
//! its translation from and to a Hugging Face `config.json`.
//!
//! The TOML-facing struct is strict (`deny_unknown_fields`); a Hugging Face
//! `config.json` is read permissively (it carries many keys that change nothing here)
//! except for the keys that would change the math, which must hold values Braid
//! implements (`hidden_act = "silu"`, no sliding window, no partial rotary, a rope
//! type of [`RopeScaling`]).

use braid_nn::{Error, Result};
use serde::{Deserialize, Serialize};

mod hf;

/// The Hugging Face architectures this crate builds, as named in `architectures`.
pub const SUPPORTED_ARCHITECTURES: [&str; 2] = ["LlamaForCausalLM", "Qwen2ForCausalLM"];

/// Which Hugging Face family the weights and `config.json` follow (the math is the same;
/// the defaults, the bias layout and the exported `model_type` differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Qwen2,
}

impl Family {
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }
}

/// Rotary embedding: base `theta` and a scaling variant (Hugging Face `rope_type`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeSpec {
    pub theta: f64,
    #[serde(default)]
    pub scaling: RopeScaling,
}

/// The rope types of `transformers/modeling_rope_utils.py` that Llama and Qwen2 configs
/// use; the fields keep Hugging Face's names so a `rope_parameters` dict maps 1:1.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// `inv_freq[i] = theta^(-2i/HS)`.
    #[default]
    Default,
    /// Position interpolation: `inv_freq / factor`.
    Linear { factor: f64 },
    /// Dynamic NTK: the base grows with the batch length once it exceeds
    /// `max_position_embeddings` (see [`braid_nn::DynamicNtk`] for what Braid does
    /// with batches longer than that: a function of the batch alone, no cache).
    Dynamic { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp
    /// between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN: per-frequency blend of interpolation and extrapolation, and cos/sin
    /// multiplied by `attention_factor` (default from `factor`, `mscale`, `mscale_all_dim`).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta_fast: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        beta_slow: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale_all_dim: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        truncate: Option<bool>,
    },
}

impl RopeScaling {
    /// Hugging Face's `rope_type` string.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }
}

/// A decoder-only LLM of the Llama/Qwen2 family.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    pub family: Family,
    /// V
    pub vocab: usize,
    /// C
    pub hidden: usize,
    /// FF of the SwiGLU MLP
    pub intermediate: usize,
    /// number of transformer blocks
    pub layers: usize,
    /// NH
    pub heads: usize,
    /// NKV (GQA: divides NH)
    pub kv_heads: usize,
    /// HS (NH * HS need not equal C)
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    /// The pretraining length: dynamic NTK scales beyond it; exported as is.
    pub max_position_embeddings: usize,
    pub rope: RopeSpec,
    /// lm_head shares the embedding table (one parameter used twice).
    pub tie_embeddings: bool,
    /// Biases on q/k/v (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama's `attention_bias`; never in Qwen2).
    #[serde(default)]
    pub o_bias: bool,
    /// Biases on gate/up/down (Llama's `mlp_bias`).
    #[serde(default)]
    pub mlp_bias: bool,
}

fn invalid(msg: String) -> Error {
    Error::config("LlmConfig", msg)
}

impl LlmConfig {
    /// Checks every field and their combinations; the error names the key and says what
    /// is allowed.
    pub fn validate(&self) -> Result<()> {
        for (key, v) in [
            ("vocab", self.vocab),
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(invalid(format!("`{key}` = 0: must be >= 1")));
            }
        }
        use braid_nn::error::{MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_TABLE, MAX_WIDTH};
        Error::check_sizes(
            "LlmConfig",
            &[
                ("vocab", self.vocab, MAX_TABLE),
                ("hidden", self.hidden, MAX_WIDTH),
                ("intermediate", self.intermediate, MAX_FFN),
                ("layers", self.layers, MAX_LAYERS),
                ("heads", self.heads, MAX_HEADS),
                ("kv_heads", self.kv_heads, MAX_HEADS),
                ("head_dim", self.head_dim, MAX_WIDTH),
                (
                    "max_position_embeddings",
                    self.max_position_embeddings,
                    MAX_TABLE,
                ),
            ],
        )?;
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(format!(
                "`kv_heads` = {} must divide `heads` = {} (each key/value head serves heads / kv_heads query heads)",
                self.kv_heads, self.heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(format!(
                "`head_dim` = {} must be even: RoPE rotates channel pairs (i, i + head_dim/2)",
                self.head_dim
            )));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(invalid(format!(
                "`rms_norm_eps` = {} must be a positive number",
                self.rms_norm_eps
            )));
        }
        if self.vocab > u32::MAX as usize - 1 {
            return Err(invalid(format!(
                "`vocab` = {} does not fit u32 token ids (u32::MAX is the ignore index)",
                self.vocab
            )));
        }
        // Each family's Hugging Face config can express only its own bias layout, so a
        // config that validates can always be exported.
        match self.family {
            Family::Llama if self.qkv_bias != self.o_bias => {
                return Err(invalid(format!(
                    "`qkv_bias` = {} and `o_bias` = {} differ, but a Llama config has one `attention_bias` for q/k/v/o",
                    self.qkv_bias, self.o_bias
                )));
            }
            Family::Qwen2 if !self.qkv_bias || self.o_bias || self.mlp_bias => {
                return Err(invalid(format!(
                    "family qwen2 has biases on q/k/v only: need `qkv_bias` = true, `o_bias` = false, `mlp_bias` = false (got {}, {}, {})",
                    self.qkv_bias, self.o_bias, self.mlp_bias
                )));
            }
            _ => {}
        }
        self.validate_rope()
    }

    fn validate_rope(&self) -> Result<()> {
        let theta = self.rope.theta;
        if !(theta > 1.0 && theta.is_finite()) {
            return Err(invalid(format!(
                "`rope.theta` = {theta} must be a finite number > 1"
            )));
        }
        let kind = self.rope.scaling.rope_type();
        let factor_ok = |factor: f64| -> Result<()> {
            if !(factor >= 1.0 && factor.is_finite()) {
                return Err(invalid(format!(
                    "`rope.scaling.factor` = {factor} for type \"{kind}\" must be a finite number >= 1"
                )));
            }
            Ok(())
        };
        let orig_ok = |orig: usize| -> Result<()> {
            if orig == 0 {
                return Err(invalid(format!(
                    "`rope.scaling.original_max_position_embeddings` = 0 for type \"{kind}\": must be >= 1"
                )));
            }
            Ok(())
        };
        match &self.rope.scaling {
            RopeScaling::Default => Ok(()),
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => factor_ok(*factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                factor_ok(*factor)?;
                orig_ok(*original_max_position_embeddings)?;
                if !(*low_freq_factor > 0.0 && high_freq_factor > low_freq_factor) {
                    return Err(invalid(format!(
                        "`rope.scaling.low_freq_factor` = {low_freq_factor} and `high_freq_factor` = {high_freq_factor}: need 0 < low_freq_factor < high_freq_factor"
                    )));
                }
                Ok(())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                ..
            } => {
                factor_ok(*factor)?;
                orig_ok(*original_max_position_embeddings)?;
                if let Some(a) = attention_factor
                    && !(*a > 0.0 && a.is_finite())
                {
                    return Err(invalid(format!(
                        "`rope.scaling.attention_factor` = {a} must be a positive number"
                    )));
                }
                let (fast, slow) = (beta_fast.unwrap_or(32.0), beta_slow.unwrap_or(1.0));
                if !(fast > slow && slow > 0.0) {
                    return Err(invalid(format!(
                        "`rope.scaling.beta_fast` = {fast} and `beta_slow` = {slow}: need beta_fast > beta_slow > 0"
                    )));
                }
                Ok(())
            }
        }
    }
}
