//! `[model.*]`: each module is either given by its sizes (the owning crate's config struct)
//! or started from a Hugging Face checkpoint (`init = "hf:PATH"`), never both.

use std::path::{Path, PathBuf};

use braid_encoders::{VisionConfig, WhisperEncoderConfig};
use braid_llm::LlmConfig;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::mllm::{AudioProjectorConfig, VisionProjectorConfig};

/// One module: explicit sizes, or `init = "hf:PATH"` (a Hugging Face model folder whose
/// `config.json` gives the sizes and whose safetensors give the weights).
#[derive(Clone, Debug, PartialEq)]
pub enum ModuleSpec<T> {
    Sizes(T),
    Hf(PathBuf),
}

impl<T> ModuleSpec<T> {
    pub fn hf_path(&self) -> Option<&Path> {
        match self {
            ModuleSpec::Hf(p) => Some(p),
            ModuleSpec::Sizes(_) => None,
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for ModuleSpec<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut table = toml::Table::deserialize(d)?;
        match table.remove("init") {
            None => T::deserialize(toml::Value::Table(table))
                .map(ModuleSpec::Sizes)
                .map_err(D::Error::custom),
            Some(init) => {
                if !table.is_empty() {
                    let keys: Vec<&str> = table.keys().map(String::as_str).collect();
                    return Err(D::Error::custom(format!(
                        "`init` takes every size from the checkpoint's config.json; remove {}",
                        keys.join(", ")
                    )));
                }
                let s = init
                    .as_str()
                    .ok_or_else(|| D::Error::custom("`init` must be a string \"hf:PATH\""))?;
                let path = s.strip_prefix("hf:").ok_or_else(|| {
                    D::Error::custom(format!(
                        "init = {s:?}: expected \"hf:PATH\" (a Hugging Face model folder)"
                    ))
                })?;
                if path.is_empty() {
                    return Err(D::Error::custom("init = \"hf:\" names no folder"));
                }
                Ok(ModuleSpec::Hf(PathBuf::from(path)))
            }
        }
    }
}

impl<T: Serialize> Serialize for ModuleSpec<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ModuleSpec::Sizes(t) => t.serialize(s),
            ModuleSpec::Hf(p) => {
                let mut m = std::collections::BTreeMap::new();
                m.insert("init", format!("hf:{}", p.display()));
                m.serialize(s)
            }
        }
    }
}

/// `[model.projector.vision]` and `[model.projector.audio]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectorSection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vision: Option<VisionProjectorConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<AudioProjectorConfig>,
}

/// `[model]`: the LLM, the optional encoders and their projectors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub llm: ModuleSpec<LlmConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vision: Option<ModuleSpec<VisionConfig>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<ModuleSpec<WhisperEncoderConfig>>,
    #[serde(default)]
    pub projector: ProjectorSection,
    /// Std of the random init of every module given by sizes.
    #[serde(default = "default_init_std")]
    pub init_std: f32,
}

fn default_init_std() -> f32 {
    0.02
}
