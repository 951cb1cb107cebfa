//! `LlmConfig`: Braid's own, validated description of a Llama/Qwen2-family decoder, and
//! its translation from and to a Hugging Face `config.json`.
//!
//! The TOML-facing struct is strict (`deny_unknown_fields`); a Hugging Face
//! `config.json` is read permissively (it carries many keys that change nothing here)
//! except for the keys that would change the math, which must hold values Braid
//! implements (`hidden_act = "silu"`, no sliding window, no partial rotary, a rope
//! type of [`RopeScaling`]).

use std::path::Path;

use braid_nn::hf::read_json;
use braid_nn::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

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

    /// Reads `dir/config.json` of a `LlamaForCausalLM` or `Qwen2ForCausalLM` checkpoint
    /// (transformers 4.x `rope_theta` + `rope_scaling` or 5.x `rope_parameters`) and
    /// validates the result.
    pub fn from_hf_config(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let json: Value = read_json(&path)?;
        Self::from_hf_json(&json).map_err(|e| match e {
            Error::Config { what, msg } => Error::Config {
                what,
                msg: format!("{}: {msg}", path.display()),
            },
            other => other,
        })
    }

    /// [`Self::from_hf_config`] on an already parsed `config.json`.
    pub fn from_hf_json(json: &Value) -> Result<Self> {
        let cfg = HfReader(json);
        let archs = json.get("architectures").and_then(Value::as_array);
        let arch = archs
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .unwrap_or("<none>");
        let family = match arch {
            "LlamaForCausalLM" => Family::Llama,
            "Qwen2ForCausalLM" => Family::Qwen2,
            other => {
                return Err(Error::config(
                    "architectures",
                    format!(
                        "`architectures` = {:?}: \"{other}\" is not supported; supported: {}",
                        archs.map(|a| a.to_vec()).unwrap_or_default(),
                        SUPPORTED_ARCHITECTURES.join(", ")
                    ),
                ));
            }
        };
        if let Some(act) = cfg.str("hidden_act")?
            && act != "silu"
        {
            return Err(invalid(format!(
                "`hidden_act` = \"{act}\": only \"silu\" (SwiGLU) is implemented"
            )));
        }
        if family == Family::Qwen2 && cfg.bool("use_sliding_window")?.unwrap_or(false) {
            return Err(invalid(
                "`use_sliding_window` = true: sliding-window attention is not implemented".into(),
            ));
        }
        let hidden = cfg.req_usize("hidden_size")?;
        let heads = cfg.req_usize("num_attention_heads")?;
        let kv_heads = cfg.usize("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = match cfg.usize("head_dim")? {
            Some(h) => h,
            None if heads > 0 => hidden / heads,
            None => 0,
        };
        let max_pos = cfg
            .usize("max_position_embeddings")?
            .unwrap_or(match family {
                Family::Llama => 2048,
                Family::Qwen2 => 32768,
            });
        let (qkv_bias, o_bias, mlp_bias) = match family {
            Family::Llama => {
                let ab = cfg.bool("attention_bias")?.unwrap_or(false);
                (ab, ab, cfg.bool("mlp_bias")?.unwrap_or(false))
            }
            Family::Qwen2 => (true, false, false),
        };
        let config = LlmConfig {
            family,
            vocab: cfg.req_usize("vocab_size")?,
            hidden,
            intermediate: cfg.req_usize("intermediate_size")?,
            layers: cfg.req_usize("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            rms_norm_eps: cfg.f64("rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings: max_pos,
            rope: read_hf_rope(json, max_pos)?,
            tie_embeddings: cfg.bool("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
        };
        config.validate()?;
        Ok(config)
    }

    /// The `config.json` transformers needs for `from_pretrained`. RoPE is written both
    /// as 5.x `rope_parameters` and as 4.x `rope_theta` + `rope_scaling` (5.x reads the
    /// latter first, and they agree), so either major version loads the same model.
    pub fn to_hf_json(&self) -> Value {
        let mut rope_params = match serde_json::to_value(&self.rope.scaling) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        rope_params.remove("type");
        rope_params.insert("rope_type".into(), json!(self.rope.scaling.rope_type()));
        let rope_scaling = match self.rope.scaling {
            RopeScaling::Default => Value::Null,
            _ => Value::Object(rope_params.clone()),
        };
        rope_params.insert("rope_theta".into(), json!(self.rope.theta));
        let mut out = json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_params,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": "float32",
        });
        if let Value::Object(m) = &mut out {
            match self.family {
                Family::Llama => {
                    m.insert("attention_bias".into(), json!(self.qkv_bias));
                    m.insert("mlp_bias".into(), json!(self.mlp_bias));
                }
                Family::Qwen2 => {
                    m.insert("use_sliding_window".into(), json!(false));
                    m.insert("sliding_window".into(), Value::Null);
                }
            }
        }
        out
    }
}

/// Typed, permissive access to `config.json` keys: absent or null is `None`, a value
/// of the wrong type is an error naming the key.
struct HfReader<'a>(&'a Value);

impl HfReader<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn wrong(key: &str, want: &str, v: &Value) -> Error {
        invalid(format!("`{key}` = {v}: expected {want}"))
    }
    fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
            })
            .transpose()
    }
    fn req_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?
            .ok_or_else(|| invalid(format!("`{key}` is missing from config.json")))
    }
    fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| Self::wrong(key, "a number", v)))
            .transpose()
    }
    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| Self::wrong(key, "true or false", v))
            })
            .transpose()
    }
    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(key, "a string", v)))
            .transpose()
    }
}

/// The rope of a `config.json`, resolved as transformers 5.24's
/// `convert_rope_params_to_dict` + `standardize_rope_params` do: `rope_scaling` (4.x)
/// wins over `rope_parameters` (5.x); `rope_theta` comes from the dict, else the top
/// level, else 10000; `original_max_position_embeddings` from the top level, else the
/// dict, else `max_position_embeddings`.
fn read_hf_rope(json: &Value, max_pos: usize) -> Result<RopeSpec> {
    let top = HfReader(json);
    let mut dict = top
        .get("rope_scaling")
        .or_else(|| top.get("rope_parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    // 5.x may nest the dict per layer type; Llama/Qwen2 have only full attention.
    if let Some(inner) = dict.get("full_attention").filter(|v| v.is_object()) {
        dict = inner.clone();
    }
    if !dict.is_object() {
        return Err(invalid(format!(
            "`rope_parameters`/`rope_scaling` = {dict}: expected an object"
        )));
    }
    let d = HfReader(&dict);
    let kind = match d.str("rope_type")? {
        Some(t) => t,
        None => d.str("type")?.unwrap_or("default"),
    }
    .to_string();
    let theta = match d.f64("rope_theta")? {
        Some(t) => t,
        None => top.f64("rope_theta")?.unwrap_or(10_000.0),
    };
    if let Some(p) = d
        .f64("partial_rotary_factor")?
        .or(top.f64("partial_rotary_factor")?)
        && p != 1.0
    {
        return Err(invalid(format!(
            "`partial_rotary_factor` = {p}: only full rotary (1.0) is implemented for Llama/Qwen2"
        )));
    }
    let known: &[&str] = match kind.as_str() {
        "default" => &[],
        "linear" | "dynamic" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        other => {
            return Err(invalid(format!(
                "rope type \"{other}\" is not supported; supported: default, linear, dynamic, llama3, yarn"
            )));
        }
    };
    if let Some(obj) = dict.as_object() {
        let always = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
        if let Some(k) = obj
            .keys()
            .find(|k| !always.contains(&k.as_str()) && !known.contains(&k.as_str()))
        {
            return Err(invalid(format!(
                "rope key `{k}` is not understood for rope type \"{kind}\" (allowed: {})",
                known.join(", ")
            )));
        }
    }
    let req = |key: &str| -> Result<f64> {
        d.f64(key)?.ok_or_else(|| {
            invalid(format!(
                "rope type \"{kind}\" needs `{key}` in `rope_parameters`/`rope_scaling`"
            ))
        })
    };
    let orig = || -> Result<usize> {
        Ok(match top.usize("original_max_position_embeddings")? {
            Some(o) => o,
            None => d
                .usize("original_max_position_embeddings")?
                .unwrap_or(max_pos),
        })
    };
    let scaling = match kind.as_str() {
        "linear" => RopeScaling::Linear {
            factor: req("factor")?,
        },
        "dynamic" => RopeScaling::Dynamic {
            factor: req("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: req("factor")?,
            low_freq_factor: req("low_freq_factor")?,
            high_freq_factor: req("high_freq_factor")?,
            original_max_position_embeddings: orig()?,
        },
        "yarn" => {
            let original = orig()?;
            RopeScaling::Yarn {
                factor: match d.f64("factor")? {
                    Some(f) => f,
                    None => max_pos as f64 / original as f64,
                },
                original_max_position_embeddings: original,
                attention_factor: d.f64("attention_factor")?,
                beta_fast: d.f64("beta_fast")?,
                beta_slow: d.f64("beta_slow")?,
                mscale: d.f64("mscale")?,
                mscale_all_dim: d.f64("mscale_all_dim")?,
                truncate: d.bool("truncate")?,
            }
        }
        _ => RopeScaling::Default,
    };
    Ok(RopeSpec { theta, scaling })
}
