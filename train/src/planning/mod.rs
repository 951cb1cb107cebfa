//! From a run config to the balancer's planner and back: the model's sizes as
//! [`ModelDims`], the workload (rows of real shards, or the `[plan]` section's synthetic
//! mix), the search, and the plan file that `braid train` reads through
//! `parallel.plan = "PATH"` (or `"auto"`, which searches for `parallel.world_size` first).

use std::path::Path;

use braid_balancer::cluster::Cluster;
use braid_balancer::plan::baseline::llm_centric;
use braid_balancer::plan::search::{Outcome, Space};
use braid_balancer::workload::{MediaTokens, Mix, RowShape, Workload, generate};
use braid_balancer::{ModelDims, Module, ModuleDims, Placement, Problem, Schedule};
use braid_dataloader::dataset::DatasetInfo;
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::mllm::MllmConfig;

mod apply;
mod schedules;
pub use apply::{AUTO_PLAN_FILE, Applied, PlanFile, Predicted, apply};
use schedules::search_schedules;
pub use schedules::{as_trained, llm_alone};

/// `[plan]`: what `braid plan` plans for when the command line does not say.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanSection {
    /// A preset (`h100`, `h200`) or a cluster TOML (`braid profile` writes one).
    #[serde(default = "default_cluster")]
    pub cluster: String,
    /// GPUs to plan for (`--gpus` overrides).
    #[serde(default)]
    pub gpus: Option<usize>,
    /// Tokens per packed row (default: the packed data's `max_seq_len`, else 4096).
    #[serde(default)]
    pub seq_len: Option<usize>,
    /// Sampled batches each candidate's simulated step is averaged over.
    #[serde(default = "default_batches")]
    pub batches: usize,
    /// `best` (both searched, the faster plan taken), `phased` or `overlapped` (1F1B
    /// across modules); `braid train` runs either (`parallel.schedule`, which a plan
    /// file sets).
    #[serde(default)]
    pub schedule: PlanSchedule,
    /// Where the modules may go: `any` (both searched, the default), `colocated` (every
    /// module on every GPU, in turns) or `disjoint` (each module on GPUs of its own).
    /// The LLM-centric baseline is searched whatever this says.
    #[serde(default)]
    pub placement: PlanPlacement,
    /// The synthetic sample distribution used without `--data`.
    #[serde(default)]
    pub mix: Option<Mix>,
    /// Whether the runtime hides the gradient sync behind compute (bucketed reduce during
    /// the last backward, parameter all-gather during the next forward, as PyTorch DDP,
    /// FSDP and Megatron do). Default: yes on GPU clusters, no on a shared CPU
    /// (`braid train`'s thread ranks sync after the backward). Applies to the plan and
    /// the LLM-centric baseline alike.
    #[serde(default)]
    pub overlap_grad_sync: Option<bool>,
    /// Whether TP splits the norms and residuals by sequence (Megatron's sequence
    /// parallelism). Default: yes on GPU clusters, no on a shared CPU (`braid train`'s TP
    /// repeats them on every TP rank). Applies to the plan and the baseline alike.
    #[serde(default)]
    pub sequence_parallel: Option<bool>,
    /// Where brute force cannot run, also simulate this many of the best-estimated
    /// combinations and report their best beside the pick (`braid plan --check N`; 0:
    /// none). Slow: each costs a few simulated steps.
    #[serde(default)]
    pub check: usize,
}

fn default_cluster() -> String {
    "h100".into()
}
fn default_batches() -> usize {
    3
}
/// The placements `braid plan` searches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanPlacement {
    /// Both.
    #[default]
    Any,
    Colocated,
    Disjoint,
}

impl PlanPlacement {
    fn placements(self) -> Vec<Placement> {
        match self {
            PlanPlacement::Any => vec![Placement::Colocated, Placement::Disjoint],
            PlanPlacement::Colocated => vec![Placement::Colocated],
            PlanPlacement::Disjoint => vec![Placement::Disjoint],
        }
    }
}

/// The schedules `braid plan` searches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanSchedule {
    /// Both, the faster plan taken.
    #[default]
    Best,
    Phased,
    Overlapped,
}

impl PlanSchedule {
    fn schedules(self) -> Vec<Schedule> {
        match self {
            PlanSchedule::Best => vec![Schedule::Phased, Schedule::Overlapped],
            PlanSchedule::Phased => vec![Schedule::Phased],
            PlanSchedule::Overlapped => vec![Schedule::Overlapped],
        }
    }
}

impl Default for PlanSection {
    fn default() -> Self {
        PlanSection {
            cluster: default_cluster(),
            gpus: None,
            seq_len: None,
            batches: default_batches(),
            schedule: PlanSchedule::default(),
            placement: PlanPlacement::default(),
            mix: None,
            overlap_grad_sync: None,
            sequence_parallel: None,
            check: 0,
        }
    }
}

fn err(msg: String) -> TrainError {
    TrainError::Other(msg)
}

/// The balancer's view of `m`.
pub fn model_dims(m: &MllmConfig) -> ModelDims {
    let l = &m.llm;
    let vision = m.vision.as_ref().map(|v| {
        // The patch embedding ((C*P*P) -> D per patch) and the two-layer projector, which
        // takes a merge of s*s tokens per row.
        let patch = v.num_channels * v.patch_size * v.patch_size * v.hidden_size;
        let (proj, per_row) = m.vision_projector.as_ref().map_or((0, 1), |p| {
            let s2 = p.spatial_merge * p.spatial_merge;
            (s2 * p.in_dim * p.out_dim + p.out_dim * p.out_dim, s2.max(1))
        });
        ModuleDims {
            layers: v.num_layers,
            hidden: v.hidden_size,
            heads: v.num_heads,
            kv_heads: v.num_heads,
            head_dim: v.hidden_size / v.num_heads.max(1),
            ffn: v.intermediate_size,
            mlp_mats: 2,
            causal: false,
            vocab: 0,
            tied: false,
            extra_params: (patch + proj) as u64,
            stem_flops_per_token: 2.0 * patch as f64,
            projector_flops_per_token: 2.0 * proj as f64 / per_row as f64,
        }
    });
    let audio = m.audio.as_ref().map(|a| {
        // conv1 (k 3, mels -> D) runs on the two frames of each token, conv2 (k 3, D -> D,
        // stride 2) once per token; the projector stacks `stride` tokens per row.
        let conv1 = 3 * a.num_mel_bins * a.d_model;
        let conv2 = 3 * a.d_model * a.d_model;
        let (proj, per_row) = m.audio_projector.as_ref().map_or((0, 1), |p| {
            (
                p.in_dim * p.stride * p.out_dim + p.out_dim * p.out_dim,
                p.stride.max(1),
            )
        });
        ModuleDims {
            layers: a.encoder_layers,
            hidden: a.d_model,
            heads: a.encoder_attention_heads,
            kv_heads: a.encoder_attention_heads,
            head_dim: a.d_model / a.encoder_attention_heads.max(1),
            ffn: a.encoder_ffn_dim,
            mlp_mats: 2,
            causal: false,
            vocab: 0,
            tied: false,
            extra_params: (conv1 + conv2 + proj) as u64,
            stem_flops_per_token: 2.0 * (2 * conv1 + conv2) as f64,
            projector_flops_per_token: 2.0 * proj as f64 / per_row as f64,
        }
    });
    let merge = m
        .vision_projector
        .as_ref()
        .map_or(1, |p| p.spatial_merge.max(1));
    let stride = m.audio_projector.as_ref().map_or(4, |p| p.stride.max(1));
    ModelDims {
        llm: ModuleDims {
            layers: l.layers,
            hidden: l.hidden,
            heads: l.heads,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            ffn: l.intermediate,
            mlp_mats: 3,
            causal: true,
            vocab: l.vocab,
            tied: l.tie_embeddings,
            extra_params: 0,
            stem_flops_per_token: 0.0,
            projector_flops_per_token: 0.0,
        },
        vision,
        audio,
        vision_llm_ratio: 1.0 / (merge * merge) as f64,
        audio_llm_ratio: 1.0 / (2 * stride) as f64,
    }
}

/// Vision-encoder tokens per image and the LLM tokens they become.
fn media_tokens(m: &MllmConfig, dims: &ModelDims) -> MediaTokens {
    let image_encoder = m.vision.as_ref().map_or(0, |v| {
        let side = v.image_size / v.patch_size.max(1);
        side * side
    });
    MediaTokens {
        image_encoder,
        image_llm: (image_encoder as f64 * dims.vision_llm_ratio).round() as usize,
        llm_per_frame: dims.audio_llm_ratio,
    }
}

/// Rows of the packed dataset in `dir` (up to `limit` packs, in order).
fn rows_of_shards(dir: &Path, limit: usize) -> Result<(Vec<RowShape>, usize)> {
    let (info, ds) =
        DatasetInfo::open(dir).map_err(|e| err(format!("--data {}: {e}", dir.display())))?;
    let mut rows = Vec::new();
    for p in 0..ds.packs().len().min(limit) {
        let samples = ds
            .read_pack(p)
            .map_err(|e| err(format!("--data {}: pack {p}: {e}", dir.display())))?;
        let mut r = RowShape::default();
        for s in samples {
            r.samples.push(s.meta.llm_len);
            r.images.extend(s.meta.images.iter().map(|i| i.patches));
            r.clips.extend(s.meta.audio.iter().map(|a| a.mel_frames));
        }
        rows.push(r);
    }
    if rows.is_empty() {
        return Err(err(format!(
            "--data {}: the dataset has no rows",
            dir.display()
        )));
    }
    Ok((rows, info.max_seq_len as usize))
}

/// The rows the planner draws batches from: real shards, or the `[plan]` mix.
pub fn workload(cfg: &RunConfig, model: &MllmConfig, data: Option<&Path>) -> Result<Workload> {
    let batch_rows = cfg.train.batch_rows.ok_or_else(|| {
        err("planning needs train.batch_rows (the global batch in packed rows)".into())
    })?;
    let sec = cfg.plan.clone().unwrap_or_default();
    // Past these the planner would run for hours (or allocate terabytes) before a word.
    if let Some(l) = sec.seq_len.filter(|l| !(1..=MAX_PLAN_SEQ_LEN).contains(l)) {
        return Err(err(format!(
            "plan.seq_len = {l}: must be from 1 to {MAX_PLAN_SEQ_LEN} tokens"
        )));
    }
    if sec.batches == 0 {
        return Err(err(
            "plan.batches = 0: the planner averages each candidate over at least 1 sampled batch"
                .into(),
        ));
    }
    let sampled = batch_rows.saturating_mul(sec.batches.max(1));
    if sampled > MAX_PLAN_ROWS {
        return Err(err(format!(
            "train.batch_rows {batch_rows} x plan.batches {} = {sampled} rows to sample: at most {MAX_PLAN_ROWS} (lower train.batch_rows or plan.batches)",
            sec.batches.max(1)
        )));
    }
    if let Some(dir) = data {
        let (rows, max_len) = rows_of_shards(dir, sampled)?;
        return Ok(Workload {
            rows,
            batch_rows,
            seq_len: sec.seq_len.unwrap_or(max_len),
        });
    }
    let mix = sec.mix.clone().ok_or_else(|| {
        err("planning needs --data DIR (packed shards) or a [plan.mix] section (a synthetic length distribution)".into())
    })?;
    mix.validate().map_err(err)?;
    let seq_len = sec.seq_len.unwrap_or(4096);
    let dims = model_dims(model);
    let media = media_tokens(model, &dims);
    // A sample drops media until it fits a row: rows too short for even one image (or
    // the shortest clip) would plan a text-only workload while the mix asks for media.
    // As the workload counts a clip: whole mel frames, then LLM tokens rounded up.
    let shortest_clip =
        (f64::from((mix.clip_s[0] * 100.0) as u32) * media.llm_per_frame).ceil() as usize;
    for (wanted, tokens, what, key) in [
        (
            mix.image_prob > 0.0,
            media.image_llm,
            "one image",
            "image_prob",
        ),
        (
            mix.audio_prob > 0.0,
            shortest_clip,
            "the shortest clip",
            "audio_prob",
        ),
    ] {
        if wanted && tokens.saturating_add(8) > seq_len {
            return Err(err(format!(
                "plan.seq_len = {seq_len} holds no media: {what} is {tokens} LLM tokens, which with the 8 of text every sample keeps overflow a row, and a sample drops media until it fits; raise plan.seq_len, or set plan.mix.{key} = 0"
            )));
        }
    }
    // Enough samples for every sampled batch (rows hold ~seq_len / mean-sample tokens).
    let mean = mix.text_median * 1.3
        + mix.image_prob * (1.0 + mix.images_max as f64) / 2.0 * media.image_llm as f64
        + mix.audio_prob * (1.0 + mix.clips_max as f64) / 2.0 * 1500.0 * media.llm_per_frame;
    let n = ((sampled + 1) as f64 * seq_len as f64 / mean.max(1.0) * 1.2) as usize;
    if n > MAX_PLAN_SAMPLES {
        return Err(err(format!(
            "the [plan.mix] would need {n} samples to fill {sampled} rows of {seq_len} tokens: at most {MAX_PLAN_SAMPLES} (lower plan.seq_len, train.batch_rows or plan.batches, or raise plan.mix.text_median)"
        )));
    }
    Ok(Workload {
        rows: generate(&mix, media, n, seq_len, cfg.run.seed),
        batch_rows,
        seq_len,
    })
}

/// What `braid plan` found.
#[derive(Debug)]
pub struct Planned {
    pub problem: Problem,
    pub workload: Workload,
    pub outcome: Outcome,
    /// GPUs the plan runs on: those asked for, or fewer where no layout tiles them all
    /// ([`plan`]).
    pub gpus: usize,
    pub asked_gpus: usize,
    /// Whether some plan runs on all the GPUs asked for (where `gpus` is fewer, one on
    /// fewer is faster; else none fits them all).
    pub fits_all: bool,
    /// Each schedule searched, and its best plan's step (the fastest is the outcome's).
    pub schedule_steps: Vec<(Schedule, f64)>,
    pub cluster: String,
    /// Sampled batches each candidate was simulated on.
    pub batches: usize,
}

/// The most GPUs a plan is made for (2^20): the search and the bound walk every divisor
/// of the count, and no job of this kind is larger.
pub const MAX_GPUS: usize = 1 << 20;

/// Searches a plan for `cfg` on `gpus` GPUs, or with `fewer_gpus` on fewer of them where
/// no layout tiles them all and that is faster (a launched world cannot shrink: `false`).
pub fn plan(
    cfg: &RunConfig,
    gpus: usize,
    cluster: Option<&str>,
    data: Option<&Path>,
    schedule: Option<PlanSchedule>,
    fewer_gpus: bool,
) -> Result<Planned> {
    if gpus == 0 {
        return Err(err(
            "GPUs to plan for (--gpus or plan.gpus) must be at least 1".into(),
        ));
    }
    if gpus > MAX_GPUS {
        return Err(err(format!(
            "--gpus {gpus}: braid plan plans at most {MAX_GPUS} GPUs (its searches walk the divisors of the count)"
        )));
    }
    let model = crate::assemble::model_config(cfg)?;
    let sec = cfg.plan.clone().unwrap_or_default();
    let cluster_name = cluster.map_or(sec.cluster.clone(), str::to_string);
    let c = Cluster::load(&cluster_name).map_err(|e| err(e.to_string()))?;
    let frozen = cfg
        .train
        .freeze
        .iter()
        .filter_map(|f| match f.as_str() {
            "vision" => Some(Module::Vision),
            "audio" => Some(Module::Audio),
            "llm" => Some(Module::Llm),
            _ => None,
        })
        .collect();
    let overlap_sync = sec.overlap_grad_sync.unwrap_or(!c.shared_compute);
    let sequence_parallel = sec.sequence_parallel.unwrap_or(!c.shared_compute);
    // Every rank's loader reads the whole global batch; on a shared CPU that competes with
    // the step, so it is measured on the data (on GPUs it runs beside the step: free).
    let input_s = match data {
        Some(d) if c.shared_compute => loader_seconds(cfg, d, LOADER_PROBE_BATCHES)?,
        _ => 0.0,
    };
    let problem = Problem {
        model: model_dims(&model),
        cluster: c,
        frozen,
        input_s,
        overlap_sync,
        sequence_parallel,
    };
    // Each checked combination is a few simulated steps (tens of ms at 1,024 GPUs).
    if sec.check > MAX_PLAN_CHECK {
        return Err(err(format!(
            "plan.check (--check) {}: at most {MAX_PLAN_CHECK} combinations (each is simulated)",
            sec.check
        )));
    }
    let workload = workload(cfg, &model, data)?;
    let mut space = Space::new(gpus);
    space.batches = sec.batches.max(1);
    space.check = sec.check;
    space.placements = sec.placement.placements();
    let schedules = schedule.unwrap_or(sec.schedule).schedules();
    let search = |problem: &Problem, workload: &Workload, space: &Space| {
        search_schedules(problem, workload, space, &schedules, fewer_gpus)
    };
    // Where no layout tiles all the GPUs (1,000 for a model whose stages need 32 each), the
    // LLM-centric baseline runs on fewer, the rest idle, as a Megatron job would; so may
    // the plan: searched on the baseline's count too, the faster taken (its plan file
    // says how many ranks to launch).
    let fewer = |n: usize| {
        let mut on = space.clone();
        on.gpus = n;
        search(&problem, &workload, &on)
    };
    let on_all = search(&problem, &workload, &space);
    let fits_all = on_all.is_ok();
    let (outcome, schedule_steps) = match on_all {
        Ok(o) if !fewer_gpus => o,
        Err(e) if !fewer_gpus => return Err(err(e)),
        Ok(o) if o.0.baseline.plan.gpus() < gpus => match fewer(o.0.baseline.plan.gpus()) {
            Ok(f) if f.0.best.sim.step_s < o.0.best.sim.step_s => f,
            _ => o,
        },
        Ok(o) => o,
        Err(e) => {
            let n = llm_centric(&problem, &workload, &space).map_or(gpus, |b| b.plan.gpus());
            if n == gpus {
                return Err(err(e));
            }
            // The error names the GPUs asked for, not the count tried after them.
            fewer(n).map_err(|_| err(e))?
        }
    };
    let used = outcome.best.plan.gpus();
    Ok(Planned {
        problem,
        workload,
        outcome,
        gpus: used,
        asked_gpus: gpus,
        fits_all,
        schedule_steps,
        cluster: cluster_name,
        batches: space.batches,
    })
}

/// The longest `plan.seq_len` the planner takes (a million tokens a row).
const MAX_PLAN_SEQ_LEN: usize = 1 << 20;

/// The most rows the planner samples (`train.batch_rows` x `plan.batches`).
const MAX_PLAN_ROWS: usize = 1 << 18;

/// The most combinations `--check` simulates (hours at 1,024 GPUs).
pub const MAX_PLAN_CHECK: usize = 1_000_000;

/// The most synthetic samples the planner draws for them.
const MAX_PLAN_SAMPLES: usize = 1 << 24;

/// Global batches a round of [`loader_seconds`] times when planning.
pub const LOADER_PROBE_BATCHES: usize = 4;

/// Rounds [`loader_seconds`] takes the median of.
const LOADER_PROBE_ROUNDS: usize = 5;

/// Compute seconds one rank's loader spends on a global batch of the packed rows at
/// `data`, in device-seconds (a CPU profile's rates were measured on all its cores; a
/// loader uses `data.workers` of them): the time per batch of a loader nobody else
/// competes with, after a warm-up, the median of a few rounds of `batches` each.
pub fn loader_seconds(cfg: &RunConfig, data: &Path, batches: usize) -> Result<f64> {
    let d = &cfg.data;
    let lc = braid_dataloader::loader::LoaderConfig {
        seed: cfg.run.seed,
        batch_rows: cfg
            .train
            .batch_rows
            .ok_or_else(|| err("train.batch_rows is needed to time the loader".into()))?,
        workers: d.workers,
        prefetch: d.prefetch,
        shuffle: d.shuffle,
    };
    let fail = |e: braid_dataloader::loader::LoaderError| {
        err(format!("timing the loader on {}: {e}", data.display()))
    };
    let mut loader = braid_dataloader::loader::Loader::open(data, &lc, 0, 1, None).map_err(fail)?;
    // Warm-up: the first batch, and the `prefetch` batches the workers decode while it is
    // taken, which would come back at once and read as a faster loader.
    for _ in 0..=d.prefetch {
        loader.next_batch().map_err(fail)?;
    }
    // The median of a few rounds: one timing on a shared machine moves by 10-20 %
    // between runs (a validation's mean error moved 7 -> 15 % with it).
    let batches = batches.max(1);
    let per_batch: Vec<f64> = (0..LOADER_PROBE_ROUNDS)
        .map(|_| {
            let t = std::time::Instant::now();
            for _ in 0..batches {
                loader.next_batch().map_err(fail)?;
            }
            Ok(t.elapsed().as_secs_f64() / batches as f64)
        })
        .collect::<Result<_>>()?;
    let per_batch = braid_balancer::plan::check::median(&per_batch);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(per_batch * d.workers.min(cores) as f64 / cores as f64)
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

#[cfg(test)]
#[path = "search_tests.rs"]
mod search_tests;
