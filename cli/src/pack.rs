//! `braid pack`: raw multimodal data -> validated, tokenized, packed Parquet shards.
//!
//! Flags override the data config (`--config DATA.toml`); the resolved config is stored in
//! `dataset.json`. Exit status: 0 when a dataset was written (rejects or not); 1 when the
//! template's tokens are not in the tokenizer, more than `pack.max_reject_ratio` of the samples
//! were rejected, a config value is invalid, nothing valid remained, or the input/output could
//! not be used; 2 for usage errors (a bad flag, a config file that does not parse, a format
//! that cannot be inferred).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use braid_dataloader::config::{DataConfig, MediaStorage};
use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::job::{PackJob, PackProgress};
use braid_dataloader::job_output::run_pack_locked;
use braid_dataloader::read::{Format, infer_format};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Debug, Args)]
pub struct PackArgs {
    /// Input file or folder (overrides `[input] path`).
    #[arg(long)]
    input: Option<PathBuf>,
    /// jsonl, llava, wds or parquet (overrides `[input] format`); inferred from the input when
    /// neither is given (.jsonl, .json, .tar, .parquet, or a folder of one of them).
    #[arg(long)]
    format: Option<String>,
    /// Output folder for the shards, dataset.json and rejects.jsonl.
    #[arg(long)]
    output: PathBuf,
    /// A Hugging Face tokenizer.json, or a model folder holding one (default: the byte-level
    /// tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Tokens per packed row (overrides `[pack] max_seq_len`).
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// A folder of media you trust (repeatable): relative media paths are looked up there
    /// first, and symlinks into it are followed (adds to `[input] media_roots`).
    #[arg(long = "media-root", value_name = "DIR")]
    media_roots: Vec<PathBuf>,
    /// Old name of `--media-root` (LLaVA's image folder).
    #[arg(long, hide = true, value_name = "DIR")]
    image_root: Vec<PathBuf>,
    /// Largest share of samples that may be rejected before the pack fails (overrides
    /// `[pack] max_reject_ratio`, default 0.5).
    #[arg(long)]
    max_reject_ratio: Option<f64>,
    /// Data config (TOML): input, tokenizer, template, image, audio, pack, shards.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Keep the original media bytes instead of preprocessed pixels and PCM.
    #[arg(long)]
    keep_original_media: bool,
    /// Decoding threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Replace a dataset already in the output folder.
    #[arg(long)]
    overwrite: bool,
}

/// Builds the job from the flags and the config file.
fn job(a: PackArgs) -> Result<PackJob, String> {
    let mut cfg = match &a.config {
        Some(p) => DataConfig::from_file(p).map_err(|e| e.to_string())?,
        None => DataConfig::default(),
    };
    if let Some(t) = a.tokenizer {
        cfg.tokenizer.path = Some(t);
    }
    if let Some(p) = &cfg.tokenizer.path
        && p.is_dir()
    {
        let file = p.join("tokenizer.json");
        if !file.is_file() {
            return Err(format!(
                "tokenizer {}: a folder without tokenizer.json (pass the file, or a model folder holding it)",
                p.display()
            ));
        }
        cfg.tokenizer.path = Some(file);
    }
    if let Some(r) = a.max_reject_ratio {
        cfg.pack.max_reject_ratio = r;
    }
    if let Some(n) = a.max_seq_len {
        cfg.pack.max_seq_len = n;
    }
    cfg.input.media_roots.extend(a.media_roots);
    cfg.input.media_roots.extend(a.image_root);
    if a.keep_original_media {
        cfg.shards.media = MediaStorage::Original;
    }
    if let Some(t) = a.threads {
        cfg.shards.threads = t;
    }
    let input = a
        .input
        .or_else(|| cfg.input.path.clone())
        .ok_or("no input: pass --input PATH or set [input] path in the config")?;
    let format = match (a.format, cfg.input.format) {
        (Some(f), _) => f.parse::<Format>().map_err(|e| e.to_string())?,
        (None, Some(f)) => f,
        (None, None) => infer_format(&input)?,
    };
    cfg.input.path = Some(input.clone());
    cfg.input.format = Some(format);
    Ok(PackJob {
        input,
        format,
        output: a.output,
        config: cfg,
        overwrite: a.overwrite,
    })
}

pub fn run(args: PackArgs) -> u8 {
    let job = match job(args) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("braid pack: {e}");
            return 2;
        }
    };
    let tty = console_is_tty();
    let bar = ProgressBar::new_spinner();
    if !tty {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let started = Instant::now();
    let mut last_log = Instant::now();
    let mut on_progress = |p: &PackProgress| {
        let rate = p.read as f64 / started.elapsed().as_secs_f64().max(1e-9);
        let msg = format!(
            "read {} | packed {} | rejected {} | packs {} | shards {} | {rate:.0} samples/s",
            p.read, p.packed, p.rejected, p.packs, p.shards
        );
        if tty {
            bar.set_message(msg);
        } else if last_log.elapsed() > Duration::from_secs(10) {
            eprintln!("braid pack: {msg}");
            last_log = Instant::now();
        }
    };
    let result = run_pack_locked(&job, &mut on_progress);
    bar.finish_and_clear();
    match result {
        Ok(info) => {
            print_summary(&info, &job.output.display().to_string());
            0
        }
        Err(e) => {
            eprintln!("braid pack: error: {e}");
            1
        }
    }
}

fn console_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// The final summary (also what `braid inspect` starts with).
pub fn print_summary(info: &DatasetInfo, dir: &str) {
    println!("dataset {dir}");
    println!(
        "  samples   {} read, {} packed ({} truncated), {} rejected",
        info.samples, info.packed_samples, info.truncated, info.rejected
    );
    for (kind, n) in &info.rejected_by_kind {
        println!("    rejected {kind}: {n}");
    }
    if !info.damaged_files.is_empty() {
        println!(
            "  warning   {} input files could not be read to the end; what followed the damage is in no count above: {}",
            info.damaged_files.len(),
            info.damaged_files.join(", ")
        );
    }
    println!(
        "  media     {} images, {} audio clips",
        info.images, info.audio_clips
    );
    println!(
        "  packs     {} rows of {} tokens, {} tokens, fill {:.2}%",
        info.packs,
        info.max_seq_len,
        info.tokens,
        100.0 * info.fill
    );
    let b = &info.balance;
    if b.vision.before.mean > 0.0 {
        println!(
            "  vision load per pack max/mean {:.3} -> {:.3} after balancing",
            b.vision.before.max_over_mean, b.vision.after.max_over_mean
        );
    }
    if b.audio.before.mean > 0.0 {
        println!(
            "  audio  load per pack max/mean {:.3} -> {:.3} after balancing",
            b.audio.before.max_over_mean, b.audio.after.max_over_mean
        );
    }
    let bytes: u64 = info.shards.iter().map(|s| s.bytes).sum();
    println!(
        "  shards    {} files, {:.1} MiB; tokenizer {} (vocab {})",
        info.shards.len(),
        bytes as f64 / (1 << 20) as f64,
        info.tokenizer.kind,
        info.tokenizer.vocab_size
    );
    println!("  took      {:.1} s", info.elapsed_s);
}
