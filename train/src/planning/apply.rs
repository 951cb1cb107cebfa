//! The plan file (`braid plan --out`, `parallel.plan = "PATH"`) and applying a plan to a
//! run config before its grids are built: `"auto"` searches for `parallel.world_size`
//! first and keeps its plan in the run folder.

use std::path::{Path, PathBuf};

use braid_balancer::{Placement, Plan};
use serde::{Deserialize, Serialize};

use super::{err, plan};
use crate::config::{ModuleLayout, RunConfig};
use crate::error::Result;

/// The plan file: the chosen plan and the predictions it was chosen on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub gpus: usize,
    pub cluster: String,
    pub step_time_s: f64,
    pub baseline_step_time_s: f64,
    /// Planned with Megatron's sequence-parallel TP (`plan.sequence_parallel`, GPU
    /// clusters' default), which `braid train`'s TP does not run yet: with TP its ranks
    /// hold the norms' activations whole, more than the plan counted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
    pub plan: Plan,
}

impl PlanFile {
    pub fn read(path: &Path) -> Result<PlanFile> {
        let bytes = braid_nn::files::read_limited(path, 64 << 20)
            .map_err(|e| err(format!("parallel.plan = {:?}: {e}", path.display())))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            err(format!(
                "parallel.plan = {:?}: not UTF-8 text: {e}",
                path.display()
            ))
        })?;
        toml::from_str(&text).map_err(|e| err(format!("parallel.plan = {:?}: {e}", path.display())))
    }

    /// Writes atomically (a temporary file, then a rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = toml::to_string(self).map_err(|e| err(format!("plan file: {e}")))?;
        let body = format!(
            "# Written by `braid plan`; use it with parallel.plan = {:?}.\n{text}",
            path.display()
        );
        braid_nn::hf::write_atomic(path, |tmp| {
            std::fs::write(tmp, &body).map_err(|e| braid_nn::Error::io(tmp, "write", e))
        })
        .map_err(|e| err(format!("writing {}: {e}", path.display())))
    }
}

/// A module's layout from a plan's; `reverse` reverses its stages where it has two or
/// more (the plan's `reverse_encoder_stages`, for the encoders).
fn module_layout(
    l: Option<braid_balancer::Layout>,
    recompute: bool,
    reverse: bool,
) -> ModuleLayout {
    let l = l.unwrap_or(braid_balancer::Layout::ONE);
    ModuleLayout {
        tp: l.tp,
        cp: l.cp,
        pp: l.pp,
        dp: l.dp,
        recompute,
        virtual_stages: 1,
        first_stage_layers: None,
        reverse_stages: reverse && l.pp >= 2,
        zero_bubble: false,
    }
}

/// What `parallel.plan` did to a run config: lines for the log, and the plan's
/// predicted step (for the run's summary to set beside the measured one).
#[derive(Clone, Debug, Default)]
pub struct Applied {
    pub notes: Vec<String>,
    /// The plan `"auto"` searched, for the trainer to save as [`AUTO_PLAN_FILE`] in the
    /// run folder once the config has passed its checks.
    pub searched: Option<PlanFile>,
    pub predicted: Option<Predicted>,
}

/// Where `parallel.plan = "auto"` keeps its plan in `run.dir`.
pub const AUTO_PLAN_FILE: &str = "plan.toml";

/// A plan's predicted step time and the cluster it was predicted for.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    pub step_s: f64,
    /// A preset name or a cluster TOML's path.
    pub cluster: String,
}

/// Applies `parallel.plan` to `cfg`: world size, placement, every module's layout and the
/// microbatch count. Returns notes for the log (what the trainer does not do yet).
pub fn apply(cfg: &mut RunConfig) -> Result<Applied> {
    let Some(spec) = cfg.parallel.plan.clone() else {
        return Ok(Applied::default());
    };
    let gpus = cfg.parallel.world_size;
    // "auto" plans once per run: a resumed run reuses the plan its start saved, since a
    // search on a CPU times the loader and may pick another layout the second time.
    let saved = cfg.run.dir.join(AUTO_PLAN_FILE);
    let reuse = spec == "auto" && saved.exists();
    let mut searched = None;
    let file = if reuse {
        let f = PlanFile::read(&saved)?;
        if f.gpus != gpus {
            return Err(err(format!(
                "parallel.plan = \"auto\": {} was planned for {} GPUs but parallel.world_size = {gpus}; remove it to plan again",
                saved.display(),
                f.gpus
            )));
        }
        f
    } else if spec == "auto" {
        // The run's own packed rows when they exist, else the [plan.mix].
        let own = cfg.data.path.join(braid_dataloader::dataset::DATASET_JSON);
        let data = own.exists().then_some(cfg.data.path.as_path());
        // The run plans for what it runs: its TP does not split the norms by sequence, so
        // unless `plan.sequence_parallel` says otherwise, neither does the plan.
        let mut own = cfg.clone();
        let section = own.plan.get_or_insert_with(super::PlanSection::default);
        section.sequence_parallel.get_or_insert(false);
        let p = plan(&own, gpus, None, data, None, false)?;
        let f = PlanFile {
            gpus,
            cluster: p.cluster,
            step_time_s: p.outcome.best.sim.step_s,
            baseline_step_time_s: p.outcome.baseline.sim.step_s,
            sequence_parallel: p.problem.sequence_parallel,
            plan: p.outcome.best.plan,
        };
        searched = Some(f.clone());
        f
    } else {
        PlanFile::read(&PathBuf::from(&spec))?
    };
    let p = &file.plan;
    let placement = match p.placement {
        Placement::Disjoint => crate::config::Placement::Disjoint,
        Placement::Colocated => crate::config::Placement::Colocated,
        Placement::LlmCentric => crate::config::Placement::Centric,
    };
    if p.llm_virtual_stages == 0 {
        return Err(err(format!(
            "parallel.plan = {spec:?}: llm_virtual_stages = 0, but a stage holds at least one model chunk; set it to 1 (plain 1F1B) or more"
        )));
    }
    let mut notes = Vec::new();
    cfg.parallel.world_size = file.gpus;
    cfg.parallel.schedule = p.schedule;
    cfg.parallel.placement = placement;
    cfg.parallel.llm = ModuleLayout {
        virtual_stages: p.llm_virtual_stages,
        first_stage_layers: p.llm_first_stage_layers,
        zero_bubble: p.llm_zero_bubble,
        ..module_layout(Some(p.llm), p.recompute, false)
    };
    let reverse = p.reverse_encoder_stages;
    cfg.parallel.vision = module_layout(p.vision, p.recompute_encoders, reverse);
    cfg.parallel.audio = module_layout(
        p.audio,
        p.recomputes(braid_balancer::Module::Audio),
        reverse,
    );
    if p.placement == Placement::LlmCentric {
        // The encoders on the LLM's first stage at their own TP: a replica on every
        // `tp` of the stage's ranks, as the planner counts them.
        let llm = cfg.parallel.llm;
        for (key, e, present) in [
            ("vision", &mut cfg.parallel.vision, p.vision.is_some()),
            ("audio", &mut cfg.parallel.audio, p.audio.is_some()),
        ] {
            if !present {
                continue;
            }
            if e.tp == 0 || !llm.tp.is_multiple_of(e.tp) {
                return Err(err(format!(
                    "parallel.plan = {spec:?}: the LLM-centric plan gives the {key} encoder TP {} inside the LLM's TP {}, which it does not divide",
                    e.tp, llm.tp
                )));
            }
            *e = ModuleLayout {
                cp: 1,
                pp: 1,
                dp: llm.centric_encoder_dp(e.tp),
                reverse_stages: false,
                ..*e
            };
        }
    }
    cfg.parallel.zero1 = p.zero1;
    cfg.train.microbatches = p.microbatches;
    if file.sequence_parallel && p.has_tp() {
        notes.push(format!(
            "parallel.plan = {spec:?} was planned with sequence-parallel TP, which braid train's TP does not run yet: each TP rank holds the norms' activations whole, more memory than planned (`braid plan` prints the pick as trained; plan.sequence_parallel = false plans for it)"
        ));
    }
    if reuse {
        notes.push(format!(
            "parallel.plan auto: reusing {} (planned when this run started)",
            saved.display()
        ));
    }
    let chunks = match p.llm_virtual_stages {
        0 | 1 => String::new(),
        v => format!(" x {v} chunks a stage"),
    };
    let audio = p
        .own_audio_recompute()
        .map_or(String::new(), |a| format!(" / audio {a}"));
    let reversed = if p.reverse_encoder_stages {
        ", encoder stages reversed"
    } else {
        ""
    };
    let split = if p.llm_zero_bubble {
        ", zero-bubble"
    } else {
        ""
    };
    notes.push(format!(
        "parallel.plan {spec}: {} GPUs, {} {}, llm {}{chunks}, {} microbatches, recompute llm {} / encoders {}{audio}{reversed}{split} (predicted {:.3} s/step on {})",
        file.gpus,
        p.placement.name(),
        p.schedule.name(),
        p.llm,
        p.microbatches,
        p.recompute,
        p.recompute_encoders,
        file.step_time_s,
        file.cluster
    ));
    Ok(Applied {
        notes,
        searched,
        predicted: Some(Predicted {
            step_s: file.step_time_s,
            cluster: file.cluster,
        }),
    })
}
