//! `[parallel]`: the device, the world and one layout per module. This build trains on one
//! rank (world size 1); the layouts are parsed and checked so configs written for larger
//! worlds fail with a message saying so.

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Each module on its own ranks.
    #[default]
    Disjoint,
    /// Modules share ranks, each with its own layout.
    Colocated,
}

/// One module's grid: tensor, context, pipeline and data parallel sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModuleLayout {
    pub tp: usize,
    pub cp: usize,
    pub pp: usize,
    pub dp: usize,
}

impl Default for ModuleLayout {
    fn default() -> Self {
        ModuleLayout {
            tp: 1,
            cp: 1,
            pp: 1,
            dp: 1,
        }
    }
}

impl ModuleLayout {
    pub fn ranks(&self) -> usize {
        self.tp * self.cp * self.pp * self.dp
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    #[serde(default)]
    pub device: Device,
    #[serde(default = "one")]
    pub world_size: usize,
    #[serde(default)]
    pub placement: Placement,
    #[serde(default)]
    pub llm: ModuleLayout,
    #[serde(default)]
    pub vision: ModuleLayout,
    #[serde(default)]
    pub audio: ModuleLayout,
}

fn one() -> usize {
    1
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            device: Device::Cpu,
            world_size: 1,
            placement: Placement::Disjoint,
            llm: ModuleLayout::default(),
            vision: ModuleLayout::default(),
            audio: ModuleLayout::default(),
        }
    }
}

impl ParallelConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.device == Device::Cuda {
            return Err(invalid(
                "parallel.device",
                "\"cuda\": this build trains on the CPU backend only (the CUDA backend is not built yet); use \"cpu\"",
            ));
        }
        if self.world_size == 0 {
            return Err(invalid("parallel.world_size", "must be >= 1"));
        }
        for (name, l) in [
            ("llm", &self.llm),
            ("vision", &self.vision),
            ("audio", &self.audio),
        ] {
            for (axis, v) in [("tp", l.tp), ("cp", l.cp), ("pp", l.pp), ("dp", l.dp)] {
                if v == 0 {
                    return Err(invalid(format!("parallel.{name}.{axis}"), "must be >= 1"));
                }
            }
        }
        if self.world_size != 1 {
            return Err(invalid(
                "parallel.world_size",
                format!(
                    "{}: this build trains on one rank; several ranks arrive with the parallelism issue (set world_size = 1)",
                    self.world_size
                ),
            ));
        }
        for (name, l) in [
            ("llm", &self.llm),
            ("vision", &self.vision),
            ("audio", &self.audio),
        ] {
            if l.ranks() != 1 {
                return Err(invalid(
                    format!("parallel.{name}"),
                    format!(
                        "tp * cp * pp * dp = {} does not fit world_size = 1",
                        l.ranks()
                    ),
                ));
            }
        }
        Ok(())
    }
}
