//! `braid train` with `parallel.world_size > 1`: the ranks run as threads of this process
//! over a [`LocalWorld`] ([`run`]), or this process is one rank of a world of processes
//! ([`run_process`], set up by [`super::procs`]); each rank has its own loader (the same
//! global batches) and its share of the model. Set-up, evaluation and export are the
//! one-rank trainer's: the run is set up as a one-rank [`Trainer`], which checks
//! everything. On threads it also builds the full model (and restores a checkpoint of any
//! layout into it), and every rank cuts its share from that; a process of a world never
//! builds it: its rank makes its own shards and reads its own slices of a checkpoint
//! ([`super::load`]). At the end rank 0 reads the full model back from the last checkpoint.
//!
//! Rank 0 reports progress (through a channel to the caller's [`Observer`]); any rank's
//! error or panic poisons the world, every rank stops, and the run fails naming the
//! rank that failed first.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use braid_comm::Comm;
use braid_comm::local::{LocalComm, run_local};
use braid_dataloader::loader::{Loader, LoaderConfig};
use braid_nn::param::cut_shard;
use braid_nn::{Init, Module, Shard};

use super::ckpt;
use super::engine::Engine;
use super::layout::Layouts;
use super::model::ShardSource;
use crate::checkpoint::{self, TrainState};
use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::metrics::{BalanceMetrics, MetricsWriter, StepMetrics};
use crate::mllm::{Loaded, Mllm};
use crate::optim::AdamW;
use crate::optim::clip_factor;
use crate::stop::StopFlag;
use crate::trainer::{LossTrail, Observer, RunSummary, Trainer};
use braid_kernels::{Device, Tensor};

/// What rank 0 tells the caller's observer.
enum Event {
    Log(String),
    Step(Box<StepMetrics>),
    Checkpoint(u64, std::path::PathBuf),
}

/// Trains `trainer`'s run on `parallel.world_size` ranks (threads) and returns what the
/// one-rank [`Trainer::run`] returns.
pub fn run(trainer: Trainer, obs: &mut dyn Observer) -> Result<RunSummary> {
    run_ranks(trainer, None, obs)
}

/// Trains as one rank of a world of processes, over `comm` (the whole world). Rank 0
/// writes the metrics, evaluates and exports; the other ranks only train and save their
/// shards.
pub fn run_process(
    trainer: Trainer,
    comm: Arc<dyn Comm>,
    obs: &mut dyn Observer,
) -> Result<RunSummary> {
    run_ranks(trainer, Some(comm), obs)
}

fn run_ranks(
    mut trainer: Trainer,
    process: Option<Arc<dyn Comm>>,
    obs: &mut dyn Observer,
) -> Result<RunSummary> {
    let writes = process.as_ref().is_none_or(|c| c.rank() == 0);
    obs.start(&trainer.info);
    for line in trainer.layouts.describe() {
        obs.log(&line);
    }
    obs.log(&schedule_line(&trainer));
    if trainer.cfg.eval.interval > 0 && trainer.cfg.eval.path.is_some() {
        // The model is sharded over the ranks during training; the full model exists again
        // (from the last checkpoint) only at the end.
        obs.log(&format!(
            "warning: eval.interval = {} is not run between steps on several ranks; the held-out evaluation runs at the end",
            trainer.cfg.eval.interval
        ));
    }
    let world_size = trainer.layouts.world;
    let timeout = Duration::from_secs_f64(trainer.cfg.parallel.timeout_s);
    let start_step = trainer.state.step;
    let total = trainer.cfg.train.steps;
    let started = Instant::now();
    let mut metrics = if writes {
        Some(MetricsWriter::open(
            &trainer.cfg.run.dir.join("metrics.jsonl"),
            trainer.state.step,
        )?)
    } else {
        None
    };
    let (tx, rx) = mpsc::channel::<Event>();
    let mconfig = trainer.mconfig.clone();
    let source = match &trainer.model {
        Some(full) => ShardSource::Cut(full),
        None => ShardSource::Direct {
            config: &mconfig,
            cfg: &trainer.cfg,
        },
    };
    let shared = &Shared {
        cfg: &trainer.cfg,
        source,
        optim: trainer.optim.as_ref(),
        whole: (trainer.info.params, trainer.info.optimizer_state),
        layouts: &trainer.layouts,
        state: &trainer.state,
        loader_cfg: &trainer.loader_cfg,
        config_toml: &trainer.config_toml,
        data_json: &trainer.data_json,
        resumed_from: trainer.info.resumed_from.as_deref(),
        counts: trainer.counts,
        stop: &trainer.stop,
        tokenizer_files: &trainer.tokenizer_files,
        transport: match &process {
            None => "threads".into(),
            Some(_) => {
                let on_gpu = trainer.cfg.parallel.device == crate::config::Device::Cuda;
                format!("processes ({})", crate::parallel::procs::transport(on_gpu))
            }
        },
    };
    let outcome = std::thread::scope(|s| {
        let ranks = s.spawn(move || -> Result<Vec<RankEnd>> {
            let tx = tx;
            match process {
                // This process is one rank of a world of processes.
                // Every process reports its own rank's events (only rank 0 writes metrics).
                Some(comm) => {
                    let events = Some(&tx);
                    let rank = comm.rank();
                    let end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        rank_main(comm, shared, events)
                    }))
                    .map_err(|p| {
                        TrainError::Other(format!(
                            "rank {rank} panicked: {}",
                            braid_comm::local::panic_message(p.as_ref())
                        ))
                    })??;
                    Ok(vec![end])
                }
                None => run_local(world_size, timeout, |comm: LocalComm| {
                    let events = (comm.rank() == 0).then_some(&tx);
                    rank_main(Arc::new(comm), shared, events)
                })
                .map_err(|f| {
                    TrainError::Other(format!(
                        "rank {} of {world_size} failed: {} (every other rank stopped)",
                        f.rank, f.message
                    ))
                }),
            }
        });
        let mut trail = LossTrail::default();
        let mut last_ckpt = None;
        let mut write_err = None;
        for ev in rx {
            match ev {
                Event::Log(l) => obs.log(&l),
                Event::Step(m) => {
                    trail.record(&m);
                    if let Some(metrics) = metrics.as_mut()
                        && let Err(e) = metrics.append(&m)
                    {
                        write_err.get_or_insert(e);
                    }
                    obs.step(&m, total);
                }
                Event::Checkpoint(step, dir) => {
                    obs.checkpoint(step, &dir);
                    last_ckpt = Some(dir);
                }
            }
        }
        let finals = ranks
            .join()
            .map_err(|_| TrainError::Other("the rank launcher panicked".into()))??;
        if let Some(e) = write_err {
            return Err(e);
        }
        Ok((finals, trail, last_ckpt))
    });
    let (finals, trail, mut last_ckpt) = outcome?;
    let train_s = started.elapsed().as_secs_f64();
    if let Some(end) = finals.into_iter().next() {
        trainer.state = end.state;
        if let Some(signal) = end.stopped {
            let checkpoint = last_ckpt.clone().or(end.checkpoint).ok_or_else(|| {
                TrainError::Other("stopped by a signal but no checkpoint was written".into())
            })?;
            return Err(TrainError::Interrupted {
                signal,
                step: trainer.state.step,
                checkpoint,
            });
        }
    }
    if start_step == total {
        obs.log(&format!("the run already reached train.steps = {total}"));
    }
    let root = trainer.cfg.run.dir.join("checkpoints");
    if last_ckpt.is_none() {
        last_ckpt = checkpoint::latest(&root)?.map(|(_, p)| p);
    }
    if !writes {
        // Not rank 0 of a world of processes: rank 0 evaluates and exports.
        return Ok(trainer.summary_parts(trail, train_s, last_ckpt));
    }
    // The full model from the last checkpoint, for evaluation and export; the ranks'
    // shards are gone, and so is the memory they held.
    crate::metrics::return_freed_memory();
    let device = trainer.cfg.parallel.kernel_device();
    match (&mut trainer.model, &last_ckpt) {
        (Some(full), Some(dir)) => checkpoint::load_weights(dir, full, device)?,
        // Rank 0 of a world of processes held only its share: the whole model exists
        // again only now, weights only (no grads), after the engine's share is gone.
        (None, Some(dir)) => {
            let weights_only = Init::for_loading(device).frozen();
            let mut full = Mllm::new_except(mconfig, &weights_only, ALL_LOADED)?;
            // It only evaluates: its forwards keep no more than each block's input (the
            // cache a backward would need is never used).
            full.set_recompute(true, true, true);
            full.set_compute_dtype(trainer.cfg.precision().compute_dtype())?;
            checkpoint::load_weights(dir, &mut full, device)?;
            // The slices joined while loading are gone too.
            crate::metrics::return_freed_memory();
            trainer.model = Some(full);
        }
        (None, None) => {
            let cfg = &trainer.cfg;
            let full = crate::assemble::build_model(cfg, mconfig, cfg.run.seed, device)?;
            trainer.model = Some(full);
        }
        (Some(_), None) => {}
    }
    trainer.finish(trail, train_s, last_ckpt)
}

/// Every module read from a checkpoint: the full model starts at zero, drawing nothing.
const ALL_LOADED: Loaded = Loaded {
    llm: true,
    vision: true,
    audio: true,
};

/// What every rank reads from the set-up (the loader itself is not shared: each rank
/// opens its own).
struct Shared<'a> {
    cfg: &'a RunConfig,
    /// Where each rank's engine gets its weights: cut from the set-up's full model
    /// (threads), or made by the rank alone (a process of a world).
    source: ShardSource<'a>,
    /// The full model's optimizer state to cut the moments from (with `ShardSource::Cut`).
    optim: Option<&'a AdamW>,
    /// The whole model's parameter elements and optimizer state, for the log.
    whole: (usize, usize),
    layouts: &'a Layouts,
    state: &'a TrainState,
    loader_cfg: &'a LoaderConfig,
    config_toml: &'a str,
    data_json: &'a str,
    /// The checkpoint the run resumes from.
    resumed_from: Option<&'a std::path::Path>,
    /// What the whole model holds (set when the trainer has no full model).
    counts: Option<crate::assemble::ModelCounts>,
    stop: &'a StopFlag,
    tokenizer_files: &'a crate::tokenizer::TokenizerFiles,
    /// How the ranks talk, for the log ("threads", "processes (SocketComm: TCP ...)").
    transport: String,
}

/// How a rank's run ended: its state, and the signal that stopped it early (if any).
struct RankEnd {
    state: TrainState,
    stopped: Option<i32>,
    /// The last checkpoint this rank took part in (every rank knows it, not only rank 0,
    /// whose events the caller sees).
    checkpoint: Option<std::path::PathBuf>,
}

/// Every rank learns whether every other rank set its share up: a rank that failed (a
/// broken Hugging Face folder, a missing checkpoint slice) makes every rank stop at once,
/// naming it, instead of leaving the others waiting in the first step's collectives.
fn agree_on_setup<T>(world: &dyn Comm, local: Result<T>) -> Result<T> {
    let n = world.size();
    let mut failed = vec![0.0f32; n];
    if local.is_err() {
        failed[world.rank()] = 1.0;
    }
    let mut t = braid_kernels::Tensor::from_vec(failed, [n], braid_kernels::Device::Cpu)?;
    world.all_reduce_sum(&mut t)?;
    let v = t.to_vec_f32()?;
    let bad: Vec<usize> = (0..n)
        .filter(|&r| v.get(r).is_some_and(|x| *x > 0.0))
        .collect();
    match local {
        Err(e) => Err(e),
        Ok(_) if !bad.is_empty() => Err(TrainError::Other(format!(
            "rank(s) {bad:?} could not set up their share of the model (their logs say why)"
        ))),
        Ok(x) => Ok(x),
    }
}

/// One rank's whole run.
fn rank_main(
    world: Arc<dyn Comm>,
    t: &Shared<'_>,
    events: Option<&mpsc::Sender<Event>>,
) -> Result<RankEnd> {
    let rank = world.rank();
    let cfg = t.cfg;
    let say = |e: Event| {
        if let Some(tx) = events {
            // The receiver only goes away when the caller is done: nothing to report to.
            let _ = tx.send(e);
        }
    };
    let setup = (|| -> Result<Engine> {
        let mut engine = Engine::new(t.source, Arc::clone(&world), t.layouts.clone(), cfg)?;
        // Making the shards drew (or read) full tensors one at a time: hand those back
        // before the steps allocate their activations.
        crate::metrics::return_freed_memory();
        match (t.optim, t.resumed_from) {
            (Some(full), _) => copy_moments(&mut engine, full)?,
            (None, Some(dir)) => {
                let device = cfg.parallel.kernel_device();
                // Counted once, when the trainer was set up without the full model.
                let counts = t.counts.ok_or_else(|| {
                    TrainError::Other("a rank resumes alone but the model was not counted".into())
                })?;
                let step = t.state.optimizer_step;
                super::load::load_rank_checkpoint(dir, &mut engine, step, device, counts)?
            }
            // A fresh start made by the rank itself: zero moments, step 0.
            (None, None) => {}
        }
        Ok(engine)
    })();
    let mut engine = agree_on_setup(world.as_ref(), setup)?;
    let resumed = t.resumed_from.is_some();
    // Every rank reads the whole global batch's token layout, but decodes only the media
    // its encoders take.
    let mut loader = Loader::open_filtered(
        &cfg.data.path,
        t.loader_cfg,
        0,
        1,
        resumed.then_some(t.state.loader),
        Some(engine.media_filter()),
    )
    .map_err(|e| TrainError::Data(format!("{}: {e}", cfg.data.path.display())))?;
    if rank == 0 {
        say(Event::Log(format!(
            "{} ranks ({}); rank 0 holds {} parameter elements and {} of optimizer state (the whole model: {} and {})",
            t.layouts.world,
            t.transport,
            engine.model.num_params(),
            engine.optim.num_state(),
            t.whole.0,
            t.whole.1
        )));
    }
    let root = cfg.run.dir.join("checkpoints");
    let peers = crate::straggler::peer_groups(&engine.layouts);
    let mut watch = crate::straggler::Watch::default();
    let mut state = t.state.clone();
    let mut last_checkpoint = None;
    while state.step < cfg.train.steps {
        let step = state.step + 1;
        if cfg.fault.panic_at == Some(step) && cfg.fault.panic_rank == rank {
            panic!("fault injection: rank {rank} panics at step {step} (fault.panic_at)");
        }
        let started = Instant::now();
        engine.trace.set_step(step);
        let t0 = engine.trace.start();
        let batch = loader
            .next_batch()
            .map_err(|e| TrainError::Data(e.to_string()))?;
        engine.trace.end(t0, "data", "data")?;
        let data_time_s = started.elapsed().as_secs_f64();
        let pass = engine.forward_backward(&batch.rows)?;
        let loss = pass.loss_sum / pass.targets.max(1) as f64;
        if cfg.fault.nan_grad_at.contains(&step) {
            engine.scale_grads(f32::NAN)?;
        }
        let norm = engine.grad_norm()?;
        let lr = cfg.optim.lr_at(step, cfg.train.steps);
        let skipped = !(loss.is_finite() && norm.is_finite());
        if skipped {
            state.skipped_steps += 1;
            state.nonfinite_in_a_row += 1;
            if state.nonfinite_in_a_row >= cfg.train.max_nonfinite_in_a_row {
                return Err(TrainError::NonFinite {
                    step,
                    count: state.nonfinite_in_a_row,
                    loss,
                    grad_norm: norm,
                });
            }
        } else {
            if let Some(f) = clip_factor(norm, cfg.optim.clip_grad) {
                engine.scale_grads(f)?;
            }
            engine.update(lr)?;
            state.nonfinite_in_a_row = 0;
        }
        state.step = step;
        state.optimizer_step = engine.optim.step;
        state.loader = loader.state();
        state.tokens_seen = state.tokens_seen.saturating_add(pass.tokens as u64);
        // Every rank's compute time of the step, against the ranks doing the same work.
        let busy = Tensor::from_vec(vec![engine.trace.take_busy() as f32], [1], Device::Cpu)?;
        let busy: Vec<f64> = world
            .all_gather(&busy)?
            .to_vec_f32()?
            .into_iter()
            .map(f64::from)
            .collect();
        let straggler = crate::straggler::slowest(&busy, &peers);
        if rank == 0
            && let Some(line) = watch.observe(step, straggler.as_ref())
        {
            say(Event::Log(line));
        }
        let step_time_s = started.elapsed().as_secs_f64();
        state.elapsed_s += step_time_s;
        say(Event::Step(Box::new(StepMetrics {
            step,
            loss,
            lr,
            grad_norm: norm,
            tokens: pass.tokens as u64,
            targets: pass.targets as u64,
            images: pass.images as u64,
            clips: pass.clips as u64,
            step_time_s,
            data_time_s,
            skipped,
            epoch: batch.epoch,
            balance: Some(BalanceMetrics {
                llm: pass.imbalance.llm,
                microbatch: pass.imbalance.microbatch,
                vision: pass.imbalance.vision,
                audio: pass.imbalance.audio,
            }),
            peak_mem_gib: None,
            straggler,
        })));
        let every = cfg.checkpoint.interval;
        let stopped = crate::stop::agree(world.as_ref(), t.stop)?;
        if let Some(signal) = stopped
            && rank == 0
        {
            say(Event::Log(crate::trainer::stopping_line(signal, step)));
        }
        if stopped.is_some() || step == cfg.train.steps || (every > 0 && step.is_multiple_of(every))
        {
            let t0 = engine.trace.start();
            let dir = ckpt::save(
                &engine,
                world.as_ref(),
                &root,
                &state,
                &crate::checkpoint::files(t.config_toml, t.data_json, t.tokenizer_files),
                cfg.checkpoint.keep,
                cfg.fault.abort_during_checkpoint_at == Some(step),
            )?;
            engine.trace.end(t0, "checkpoint", "checkpoint")?;
            say(Event::Checkpoint(step, dir.clone()));
            last_checkpoint = Some(dir);
        }
        if stopped.is_some() {
            write_trace(&engine, world.as_ref(), cfg, &say)?;
            return Ok(RankEnd {
                state,
                stopped,
                checkpoint: last_checkpoint,
            });
        }
    }
    write_trace(&engine, world.as_ref(), cfg, &say)?;
    Ok(RankEnd {
        state,
        stopped: None,
        checkpoint: last_checkpoint,
    })
}

/// With `log.trace`: every rank writes its timeline, then rank 0 merges them (after a
/// barrier, so every file is there).
fn write_trace(
    engine: &Engine,
    world: &dyn Comm,
    cfg: &RunConfig,
    say: &dyn Fn(Event),
) -> Result<()> {
    if !engine.trace.is_enabled() {
        return Ok(());
    }
    // The timeline is for looking: failing to write it warns, never fails the run, and
    // every rank still reaches the barrier.
    let dir = cfg.run.dir.join("trace");
    if let Err(e) = engine.trace.write(&dir) {
        say(Event::Log(format!(
            "warning: rank {}: no timeline: {e}",
            world.rank()
        )));
    }
    world.barrier()?;
    if world.rank() == 0 {
        say(Event::Log(match crate::trace::merge(&dir, world.size()) {
            Ok(merged) => format!(
                "timeline of every rank: {} (open it in ui.perfetto.dev)",
                merged.display()
            ),
            Err(e) => format!("warning: no merged timeline: {e}"),
        }));
    }
    Ok(())
}

/// The AdamW moments this rank holds, cut from the full optimizer of the set-up (zeros
/// on a fresh start, the checkpoint's on resume).
fn copy_moments(engine: &mut Engine, full: &AdamW) -> Result<()> {
    let mut shards = std::collections::HashMap::new();
    engine.model.visit_params(&mut |p| {
        shards.insert(p.name.clone(), p.shard);
    });
    for m in &mut engine.optim.moments {
        let full = full
            .moments
            .iter()
            .find(|f| f.name == m.name)
            .ok_or_else(|| TrainError::Other(format!("no optimizer state for `{}`", m.name)))?;
        let shard = shards.get(&m.name).copied().unwrap_or(Shard::Full);
        for (dst, src) in [
            (&mut m.exp_avg, &full.exp_avg),
            (&mut m.exp_avg_sq, &full.exp_avg_sq),
        ] {
            let (data, dims) = cut_shard(&m.name, src.to_vec_f32()?, src.dims(), shard)?;
            *dst = braid_kernels::Tensor::from_vec(data, dims, dst.device())?;
        }
    }
    engine.optim.step = full.step;
    Ok(())
}

/// The start-up line naming how a step runs across the modules (what
/// [`crate::parallel::engine::Engine`] takes: one rank, or centric placement, runs
/// phased).
fn schedule_line(t: &Trainer) -> String {
    use crate::config::Placement;
    let l = &t.layouts;
    let overlapped = crate::parallel::engine::runs_overlapped(t.cfg.parallel.schedule, l);
    let how = match (overlapped, l.placement) {
        (false, Placement::Centric) => {
            "the encoders inside the LLM's first stage, microbatch by microbatch"
        }
        (false, _) => {
            "every encoder forward, the bridge, the LLM's pipeline, the bridge back, every encoder backward"
        }
        (true, Placement::Colocated) => {
            "1F1B across the modules, each rank interleaving its modules' passes in one order"
        }
        (true, _) => "1F1B across the modules, each on ranks of its own",
    };
    let name = if overlapped { "overlapped" } else { "phased" };
    let placement = match l.placement {
        Placement::Disjoint => "disjoint",
        Placement::Colocated => "colocated",
        Placement::Centric => "centric",
    };
    format!("schedule {name}, {placement} placement: {how}")
}
