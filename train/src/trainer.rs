//! The training loop on one rank: set-up (datasets, model, optimizer, resume), the step
//! (loader -> microbatches -> forward/backward -> clip -> AdamW -> schedule), checkpoints,
//! evaluation and the export at the end. What the user sees is left to an [`Observer`].

use std::path::{Path, PathBuf};
use std::time::Instant;

use braid_dataloader::loader::{Loader, LoaderConfig};
use braid_kernels::Device;
use braid_nn::Module;

use crate::assemble::{
    ModelCounts, build_model, check_against_dataset, check_host_memory, model_config, model_counts,
    param_counts,
};
use crate::checkpoint::{self, TrainState};
use crate::config::{RunConfig, invalid};
use crate::data::ensure_dataset;
use crate::error::{Result, TrainError, io_err};
use crate::eval::{EvalReport, evaluate};
use crate::metrics::{MetricsWriter, StepMetrics};
use crate::mllm::{Freeze, Mllm, MllmConfig};
use crate::optim::AdamW;
use crate::parallel::layout::Layouts;
use crate::resume::{check_resumable, check_same_data, check_same_tokenizer};
use crate::run_lock::RunLock;
use crate::stop::StopFlag;
pub(crate) use crate::summary::LossTrail;
pub use crate::summary::RunSummary;
use crate::tokenizer::TokenizerFiles;
use crate::trace::Tracer;

mod one_rank;

/// What a front end (the CLI's progress bar, a test) hears from a run.
pub trait Observer {
    /// A line of set-up or end-of-run information.
    fn log(&mut self, line: &str);
    /// Training is about to start at `info.start_step`.
    fn start(&mut self, _info: &RunInfo) {}
    /// A step finished (`total`: the run's last step).
    fn step(&mut self, _m: &StepMetrics, _total: u64) {}
    /// A checkpoint was written.
    fn checkpoint(&mut self, _step: u64, _dir: &Path) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default)]
pub struct Quiet;
impl Observer for Quiet {
    fn log(&mut self, _line: &str) {}
}

/// What the run is about to do.
#[derive(Clone, Debug)]
pub struct RunInfo {
    pub name: String,
    pub dir: PathBuf,
    pub params: usize,
    pub trainable: usize,
    pub optimizer_state: usize,
    pub packs: u64,
    pub max_seq_len: u64,
    pub batch_rows: usize,
    pub microbatches: usize,
    pub batches_per_epoch: u64,
    pub start_step: u64,
    pub steps: u64,
    pub resumed_from: Option<PathBuf>,
    /// `train.precision` as resolved for the device ("f32" or "bf16").
    pub precision: &'static str,
}

/// A run, set up and ready to step.
#[derive(Debug)]
pub struct Trainer {
    pub cfg: RunConfig,
    pub(crate) config_toml: String,
    /// The training set's data config as JSON (saved with every checkpoint).
    pub(crate) data_json: String,
    /// The training set's identity ([`braid_dataloader::dataset::DatasetInfo::fingerprint`]).
    pub(crate) data_fingerprint: String,
    /// The whole model and its optimizer; `None` on a rank of a world of processes, which
    /// holds only its share (made by its engine) until rank 0 reads the whole model back
    /// from the last checkpoint for evaluation and export.
    pub model: Option<Mllm>,
    pub(crate) optim: Option<AdamW>,
    /// The model's config (read once: Hugging Face modules take it from their folders).
    pub(crate) mconfig: MllmConfig,
    /// What the model holds, counted without it (when the trainer has no full model):
    /// what a rank's resume checks the checkpoint against.
    pub(crate) counts: Option<ModelCounts>,
    pub(crate) loader: Loader,
    pub(crate) loader_cfg: LoaderConfig,
    pub state: TrainState,
    /// None on the ranks of a world of processes other than 0.
    pub(crate) metrics: Option<MetricsWriter>,
    eval_dir: Option<PathBuf>,
    device: Device,
    pub info: RunInfo,
    /// The grids of a run on several ranks (one rank: every module on rank 0).
    pub layouts: Layouts,
    /// The plan's predicted step, when `parallel.plan` set the layouts.
    pub predicted: Option<crate::planning::Predicted>,
    /// Checked after every step: when set, the run checkpoints that step and stops.
    pub stop: StopFlag,
    /// The tokenizer's files, carried into every checkpoint and the export.
    pub(crate) tokenizer_files: TokenizerFiles,
    /// The run folder's lock (rank 0's process), held while this trainer lives: a second
    /// run started on the same `run.dir` is refused instead of interleaving its metrics
    /// and checkpoints with this one's.
    _run_lock: Option<RunLock>,
    /// A one-rank run's timeline (`log.trace`); a run on several ranks keeps one per rank
    /// in its engines.
    trace: Tracer,
}

impl Trainer {
    /// Makes the datasets if needed, builds the model and optimizer, and (with `resume`)
    /// restores the newest complete checkpoint of `run.dir`.
    pub fn new(cfg: RunConfig, resume: bool, obs: &mut dyn Observer) -> Result<Self> {
        Self::new_rank(cfg, resume, obs, true, true)
    }

    /// [`Trainer::new`] for one process of a world of processes: only the process that
    /// `writes` (rank 0) touches the run folder's metrics.jsonl, config.toml and plan (the
    /// others rewriting them at the same moment would lose rank 0's lines), and without
    /// the `full` model a process's engine makes only its share.
    pub(crate) fn new_rank(
        cfg: RunConfig,
        resume: bool,
        obs: &mut dyn Observer,
        writes: bool,
        full: bool,
    ) -> Result<Self> {
        // `parallel.plan` first: it decides the world and every layout below.
        let mut cfg = cfg;
        let applied = crate::planning::apply(&mut cfg)?;
        for note in &applied.notes {
            obs.log(note);
        }
        cfg.parallel.plan = None;
        cfg.validate()?;
        cfg.parallel.check_device()?;
        // Thread ranks share one process's memory and cores: a world this large (from the
        // config or a plan file) is a typo or belongs to processes, and spawning it would
        // end in an allocation abort.
        if full && cfg.parallel.world_size > MAX_THREAD_RANKS {
            return Err(invalid(
                "parallel.world_size",
                format!(
                    "{} ranks as threads of one process (at most {MAX_THREAD_RANKS}): a larger \
                     world runs one process per rank (braid launch, torchrun or srun)",
                    cfg.parallel.world_size
                ),
            )
            .into());
        }
        let device = cfg.parallel.kernel_device();
        let run_dir = cfg.run.dir.clone();
        let run_lock = if writes {
            Some(RunLock::take(&run_dir)?)
        } else {
            None
        };
        let ckpt_root = run_dir.join("checkpoints");
        for partial in checkpoint::remove_partial(&ckpt_root)? {
            let what = if partial
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(".tmp-discard-"))
            {
                "an old checkpoint whose deletion never finished"
            } else {
                "its save never finished"
            };
            obs.log(&format!("removed {}: {what}", partial.display()));
        }
        let latest = checkpoint::latest(&ckpt_root)?;
        // A damaged `step-*` entry past the newest complete checkpoint (not a crash's
        // leftover, which is `.tmp-*`): resuming from an older one or from step 0 would
        // save over it, so nothing goes on until someone has looked at it. Older ones,
        // and names no save writes, are left alone.
        let newest = latest.as_ref().map(|(step, _)| *step);
        let ahead = checkpoint::unusable(&ckpt_root)?
            .into_iter()
            .find(|(_, step, _)| step.is_some_and(|s| newest.is_none_or(|n| s > n)));
        if let Some((path, _, why)) = ahead {
            return Err(TrainError::Checkpoint {
                path,
                reason: format!(
                    "{why}: not a complete checkpoint, and {} would save over it; move it out of {} (nothing was changed)",
                    if resume { "--resume" } else { "this run" },
                    ckpt_root.display()
                ),
            });
        }
        if !resume && latest.is_some() {
            return Err(invalid(
                "run.dir",
                format!(
                    "{} already holds checkpoints of a run: pass --resume to continue it, or set another run.dir (nothing was changed)",
                    run_dir.display()
                ),
            )
            .into());
        }
        // The model's sizes and their layouts first: a bad value fails before any data
        // is made.
        let mconfig = model_config(&cfg)?;
        let layouts = Layouts::new(&cfg.parallel, &mconfig)?;
        if full && device == braid_kernels::Device::Cpu {
            check_host_memory(&mconfig)?;
        }
        let d = &cfg.data;
        let (data, _) = ensure_dataset(
            &d.path,
            d.build.as_deref(),
            None,
            d.demo.as_deref(),
            &mut |l| obs.log(l),
        )?;
        let eval_dir = match &cfg.eval.path {
            None => None,
            Some(p) => {
                let (heldout, _) = ensure_dataset(
                    p,
                    d.build.as_deref(),
                    cfg.eval.input.as_deref(),
                    d.demo.as_deref(),
                    &mut |l| obs.log(l),
                )?;
                check_against_dataset(&mconfig, &heldout, "eval.path")?;
                Some(p.clone())
            }
        };
        check_against_dataset(&mconfig, &data, "data.path")?;
        if let Some(w) = crate::assemble::past_max_position(&mconfig, &data, &d.path) {
            obs.log(&w);
        }
        if writes && d.verify {
            crate::data::verify_shards(&data, &d.path, &mut |l| obs.log(l))?;
        }
        let tokenizer_files = crate::tokenizer::collect(&d.path, &data, &mut |l| obs.log(l))?;
        let batch_rows = cfg.batch_rows(data.max_seq_len as usize);
        if cfg.train.microbatches > batch_rows {
            return Err(invalid(
                "train.microbatches",
                format!(
                    "{} microbatches for a batch of {batch_rows} rows",
                    cfg.train.microbatches
                ),
            )
            .into());
        }
        if (data.packs as usize) < batch_rows {
            return Err(invalid(
                "train.batch_rows",
                format!(
                    "{batch_rows} rows per step but {} holds only {} packs",
                    d.path.display(),
                    data.packs
                ),
            )
            .into());
        }

        // A process of a world never builds the model: its counts come from the layers.
        let (mut model, mut optim, counts, model_counted) = if full {
            let model = build_model(&cfg, mconfig.clone(), cfg.run.seed, device)?;
            let optim = AdamW::new(cfg.optim.clone(), &model)?;
            let counts = param_counts(&model);
            (Some(model), Some(optim), counts, None)
        } else {
            let c = model_counts(&mconfig, Freeze::from_names(&cfg.train.freeze)?)?;
            (None, None, (c.params, c.trainable), Some(c))
        };
        let config_toml = cfg.to_toml()?;
        let data_fingerprint = data.fingerprint();
        let data_json = serde_json::to_string_pretty(&data.settings)
            .map_err(|e| TrainError::Other(e.to_string()))?;
        let loader_cfg = LoaderConfig {
            seed: cfg.run.seed,
            batch_rows,
            workers: d.workers,
            prefetch: d.prefetch,
            shuffle: d.shuffle,
        };
        let (state, resumed_from) = match (&latest, resume) {
            (Some((_, dir)), true) => {
                let saved = std::fs::read_to_string(dir.join(checkpoint::CONFIG_FILE))
                    .map_err(io_err(&dir.join(checkpoint::CONFIG_FILE), "read"))?;
                check_resumable(&saved, &cfg)?;
                // Checkpoints written before data.json was carried have none to compare.
                let saved_data = dir.join(checkpoint::DATA_FILE);
                if saved_data.is_file() {
                    let text = std::fs::read_to_string(&saved_data)
                        .map_err(io_err(&saved_data, "read"))?;
                    check_same_data(&text, &data_json, &dir.display().to_string())?;
                }
                // The tokenizer the checkpoint trained with against the dataset's: the same
                // ids must mean the same tokens.
                check_same_tokenizer(dir, &data)?;
                let state = checkpoint::read_state(dir)?;
                // Without the full model, each engine reads its own slices.
                if let (Some(model), Some(optim)) = (model.as_mut(), optim.as_mut()) {
                    checkpoint::load_weights(dir, model, device)?;
                    checkpoint::load_optim(dir, optim, state.optimizer_step, device)?;
                }
                obs.log(&format!(
                    "resuming from {} (step {})",
                    dir.display(),
                    state.step
                ));
                (state, Some(dir.clone()))
            }
            _ => {
                if resume {
                    obs.log(&format!(
                        "--resume: no checkpoint in {}, starting from step 0",
                        ckpt_root.display()
                    ));
                }
                let loader = braid_dataloader::loader::LoaderState {
                    epoch: 0,
                    batch: 0,
                    seed: loader_cfg.seed,
                    batch_rows: batch_rows as u64,
                    packs: data.packs,
                    shuffle: loader_cfg.shuffle,
                };
                let state = TrainState::fresh(loader, cfg.run.seed);
                (state, None)
            }
        };
        // Mixed precision: the layers compute on bf16 copies of the f32 masters.
        let precision = cfg.precision();
        if let Some(model) = model.as_mut() {
            model.set_compute_dtype(precision.compute_dtype())?;
        }
        if precision == crate::config::Precision::Bf16 && device == Device::Cpu {
            obs.log(
                "train.precision = bf16 on the CPU: the reference emulation of mixed precision \
                 (f32 math on bf16 data, slower than f32), for checking numerics",
            );
        }
        let loader = Loader::open(
            &d.path,
            &loader_cfg,
            0,
            1,
            resumed_from.as_ref().map(|_| state.loader),
        )
        .map_err(|e| TrainError::Data(format!("{}: {e}", d.path.display())))?;
        // Everything checked: only now is anything written into the run folder.
        std::fs::create_dir_all(&run_dir).map_err(io_err(&run_dir, "create"))?;
        let metrics = if writes {
            std::fs::write(run_dir.join("config.toml"), &config_toml)
                .map_err(io_err(&run_dir.join("config.toml"), "write"))?;
            if let Some(f) = &applied.searched {
                f.write(&run_dir.join(crate::planning::AUTO_PLAN_FILE))?;
            }
            Some(MetricsWriter::open(
                &run_dir.join("metrics.jsonl"),
                state.step,
            )?)
        } else {
            None
        };

        let (params, trainable) = counts;
        let info = RunInfo {
            name: cfg.run.name.clone(),
            dir: run_dir,
            params,
            trainable,
            // Two AdamW moments per trainable weight.
            optimizer_state: 2 * trainable,
            packs: data.packs,
            max_seq_len: data.max_seq_len,
            batch_rows,
            microbatches: cfg.train.microbatches,
            batches_per_epoch: loader.batches_per_epoch(),
            start_step: state.step,
            steps: cfg.train.steps,
            resumed_from,
            precision: precision.name(),
        };
        let trace = Tracer::new(0, device, cfg.log.trace, cfg.log.trace_steps);
        Ok(Trainer {
            cfg,
            config_toml,
            data_json,
            data_fingerprint,
            model,
            optim,
            mconfig,
            counts: model_counted,
            loader,
            loader_cfg,
            state,
            metrics,
            eval_dir,
            device,
            info,
            layouts,
            predicted: applied.predicted,
            stop: StopFlag::new(),
            tokenizer_files,
            trace,
            _run_lock: run_lock.map(RunLock::keep),
        })
    }

    /// With `log.trace`: the timeline of this one-rank run, as `trace/rank-00000.json` and
    /// the merged `trace/trace.json` a run on several ranks writes. For looking: failing to
    /// write it warns, never fails the run.
    fn write_trace(&self, obs: &mut dyn Observer) {
        if !self.trace.is_enabled() {
            return;
        }
        let dir = self.cfg.run.dir.join("trace");
        let merged = self
            .trace
            .write(&dir)
            .and_then(|_| crate::trace::merge(&dir, 1));
        obs.log(&match merged {
            Ok(path) => format!("timeline: {} (open it in ui.perfetto.dev)", path.display()),
            Err(e) => format!("warning: no timeline: {e}"),
        });
    }

    /// Writes a checkpoint of the current step.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let (Some(model), Some(optim)) = (&self.model, &self.optim) else {
            return Err(no_full_model("a one-rank checkpoint"));
        };
        checkpoint::save(
            &self.cfg.run.dir.join("checkpoints"),
            model,
            optim,
            &self.state,
            &checkpoint::files(&self.config_toml, &self.data_json, &self.tokenizer_files),
            self.cfg.checkpoint.keep,
            self.cfg.fault.abort_during_checkpoint_at == Some(self.state.step),
        )
    }

    /// The held-out evaluation, when `[eval] path` is set.
    pub fn evaluate(&self) -> Result<Option<EvalReport>> {
        match (&self.eval_dir, &self.model) {
            (None, _) => Ok(None),
            (Some(_), None) => Err(no_full_model("the held-out evaluation")),
            (Some(dir), Some(model)) => Ok(Some(evaluate(
                model,
                self.device,
                dir,
                self.cfg.eval.batch_rows,
                self.cfg.data.workers,
                self.state.step,
            )?)),
        }
    }

    /// Steps to the end, checkpointing every `checkpoint.interval` steps and at the end,
    /// evaluating every `eval.interval` steps and at the end (`eval.json`), then exports
    /// the trained modules to Hugging Face format (`<run.dir>/hf/`).
    pub fn run(mut self, obs: &mut dyn Observer) -> Result<RunSummary> {
        obs.start(&self.info);
        let total = self.cfg.train.steps;
        let started = Instant::now();
        let mut trail = LossTrail::default();
        let mut last_ckpt = None;
        let mut saved_at = 0;
        let start_step = self.state.step;
        while self.state.step < total {
            let m = self.step()?;
            trail.record(&m);
            obs.step(&m, total);
            let every = self.cfg.checkpoint.interval;
            if m.step == total || (every > 0 && m.step % every == 0) {
                let t0 = self.trace.start();
                let dir = self.save_checkpoint()?;
                self.trace.end(t0, "checkpoint", "checkpoint")?;
                obs.checkpoint(m.step, &dir);
                last_ckpt = Some(dir);
                saved_at = m.step;
            }
            if let Some(signal) = self.stop.requested() {
                // The step is done; its checkpoint (unless the interval just wrote it) is
                // what `--resume` continues from. Evaluation and export wait for the end.
                obs.log(&stopping_line(signal, m.step));
                self.write_trace(obs);
                let dir = match last_ckpt.take() {
                    Some(d) if saved_at == m.step => d,
                    _ => {
                        let d = self.save_checkpoint()?;
                        obs.checkpoint(m.step, &d);
                        d
                    }
                };
                return Err(TrainError::Interrupted {
                    signal,
                    step: m.step,
                    checkpoint: dir,
                });
            }
            let ev = self.cfg.eval.interval;
            if ev > 0
                && m.step % ev == 0
                && m.step != total
                && let Some(r) = self.evaluate()?
            {
                obs.log(&format!(
                    "eval @ step {}: {} {:.4} (text only {:.4})",
                    m.step, r.metric, r.heldout, r.text_only
                ));
                append_jsonl(&self.cfg.run.dir.join("eval.jsonl"), &r)?;
            }
        }
        let train_s = started.elapsed().as_secs_f64();
        if start_step == total {
            obs.log(&format!("the run already reached train.steps = {total}"));
        }
        self.write_trace(obs);
        if last_ckpt.is_none() {
            last_ckpt = checkpoint::latest(&self.cfg.run.dir.join("checkpoints"))?.map(|(_, p)| p);
        }
        self.finish(trail, train_s, last_ckpt)
    }
}

/// The error of a one-rank operation on a trainer made without the full model.
fn no_full_model(what: &str) -> TrainError {
    TrainError::Other(format!(
        "{what} needs the whole model, but this process of a world holds only its share"
    ))
}

/// The most ranks one process runs as threads.
pub const MAX_THREAD_RANKS: usize = 1024;

/// Sets up the run and trains it: on one rank, or on `parallel.world_size` ranks.
pub fn train(cfg: RunConfig, resume: bool, obs: &mut dyn Observer) -> Result<RunSummary> {
    train_stoppable(cfg, resume, obs, StopFlag::new())
}

/// [`train`] that stops after the step during which `stop` is set, with a checkpoint of
/// that step ([`TrainError::Interrupted`]); on several ranks every rank stops after the
/// same step.
pub fn train_stoppable(
    cfg: RunConfig,
    resume: bool,
    obs: &mut dyn Observer,
    stop: StopFlag,
) -> Result<RunSummary> {
    if let Some(procs) = crate::parallel::procs::Processes::from_env()? {
        return crate::parallel::procs::train(procs, cfg, resume, obs, stop);
    }
    let mut t = Trainer::new(cfg, resume, obs)?;
    t.stop = stop;
    if t.layouts.world > 1 {
        crate::parallel::run::run(t, obs)
    } else {
        t.run(obs)
    }
}

/// What the run says when a signal stops it.
pub(crate) fn stopping_line(signal: i32, step: u64) -> String {
    format!(
        "{}: stopping after step {step} with a checkpoint (a second signal exits at once)",
        crate::stop::signal_name(signal)
    )
}

fn append_jsonl<T: serde::Serialize>(path: &Path, v: &T) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_err(path, "open"))?;
    let line = serde_json::to_string(v).map_err(|e| TrainError::Other(e.to_string()))?;
    writeln!(f, "{line}").map_err(io_err(path, "append"))
}
