//! `braid demo-data`: writes the demo multimodal dataset (see `braid_dataloader::demo`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use braid_dataloader::demo::{DemoConfig, write_demo};

/// Write a small multimodal demo dataset (PNG/JPEG shapes, WAV/FLAC tones, JSONL chat records).
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Folder to write `train.jsonl`, `heldout.jsonl`, `images/`, `audio/` and `README.md` to.
    #[arg(long)]
    output: PathBuf,
    /// Random seed; the same seed gives the same bytes [default: 1234].
    #[arg(long)]
    seed: Option<u64>,
    /// Training samples [default: 2000].
    #[arg(long)]
    train: Option<usize>,
    /// Held-out samples [default: 200].
    #[arg(long)]
    heldout: Option<usize>,
    /// Write into a non-empty folder (files of the same names are overwritten, others kept).
    #[arg(long)]
    force: bool,
}

/// Refuses a non-folder, or a non-empty folder without `--force`.
fn check_output(dir: &Path, force: bool) -> Result<(), String> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot use {}: {e}", dir.display())),
        Ok(m) if !m.is_dir() => Err(format!("{} exists and is not a folder", dir.display())),
        Ok(_) => {
            let mut entries = std::fs::read_dir(dir)
                .map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
            if entries.next().is_some() && !force {
                return Err(format!(
                    "{} is not empty; choose another folder or pass --force to write into it",
                    dir.display()
                ));
            }
            Ok(())
        }
    }
}

pub fn run(args: &DemoArgs) -> ExitCode {
    let d = DemoConfig::default();
    let cfg = DemoConfig {
        seed: args.seed.unwrap_or(d.seed),
        train: args.train.unwrap_or(d.train),
        heldout: args.heldout.unwrap_or(d.heldout),
        ..d
    };
    let res = check_output(&args.output, args.force)
        .and_then(|()| write_demo(&args.output, &cfg).map_err(|e| e.to_string()));
    match res {
        Ok(s) => {
            println!(
                "braid demo-data: wrote {} train + {} heldout samples ({} image, {} audio, {} both; \
                 {} PNG, {} JPEG, {} WAV, {} FLAC; {:.1} MB) to {}",
                s.train,
                s.heldout,
                s.image_only,
                s.audio_only,
                s.both,
                s.png,
                s.jpeg,
                s.wav,
                s.flac,
                s.total_bytes as f64 / 1e6,
                args.output.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("braid demo-data: error: {e}");
            ExitCode::FAILURE
        }
    }
}
