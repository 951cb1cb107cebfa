//! `braid train [--config RUN.toml] [--set KEY=VALUE]... [--resume]`: runs a training
//! config (the CPU demo, `configs/demo.toml`, by default) with a progress bar on a terminal
//! and plain log lines otherwise; at the end a loss-curve PNG and a one-screen summary.
//!
//! Ctrl-C (SIGINT) or SIGTERM (SLURM before preemption, forwarded by torchrun) during
//! training: the current step finishes, its checkpoint is written and named, and braid
//! exits with 128 + the signal (130, 143); `--resume` continues the run bit for bit. A
//! second signal exits at once (same codes). SIGHUP (the terminal closed, or a rank's
//! `braid launch` died) stops the same way however often it comes (129). During set-up a
//! signal ends braid at once.
//!
//! Exit status: 0 when the run finished, 1 when it failed, 2 for a bad config or usage,
//! 3 for a rank that stopped because another failed, 129 / 130 / 143 when SIGHUP /
//! SIGINT / SIGTERM stopped it. Output whose reader is gone (a closed pipe or terminal)
//! is dropped, never a crash: the run still checkpoints.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use braid_train::metrics::{StepMetrics, read_metrics};
use braid_train::{Observer, RunConfig, RunInfo, RunSummary, StopFlag, TrainError};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::plot::{Chart, LineChart, Series};

/// `eprintln!` that drops the line where stderr's reader is gone (EPIPE from a dead
/// launcher or pager, EIO from a closed terminal) instead of panicking mid-run.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Train a run config: the CPU demo by default.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Run config (TOML).
    #[arg(long, default_value = "configs/demo.toml")]
    config: PathBuf,
    /// Override any key of the config, e.g. `--set train.steps=50 --set optim.lr=1e-3`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Continue from the newest complete checkpoint in the run folder.
    #[arg(long)]
    resume: bool,
}

/// Progress output: a bar on a terminal, log lines every `log.interval` steps otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    interval: u64,
    started: Instant,
    first_step: u64,
    /// Set by SIGINT, SIGTERM or SIGHUP once training has started.
    stop: StopFlag,
    /// A rank other than 0 of a world of processes: prints nothing (rank 0 reports the
    /// run), but still stops on a signal like every rank.
    quiet: bool,
    /// Under a launcher, every rank's `<run.dir>/logs/rank-N.log`: every line it would print
    /// (each step, quiet ranks included) and how it ended.
    log_file: Option<std::fs::File>,
}

/// SIGINT and SIGTERM: the first asks the run to stop after the current step (with a
/// checkpoint); a second one of either exits at once with 128 + its number. SIGHUP (the
/// terminal or, for a rank, its launcher is gone: `braid launch` makes it the rank's
/// parent-death signal) asks the same however often it comes, and points stdout and
/// stderr at /dev/null where they were a terminal or a pipe (nobody reads them any more;
/// a file keeps them; a rank's log file gets every line anyway). A SIGHUP ignored when we
/// started (`nohup`) stays ignored.
fn install_stop_handlers(stop: &StopFlag) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    use signal_hook::flag;
    let armed = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        // Actions run in registration order: the exit first, so the first signal finds
        // it unarmed; then the request; then the arming.
        flag::register_conditional_shutdown(sig, 128 + sig, Arc::clone(&armed))?;
        flag::register_usize(sig, stop.atomic(), sig as usize)?;
        flag::register(sig, Arc::clone(&armed))?;
    }
    if !ignored(SIGHUP) {
        SILENCE[0].store(!regular_file(1), Ordering::SeqCst);
        SILENCE[1].store(!regular_file(2), Ordering::SeqCst);
        // The request first: a SIGHUP between the two registrations still stops the run.
        flag::register_usize(SIGHUP, stop.atomic(), SIGHUP as usize)?;
        // SAFETY: the action only loads atomics and calls open(2), dup2(2) and close(2),
        // which are async-signal-safe, on a static path; it allocates nothing and takes
        // no lock.
        unsafe { signal_hook::low_level::register(SIGHUP, silence_output)? };
    }
    Ok(())
}

/// Whether `sig`'s disposition is "ignore" (inherited from `nohup` and the like).
fn ignored(sig: i32) -> bool {
    // SAFETY: sigaction(2) with a null new action only reads the current one into `old`,
    // a zeroed sigaction struct we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// Whether file descriptor `fd` is a regular file (output redirected to a file).
fn regular_file(fd: i32) -> bool {
    // SAFETY: fstat(2) writes only into `st`, a zeroed stat struct we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
    }
}

/// Which of stdout, stderr a SIGHUP points at /dev/null (set before the handler).
static SILENCE: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];

/// Points stdout and stderr at /dev/null where [`SILENCE`] says. Runs inside a signal
/// handler.
fn silence_output() {
    // SAFETY: open(2), dup2(2) and close(2) are async-signal-safe; the path is a static
    // NUL-terminated string; the fds are ours. `fd` is closed only above 2: with stdout
    // or stderr closed at start, open returns that number, now /dev/null, and it stays.
    unsafe {
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
        if fd < 0 {
            return;
        }
        for (target, silence) in [1, 2].into_iter().zip(&SILENCE) {
            if silence.load(Ordering::SeqCst) && fd != target {
                libc::dup2(fd, target);
            }
        }
        if fd > 2 {
            libc::close(fd);
        }
    }
}

fn human_duration(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

impl Progress {
    fn new(interval: u64) -> Self {
        Progress {
            bar: None,
            interval,
            started: Instant::now(),
            first_step: 0,
            stop: StopFlag::new(),
            quiet: false,
            log_file: None,
        }
    }

    /// Appends `line` to this rank's log file, if it has one (a failed write only loses
    /// the log line: training goes on).
    fn record(&mut self, line: &str) {
        if let Some(f) = self.log_file.as_mut() {
            let _ = writeln!(f, "{line}");
        }
    }

    /// [`Self::record`]s `line` and prints it, quiet rank or not (how the run ended).
    fn announce(&mut self, line: &str) {
        self.record(line);
        say!("{line}");
    }

    fn line(&self, m: &StepMetrics, total: u64) -> String {
        let done = m.step.saturating_sub(self.first_step).max(1) as f64;
        let el = self.started.elapsed().as_secs_f64();
        let eta = el / done * (total - m.step) as f64;
        let tps = m.tokens as f64 / m.step_time_s.max(1e-9);
        format!(
            "step {}/{total} | loss {:.4} | lr {:.2e} | grad norm {:.3} | {:.0} tok/s | {:.2} s/step | ETA {}{}",
            m.step,
            m.loss,
            m.lr,
            m.grad_norm,
            tps,
            m.step_time_s,
            human_duration(eta),
            if m.skipped {
                " | SKIPPED (non-finite)"
            } else {
                ""
            }
        )
    }
}

impl Observer for Progress {
    fn log(&mut self, line: &str) {
        self.record(line);
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(b) => b.println(line),
            None => say!("{line}"),
        }
    }

    fn start(&mut self, info: &RunInfo) {
        // Only now: a signal during set-up (packing, loading) ends braid at once, as
        // there is nothing to save yet.
        if let Err(e) = install_stop_handlers(&self.stop) {
            say!("braid train: warning: Ctrl-C will not checkpoint: {e}");
        }
        let m = |n: usize| n as f64 / 1e6;
        let line = format!(
            "run {}: {:.2}M params ({:.2}M trainable, {}), {} packs of <= {} tokens, {} rows/step in {} microbatch(es), {} steps/epoch",
            info.name,
            m(info.params),
            m(info.trainable),
            info.precision,
            info.packs,
            info.max_seq_len,
            info.batch_rows,
            info.microbatches,
            info.batches_per_epoch
        );
        self.record(&line);
        if self.quiet {
            return;
        }
        say!("{line}");
        self.started = Instant::now();
        self.first_step = info.start_step;
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(info.steps), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_position(info.start_step);
            self.bar = Some(bar);
        }
    }

    fn step(&mut self, m: &StepMetrics, total: u64) {
        let line = self.line(m, total);
        self.record(&line);
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(b) => {
                b.set_position(m.step);
                b.set_message(
                    line.split_once(" | ")
                        .map_or(line.clone(), |x| x.1.to_string()),
                );
            }
            None => {
                if m.step.is_multiple_of(self.interval)
                    || m.step == total
                    || m.step == self.first_step + 1
                    || m.skipped
                {
                    say!("{line}");
                }
            }
        }
    }

    fn checkpoint(&mut self, step: u64, dir: &Path) {
        self.log(&format!("checkpoint @ step {step}: {}", dir.display()));
    }
}

/// The exit code of a rank of a world of processes that stopped because another rank
/// failed or stopped answering (not because of anything of its own): `braid launch` names
/// the rank that failed by itself, not the ones that followed.
pub const PEER_FAILED: u8 = 3;

/// Whether `e` is a collective that another rank broke (it went away, or never answered).
fn stopped_by_a_peer(e: &TrainError) -> bool {
    let by_peer = |c: &braid_comm::CommError| {
        matches!(
            c,
            braid_comm::CommError::Poisoned { .. } | braid_comm::CommError::Timeout { .. }
        )
    };
    // `TrainError::Comm` is `#[error(transparent)]`: its `source()` is the CommError's
    // own source, so the chain below never shows the CommError itself.
    if let TrainError::Comm(c) = e {
        return by_peer(c);
    }
    // Comm errors wrapped with context (a layer's, the bridge's) are in the chain.
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(c) = err.downcast_ref::<braid_comm::CommError>() {
            return by_peer(c);
        }
        cur = err.source();
    }
    false
}

/// Loss against step from metrics.jsonl, as a PNG.
fn plot_loss(run_dir: &Path) -> Result<PathBuf, String> {
    let metrics = read_metrics(&run_dir.join("metrics.jsonl")).map_err(|e| e.to_string())?;
    let out = run_dir.join("loss.png");
    LineChart {
        title: "training loss".into(),
        x_label: "step".into(),
        y_label: "cross-entropy".into(),
        series: vec![Series {
            name: "loss".into(),
            points: metrics
                .iter()
                .filter(|m| !m.skipped)
                .map(|m| (m.step as f64, m.loss))
                .collect(),
        }],
        log_y: false,
    }
    .write_png(&out)
    .map_err(|e| e.to_string())?;
    Ok(out)
}

/// This process's peak resident memory, MiB (what `--nproc-per-node` processes each
/// hold, against one process holding the whole model).
fn peak_host_mib() -> Option<f64> {
    braid_train::metrics::peak_rss_bytes().map(|b| b as f64 / (1u64 << 20) as f64)
}

fn summary(s: &RunSummary, dir: &Path, plot: Option<&Path>) {
    say!("\n== run finished: {} ==", dir.display());
    say!("steps            {} ({} skipped)", s.steps, s.skipped_steps);
    if let Some(f) = s.first_loss {
        say!(
            "loss             {f:.4} -> {:.4} (mean of the last 10 steps)",
            s.final_loss
        );
    }
    if s.tokens > 0 {
        say!(
            "time             {} ({:.0} tokens/s)",
            human_duration(s.train_s),
            s.tokens as f64 / s.train_s
        );
    }
    if let Some(m) = s.median_step_s {
        match &s.predicted {
            Some(p) => say!(
                "step time        median {m:.3} s; the plan predicted {:.3} s on {} (measured / predicted {:.2})",
                p.step_s,
                p.cluster,
                m / p.step_s
            ),
            None => say!("step time        median {m:.3} s"),
        }
    }
    if let Some(p) = s.peak_mem_gib {
        say!("device memory    peak {p:.2} GiB in a step");
    }
    if let Some(m) = peak_host_mib() {
        say!("host memory      peak {m:.0} MiB resident (this process)");
    }
    if let Some(e) = &s.eval {
        say!(
            "held-out         {} {:.4} vs text only {:.4}; exact answers {:.1} % vs {:.1} %; loss {:.4} vs {:.4} ({} samples)",
            e.metric,
            e.heldout,
            e.text_only,
            100.0 * e.exact_match,
            100.0 * e.exact_match_text_only,
            e.loss,
            e.loss_text_only,
            e.samples
        );
        let kinds: Vec<String> = e
            .by_modality
            .iter()
            .map(|(k, m)| format!("{k} {:.3} vs {:.3}", m.heldout, m.text_only))
            .collect();
        say!("  by sample kind {}", kinds.join("; "));
        say!("                 -> {}", dir.join("eval.json").display());
    }
    if let Some(c) = &s.checkpoint {
        say!("checkpoint       {}", c.display());
    }
    if let Some(x) = &s.export {
        say!("hugging face     {}", x.display());
    }
    say!("metrics          {}", dir.join("metrics.jsonl").display());
    if let Some(p) = plot {
        say!("loss curve       {}", p.display());
    }
}

pub fn run(args: TrainArgs) -> ExitCode {
    // A device this machine lacks is refused before any work (no run folder, no logs).
    let cfg = match RunConfig::from_file(&args.config, &args.sets)
        .and_then(|c| c.parallel.check_device().map(|()| c))
    {
        Ok(c) => c,
        Err(e) => {
            say!("braid train: error: {e}");
            return ExitCode::from(2);
        }
    };
    let dir = cfg.run.dir.clone();
    // Under a launcher, rank 0 reports for the world; the other ranks say they are done.
    let launched = braid_comm::launch::LaunchEnv::from_env().ok().flatten();
    let mut progress = Progress::new(cfg.log.interval);
    progress.quiet = launched.as_ref().is_some_and(|e| e.rank != 0);
    if let Some(e) = &launched {
        let logs = cfg.run.dir.join("logs");
        let path = logs.join(format!("rank-{}.log", e.rank));
        match std::fs::create_dir_all(&logs).and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
        }) {
            Ok(f) => progress.log_file = Some(f),
            Err(err) => say!(
                "braid train: warning: no log file {}: {err}",
                path.display()
            ),
        }
        progress.record(&format!(
            "rank {} of {} ({}, local rank {}), pid {}",
            e.rank,
            e.world_size,
            e.launcher,
            e.local_rank,
            std::process::id()
        ));
    }
    let stop = progress.stop.clone();
    let result = braid_train::trainer::train_stoppable(cfg, args.resume, &mut progress, stop);
    if let Some(b) = progress.bar.take() {
        b.finish_and_clear();
    }
    match result {
        Ok(s) if launched.as_ref().is_some_and(|e| e.rank != 0) => {
            let e = launched.as_ref().map_or((0, 0), |e| (e.rank, e.world_size));
            let memory = peak_host_mib()
                .map(|m| format!(", peak host memory {m:.0} MiB resident"))
                .unwrap_or_default();
            let line = format!(
                "braid train: rank {} of {}: {} steps done{memory} (rank 0 reports the run)",
                e.0, e.1, s.steps
            );
            progress.announce(&line);
            ExitCode::SUCCESS
        }
        Ok(s) => {
            if let Some(w) = &s.world {
                say!("world            {w}");
            }
            let plot = match plot_loss(&dir) {
                Ok(p) => Some(p),
                Err(e) => {
                    say!("braid train: warning: no loss curve: {e}");
                    None
                }
            };
            summary(&s, &dir, plot.as_deref());
            ExitCode::SUCCESS
        }
        Err(e @ TrainError::Interrupted { signal, .. }) => {
            progress.announce(&format!("braid train: {e}"));
            ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
        }
        Err(e) => {
            progress.announce(&format!(
                "braid train: error: {e}{}",
                older_checkpoint(&e, &dir)
            ));
            match e {
                TrainError::Config(_) => ExitCode::from(2),
                _ if launched.is_some() && stopped_by_a_peer(&e) => ExitCode::from(PEER_FAILED),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

/// For a damaged checkpoint under `run_dir`: the one before it, which `--resume` takes
/// once the damaged one is moved aside (never done for the user: which one to keep is
/// theirs to decide).
fn older_checkpoint(e: &TrainError, run_dir: &std::path::Path) -> String {
    // Only for damage (a lost rank file, a NaN): a checkpoint of another model or
    // layout is refused the same way whichever one is taken.
    let path = match e {
        TrainError::Checkpoint { path, reason }
            if reason.contains("incomplete") || reason.contains("is missing") =>
        {
            path
        }
        TrainError::Model(braid_nn::Error::Weights { path, msg, .. })
            if msg.starts_with("holds ") =>
        {
            path
        }
        _ => return String::new(),
    };
    let Ok(all) = braid_train::checkpoint::list(&run_dir.join("checkpoints")) else {
        return String::new();
    };
    let Some(i) = all.iter().position(|(_, p)| path.starts_with(p)) else {
        return String::new();
    };
    match i.checked_sub(1).map(|j| &all[j].1) {
        Some(older) => format!(
            "\n(the checkpoint before it is {}: move {} aside to resume from that one)",
            older.display(),
            all[i].1.display()
        ),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_comm::CommError;

    fn poisoned() -> CommError {
        CommError::Poisoned {
            op: "all_reduce_sum",
            rank: 1,
            by: 2,
            why: "rank 2 on 127.0.0.1: its connection closed".into(),
        }
    }

    #[test]
    fn a_peer_failure_is_recognised_however_it_is_wrapped() {
        // Straight from a collective of the step (the loss, the grad norm).
        assert!(stopped_by_a_peer(&TrainError::Comm(poisoned())));
        // Inside a layer's context.
        let layer = braid_nn::Error::Comm {
            context: "llm.layers.0.mlp: forward".into(),
            source: poisoned(),
        };
        assert!(stopped_by_a_peer(&TrainError::Model(layer)));
        // A rank's own failures are not a peer's.
        let own = CommError::Invalid {
            op: "all_gather",
            rank: 0,
            size: 2,
            msg: "shapes differ".into(),
        };
        assert!(!stopped_by_a_peer(&TrainError::Comm(own)));
        assert!(!stopped_by_a_peer(&TrainError::Data("a bad shard".into())));
    }
}
