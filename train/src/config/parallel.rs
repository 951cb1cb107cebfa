//! `[parallel]`: the device, the world and one layout per module. Here only what needs
//! no model is checked; `parallel::layout` checks the layouts against the model (heads,
//! layers, vocab) and the world.

use braid_comm::grid::GridDims;
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
    /// Megatron's LLM-centric layout: the encoders live on the LLM's first pipeline
    /// stage and run each microbatch's images and clips inside that stage's forward
    /// (their backward inside its backward), each with a TP that divides the LLM's and
    /// no CP or PP of its own, a replica per `llm.tp / tp` ranks of the stage.
    Centric,
}

/// How each step's rows, images and clips are spread over the replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AssignPolicy {
    /// By estimated cost, largest first to the least-loaded replica (and microbatch).
    #[default]
    Balanced,
    /// Dealt in turn, blind to lengths.
    RoundRobin,
}

/// One module's grid: tensor, context, pipeline and data parallel sizes, and whether
/// its blocks recompute their activations in the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModuleLayout {
    pub tp: usize,
    pub cp: usize,
    pub pp: usize,
    pub dp: usize,
    /// Activation recomputation: each transformer block keeps only its input between
    /// the forward and the backward, which runs the block's forward again (about a
    /// third more compute for the blocks, their activations not held).
    pub recompute: bool,
    /// Model chunks per pipeline stage (Megatron's virtual pipeline stages; the LLM
    /// only): each stage holds `virtual_stages` slices of the layers, `pp` apart, and
    /// runs the interleaved 1F1B, whose bubble is `1 / virtual_stages` of 1F1B's for as
    /// many times the stage-to-stage sends. 1: plain 1F1B.
    pub virtual_stages: usize,
    /// Layers of the first pipeline stage where it holds fewer than the others, the rest
    /// split evenly over the other stages (Megatron's first-stage layer count: room for
    /// the encoders the "centric" placement puts there; the LLM only, without virtual
    /// stages). None: every stage `layers / pp`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_stage_layers: Option<usize>,
    /// An encoder's stages on its PP slices of ranks in reverse order: stage 0 on the
    /// last slice (encoders only, with `pp >= 2`). Under colocated placement this sets
    /// which LLM stage's GPUs each encoder stage shares: reversed, the encoder's first
    /// stage (whose forwards start the step and whose backwards end it) sits on the
    /// LLM's last stages, idle at both ends of 1F1B, and its last stage on the LLM's
    /// first. The math is the same either way.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub reverse_stages: bool,
    /// Zero-bubble pipelining (the LLM only, `pp >= 2`, one model chunk a stage): each
    /// stage's backward split into the input gradient (B) and the linear layers' weight
    /// gradients (W), run later where 1F1B would wait, in the order of
    /// `braid_balancer::zero_bubble` (1F1B's memory, two thirds of its idle time where
    /// the passes take as long). The math is the same.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub zero_bubble: bool,
}

impl Default for ModuleLayout {
    fn default() -> Self {
        ModuleLayout {
            tp: 1,
            cp: 1,
            pp: 1,
            dp: 1,
            recompute: false,
            virtual_stages: 1,
            first_stage_layers: None,
            reverse_stages: false,
            zero_bubble: false,
        }
    }
}

impl ModuleLayout {
    /// Under "centric" placement, the replicas of an encoder at TP `tp` inside this
    /// (the LLM's) first stage: one on every `tp` of its `tp * cp * dp` ranks.
    pub fn centric_encoder_dp(&self, tp: usize) -> usize {
        self.tp / tp.max(1) * self.cp * self.dp
    }

    /// The grid's axes.
    pub fn grid_dims(&self) -> GridDims {
        GridDims {
            tp: self.tp,
            cp: self.cp,
            dp: self.dp,
            pp: self.pp,
        }
    }

    /// `tp * cp * pp * dp`, saturating ([`GridDims::size`]): a hostile config's huge
    /// sizes give a count no world matches (and an error naming it), never an overflow.
    pub fn ranks(&self) -> usize {
        self.grid_dims().size()
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
    /// Seconds a rank waits in one collective before the run fails naming the ranks
    /// that never arrived.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// Gradients are all-reduced in buckets of this many MiB (fewer, larger messages).
    #[serde(default = "default_bucket_mb")]
    pub bucket_mb: f64,
    /// ZeRO-1: each data-parallel rank keeps the AdamW state of its share of the
    /// parameters only, updates that share and broadcasts it.
    #[serde(default = "yes")]
    pub zero1: bool,
    /// Where each step's rows, images and clips go.
    #[serde(default)]
    pub assign: AssignPolicy,
    /// How a step runs across modules: `"phased"` (every encoder forward, one bridge
    /// exchange, the LLM's 1F1B, the bridge back, every encoder backward) or
    /// `"overlapped"` (1F1B across the module graph: encoders work on later
    /// microbatches while the LLM runs earlier ones; disjoint or colocated placement,
    /// a colocated rank interleaving its modules' passes in one order).
    #[serde(default = "phased")]
    pub schedule: braid_balancer::Schedule,
    /// A plan file written by `braid plan` (or "auto": plan for `world_size` now); it
    /// sets `world_size`, `placement`, every module's layout and `train.microbatches`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
}

fn phased() -> braid_balancer::Schedule {
    braid_balancer::Schedule::Phased
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

fn default_timeout_s() -> f64 {
    300.0
}

fn default_bucket_mb() -> f64 {
    25.0
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
            timeout_s: default_timeout_s(),
            bucket_mb: default_bucket_mb(),
            zero1: true,
            assign: AssignPolicy::Balanced,
            schedule: phased(),
            plan: None,
        }
    }
}

impl ParallelConfig {
    /// The kernels' device of this process's rank. For `"cuda"`: the GPU of the
    /// launcher's local rank (`LOCAL_RANK`, `SLURM_LOCALID`; one rank per process and
    /// GPU), or GPU 0 without a launcher (threads) or when the process sees only the
    /// GPUs it was given (`CUDA_VISIBLE_DEVICES` set per task, so its GPU is `cuda:0`).
    pub fn kernel_device(&self) -> braid_kernels::Device {
        match self.device {
            Device::Cpu => braid_kernels::Device::Cpu,
            Device::Cuda => {
                let local = braid_comm::launch::LaunchEnv::from_env()
                    .ok()
                    .flatten()
                    .map_or(0, |e| e.local_rank);
                let mine = braid_kernels::Device::Cuda(local);
                if local > 0
                    && mine.unavailable_reason().is_some()
                    && braid_kernels::Device::Cuda(0)
                        .unavailable_reason()
                        .is_none()
                {
                    braid_kernels::Device::Cuda(0)
                } else {
                    mine
                }
            }
        }
    }

    /// Whether `parallel.device` can run on this machine: `"cuda"` needs a driver and a
    /// GPU. Checked where a run starts, not when a config is read, so that a `"cuda"`
    /// config plans on a login node (`braid plan`) and a GPU run's checkpoint answers on
    /// a CPU (`braid generate` reads the config saved with it).
    pub fn check_device(&self) -> Result<(), ConfigError> {
        if self.device == Device::Cuda
            && let Some(reason) = self.kernel_device().unavailable_reason()
        {
            return Err(invalid(
                "parallel.device",
                format!("\"cuda\": no usable GPU here: {reason}; use \"cpu\""),
            ));
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.world_size == 0 {
            return Err(invalid("parallel.world_size", "must be >= 1"));
        }
        if self.schedule == braid_balancer::Schedule::Overlapped
            && self.placement == Placement::Centric
            && self.world_size > 1
        {
            return Err(invalid(
                "parallel.schedule",
                "\"overlapped\" runs each module's own pipeline; \"centric\" runs the encoders inside the LLM's first stage, microbatch by microbatch, under the phased schedule: set parallel.schedule = \"phased\" or parallel.placement = \"disjoint\" or \"colocated\"",
            ));
        }
        for (name, l) in [
            ("llm", &self.llm),
            ("vision", &self.vision),
            ("audio", &self.audio),
        ] {
            for (axis, v) in [
                ("tp", l.tp),
                ("cp", l.cp),
                ("pp", l.pp),
                ("dp", l.dp),
                ("virtual_stages", l.virtual_stages),
            ] {
                if v == 0 {
                    return Err(invalid(format!("parallel.{name}.{axis}"), "must be >= 1"));
                }
            }
            if name != "llm" && l.first_stage_layers.is_some() {
                return Err(invalid(
                    format!("parallel.{name}.first_stage_layers"),
                    "a shorter first stage is for the LLM only: remove the key",
                ));
            }
            if name != "llm" && l.virtual_stages != 1 {
                return Err(invalid(
                    format!("parallel.{name}.virtual_stages"),
                    "interleaved pipeline stages are for the LLM only: remove the key",
                ));
            }
            if l.zero_bubble && name != "llm" {
                return Err(invalid(
                    format!("parallel.{name}.zero_bubble"),
                    "zero-bubble pipelining is for the LLM only: remove the key",
                ));
            }
            if l.reverse_stages && name == "llm" {
                return Err(invalid(
                    "parallel.llm.reverse_stages",
                    "reversed stages are for the encoders only (they set which LLM stage each encoder stage shares GPUs with): remove the key",
                ));
            }
            if l.reverse_stages && l.pp < 2 {
                return Err(invalid(
                    format!("parallel.{name}.reverse_stages"),
                    format!(
                        "the {name} encoder has one pipeline stage (parallel.{name}.pp = {}): nothing to reverse; remove the key or set pp >= 2",
                        l.pp
                    ),
                ));
            }
        }
        if self.llm.virtual_stages > 1 && self.llm.pp < 2 {
            return Err(invalid(
                "parallel.llm.virtual_stages",
                format!(
                    "{} chunks per stage need at least two pipeline stages (parallel.llm.pp = {}): set virtual_stages = 1 or pp >= 2",
                    self.llm.virtual_stages, self.llm.pp
                ),
            ));
        }
        let llm = &self.llm;
        if llm.zero_bubble && (llm.pp < 2 || llm.virtual_stages > 1) {
            return Err(invalid(
                "parallel.llm.zero_bubble",
                format!(
                    "splits the backward of a pipeline of one model chunk a stage; parallel.llm.pp = {} and virtual_stages = {}: set pp >= 2 and virtual_stages = 1, or remove the key",
                    llm.pp, llm.virtual_stages
                ),
            ));
        }
        if llm.zero_bubble && self.placement == Placement::Centric {
            return Err(invalid(
                "parallel.llm.zero_bubble",
                "is not run with \"centric\" placement (the encoders inside the LLM's first stage): set parallel.placement = \"disjoint\" or \"colocated\", or remove the key",
            ));
        }
        // Bounded both ways: a wait is a `Duration`, and a timeout below a millisecond
        // fails every collective.
        if !(1e-3..=1e7).contains(&self.timeout_s) {
            return Err(invalid(
                "parallel.timeout_s",
                format!(
                    "{}: must be from 0.001 to 10,000,000 seconds (about 115 days)",
                    self.timeout_s
                ),
            ));
        }
        if !(self.bucket_mb > 0.0 && self.bucket_mb.is_finite()) {
            return Err(invalid(
                "parallel.bucket_mb",
                "must be a positive number of MiB",
            ));
        }
        Ok(())
    }
}
