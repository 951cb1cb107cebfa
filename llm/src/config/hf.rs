//! [`LlmConfig`] from and to a Hugging Face `config.json`: read permissively, except for
//! the keys that change the math, which must hold values Braid implements.

use std::path::Path;

use braid_nn::hf::read_json;
use braid_nn::{Error, Result};
use serde_json::{Map, Value, json};

use super::*;

impl LlmConfig {
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
