//! `braid generate --checkpoint DIR [--image F] [--audio F] --prompt "..."`: greedy output
//! of a trained checkpoint (or a run folder's newest one), printed to stdout.

use std::path::PathBuf;
use std::process::ExitCode;

use braid_train::generate::Generator;

/// Greedy answer of a trained checkpoint to a prompt about an image and/or an audio clip.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A checkpoint folder (checkpoints/step-N) or a run folder (its newest checkpoint).
    #[arg(long)]
    checkpoint: PathBuf,
    /// An image file (PNG, JPEG, WebP, ...).
    #[arg(long)]
    image: Option<PathBuf>,
    /// An audio file (WAV, FLAC, MP3, Ogg Vorbis).
    #[arg(long)]
    audio: Option<PathBuf>,
    /// The user's message.
    #[arg(long)]
    prompt: String,
    /// Stop after this many tokens if the answer has not ended.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
}

pub fn run(a: GenerateArgs) -> ExitCode {
    let result = Generator::load(&a.checkpoint).and_then(|g| {
        eprintln!("braid generate: {}", g.checkpoint.display());
        g.generate(
            &a.prompt,
            a.image.as_deref(),
            a.audio.as_deref(),
            a.max_new_tokens,
        )
    });
    match result {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("braid generate: error: {e}");
            ExitCode::FAILURE
        }
    }
}
